"""One task's way through the megakernel's task loop, read from the machine code: the blocks it runs
from the loop head back to it (the arms its `if`s and jump tables take for this task, through
`KernelCode.successors`), the loops it enters, the polls of its waits, and what the in-order issue
of that code implies: weight bytes requested before the first poll, bytes in flight, and the
dependent round trips before, beside and after the weight stream.

`latency` turns a task's path and its table bytes into the durations of the event simulation;
`static_facts` reports the path of a sample task per op body (and per specialized variant).

Rules of the issue model (in order, one program's warps alike): a global load is outstanding from
its issue until an instruction reads or overwrites a register it writes (the scoreboard wait); an
instruction that waits for a non-weight load starts a new dependent round trip (L2: descriptors,
activations, the poll); weight loads add no round trip here (their DRAM time is the stream's, in
the model); atomics are priced on their own (fences and atomics in `sync`). A loop the path enters is
a barrier: what was outstanding before it has arrived after it (its own cost comes from
`KernelCode.loop_path` and its trips). A poll loop is issued once (its spin is the wait).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from .sass_map import KernelCode, LoopFacts, SyncCounts
from .triton_source import Evaluator

__all__ = ["PathFacts", "nest", "task_path"]


@dataclass
class PathFacts:
    """The facts of one task's path (per thread where it says so). Round trips are counted from
    the top of the task loop (the claim's atomic excluded)."""

    body: str | None
    variants: tuple[str, ...]  # the weight-reading functions on the path (`_gemv_k576_rms`, `_gemv`, op_linear...)
    polls: int  # polls on the path (= the task's waits)
    waits_in_body: bool  # the body polls itself (after requesting weights) rather than the task loop before it
    prefetch_per_thread: int  # weight bytes requested before the first poll
    used_before_poll_per_thread: int  # of those, bytes the code waits for before it polls (ptxas placed their use there)
    pre_rt: int | None  # round trips before the first weight request, when that precedes the poll
    first_weight_rt: int | None  # address chain of the first weight load (row -> descriptor -> weight)
    poll_rt: int  # round trips before the first poll issues
    lead_rt: int  # after the last poll: before the stream (weights after the prefetch, or a streaming loop)
    par_rt: int  # beside the stream (activations loaded while the weights arrive)
    tail_rt: int  # after the last weight byte is used (epilogue loads)
    tail_instrs: int  # instructions issued after the last weight byte is used (math that cannot overlap)
    in_flight_per_thread: int  # most weight bytes outstanding at once in straight-line code
    weight_opcodes: dict[str, int]  # straight-line weight loads on the path
    weight_bytes_per_thread: int
    sync: SyncCounts  # straight-line fences / L1 invalidations / atomics / barriers, the claim excluded
    waited_atomics: int  # atomics whose result the task waits for (the claim excluded)
    claim_atomics: int
    ctrl_loads: int  # loads from CTRL (mapped host memory) on the path
    loops: list[tuple[LoopFacts, str]] = field(default_factory=list)  # (loop, region) in path order
    instructions: int = 0
    reaches_body: bool = True
    decisions: tuple[int, ...] = ()  # the blocks whose successors the task's path depends on
    kv_loop: int | None = None  # header block of the loop that streams the KV cache
    # L2 prefetches (CCTL.E.PF2, the next task's weights, PREFETCH): on the path, straight-line code
    # once and each loop's per iteration; 128-byte lines, so 128 x that many bytes per thread and
    # pass; round trips before the first issues (the claim's atomic excluded, as above)
    l2_prefetches: int = 0
    l2_prefetch_rt: int | None = None
    l2_prefetch_at_end: bool = False  # they issue after the stream and the task's last round trips (the signal's side)
    claim_waited: bool = False  # the claimed index is waited for before the first weight request or poll
    # after the task's signal (its last atomic of the task loop's own code, not the claim): what
    # delays only this program's next task, not the task's dependents
    post_signal_rt: int = 0
    post_signal_instrs: int = 0
    # round trips from one poll to the next (the most between two on the path; 1 when a wait's
    # words were loaded before the first poll, 2 when they came after the previous poll's barrier)
    poll_gap_rt: int = 1

    @property
    def l2_prefetch_bytes_per_thread(self) -> int:
        return 128 * self.l2_prefetches

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k not in ("loops", "sync", "decisions")}
        d["sync"] = self.sync.as_dict()
        d["l2_prefetch_bytes_per_thread"] = self.l2_prefetch_bytes_per_thread
        d["loops"] = [f"{lf.source_fn}:{lf.source_line} ({region})" for lf, region in self.loops]
        return d


def task_path(code: KernelCode, ev: Evaluator, op: int, n_waits: int, kv: bool = False, limit: int = 1024) -> PathFacts:
    """The path of the evaluator's task (op code `op`, `n_waits` waits; `kv`: it reads the KV
    cache, and the loop on its path that moves the most bytes is that stream). Loops that load
    weights are the stream too. Among paths the branches leave open, the one with the most weight
    loads, then loops, then instructions (the slowest). `limit` caps the paths walked: SmolLM2's
    sm_90 decode kernel with the MLP split-K bodies leaves 105 open for a q projection task, and
    the cap of 96 it had cut the walk before it reached the body (the task then looked unpriced)."""
    body = _body_for(code, ev, op)
    best: tuple[tuple[int, int, int], list[tuple[str, int]]] | None = None
    decisions: set[int] = set()
    for path in _walk(code, ev, body, limit, decisions):
        seq = _flatten(code, path, ev, n_waits)
        nw = sum(1 for k, x in seq if k == "i" and x in code.weight)
        key = (int(any(k == "i" and code.where[x] == body for k, x in seq)), nw, sum(k == "l" for k, _ in seq), len(seq))
        if best is None or key > best[0]:  # type: ignore[operator]
            best = (key, seq)  # type: ignore[assignment]
    seq = best[1] if best is not None else []
    kv_loop = None
    if kv:
        moved = {}
        for k, x in seq:
            if k == "l":
                lf = code.loop_facts(next(lp for lp in code.inner_loops if lp.header == x))
                for inner in nest(code, lf):
                    trips = code.trips(inner, ev)
                    if not inner.weight_loads and trips:
                        moved[inner.loop.header] = trips * code.loop_path(inner, ev, body or "")["global_bytes_per_thread"]
        kv_loop = max(moved, key=lambda h: moved[h]) if moved else None
    facts = _issue(code, seq, body, lambda lf: any(i.loop.header == kv_loop for i in nest(code, lf)))
    facts.reaches_body = body is None or any(k == "i" and code.where[x] == body for k, x in seq)
    facts.decisions = tuple(sorted(decisions))
    facts.kv_loop = kv_loop
    return facts


def nest(code: KernelCode, lf: LoopFacts) -> list[LoopFacts]:
    """A loop and the loops inside it (polls excluded), outermost first."""
    return [code.loop_facts(lp) for lp in sorted(code.inner_loops, key=lambda lp: -len(lp.blocks))
            if lp.blocks <= lf.loop.blocks and lp.header not in code.poll_loops]



def _body_for(code: KernelCode, ev: Evaluator, op: int) -> str | None:
    """The op's body in this kernel: the one of its arm's functions with code here (a decode or a
    prefill body chosen by a constexpr), else the one whose call site runs for the task."""
    names = [b for b in code.src.dispatch.get(op, ()) if b in code.body_blocks]
    if len(names) > 1:
        call = code.src.dispatch_calls
        names = [b for b in names if ev.executes(call[b], ((code.src.entry, call[b].lineno),)) is not False] or names
    return names[0] if names else None


def _walk(code: KernelCode, ev: Evaluator, body: str | None, limit: int, decisions: set[int]
          ) -> list[list[tuple[str, int]]]:
    """Paths from the task loop's head back to it: ("b", block) and ("l", loop header) items, an
    inner loop entered once and left at its exits."""
    cfg, tl = code.cfg, code.task_loop
    assert tl is not None
    header = tl.header
    paths: list[list[tuple[str, int]]] = []
    stack: list[tuple[int, list[tuple[str, int]], frozenset[int]]] = [(header, [], frozenset())]
    while stack and len(paths) < limit:
        b, path, seen = stack.pop()
        if (path and b == header) or b not in tl.blocks or b in seen:
            paths.append(path)
            continue
        lp = code.outer_of.get(b)
        if lp is not None:
            exits = sorted({x for y in lp.blocks for x in cfg.blocks[y].succs if x not in lp.blocks})
            nxt = [*path, ("l", lp.header)]
            if not exits:
                paths.append(nxt)
            for x in reversed(exits):
                stack.append((x, nxt, seen | lp.blocks))
            continue
        if len(cfg.blocks[b].succs) > 1:
            decisions.add(b)
        succ = code.successors(b, ev, body)
        succ = [s for s in succ if s in tl.blocks] or succ  # stay in the loop: the task runs
        nxt = [*path, ("b", b)]
        for s in reversed(succ):
            stack.append((s, nxt, seen | {b}))
    return paths


def _flatten(code: KernelCode, path: list[tuple[str, int]], ev: Evaluator, n_waits: int) -> list[tuple[str, int]]:
    """The path as ("i", instruction) and ("l", loop header) entries: instructions the task provably
    skips dropped, a poll loop inlined once, wait copies beyond the task's waits dropped, the group
    arm of the signal dropped."""
    cfg, ins = code.cfg, code.sass.instrs
    out: list[tuple[str, int]] = []
    for kind, b in path:
        if kind == "l" and b not in code.poll_loops:
            out.append(("l", b))
            continue
        if kind == "l":
            lp = next(lp for lp in code.inner_loops if lp.header == b)
            idx = lp.instr_indices(cfg)
        else:
            idx = list(range(cfg.blocks[b].start, cfg.blocks[b].end))
        for n in idx:
            if code.executes(n, ev) is False or code.in_group_arm(n):
                continue
            if ins[n].op in ("BRA", "BRX", "BRXU", "NOP", "YIELD", "BSSY", "BSYNC", "WARPSYNC"):
                continue
            out.append(("i", n))
    kept: list[tuple[str, int]] = []
    copy = 0
    done = n_waits == 0  # the last copy the task runs is over (its barrier passed): drop the rest
    for kind, x in out:
        if kind == "i" and code.in_wait[x]:
            if done:
                continue
            if x in code.polls:
                copy += 1
            elif copy >= n_waits and ins[x].is_barrier:
                done = True  # the last wait's barrier: its test of the polled count came before it
        kept.append((kind, x))
    return kept


def _issue(code: KernelCode, seq: list[tuple[str, int]], body: str | None, streams_kv: Any) -> PathFacts:
    ins = code.sass.instrs
    pending: dict[str, int] = {}
    loads: dict[int, tuple[int, bool, int, bool]] = {}  # id -> (bytes, weight, arrival depth, atomic)
    depth, outstanding_w, best_w = 0, 0, 0
    marks: list[int] = []
    consumed: list[int] = []  # positions where a weight load's data is first used
    used: dict[int, int] = {}  # weight load -> position of its first use
    waited_atomics = 0
    sync = SyncCounts()
    claims = ctrl = 0
    wops: Counter[str] = Counter()
    wbytes = 0
    loops: list[tuple[int, LoopFacts]] = []
    pf_n, pf_pos, claim_use = 0, -1, -1
    for pos, (kind, x) in enumerate(seq):
        if kind == "l":  # a barrier: everything outstanding has arrived when the loop is done
            depth = max([depth] + [arr for _, _, arr, at in loads.values() if not at])
            n_pf = sum(1 for lf in nest(code, code.loop_facts(next(lp for lp in code.inner_loops if lp.header == x)))
                       for n in lf.own if ins[n].is_l2_prefetch)
            if n_pf and pf_pos < 0:
                pf_pos = pos
            pf_n += n_pf
            if any(w for _, w, _, _ in loads.values()):
                consumed.append(pos)
            loads.clear()
            pending.clear()
            outstanding_w = 0
            marks.append(depth)
            loops.append((pos, code.loop_facts(next(lp for lp in code.inner_loops if lp.header == x))))
            continue
        i = ins[x]
        hit = {pending[r] for r in (*i.srcs, *i.dests) if r in pending}
        if i.is_l2_prefetch:
            pf_n += 1
            if pf_pos < 0:
                pf_pos = pos
        for lid in hit:
            if lid in code.claims and claim_use < 0:
                claim_use = pos
            nbytes, w, arr, at = loads.pop(lid)
            depth = max(depth, arr)
            if w:
                consumed.append(pos)
                used[lid] = pos
                outstanding_w -= nbytes
            if at and lid not in code.claims:
                waited_atomics += 1
        if hit:
            for r in [r for r, lid in pending.items() if lid in hit]:
                pending.pop(r)
        marks.append(depth)
        if x in code.claims:
            claims += 1
        else:
            sync.add(i)
        if x in code.ctrl_loads:
            ctrl += 1
        if i.is_global_load:
            w = x in code.weight
            at = i.is_global_atomic
            loads[x] = (i.width(), w, depth + (0 if (w or at) else 1), at)
            for d in i.dests:
                pending[d] = x
            if w:
                outstanding_w += i.width()
                best_w = max(best_w, outstanding_w)
                wops[i.opcode] += 1
                wbytes += i.width()
        elif i.is_global_atomic and x in code.claims:
            pass
    final = max([depth] + [arr for _, _, arr, at in loads.values() if not at])
    polls = [p for p, (k, x) in enumerate(seq) if k == "i" and x in code.polls]
    weights = [p for p, (k, x) in enumerate(seq) if k == "i" and x in code.weight]
    stream_loops = {p for p, lf in loops if any(i.weight_loads for i in nest(code, lf)) or streams_kv(lf)}
    first_poll, last_poll = (polls[0], polls[-1]) if polls else (-1, -1)
    base = marks[last_poll] + 1 if polls else 0
    # the stream after the waits: weights requested or used there (a prefetch is used after the
    # poll too), and streaming loops; lead before it, par beside it, tail after it
    post_s = sorted({p for p in (*weights, *consumed, *stream_loops) if p > last_poll})
    if post_s:
        first_s, last_s = post_s[0], post_s[-1]
        lead = marks[first_s] - base
        par = marks[last_s] - marks[first_s]
        tail = final - marks[last_s]
    else:
        first_s = last_s = len(seq)
        lead, par, tail = final - base, 0, 0
    after = last_s if post_s else last_poll
    tail_instrs = sum(1 for p, (k, _) in enumerate(seq) if k == "i" and p > after)
    regions: list[tuple[LoopFacts, str]] = []
    for p, lf in loops:
        if polls and p < first_poll:
            r = "pre"
        elif p in stream_loops:
            r = "stream"
        elif p < first_s:
            r = "lead"
        elif p <= last_s:
            r = "par"
        else:
            r = "tail"
        regions.append((lf, r))
    pre_w = [p for p in weights if polls and p < first_poll]
    first_need = min([p for p in (weights[:1] + polls[:1])] or [len(seq)])
    sig = [p for p, (k, x) in enumerate(seq) if k == "i" and ins[x].is_global_atomic and x not in code.claims
           and code.where[x] is None]
    sig_pos = sig[-1] if sig else len(seq)
    first_w = weights[0] if weights else None
    variants = tuple(dict.fromkeys(f for k, x in seq if k == "i" and x in code.weight for f in _weight_fns(code, x)))
    return PathFacts(
        body=body, variants=variants, polls=len(polls),
        waits_in_body=bool(polls) and body is not None and code.where[seq[first_poll][1]] == body,
        prefetch_per_thread=sum(ins[seq[p][1]].width() for p in pre_w),
        used_before_poll_per_thread=sum(ins[seq[p][1]].width() for p in pre_w if used.get(seq[p][1], len(seq)) < first_poll),
        pre_rt=marks[pre_w[0]] if pre_w else None,
        first_weight_rt=code.address_depth(seq[first_w][1]) if first_w is not None else None,
        poll_rt=marks[first_poll] if polls else 0, lead_rt=max(0, lead), par_rt=max(0, par), tail_rt=max(0, tail),
        tail_instrs=tail_instrs, in_flight_per_thread=best_w, weight_opcodes=dict(wops), weight_bytes_per_thread=wbytes,
        sync=sync, waited_atomics=waited_atomics, claim_atomics=claims, ctrl_loads=ctrl, loops=regions,
        instructions=sum(1 for k, _ in seq if k == "i"), l2_prefetches=pf_n,
        l2_prefetch_rt=marks[pf_pos] if pf_pos >= 0 else None, claim_waited=0 <= claim_use < first_need,
        l2_prefetch_at_end=pf_pos > after,
        post_signal_rt=max(0, final - marks[sig_pos]) if sig_pos < len(seq) else 0,
        post_signal_instrs=sum(1 for p, (k, _) in enumerate(seq) if k == "i" and p > max(sig_pos, after)),
        poll_gap_rt=max([marks[b] - marks[a] for a, b in pairwise(polls)], default=1))


def _weight_fns(code: KernelCode, n: int) -> list[str]:
    """The innermost kernel.py function of a weight load's chain: the variant that streams it."""
    ch = code.chains[n]
    return [ch[-1][0]] if ch else []
