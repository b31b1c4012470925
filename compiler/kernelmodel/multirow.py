"""The multi-row bodies' latency: a prefill launch (TTFT) and a batched decode step of the prefill
kernel, priced level by level along the task table's critical path from the SASS facts of the
loops those bodies run (docs/kernel-model.md, "Multi-row bodies").

Every body that takes more than one row runs loops whose iterations wait for each other: the
Linear's `tl.dot` k-loop (a BLOCK_T x BLOCK_KD activation tile and a BLOCK_N x BLOCK_KD weight tile
loaded, normalized, handed through shared memory to the MMA operands, tf32x3), the RMSNorm pass
before it, the generic one-row matrix-vector loop (a batch of 1), the paged attention's row and key
block loops. One iteration costs

    the weight tile's latency      DRAM for a task's first row block (the tile is read once from
                                   HBM, nothing else in flight), L2 for the row blocks after it
    + kstep_rt L2 round trips      the rest of the iteration's dependent chain (the activations'
                                   load beside the weights, the norm's gains, the hand-over)
    + max(issue, MMA)              the iteration's warp instructions (SASS, per warp) x warps / IPC,
                                   or its HMMAs at the target's tensor-core rate, whichever is longer
    + barriers, spills             BAR.SYNCs x t_bar; local loads/stores x local_rt L2 round trips

and a level costs waves x (its task + the calibrated per-task cost) + signal -> poll. The facts
per tile shape (instructions, HMMAs, barriers, local accesses per iteration) are read off the
prefill cubins (`sass_facts`, recorded in calibration.json); the model shapes are the bench's.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, fields
from typing import Any

from .latency import LatencyParams

__all__ = ["BodyFacts", "Loop", "ModelShape", "MultiRowTerms", "Priced", "Pricer", "batch_step", "prefill",
           "sass_facts"]

# tensor-core rate per SM per cycle (dense, the spec sheets: H100/H200 989 TFLOP/s bf16 and 495
# tf32 at 132 SMs x 1.83 GHz; A10 125 / 62.5 at 72 SMs x 1.695 GHz)
MMA_FLOPS_PER_CLK = {"sm_90": {"tf32": 2048.0, "bf16": 4096.0}, "sm_8x": {"tf32": 512.0, "bf16": 1024.0}}
HMMA_FLOPS = {"tf32": 16 * 8 * 8 * 2, "bf16": 16 * 8 * 16 * 2}  # one m16n8k8 / m16n8k16 per warp


@dataclass(frozen=True)
class Loop:
    """One iteration of a SASS loop, per warp."""

    instrs: float = 0.0
    hmma: float = 0.0  # warp-level MMAs (m16n8k8 tf32)
    hgmma: float = 0.0  # warpgroup MMAs (sm_90 wgmma, m64 x BLOCK_N x k8 tf32), per warp
    bars: float = 0.0
    local: float = 0.0  # spilled local loads + stores

    def __add__(self, o: Loop) -> Loop:
        return Loop(self.instrs + o.instrs, self.hmma + o.hmma, self.hgmma + o.hgmma, self.bars + o.bars,
                    self.local + o.local)

    def scaled(self, k: float) -> Loop:
        return Loop(self.instrs * k, self.hmma * k, self.hgmma * k, self.bars * k, self.local * k)


@dataclass(frozen=True)
class BodyFacts:
    """The prefill kernel's multi-row loops at one tiling (BLOCK_T x BLOCK_N x BLOCK_KD)."""

    block_t: int
    block_n: int
    block_kd: int
    warps: int
    dot: Loop  # the tl.dot k-loop, one product (the ungated arm)
    gated: Loop  # what the gated arm adds (the second product)
    stats: Loop  # the RMSNorm pass over the rows, per BLOCK_KD
    gemv: Loop  # the generic one-row loop, per BLOCK_N x BLOCK_K chunk
    paged_row: Loop  # paged attention: a row's setup
    paged_block: Loop  # paged attention: one key block of a row
    append: Loop  # cache append: one row block
    block_k: int = 64  # the one-row loop's chunk along K
    block_kv: int = 32
    block_e: int = 256
    lm_block_n: int = 256

    @staticmethod
    def from_dict(d: dict[str, Any]) -> BodyFacts:
        kw: dict[str, Any] = {f.name: (Loop(**d[f.name]) if isinstance(d[f.name], dict) else d[f.name])
                              for f in fields(BodyFacts) if f.name in d}
        return BodyFacts(**kw)


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


@dataclass(frozen=True)
class MultiRowTerms:
    """The multi-row bodies' fitted terms (calibration.json, `multirow.fit`)."""

    kstep_rt: float  # L2 round trips per loop iteration beside its weight tile
    tile_dram_x: float  # a weight tile's first read from HBM: x the range's DRAM latency
    local_rt: float = 0.0  # L2 round trips per spilled local access


@dataclass
class Priced:
    us: float
    parts: dict[str, float]  # µs of the critical path per term

    @property
    def limit(self) -> str:
        return max(self.parts, key=lambda k: self.parts[k])

    def add(self, o: Priced, times: float = 1.0) -> None:
        self.us += o.us * times
        for k, v in o.parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + v * times


def _fam(lp: LatencyParams, fam: str | None) -> str:
    return fam or ("sm_90" if lp.sms >= 100 else "sm_8x")


class Pricer:
    """Prices one iteration of the multi-row loops, and the bodies built of them, on one case of a
    target's calibrated parameters (a subclass prices other bodies: designs.Issue34)."""

    def __init__(self, lp: LatencyParams, terms: MultiRowTerms, facts: BodyFacts, dram_raw_us: float,
                 fam: str | None = None, precision: str = "tf32"):
        self.lp, self.t, self.f, self.fam = lp, terms, facts, _fam(lp, fam)
        self.instr_us = facts.warps / lp.ipc / (lp.clock_ghz * 1e3)
        rate = MMA_FLOPS_PER_CLK[_fam(lp, fam)][precision]
        self.hmma_us = HMMA_FLOPS[precision] * facts.warps / rate / (lp.clock_ghz * 1e3)
        # a wgmma instruction (one per warpgroup in the code): every warpgroup's 64 x BLOCK_N x 8 product
        self.hgmma_us = 64 * facts.block_n * 8 * 2 * facts.warps / 4 / rate / (lp.clock_ghz * 1e3)
        self.dram_us = terms.tile_dram_x * dram_raw_us  # the range's, not the decode fit's loaded one

    def iteration(self, loop: Loop, weight: str | None, rt: float) -> Priced:
        """One iteration: its weight tile from 'dram' / 'l2' / nowhere, `rt` more round trips."""
        lp = self.lp
        parts = {"weight tile (DRAM)": self.dram_us if weight == "dram" else 0.0,
                 "weight tile (L2)": lp.l2_us if weight == "l2" else 0.0,
                 "dependent round trips": rt * lp.l2_us,
                 "issue": loop.instrs * self.instr_us, "mma": 0.0,
                 "barriers": loop.bars * lp.barrier_us, "spills": loop.local * self.t.local_rt * lp.l2_us}
        mma = loop.hmma * self.hmma_us + loop.hgmma * self.hgmma_us
        if mma > parts["issue"]:
            parts["mma"], parts["issue"] = mma, 0.0
        return Priced(sum(parts.values()), parts)

    def linear(self, rows: int, k: int, n: int, gated: bool, normed: bool) -> Priced:
        f, t = self.f, self.t
        p = Priced(0.0, {})
        if rows == 1:  # the generic one-row body: every chunk's weights from HBM
            ks = math.ceil(k / f.block_k)
            if normed:
                p.add(self.iteration(f.stats, None, 1.0), ks)
            p.add(self.iteration(f.gemv, "dram", 0.0), ks * math.ceil(n / f.block_n))
            return p
        rb, ks, cb = math.ceil(rows / f.block_t), math.ceil(k / f.block_kd), math.ceil(n / f.block_n)
        loop = f.dot + f.gated if gated else f.dot
        if normed:
            p.add(self.iteration(f.stats, None, 1.0), rb * ks)
        p.add(self.iteration(loop, "dram", t.kstep_rt), cb * ks)
        p.add(self.iteration(loop, "l2", t.kstep_rt), (rb - 1) * cb * ks)
        return p

    def attention_prefill(self, t_rows: int) -> Priced:
        """The last query block (the causal level's slowest task): every key block, two products."""
        p = Priced(0.0, {})
        p.add(self.iteration(self.f.dot.scaled(2.0), "l2", self.t.kstep_rt), math.ceil(t_rows / self.f.block_kv))
        return p

    def attention_paged(self, rows: int, context: int) -> Priced:
        """A task's rows one after another: per row its setup (the page table, then its first keys),
        per key block the next block's page and keys (the rows' f32 KV is read from HBM once a step)."""
        p = Priced(0.0, {})
        p.add(self.iteration(self.f.paged_row, "dram", 1.0), rows)
        p.add(self.iteration(self.f.paged_block, "dram", 1.0), rows * math.ceil((context + 1) / self.f.block_kv))
        return p

    def append(self, rows: int) -> Priced:
        p = Priced(0.0, {})
        p.add(self.iteration(self.f.append, "l2", 0.0), math.ceil(rows / self.f.block_t))
        return p

    def embed(self, rows: int, hidden: int) -> Priced:
        p = Priced(0.0, {})
        p.add(self.iteration(Loop(), "dram", 0.0), math.ceil(rows / self.f.block_t) * math.ceil(hidden / self.f.block_e))
        return p


@dataclass
class _Task:
    body: Priced
    after: list[int]  # the tasks it waits for (one list object per level: its maximum is cached)


def _table(pr: Pricer, m: ModelShape, rows: int, chunk: int, lm_rows: int, attention: Priced) -> list[_Task]:
    """The prefill table's tasks in table order (the scheduler's: per layer q, k, v, the cache
    appends, attention per (head, query block), o, gate/up, down; then the LM head and the argmax),
    each waiting for the level it reads, with its priced body."""
    f, h, hd = pr.f, m.hidden, m.head_dim
    tasks: list[_Task] = []

    def level(body: Priced, n: int, after: list[int]) -> list[int]:
        ids = list(range(len(tasks), len(tasks) + n))
        tasks.extend(_Task(body, after) for _ in ids)
        return ids

    prev = level(pr.embed(rows, h), 1, [])
    q_body, o_body = pr.linear(rows, h, f.block_n, False, True), pr.linear(rows, h, f.block_n, False, False)
    gu_body, down_body = pr.linear(rows, h, f.block_n, True, True), pr.linear(rows, m.mlp, f.block_n, False, False)
    qblocks, live = math.ceil(chunk / f.block_t), math.ceil(rows / f.block_t)
    empty = Priced(0.0, {})
    for _ in range(m.layers):
        q = level(q_body, h // f.block_n, prev)
        kv = level(q_body, 2 * (m.kv_heads * hd // f.block_n), prev)
        app = level(pr.append(rows), m.kv_heads, kv)
        ready, att = q + app, []
        for _h in range(m.heads):
            for b in range(qblocks):
                att += level(attention if b < live else empty, 1, ready)
        o = level(o_body, h // f.block_n, att)
        gu = level(gu_body, m.mlp // f.block_n, o)
        prev = level(down_body, h // f.block_n, gu)
    lm = level(pr.linear(lm_rows, h, f.lm_block_n, False, True), math.ceil(m.vocab / f.lm_block_n), prev)
    level(empty, 1, lm)  # the argmax
    return tasks


def _run(pr: Pricer, tasks: list[_Task]) -> Priced:
    """List scheduling of the table by the kernel's claim rule (event_sim's, without streams: the
    grid's programs claim tasks in table order, each its next one when it begins one (usable an
    atomic's round trip later), so a program holds a claimed task until the one it runs finishes); a
    task's body starts at the later of that and its waits' last signal + signal -> poll, and it signals its body +
    the per-task cost later. The critical chain's time split into the bodies' terms, the per-task
    cost, the launch, and the rest: waiting (signals, and programs held by tasks claimed ahead)."""
    lp = pr.lp
    finish = [0.0] * len(tasks)
    cause = [-1] * len(tasks)
    progs = [(0.0, i, 0.0, -1) for i in range(lp.sms)]  # (claim time, program, free at, its last task)
    heapq.heapify(progs)
    cache: dict[int, tuple[float, int]] = {}
    for k, t in enumerate(tasks):
        claim, pid, free, last = heapq.heappop(progs)
        key = id(t.after)
        if key not in cache:
            j = max(t.after, key=lambda j: finish[j]) if t.after else -1
            cache[key] = (finish[j] + lp.sync_us if j >= 0 else 0.0, j)
        ready, dep = cache[key]
        begin = max(free, claim + lp.atomic_us)  # the claim's result, then the program is free
        start = max(begin, ready)
        cause[k] = dep if ready >= begin else last
        finish[k] = start + t.body.us + lp.task_us
        heapq.heappush(progs, (begin, pid, finish[k], k))  # it claims its next task as it begins this one
    end = max(range(len(tasks)), key=lambda i: finish[i])
    out = Priced(lp.launch_us + finish[end], {"launch + sync": lp.launch_us})
    k, n = end, 0
    while k >= 0:
        for term, v in tasks[k].body.parts.items():
            out.parts[term] = out.parts.get(term, 0.0) + v
        k, n = cause[k], n + 1
    out.parts["per-task cost"] = lp.task_us * n
    out.parts["waiting (signals, claimed tasks)"] = max(0.0, out.us - sum(out.parts.values()))
    return out


def prefill(m: ModelShape, facts: BodyFacts, lp: LatencyParams, terms: MultiRowTerms, dram_raw_us: float,
            tokens: int = 128, fam: str | None = None, pricer: type[Pricer] | None = None) -> Priced:
    """µs of one prefill launch of `tokens` rows (TTFT: the LM head's last row only). `lp`: the
    calibrated parameters of a case; `dram_raw_us`: the same case's DRAM latency range, uncalibrated."""
    pr = (pricer or Pricer)(lp, terms, facts, dram_raw_us, fam)
    return _run(pr, _table(pr, m, tokens, tokens, 1, pr.attention_prefill(tokens)))


def batch_step(m: ModelShape, facts: BodyFacts, lp: LatencyParams, terms: MultiRowTerms, dram_raw_us: float,
               batch: int, context: int, chunk: int = 128, fam: str | None = None,
               pricer: type[Pricer] | None = None) -> Priced:
    """µs of one batched decode step: `batch` rows at `context` tokens each (every row's logits),
    over the prefill table of `chunk` rows (its query blocks past the rows exit at once)."""
    pr = (pricer or Pricer)(lp, terms, facts, dram_raw_us, fam)
    return _run(pr, _table(pr, m, batch, chunk, batch, pr.attention_paged(min(batch, facts.block_t), context)))


def sass_facts(code: Any, constexprs: dict[str, Any]) -> dict[str, Any]:
    """The BodyFacts of a prefill KernelCode (sass_map.KernelCode of kernel="prefill") and its
    tiling's constexprs, as a dict: per loop iteration and warp, its instructions, HMMAs, barriers
    and local (spill) accesses."""
    import collections

    def count(ns: set[int]) -> dict[str, int]:
        c = collections.Counter(code.sass.instrs[n].opcode.split(".")[0] for n in ns)
        return {"instrs": len(ns), "hmma": c["HMMA"], "hgmma": c["HGMMA"], "bars": c["BAR"], "local": c["LDL"] + c["STL"]}

    cx = constexprs
    out: dict[str, Any] = {"warps": max(1, (code.params.threads or 256) // 32)}
    for body in ("op_linear", "op_attention", "op_cache_append"):
        stats_line = None
        for lf in code.body_loops(body):
            own = set(lf.own)
            fn = lf.source_fn
            if body == "op_linear" and fn == "op_linear" and lf.mma and "dot" not in out:
                blocks = sorted({code.cfg.block_of[n] for n in own})
                hm = [b for b in blocks if any(code.sass.instrs[n].opcode.startswith(("HMMA", "HGMMA"))
                                               for n in range(code.cfg.blocks[b].start, code.cfg.blocks[b].end))]
                if len(hm) >= 2:  # the k-loop: its last HMMA block is the gated arm's second product
                    g = {n for n in range(code.cfg.blocks[hm[-1]].start, code.cfg.blocks[hm[-1]].end) if n in own}
                    out["dot"], out["gated"] = count(own - g), count(g)
            elif body == "op_linear" and fn == "_row_stats" and "stats" not in out:
                # the first copy is the dot path's: its LayerNorm mean pass, then the RMS pass
                if stats_line is None:
                    stats_line = lf.source_line
                elif lf.source_line != stats_line:
                    out["stats"] = count(own)
            elif body == "op_linear" and fn == "_gemv" and "gemv" not in out and not lf.mma:
                out["_gemv"] = out.get("_gemv", []) + [(lf.source_line, count(own))]
            elif body == "op_attention" and fn == "_attention_paged":
                out.setdefault("_paged", []).append((lf.source_line, count(own)))
            elif body == "op_cache_append" and "append" not in out:
                out["append"] = count(own)
    gem = sorted(out.pop("_gemv", []), key=lambda x: x[0])
    if gem:  # the k-loop is the innermost (the last line) of the first copy
        out["gemv"] = max(gem[:2], key=lambda x: x[0])[1]
    pg = sorted(out.pop("_paged", []), key=lambda x: x[0])
    if len(pg) >= 2:  # the row loop, then its key-block loop
        out["paged_row"], out["paged_block"] = pg[0][1], pg[1][1]
    for k, name in (("block_t", "BLOCK_T"), ("block_n", "BLOCK_N"), ("block_kd", "BLOCK_KD"), ("block_k", "BLOCK_K"),
                    ("block_kv", "BLOCK_KV"), ("block_e", "BLOCK_E")):
        if name in cx:
            out[k] = int(cx[name])
    return out
