"""Facts of a bundle's task tables for the kernel statistics: tasks per step, dependency levels
(longest path in the wait DAG) and tasks per level, and the weight bytes every task reads.

Weight bytes come from the manifest's placement of W, found through the kernel source: the names a
body adds to `W` in a `tl.load` address are evaluated for the task (`kernel_source.Evaluator` over
the real TASKS/DI/DF), and a value that is the offset of a placed weight names that weight. A body
whose W address also uses a loaded value (a token id) gathers one row per token; the other tasks
that use a weight share its bytes evenly (the tiles of one matrix).
"""

from __future__ import annotations

import ast
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zlc.bundle import (
    CTRL_MODE,
    CTRL_PAST,
    CTRL_T,
    HEADER_WORDS,
    MAX_WAITS,
    MODE_DECODE,
    MODE_PREFILL,
    OP_NAMES,
    TASK_WORDS,
    read_manifest,
)

from .kernel_source import UNKNOWN, Evaluator, KernelSource

__all__ = ["TableFacts", "Tables", "levels_of", "table_facts"]


class Tables:
    """One tiling's binary tables (what the kernel reads) and evaluators over them."""

    def __init__(self, bundle: Path, man: dict[str, Any], tiling: str, src: KernelSource):
        from safetensors.numpy import load_file

        if tiling not in man["tilings"]:
            raise ValueError(f"{bundle} has no {tiling} tiling (tilings: {', '.join(man['tilings'])})")
        t = load_file(str(Path(bundle) / man["tilings"][tiling]["tables"]))
        self.man, self.tiling, self.src = man, tiling, src
        self.tasks = t["tasks"].astype(np.int64)
        self.desc_int = t["desc_int"].astype(np.int64)
        self.desc_float = t["desc_float"]

    def rows(self, mode: int) -> list[dict[str, Any]]:
        n, base = int(self.tasks[2 * mode]), int(self.tasks[2 * mode + 1])
        out = []
        for i in range(n):
            r = self.tasks[HEADER_WORDS + base + i * TASK_WORDS:][:TASK_WORDS]
            out.append({"op": int(r[0]), "desc": int(r[1]), "waits": [(int(r[6 + 2 * k]), int(r[7 + 2 * k]))
                                                                     for k in range(int(r[5]))],
                        "signal": int(r[6 + 2 * MAX_WAITS]), "parent": int(r[8 + 2 * MAX_WAITS])})
        return out

    def evaluator(self, mode: int, context: int) -> Evaluator:
        """Reads the tables and the control block of one step of `mode` (decode: T=1 at `context`
        tokens of cache; prefill: a full chunk)."""
        tl = self.man["tilings"][self.tiling]
        layout = tl.get("layout", {})
        ctrl = np.zeros(int(layout.get("ctrl_size", 64)), dtype=np.int64)
        ctrl[CTRL_MODE] = mode
        ctrl[CTRL_T] = 1 if mode == MODE_DECODE else int(layout.get("chunk", 1))
        ctrl[CTRL_PAST] = context if mode == MODE_DECODE else 0
        mem = {"TASKS": self.tasks, "DI": self.desc_int.reshape(-1), "DF": self.desc_float.reshape(-1), "CTRL": ctrl}
        return Evaluator(self.src, mem, tl.get("constexprs", {}), int(tl.get("grid", 1)))

    def sampler(self, mode: int = MODE_DECODE, context: int = 1) -> Callable[[int], tuple[Evaluator, int] | None]:
        """op code -> (an evaluator set to the first task of that op kind, its index)."""
        first: dict[int, int] = {}
        for i, r in enumerate(self.rows(mode)):
            first.setdefault(r["op"], i)

        def get(op: int) -> tuple[Evaluator, int] | None:
            if op not in first:
                return None
            ev = self.evaluator(mode, context)
            ev.set_task(first[op])
            return ev, first[op]

        return get

    def _loaded(self, fn: str, name: str) -> bool:
        """`name` in `fn` is assigned from an expression holding a `tl.load` (data, e.g. a token id)."""
        key = ("loaded", fn, name)
        if key not in self.src.cache:
            self.src.cache[key] = any(
                isinstance(st, ast.Assign) and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                                                   and c.func.attr == "load" for c in ast.walk(st.value))
                for st in self.src.fns[fn].assigns.get(name, []))
        return bool(self.src.cache[key])

    def weight_bytes(self, mode: int) -> list[int]:
        """Bytes of W each task of `mode` reads (see the module docstring)."""
        src, man = self.src, self.man
        place = {p["offset"]: p for p in man["weights"]["placement"] if p["arena"] == "W"}
        item = 2 if man["dtype"]["weights"] in ("bf16", "fp16") else 4
        ev = self.evaluator(mode, context=1)
        loads = {b: src.pointer_loads(b, "W") for b in src.bodies}
        call_line = {b: c.lineno for b, c in src.dispatch_calls.items()}
        uses: list[list[tuple[int, bool]]] = []
        for i, r in enumerate(self.rows(mode)):
            ev.set_task(i)
            body = src.dispatch.get(r["op"])
            found: list[tuple[int, bool]] = []
            for ld in loads.get(body, []) if body is not None else []:
                assert body is not None
                chain = ((src.entry, call_line[body]), (body, ld.lineno))
                if ev.executes(ld, chain) is False:
                    continue
                gather, offs = False, []
                for nm in sorted({x.id for x in ast.walk(ld.args[0]) if isinstance(x, ast.Name)} - {"W"}):
                    v = ev.value(ast.Name(nm, ast.Load()), chain)
                    if isinstance(v, (int, np.integer)) and int(v) in place:
                        offs.append(int(v))
                    elif v is UNKNOWN and self._loaded(body, nm):
                        gather = True
                found += [(o, gather) for o in offs]
            uses.append(list(dict.fromkeys(found)))
        sharers = Counter(o for u in uses for o, g in u if not g)
        out = []
        for u in uses:
            b = 0
            for o, g in u:
                shape = place[o]["shape"]
                b += int(shape[-1]) * item if g else int(np.prod(shape)) * item // max(sharers[o], 1)
            out.append(b)
        return out




def levels_of(rows: list[dict[str, Any]]) -> list[int]:
    """Dependency level of each task: 1 + the deepest task it waits for (no waits: level 1). An
    event's signallers are the tasks signalling it directly and, for a parent event, every task of
    the groups that bump it. Tables are in topological order."""
    sig: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        if r["signal"] >= 0:
            sig.setdefault(r["signal"], []).append(i)
        if r["parent"] >= 0:
            sig.setdefault(r["parent"], []).append(i)
    lv = [0] * len(rows)
    for i, r in enumerate(rows):
        lv[i] = 1 + max([lv[j] for e, _ in r["waits"] for j in sig.get(e, ()) if j < i] + [0])
    return lv


@dataclass
class TableFacts:
    tiling: str
    modes: dict[str, dict[str, Any]]  # mode -> tasks, levels, tasks per level, bytes
    ops: dict[str, list[int]]  # mode -> op code per task
    levels: dict[str, list[int]]
    weight_bytes: dict[str, list[int]]
    tables: Tables

    def as_dict(self) -> dict[str, Any]:
        return {"tiling": self.tiling, "modes": self.modes}


def table_facts(bundle: Path, tiling: str, src: KernelSource, man: dict[str, Any] | None = None) -> TableFacts:
    """Tasks, levels and weight bytes per task and per level of one tiling's decode and prefill."""
    man = man or read_manifest(Path(bundle))
    tabs = Tables(Path(bundle), man, tiling, src)
    modes, ops, lvls, wbytes = {}, {}, {}, {}
    for mode, code in (("decode", MODE_DECODE), ("prefill", MODE_PREFILL)):
        rows = tabs.rows(code)
        lv = levels_of(rows)
        wb = tabs.weight_bytes(code)
        per = Counter(lv)
        counts = [per[k] for k in sorted(per)]
        by_level = [0] * (max(lv, default=0) + 1)
        for b, k in zip(wb, lv, strict=True):
            by_level[k] += b
        modes[mode] = {
            "tasks": len(rows), "levels": len(counts),
            "tasks_per_level": {"min": min(counts, default=0), "median": statistics.median(counts or [0]),
                                "max": max(counts, default=0)},
            "levels_by_width": _width_histogram(counts, int(man["tilings"][tiling].get("grid", 1))),
            "tasks_by_op": dict(Counter(OP_NAMES[r["op"]] if r["op"] < len(OP_NAMES) else str(r["op"]) for r in rows)),
            "weight_bytes": sum(wb), "weight_bytes_per_level": by_level[1:],
            "weight_bytes_per_level_stats": {"min": min(by_level[1:], default=0),
                                             "median": statistics.median(by_level[1:] or [0]),
                                             "max": max(by_level[1:], default=0)}}
        ops[mode], lvls[mode], wbytes[mode] = [r["op"] for r in rows], lv, wb
    return TableFacts(tiling, modes, ops, lvls, wbytes, tabs)


def _width_histogram(counts: list[int], grid: int) -> dict[str, int]:
    """Levels by how many tasks they hold, against the grid (a level under `grid` leaves SMs idle)."""
    edges = [(1, 1), (2, 8), (9, max(9, grid // 4)), (max(10, grid // 4 + 1), max(10, grid - 1)), (grid, 1 << 30)]
    return {(f"{a}" if a == b else f">={a}" if b >= 1 << 30 else f"{a}-{b}"): sum(a <= c <= b for c in counts)
            for a, b in edges}
