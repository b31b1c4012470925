"""The batched decode step's latency: B sequences' decode rows in one launch of the prefill kernel
(docs/megakernel.md, "Batched steps and the paged KV cache"), priced by the same event simulation
as the single-sequence decode step (`latency`, `event_sim`; docs/kernel-model.md).

Per task of the prefill table, its path through the **prefill kernel's** SASS (`task_path`, with an
evaluator of a batched step: T = B rows, CTRL_BATCH set, so every `if` on the batch takes the
batched arm) gives its round trips, bytes in flight, loops, fences and barriers, exactly as for the
decode kernel. What the source cannot tell -- trips of loops bounded by the batch block, which the
host writes per launch -- comes from the step's shape: every row is a decode row at `context`
(the LM head's rows: all B; a paged attention task's rows: its query block's share of B; its key
blocks: (context + 1) / BLOCK_KV per row). Bytes: each Linear's weight tile once per step (the
tables; later row blocks re-read it from L2, priced as the loop's round trips per iteration), the
embedding's B rows, and per paged attention task its rows' keys and values, (context + 1) x D x 2
f32 per row, shared by the heads of a KV group as in decode. Batch 1 of the decode kernel (the
single-sequence step) is `latency.predict`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from zlc.abi import AttentionDesc, EmbedDesc
from zlc.bundle import (
    CTRL_BATCH,
    CTRL_MODE,
    CTRL_PAST,
    CTRL_T,
    MODE_PREFILL,
    OP_ATTENTION,
    OP_EMBED,
    OP_NAMES,
)

from .event_sim import TaskShape, simulate
from .latency import CASES, params_for, path_shape, sim_params
from .sass_map import KernelCode, LoopFacts
from .task_path import task_path
from .task_tables import TableFacts, waits_of
from .triton_source import UNKNOWN, Evaluator

__all__ = ["BatchPrediction", "predict_batch"]

BATCH_BLOCK = 16  # where the evaluator's control block says the batch block is (any offset > 0)


@dataclass
class BatchPrediction:
    target: str
    batch: int
    context: int
    us: dict[str, float]  # case -> µs per batched step
    bytes_per_step: dict[str, int]  # weights (once), kv (every row's cache), other
    per_op_busy_us: dict[str, float]  # central
    unpriced_tasks: int

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "batch": self.batch, "context": self.context, "us": self.us,
                "bytes_per_step": self.bytes_per_step, "per_op_busy_us": self.per_op_busy_us,
                "unpriced_tasks": self.unpriced_tasks}


class _BatchTrips:
    """A KernelCode whose `trips` fills in what the batch block bounds (see the module docstring);
    everything else is the kernel's own."""

    def __init__(self, code: KernelCode, batch: int, context: int, block_t: int, block_kv: int):
        self._code, self.batch, self.context, self.block_t, self.block_kv = code, batch, context, block_t, block_kv
        self.rows_in_task = batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._code, name)

    def _own(self, fn: str | None, node: Any, chain: Any, ev: Evaluator) -> int:
        t = ev.trips(node, chain)
        if t is not UNKNOWN:
            return int(t)
        var = node.target.id if hasattr(node, "target") and hasattr(node.target, "id") else None
        if fn == "_attention_paged" and var == "r":  # the task's query rows
            return self.rows_in_task
        if fn == "_attention_paged" and var == "j0":  # key blocks of one decode row at `context`
            return math.ceil((self.context + 1) / self.block_kv)
        if fn == "op_linear" and var == "r0":  # the batched LM head: every row's logits
            return math.ceil(self.batch / self.block_t)
        return 1  # the model's rule for trips the source cannot tell: once

    def trips(self, lf: LoopFacts, ev: Evaluator) -> int | None:
        t = self._code.trips(lf, ev)
        if t is not None or lf.node is None:
            return t
        if ev.executes(lf.node, lf.chain) is False:
            return 0
        total = self._own(lf.source_fn, lf.node, lf.chain, ev)
        for ch, node in lf.enclosing:
            total *= self._own(ch[-1][0] if ch else None, node, ch, ev)
        return total


def _evaluator(tf: TableFacts, batch: int) -> Evaluator:
    tabs = tf.tables
    tl = tabs.man["tilings"][tabs.tiling]
    ctrl = np.zeros(int(tl["layout"].get("ctrl_size", 64)), dtype=np.int64)
    ctrl[CTRL_MODE], ctrl[CTRL_T], ctrl[CTRL_PAST], ctrl[CTRL_BATCH] = MODE_PREFILL, batch, 0, BATCH_BLOCK
    mem = {"TASKS": tabs.tasks, "DI": tabs.desc_int.reshape(-1), "DF": tabs.desc_float.reshape(-1), "CTRL": ctrl}
    constexprs = dict(tl.get("constexprs", {}), STEP=MODE_PREFILL)
    return Evaluator(tabs.src, mem, constexprs, int(tl.get("grid", 1)))


def predict_batch(code: KernelCode, tf: TableFacts, man: dict[str, Any], batch: int,
                  context: int) -> BatchPrediction:
    """µs per batched decode step of `batch` rows at `context` tokens each (low / central / high),
    on `code` (a target's prefill kernel) over the prefill table of `tf`."""
    tabs = tf.tables
    rows = tabs.rows(MODE_PREFILL)
    chunk = int(man["tilings"][tabs.tiling]["layout"]["chunk"])
    if not 1 <= batch <= chunk:
        raise ValueError(f"a batched step carries 1..{chunk} rows (the prefill chunk), not {batch}")
    cx = tabs.man["tilings"][tabs.tiling]["constexprs"]
    block_t, block_kv = int(cx["BLOCK_T"]), int(cx["BLOCK_KV"])
    bc = _BatchTrips(code, batch, context, block_t, block_kv)
    ev = _evaluator(tf, batch)
    waits = waits_of(rows)
    levels = tf.levels["prefill"]
    tr = tf.traffic["prefill"]  # weights per task do not depend on the rows (the embedding's do)
    threads = code.params.threads or int(code.info.get("metadata", {}).get("num_warps", 8)) * 32
    kv: list[float] = []
    for r in rows:
        d = tabs.desc_int[r["desc"]]
        if r["op"] == OP_ATTENTION:
            lo = r["b"] * block_t
            n = max(0, min(batch, lo + block_t) - lo)
            group = max(1, int(d[AttentionDesc.group]))
            kv.append(n * (context + 1) * int(d[AttentionDesc.head_dim]) * 4 * 2 / group)
        else:
            kv.append(0.0)
    weights = []
    for i, r in enumerate(rows):
        w = tr.weights[i]
        if r["op"] == OP_EMBED:  # the chunk's rows in the table; a step reads B
            w = w // max(1, chunk) * batch
            if int(tabs.desc_int[r["desc"]][EmbedDesc.pos_table]) >= 0:
                w = w  # learned positions: B rows too (already per row)
        weights.append(w)
    central = params_for(code.target, "central")
    kv_in_l2 = sum(kv) <= central.l2_mb * 1e6 / 2
    cache: dict[tuple[Any, ...], Any] = {}
    shapes: list[TaskShape] = []
    unpriced = 0
    for i, r in enumerate(rows):
        ev.set_task(i)
        rows_here = batch
        if r["op"] == OP_ATTENTION:
            lo = r["b"] * block_t
            rows_here = max(0, min(batch, lo + block_t) - lo)
        bc.rows_in_task = rows_here
        key = (r["op"], r["desc"], len(r["waits"]), kv[i] > 0, rows_here)
        pf = cache.get(key)
        if pf is None:
            pf = cache[key] = task_path(bc, ev, r["op"], len(r["waits"]), kv=kv[i] > 0)  # type: ignore[arg-type]
        s, priced, _ = path_shape(bc, ev, pf, weights[i], kv[i], threads, kv_in_l2)  # type: ignore[arg-type]
        unpriced += not priced
        s.op, s.waits, s.level = r["op"], waits[i], levels[i]
        s.l2_bytes = 0.0  # the prefill kernel has no L2 prefetch of the next task
        shapes.append(s)
    grid = int(code.info.get("grid") or man["targets"][code.target].get("grid") or central.sms)
    warps = max(1, threads // 32)
    overlapped = bool(code.src.claim.get("overlapped"))
    us: dict[str, float] = {}
    busy: dict[str, float] = {}
    for case in CASES:
        res = simulate(shapes, sim_params(params_for(code.target, case), grid, warps, overlapped))
        us[case] = round(res.step_us, 1)
        if case == "central":
            busy = {OP_NAMES[o] if 0 <= o < len(OP_NAMES) else str(o): round(v["busy_us"], 1)
                    for o, v in sorted(res.per_op.items())}
    wsum = int(sum(w for r, w in zip(rows, weights, strict=True) if r["op"] != OP_EMBED))
    return BatchPrediction(code.target, batch, context, us,
                           {"weights": wsum, "kv": int(sum(kv)), "embedding": int(sum(weights) - wsum)}, busy, unpriced)
