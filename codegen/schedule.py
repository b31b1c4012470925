"""The scheduler: raised decode/prefill IR -> a `Program` (fused ops, tiles, tasks, events).

`schedule` runs it in three steps:
- tasks.py lowers the transformer-level ops into fused ops split into tasks (norms into the
  Linear tiles that read them, residual Adds into epilogues, RoPE into the attention and
  cache-append loads); every task declares the regions it reads and writes;
- pack.py places what the tasks touch: activation buffers in A, constants in W/P, the op
  descriptors (and `pack.pack_arenas` fills W and P afterwards);
- this module derives the events tasks wait on and signal.

Dependencies are derived, not hand-written: every task declares the regions it reads and writes;
a consumer waits on the events that cover the tasks writing what it reads (a per-head group
event where it reads one head, the op's event where it reads everything), and waits implied by
other waits are dropped. `signalers` and `happens_before` read that DAG back from a finished
table (the validator and the table shuffler use them).
"""

from __future__ import annotations

import functools
from typing import Any

from zlc.bundle import MAX_WAITS
from zlc.ir import Graph

from .program import Program, Region, Task, Tiling
from .tasks import Op, ScheduleError, TaskBuilder

# ---- tiling per target -------------------------------------------------------------------------

def tiling_for(target: Any, max_seq: int, *, native: bool = False, heads: int = 0) -> Tiling:
    """Coarse tiles for the interpreter (few tasks: it costs ms per task); for GPUs, one Linear
    block per task so a decode step spreads across every SM, and split-KV for long contexts.
    GPU block sizes and 8 warps are what compiles without register spills on sm_80..sm_90 (the
    heaviest op body sets the whole kernel's registers); not yet tuned for speed.

    `native=True`: the native CPU kernel's tiling (threads, one per core). 128 output columns per
    Linear task: a decode task then streams 147 KB of bf16 weights (SmolLM2, K=576), long enough
    that what a task costs besides streaming (taking it, its waits and signal, its input row from
    another core's cache, the prefetcher's ramp-up on a new address: ~1 us) stays small (SmolLM2 on
    2 cores decodes ~15% faster than with 64 columns), short enough that a few threads still finish
    an op nearly together; 16 query rows per prefill attention task; no split-KV (heads outnumber
    cores). `grid` is 0: the thread count is chosen when a session starts. The block sizes the C
    bodies do not read (block_k, block_kd, block_e, block_kv) keep the cpu values.

    `heads`: the model's most query heads per attention op (0: unknown). On a GPU it caps the
    split-KV count so that one decode attention level (heads x splits tasks) fits `target`'s SMs
    in one round."""
    if native:
        return Tiling(block_n=128, block_k=1024, block_kd=1024, block_t=16, block_kv=64, block_e=1024,
                      max_linear_tasks=0, kv_splits=1, chunk=min(128, max_seq), num_warps=1, grid=0)
    if not getattr(target, "is_gpu", False):
        return Tiling(block_n=128, block_k=1024, block_kd=1024, block_t=32, block_kv=64, block_e=1024,
                      max_linear_tasks=2, kv_splits=1, chunk=min(64, max_seq), num_warps=1, grid=2)
    # Split-KV: up to 8 splits of >= 64 keys. The output projection merges the partials as it loads
    # its row (fuse_combine), so a split costs a task of the attention level, not a level. A decode
    # attention task is mostly fixed latency (its waits, the first key block's round trip, the
    # release), so once heads x splits outgrow the SMs the level takes a second round of tasks
    # that each save only a few key blocks: the Llama-3.2-1B shape (32 heads) on 132 SMs takes 4
    # splits, not 8 (kernel_stats: that level 8.9 -> 5.2 us per layer on h200), on 72 SMs 2.
    splits = 1
    while splits < 8 and max_seq // (splits * 2) >= 64 and (heads <= 0 or heads * splits * 2 <= target.sms):
        splits *= 2
    return Tiling(block_n=32, block_k=64, block_kd=32, block_t=16, block_kv=32, block_e=256, max_linear_tasks=0,
                  kv_splits=splits, chunk=min(128, max_seq), num_warps=8, grid=target.sms,
                  dot_precision="tf32x3", fuse_kv_append=True, fuse_combine=True, fuse_mlp_down=True,
                  lm_block_n=256)


# ---- events ------------------------------------------------------------------------------------

class _Events:
    def __init__(self) -> None:
        self.labels: list[str] = []

    def new(self, label: str) -> int:
        self.labels.append(label)
        return len(self.labels) - 1


def _assign_events(ops: list[Op], mode: str, events: _Events) -> list[Task]:
    """Gives each task its signal and waits for one mode; returns the table in canonical order.

    Two passes: the first finds which reads are already ordered through other waits (a residual
    read is implied by the read of the normed input that followed it); the second assigns events
    for the remaining reads only, so no op pays for group events nobody needs."""
    scratch = _Events()
    _assign_pass(ops, mode, scratch, None)
    tasks = [t for op in ops for t in op.tasks[mode]]
    writers = _writers(tasks)
    kept = {id(t): {r for r in _deps(t) if _read_waited(t, r, writers)} for t in tasks}
    for t in tasks:
        t.waits, t.signal, t.signal_target, t.parent = [], -1, 0, -1
    return _assign_pass(ops, mode, events, kept)


def _writers(tasks: list[Task]) -> dict[str, list[Task]]:
    out: dict[str, list[Task]] = {}
    for t in tasks:
        for r in t.writes:
            out.setdefault(r.buffer, []).append(t)
    return out


def _deps(t: Task) -> list[Region]:
    """What t must come after: the regions it reads, and those it accumulates into (an
    accumulating write follows the region's initializing write; accumulators commute)."""
    return t.reads + [r for r in t.writes if r.accumulate]


def _producers(t: Task, r: Region, writers: dict[str, list[Task]]) -> list[Task]:
    """The tasks (not t) whose writes overlap r; for an accumulating write r, the plain writers only."""
    return [w for w in writers.get(r.buffer, []) if w is not t
            and any(r.overlaps(x) and not (r.accumulate and x.accumulate) for x in w.writes)]


def _read_waited(t: Task, r: Region, writers: dict[str, list[Task]]) -> bool:
    """Whether, after pruning, one of t's waits is on an event a producer of r signals."""
    waited = {e for e, _ in t.waits}
    return any(w.signal in waited or w.parent in waited for w in _producers(t, r, writers))


def _assign_pass(ops: list[Op], mode: str, events: _Events,
                 kept: dict[int, set[Region]] | None) -> list[Task]:
    tasks = [t for op in ops for t in op.tasks[mode]]
    owner: dict[int, int] = {}
    for oi, op in enumerate(ops):
        for t in op.tasks[mode]:
            owner[id(t)] = oi
    writers = _writers(tasks)
    # what each consumer read needs: the set of producer tasks, per producing op
    needs: list[list[tuple[int, frozenset[int]]]] = []
    wanted: dict[int, set[frozenset[int]]] = {}
    for t in tasks:
        tn = []
        for r in _deps(t):
            if kept is not None and r not in kept[id(t)]:
                continue
            by_op: dict[int, set[int]] = {}  # a region may have writers in several ops (an accumulator's init)
            for w in _producers(t, r, writers):
                by_op.setdefault(owner[id(w)], set()).add(id(w))
            for oi, ids in by_op.items():
                ws = frozenset(ids)
                tn.append((oi, ws))
                wanted.setdefault(oi, set()).add(ws)
        needs.append(tn)
    # per producing op: groups (partition of its tasks) and whether an op-wide event is needed
    group_of: dict[int, int] = {}  # task id -> group event
    op_event: dict[int, int] = {}
    members: dict[int, list[Task]] = {}
    for oi, sets in wanted.items():
        op = ops[oi]
        all_ids = frozenset(id(t) for t in op.tasks[mode])
        partial = [s for s in sets if s != all_ids]
        if not partial:
            e = events.new(f"{op.label}:{mode}")
            op_event[oi] = e
            for t in op.tasks[mode]:
                t.signal, t.signal_target = e, len(op.tasks[mode])
            continue
        parent = {id(t): id(t) for t in op.tasks[mode]}  # union-find over overlapping needs
        for s in partial:
            it = iter(s)
            first = _find(parent, next(it))
            for x in it:
                parent[_find(parent, x)] = first
        find = functools.partial(_find, parent)
        groups: dict[int, list[Task]] = {}
        for t in op.tasks[mode]:
            groups.setdefault(find(id(t)), []).append(t)
        needs_all = any(s == all_ids for s in sets) or any(
            len({find(x) for x in s}) > MAX_WAITS - 1 for s in partial)
        pe = events.new(f"{op.label}:{mode}") if needs_all else -1
        if needs_all:
            op_event[oi] = pe
        for gi, (_, ts) in enumerate(groups.items()):
            e = events.new(f"{op.label}:{mode}:g{gi}")
            members[e] = ts
            for t in ts:
                t.signal, t.signal_target, t.parent = e, len(ts), pe
                group_of[id(t)] = e
    # waits: group events where they cover the need, else the op event
    for t, tn in zip(tasks, needs, strict=True):
        waits: dict[int, int] = {}
        for oi, ws in tn:
            whole = oi in op_event and len(ws) == len(ops[oi].tasks[mode])
            gs = {group_of[x] for x in ws} if all(x in group_of for x in ws) else None
            if gs is not None and not whole and len(gs) <= MAX_WAITS - 1:
                for e in gs:
                    waits[e] = len(members[e])
            else:
                e = op_event[oi]
                waits[e] = _target(ops[oi], mode, e)
        t.waits = list(waits.items())
    _prune_waits(tasks)
    for t in tasks:
        if len(t.waits) > MAX_WAITS:
            raise ScheduleError(f"task {t.label} needs {len(t.waits)} waits (at most {MAX_WAITS})")
    return tasks


def _find(parent: dict[int, int], x: int) -> int:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def _target(op: Op, mode: str, e: int) -> int:
    """Signals op event `e` receives: one per group when groups report to it, else one per task."""
    ts = op.tasks[mode]
    if any(t.parent == e for t in ts):
        return len({t.signal for t in ts})
    return len(ts)


def signalers(tasks: list[Task]) -> dict[int, list[int]]:
    """Event -> indices (in `tasks`) of the tasks whose completion it counts."""
    by_group: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        if t.signal >= 0:
            by_group.setdefault(t.signal, []).append(i)
    out = dict(by_group)
    for i, t in enumerate(tasks):
        if t.parent >= 0:
            out.setdefault(t.parent, []).append(i)
    return out


def happens_before(tasks: list[Task]) -> list[int]:
    """Bitset per task of the tasks certainly finished when it starts (through its waits)."""
    sig = signalers(tasks)
    hb = [0] * len(tasks)
    closure: dict[int, int] = {}  # event -> its signalers and everything before them

    def done(e: int) -> int:
        if e not in closure:
            m = 0
            for j in sig.get(e, []):
                m |= hb[j] | (1 << j)
            closure[e] = m
        return closure[e]

    for i in _topo(tasks, sig):
        m = 0
        for e, _ in tasks[i].waits:
            m |= done(e)
        hb[i] = m
    return hb


def _topo(tasks: list[Task], sig: dict[int, list[int]]) -> list[int]:
    deps = [[j for e, _ in t.waits for j in sig.get(e, [])] for t in tasks]
    seen: set[int] = set()
    order: list[int] = []
    for s in range(len(tasks)):
        stack = [(s, 0)]
        while stack:
            i, k = stack.pop()
            if k == 0 and i in seen:
                continue
            seen.add(i)
            if k < len(deps[i]):
                stack.append((i, k + 1))
                if deps[i][k] not in seen:
                    stack.append((deps[i][k], 0))
            else:
                order.append(i)
    return order


def _prune_waits(tasks: list[Task]) -> None:
    """Drops waits whose producers are already finished through another wait (transitively)."""
    sig = signalers(tasks)
    hb = happens_before(tasks)
    for t in tasks:
        if len(t.waits) < 2:
            continue
        cover = {}
        for e, tg in t.waits:
            m = 0
            for j in sig.get(e, []):
                m |= hb[j] | (1 << j)
            cover[(e, tg)] = m
        keep: list[tuple[int, int]] = []
        for w in sorted(t.waits, key=lambda w: -bin(cover[w]).count("1")):
            others = 0
            for k in keep:
                others |= cover[k]
            own = 0
            for j in sig.get(w[0], []):
                own |= 1 << j
            if own & ~others:
                keep.append(w)
        t.waits = keep


# ---- entry point -------------------------------------------------------------------------------

def schedule(decode: Graph, tiling: Tiling, max_seq: int, *, model: str = "model") -> Program:
    """Builds the program for a raised decode graph (the prefill graph has the same structure)."""
    b = TaskBuilder(decode, tiling, max_seq)
    b.run()
    events = _Events()
    tables = {mode: _assign_events(b.ops, mode, events) for mode in ("prefill", "decode")}
    lay = b.layout
    desc_int, desc_float = lay.desc_arrays()
    return Program(model=model, tiling=tiling, head_dim=b.head_dim, vocab=b.vocab, max_seq=max_seq,
                   buffers=lay.buffers, a_size=lay.a_size, logits=b.logits,
                   desc_int=desc_int, desc_float=desc_float,
                   desc_labels=lay.desc_labels, tables=tables, n_events=len(events.labels),
                   event_labels=events.labels, w_size=lay.w_size, p_size=lay.p_size, weights=lay.placements,
                   q_size=lay.q_size)
