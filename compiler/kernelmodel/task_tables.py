"""Facts of a bundle's task tables for the kernel statistics: tasks per step, dependency levels
(longest path in the wait DAG) and tasks per level, who each wait waits for, and the bytes every
task reads from DRAM.

Bytes come from the tables and the manifest's weight placement, never from the kernel source, so
a change of the op bodies cannot silently turn them to 0: a Linear task reads rows [a, b) x K of
its descriptor's W matrices (LinearDesc's w, and w2 when >= 0; K is k), and with a fused MLP down
(down_rows > 0) columns [a, b) of that [rows, N] matrix (down_w), the embedding T rows of its table
(EmbedDesc's table, H = hidden; learned positions pos_table when >= 0); every offset must be a
placed W weight of that row length, else the table and the manifest disagree (an error); a packed
matrix (w_format != 0) is a placed Q weight whose rows cost their blocks' bytes. The P
arena's norm gains, biases and rotary rows are counted once per step (the tasks of one Linear share
them through L2), the KV cache per attention task from its span of keys before this step's position
(written by earlier steps: DRAM), shared by the heads of a KV group. The decode sum matches the
manifest roofline's bytes (which prices the P vectors at the weight type).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zlc.abi import (
    CTRL_MODE,
    CTRL_PAST,
    CTRL_T,
    MODE_DECODE,
    MODE_PREFILL,
    NORM_LAYER,
    NORM_RMS,
    OP_ARGMAX,
    OP_ATTENTION,
    OP_CACHE_APPEND,
    OP_EMBED,
    OP_LINEAR,
    OP_NAMES,
    OP_ROW_NORM,
    TASK_A,
    TASK_B,
    TASK_C,
    TASK_DESC,
    TASK_OP,
    TASK_PARENT,
    TASK_SIGNAL,
    AttentionDesc,
    CacheAppendDesc,
    EmbedDesc,
    LinearDesc,
    RowNormDesc,
    mode_rows,
    row_waits,
)

from .sass_map import KernelStatsError
from .triton_source import Evaluator, KernelSource

__all__ = ["TableFacts", "Tables", "Traffic", "levels_of", "table_facts", "waits_of", "width_histogram"]

_ITEM = {"bf16": 2, "fp16": 2, "f16": 2, "fp32": 4, "f32": 4}


class Tables:
    """One tiling's binary tables (what the kernel reads) and evaluators over them."""

    def __init__(self, bundle: Path, man: dict[str, Any], tiling: str, src: KernelSource):
        from safetensors.numpy import load_file

        if tiling not in man["tilings"]:
            raise KernelStatsError(f"{bundle} has no {tiling} tiling (tilings: {', '.join(man['tilings'])})")
        t = load_file(str(Path(bundle) / man["tilings"][tiling]["tables"]))
        self.man, self.tiling, self.src = man, tiling, src
        self.tasks = t["tasks"].astype(np.int64)
        self.desc_int = t["desc_int"].astype(np.int64)
        self.desc_float = t["desc_float"]
        self._rows: dict[int, list[dict[str, Any]]] = {}

    def rows(self, mode: int) -> list[dict[str, Any]]:
        if mode in self._rows:
            return self._rows[mode]
        out = []
        for r in mode_rows(self.tasks, mode):
            out.append({"op": int(r[TASK_OP]), "desc": int(r[TASK_DESC]), "a": int(r[TASK_A]), "b": int(r[TASK_B]),
                        "c": int(r[TASK_C]), "waits": row_waits(r), "signal": int(r[TASK_SIGNAL]),
                        "parent": int(r[TASK_PARENT])})
        self._rows[mode] = out
        return out

    def evaluator(self, mode: int, context: int, step: int | None = None) -> Evaluator:
        """Reads the tables and the control block of one step of `mode` (decode: T=1 at `context`
        tokens of cache; prefill: a full chunk). `step` binds the kernel's STEP constexpr (which
        kernel: the launch's mode)."""
        tl = self.man["tilings"][self.tiling]
        layout = tl.get("layout", {})
        ctrl = np.zeros(int(layout.get("ctrl_size", 64)), dtype=np.int64)
        ctrl[CTRL_MODE] = mode
        ctrl[CTRL_T] = 1 if mode == MODE_DECODE else int(layout.get("chunk", 1))
        ctrl[CTRL_PAST] = context if mode == MODE_DECODE else 0
        mem = {"TASKS": self.tasks, "DI": self.desc_int.reshape(-1), "DF": self.desc_float.reshape(-1), "CTRL": ctrl}
        constexprs = dict(tl.get("constexprs", {}))
        constexprs["STEP"] = mode if step is None else step
        return Evaluator(self.src, mem, constexprs, int(tl.get("grid", 1)))

    def traffic(self, mode: int, context: int) -> Traffic:
        """Bytes every task of one step reads from DRAM (see the module docstring). Decode: one row
        at `context` tokens of cache; prefill: a full chunk, no cache before it."""
        man = self.man
        place = {int(p["offset"]): p for p in man["weights"]["placement"] if p["arena"] == "W"}
        # packed matrices (w_format != 0): byte offsets into Q, a row costing its blocks' bytes
        q_place = {int(p["offset"]): p for p in man["weights"]["placement"] if p["arena"] == "Q"}
        w_item = _ITEM.get(str(man["dtype"]["weights"]), 2)
        kv_item = _ITEM.get(str(man["kernel"].get("signature", {}).get("A", "*fp32")).lstrip("*"), 4)
        layout = man["tilings"][self.tiling].get("layout", {})
        rows_t = 1 if mode == MODE_DECODE else int(layout.get("chunk", 1))
        past = context if mode == MODE_DECODE else 0
        di = self.desc_int
        weights, kv = [], []
        p_ranges: list[tuple[int, int]] = []

        def matrix(off: int, lo: int, hi: int, k: int, where: str, packed: bool = False) -> int:
            """Bytes of rows [lo, hi) x k of the W matrix placed at `off` (checked against its shape),
            or (`packed`) of the Q matrix at byte offset `off`: its rows' blocks."""
            p = (q_place if packed else place).get(off)
            if p is None:
                raise KernelStatsError(f"{where}: {'Q' if packed else 'W'} offset {off} is no placed weight (the "
                                       "tables and the manifest's weight placement disagree)")
            shape = [int(x) for x in p["shape"]]
            if len(shape) != 2 or shape[1] != k or not 0 <= lo <= hi <= shape[0]:
                raise KernelStatsError(f"{where}: reads rows [{lo}, {hi}) x {k} of '{p['value']}' {shape}")
            return (hi - lo) * int(p["bytes"]) // shape[0] if packed else (hi - lo) * k * w_item

        def columns(off: int, rows: int, k: int, lo: int, hi: int, where: str) -> int:
            """Bytes of columns [lo, hi) of the [rows, k] W matrix placed at `off` (checked)."""
            p = place.get(off)
            if p is None:
                raise KernelStatsError(f"{where}: W offset {off} is no placed weight (the tables and the manifest's "
                                       "weight placement disagree)")
            shape = [int(x) for x in p["shape"]]
            if shape != [rows, k] or not 0 <= lo <= hi <= k:
                raise KernelStatsError(f"{where}: reads columns [{lo}, {hi}) x {rows} of '{p['value']}' {shape}")
            return rows * (hi - lo) * w_item

        for i, r in enumerate(self.rows(mode)):
            d = di[r["desc"]]
            where = f"{self.tiling} {OP_NAMES[r['op']] if r['op'] < len(OP_NAMES) else r['op']} task {i}"
            w = k = 0
            if r["op"] == OP_LINEAR:
                L = LinearDesc
                kk, lo, hi = int(d[L.k]), r["a"], r["b"]
                packed = int(d[L.route]) == 0 and int(d[L.w_format]) != 0
                w = matrix(int(d[L.w]), lo, hi, kk, where, packed)
                if int(d[L.w2]) >= 0:
                    w += matrix(int(d[L.w2]), lo, hi, kk, where, packed)
                if int(d[L.norm]) in (NORM_RMS, NORM_LAYER):
                    p_ranges.append((int(d[L.norm_w]), int(d[L.norm_w]) + kk))
                    if int(d[L.norm]) == NORM_LAYER and int(d[L.norm_b]) >= 0:
                        p_ranges.append((int(d[L.norm_b]), int(d[L.norm_b]) + kk))
                if int(d[L.bias]) >= 0:
                    p_ranges.append((int(d[L.bias]) + lo, int(d[L.bias]) + hi))
                if int(d[L.route]) == 0 and int(d[L.down_rows]) > 0:  # a fused MLP down (split-K): Wd[:, lo:hi]
                    w += columns(int(d[L.down_w]), int(d[L.down_rows]), int(d[L.n]), lo, hi, where)
                    if int(d[L.down_bias]) >= 0:  # its bias
                        p_ranges.append((int(d[L.down_bias]), int(d[L.down_bias]) + int(d[L.down_rows])))
            elif r["op"] == OP_EMBED:
                h = int(d[EmbedDesc.hidden])
                w = matrix(int(d[EmbedDesc.table]), 0, 1, h, where) * rows_t  # one row per token (the step's data)
                if int(d[EmbedDesc.pos_table]) >= 0:
                    w += matrix(int(d[EmbedDesc.pos_table]), past, past + rows_t, h, where)
            elif r["op"] in (OP_ATTENTION, OP_CACHE_APPEND):
                # the rotary, head and q/k-norm words are the same in both ops (descriptors.py)
                At = AttentionDesc
                if int(d[At.rope]) != 0 and int(d[At.rope_half]) > 0:  # rotary rows of this step's positions
                    half = int(d[At.rope_half])
                    for tab in (int(d[At.rope_cos]), int(d[At.rope_sin])):
                        p_ranges.append((tab + past * half, tab + (past + rows_t) * half))
                # q/k norm gains: one head's, or the whole row's (a bit of qk_norm_whole)
                norms = ((At.q_norm_w, 0, At.q_stride), (At.k_norm_w, 1, At.k_new_stride)) \
                    if r["op"] == OP_ATTENTION else ((CacheAppendDesc.k_norm_w, 0, CacheAppendDesc.k_stride),)
                for f, bit, row_cols in norms:
                    if int(d[f]) >= 0:
                        whole = (int(d[At.qk_norm_whole]) >> bit) & 1
                        p_ranges.append((int(d[f]), int(d[f]) + (int(d[row_cols]) if whole else int(d[At.head_dim]))))
                if r["op"] == OP_ATTENTION and past > 0:
                    dim, group, split_len = int(d[At.head_dim]), max(1, int(d[At.group])), int(d[At.split_len])
                    lo = r["c"] * split_len if split_len > 0 else 0
                    hi = min(past, lo + split_len) if split_len > 0 else past
                    k = max(0, hi - lo) * dim * kv_item * 2 // group
            elif r["op"] == OP_ROW_NORM:  # the norm's gains (and bias)
                p_ranges += [(int(d[f]), int(d[f]) + int(d[RowNormDesc.k]))
                             for f in (RowNormDesc.norm_w, RowNormDesc.norm_b) if int(d[f]) >= 0]
            weights.append(w)
            kv.append(k)
        p_elems = _union_length(p_ranges)
        return Traffic(weights, kv, p_elems * 4, p_elems * w_item)


@dataclass
class Traffic:
    """DRAM bytes of one step: per task W bytes and KV bytes; the P arena's vectors once (as the
    kernel reads them, f32; and priced at the weight type, as the manifest's roofline does)."""

    weights: list[int]
    kv: list[int]
    p_bytes: int
    p_bytes_roofline: int

    @property
    def total(self) -> int:
        return sum(self.weights) + sum(self.kv) + self.p_bytes


def _union_length(ranges: list[tuple[int, int]]) -> int:
    """Elements covered by half-open ranges (each P vector counted once however many tasks read it)."""
    out, end = 0, None
    for lo, hi in sorted(ranges):
        if end is None or lo > end:
            out += hi - lo
            end = hi
        elif hi > end:
            out += hi - end
            end = hi
    return out


def levels_of(rows: list[dict[str, Any]]) -> list[int]:
    """Dependency level of each task: 1 + the deepest task it waits for (no waits: level 1). An
    event's signallers are the tasks signalling it directly and, for a parent event, every task of
    the groups that bump it (`waits_of`). Tables are in topological order."""
    lv = [0] * len(rows)
    for i, waits in enumerate(waits_of(rows)):
        lv[i] = 1 + max([lv[j] for w in waits for j in w] + [0])
    return lv


def waits_of(rows: list[dict[str, Any]]) -> list[list[list[int]]]:
    """Per task, per wait: the tasks whose finish it waits for (an event's signallers; a parent
    event's: every task of the groups that bump it)."""
    sig: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r["signal"] >= 0:
            sig.setdefault(r["signal"], []).append(i)
        if r["parent"] >= 0:
            sig.setdefault(r["parent"], []).append(i)
    return [[[j for j in sig.get(e, ()) if j < i] for e, _ in r["waits"]] for i, r in enumerate(rows)]


@dataclass
class TableFacts:
    tiling: str
    modes: dict[str, dict[str, Any]]  # mode -> tasks, levels, tasks per level, bytes
    ops: dict[str, list[int]]  # mode -> op code per task
    levels: dict[str, list[int]]
    traffic: dict[str, Traffic]  # decode at the report's context, prefill: one chunk
    tables: Tables
    context: int

    def as_dict(self) -> dict[str, Any]:
        return {"tiling": self.tiling, "context": self.context, "modes": self.modes}


def table_facts(bundle: Path, tiling: str, src: KernelSource, man: dict[str, Any], context: int) -> TableFacts:
    """Tasks, levels and DRAM bytes per task and per level of one tiling's decode (at `context`
    tokens of cache) and prefill (one chunk)."""
    tabs = Tables(Path(bundle), man, tiling, src)
    modes, ops, lvls, traffic = {}, {}, {}, {}
    layers = int(man["model"].get("layers") or 0) or None
    for mode, code in (("decode", MODE_DECODE), ("prefill", MODE_PREFILL)):
        rows = tabs.rows(code)
        lv = levels_of(rows)
        tr = tabs.traffic(code, context)
        per = Counter(lv)
        counts = [per[k] for k in sorted(per)]
        by_level = [0] * (max(lv, default=0) + 1)
        for b, k in zip(tr.weights, lv, strict=True):
            by_level[k] += b
        # Levels that hold only the step's ends (embedding, LM head, argmax): no transformer
        # layer's. Per layer counts the rest, so a model's count does not fall with depth.
        ends = {k for k in per if all(_outside_layers(tabs, r) for r, x in zip(rows, lv, strict=True) if x == k)}
        modes[mode] = {
            "tasks": len(rows), "levels": len(counts), "levels_outside_layers": len(ends),
            "levels_per_layer": round((len(counts) - len(ends)) / layers, 2) if layers else None,
            "tasks_per_level": {"min": min(counts, default=0), "median": statistics.median(counts or [0]),
                                "max": max(counts, default=0)},
            "tasks_per_level_all": counts,
            "tasks_by_op": dict(Counter(OP_NAMES[r["op"]] if r["op"] < len(OP_NAMES) else str(r["op"]) for r in rows)),
            "weight_bytes": sum(tr.weights), "kv_bytes": sum(tr.kv), "p_bytes": tr.p_bytes,
            "p_bytes_at_weight_type": tr.p_bytes_roofline,
            "weight_bytes_per_level": by_level[1:],
            "weight_bytes_per_level_stats": {"min": min(by_level[1:], default=0),
                                             "median": statistics.median(by_level[1:] or [0]),
                                             "max": max(by_level[1:], default=0)}}
        ops[mode], lvls[mode], traffic[mode] = [r["op"] for r in rows], lv, tr
    return TableFacts(tiling, modes, ops, lvls, traffic, tabs, context)


def _outside_layers(tabs: Tables, row: dict[str, Any]) -> bool:
    """An embedding, argmax or LM-head task (a Linear whose descriptor's `lm` is set)."""
    return row["op"] in (OP_EMBED, OP_ARGMAX) or (
        row["op"] == OP_LINEAR and int(tabs.desc_int[row["desc"]][LinearDesc.lm]) != 0)


def width_histogram(counts: list[int], grid: int) -> dict[str, int]:
    """Levels by how many tasks they hold, against the grid (a level under `grid` leaves SMs idle)."""
    edges = [(1, 1), (2, 8), (9, max(9, grid // 4)), (max(10, grid // 4 + 1), max(10, grid - 1)), (grid, 1 << 30)]
    return {(f"{a}" if a == b else f">={a}" if b >= 1 << 30 else f"{a}-{b}"): sum(a <= c <= b for c in counts)
            for a, b in edges}
