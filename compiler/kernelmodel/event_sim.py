"""A discrete-event simulation of one megakernel step over its task table: the latency model's
engine (docs/kernel-model.md). Inputs are case-free task shapes (round trips, bytes, in-flight
bytes, sync instruction counts: `latency.task_shapes`) and one case of the stated latency and
bandwidth parameters; the output is the step's time, every task's timeline, and the critical
path.

    programs  grid programs claim tasks in table order: the first one each at launch, then the next
              when a task starts (overlapped claim: it is usable a claim round trip later) or when
              it ends (serial claim: the next start waits one claim round trip)
    a task    starts when its program is free; requests `prefetch` weight bytes after `pre_rt` L2
              round trips (they stream while it waits); polls after `poll_rt` (after the prefetch
              too, where the code uses those weights before polling); the first wait resolves
              at max(poll + one L2 round trip, its latest signaller's finish + t_sig), each next
              at max(previous + `poll_gap_rt` round trips, its signaller's finish + t_sig); then
              `lead_rt` round trips, the rest of its bytes stream (starting one DRAM latency after
              the request, or seamlessly after the prefetch), `par_rt` round trips beside them;
              then `serial` round trips the loop iterations add, `tail_rt`, the math it cannot
              overlap, and its fences / waited atomics / barriers / L1 invalidations; it finishes
              (signals) before the `post_rt` / `post_instrs` of those that follow its signal,
              which keep only its program from its next task
    L2 prefetch  a task whose path prefetches its next task's weights into L2 (`l2_next_rt` >= 0)
              issues it once its claim has returned and `l2_next_rt` more round trips (the next
              row, its descriptor): an HBM stream of the next task's `l2_bytes` from one DRAM
              latency later, all of them in flight (no register holds a prefetched line), admitted
              while the prefetched bytes not yet consumed fit in `l2_cap` (else it streams all the
              same and is evicted before use: no benefit). The next task reads those bytes from L2
              (first byte one L2 round trip after its request, at its L2 rate) in address order
              behind the prefetch: it ends at the later of its own pace and one L2 round trip
              after the prefetch's last line (so a later prefetch never makes the task earlier);
              the rest of its bytes stream from HBM as before
    streams   a stream of B bytes with D bytes in flight per SM wants min(D / latency, BW_sm);
              HBM streams share BW_hbm in proportion to what they want whenever they want more
              in total (the loaded-latency view: when HBM saturates the latency grows for every
              SM alike, so each keeps its share of the bytes in flight); exact for piecewise
              constant rates through a virtual clock (generalized processor sharing)

Monotone in every latency and bandwidth, and in every task's bytes in flight and dependencies,
while each program runs at most one task (then no claim can change hands) and the streams never
oversubscribe HBM; otherwise list-scheduling and shared-bandwidth anomalies are possible (a task
finishing earlier can hand the next claim to a busier program; a stream starting earlier can take
bandwidth from a critical one), as on the hardware.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SimParams", "SimResult", "TaskShape", "simulate"]


@dataclass
class TaskShape:
    """What one task does, as counts (the case-free input of the simulation)."""

    op: int
    waits: list[list[int]]  # per wait: the tasks that must finish
    pre_rt: float = 0.0  # L2 round trips before the prefetch request
    poll_rt: float = 0.0  # L2 round trips before the first poll issues
    poll_gap_rt: float = 1.0  # L2 round trips from one wait's poll to the next's
    prefetch: float = 0.0  # bytes requested before the waits
    used_before_poll: bool = False  # the code waits for (some of) them before it polls
    lead_rt: float = 0.0  # after the waits, before the stream
    lead_l2: float = 0.0  # of loops there: L2 round trips (trips x round trips per iteration)
    stream: float = 0.0  # bytes after the waits
    stream_l2: bool = False  # they come from L2 (a KV cache that fits), not HBM
    in_flight: float = 0.0  # bytes in flight per SM while streaming
    serial_rt: float = 0.0  # L2 round trips the stream's loop iterations add (activation, norm loads)
    par_rt: float = 0.0  # beside the stream
    tail_rt: float = 0.0  # after it
    instrs: float = 0.0  # warp instructions per warp after the last streamed byte
    # warp instructions per warp on the whole path (loops times their trips): the body ends no
    # sooner than they have issued from the task's start (dequantizing weight streams are issue-bound
    # where the SM's share of HBM outruns its schedulers)
    issue: float = 0.0
    fences: float = 0.0
    invalidations: float = 0.0
    atomics: float = 0.0  # atomics whose result the task waits for
    barriers: float = 0.0
    level: int = 0
    # the L2 prefetch of the next task's weights (its path's CCTL.E.PF2): round trips after the
    # claim's atomic before it issues (< 0: no prefetch on the path); whether the task waits for the
    # claim before its first weight request or poll (then those come an atomic later)
    l2_next_rt: float = -1.0
    l2_next_at_end: bool = False  # it issues at the task's end (after the signal), not l2_next_rt in
    claim_waited: bool = False
    l2_bytes: float = 0.0  # of this task's weight bytes, those a previous task's prefetch covers
    # of tail_rt / instrs: those after the signal (they keep the program, not the dependents, waiting)
    post_rt: float = 0.0
    post_instrs: float = 0.0


@dataclass(frozen=True)
class SimParams:
    """One case of a target's parameters, in µs and bytes per µs."""

    grid: int
    l2: float
    dram: float
    atomic: float
    fence: float
    inval: float
    barrier: float
    sig: float
    launch: float
    sm_bw: float
    hbm_bw: float
    instr: float  # µs per warp instruction per warp of a program (warps / IPC / clock)
    claim_overlapped: bool = True
    l2_cap: float = math.inf  # bytes of prefetched weights L2 holds for their tasks at once
    # calibrated (kernelmodel/calibration.py, fitted on the measured device runs; 0 by default): a
    # fixed cost every task pays before it signals (the claim's broadcast, the row and descriptor
    # words, dispatch, the signal's own issue: what the SASS path prices too little)
    task: float = 0.0


@dataclass
class Times:
    program: int = -1
    start: float = math.nan
    req: float = math.nan
    poll: float = math.nan
    wait: float = math.nan
    a_end: float = math.nan
    b_start: float = math.nan
    b_end: float = math.nan
    body: float = math.nan
    finish: float = math.nan
    start_by: str = ""  # "launch", "program" (previous task), "claim"
    prev: int = -1  # previous task on the program
    poll_by: str = ""  # "issue" or "prefetch" (the code used the prefetched weights first)
    wait_by: int = -1  # the signaller that bound the wait, -1: the poll itself
    body_by: str = ""  # "stream", "prefetch", "chain"
    l2_pf: str = ""  # "", "hit" (its weights were prefetched into L2), "evicted" (over l2_cap)
    pf_end: float = math.nan  # when the prefetch of its weights arrived in L2
    free: float = math.nan  # when its program is done with it (finish = its signal, then what follows it)


@dataclass
class SimResult:
    step_us: float  # launch + the last finish
    times: list[Times]
    busy_us: list[float]  # per program: inside tasks
    polling_us: list[float]  # per program: inside tasks, waiting for signals
    per_op: dict[int, dict[str, float]]
    critical: dict[str, Any]
    hbm_bytes: float
    terms: dict[str, float] = field(default_factory=dict)


class _Fluid:
    """HBM shared in proportion to demand, through a virtual clock: every active stream advances
    by its demand x s(t) with s = min(1, cap / total demand)."""

    def __init__(self, cap: float):
        self.cap, self.v, self.t, self.total = cap, 0.0, 0.0, 0.0
        self.heap: list[tuple[float, int]] = []
        self.demand: dict[int, float] = {}

    def share(self) -> float:
        return 1.0 if self.total <= self.cap else self.cap / self.total

    def advance(self, t: float) -> None:
        if t > self.t:
            self.v += (t - self.t) * self.share()
            self.t = t

    def add(self, sid: int, nbytes: float, demand: float) -> None:
        self.demand[sid] = demand
        self.total += demand
        heapq.heappush(self.heap, (self.v + nbytes / demand, sid))

    def next_end(self) -> float:
        if not self.heap:
            return math.inf
        return self.t + max(0.0, self.heap[0][0] - self.v) / self.share()

    def pop(self) -> int:
        _, sid = heapq.heappop(self.heap)
        self.total -= self.demand.pop(sid)
        if not self.demand:
            self.total = 0.0
        return sid


def simulate(tasks: list[TaskShape], p: SimParams) -> SimResult:
    n = len(tasks)
    tm = [Times() for _ in range(n)]
    fluid = _Fluid(p.hbm_bw)
    ev: list[tuple[float, int, str, int]] = []
    seq = 0

    def push(t: float, kind: str, k: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (t, seq, kind, k))

    def demand(s: TaskShape, lat: float) -> float:
        return max(1e-9, min(s.in_flight / lat if s.in_flight > 0 else p.sm_bw, p.sm_bw))

    next_index = 0
    prog_next: dict[int, tuple[int, float, int]] = {}  # program -> (claimed task, usable at, claimed at task)
    waiters: dict[int, list[int]] = {}
    missing = [0] * n
    a_pending = [False] * n
    b_after_a = [False] * n
    lead_end = [math.nan] * n
    chain_end = [math.nan] * n
    streams: dict[int, tuple[int, str]] = {}  # sid -> (task, "A"/"B"/"P": before the poll / after it / L2 prefetch)
    hbm_bytes = 0.0
    pf_resident = 0.0  # prefetched bytes admitted to L2 whose task has not finished
    pf_waiting: dict[int, list[tuple[str, float, float]]] = {}  # task -> L2 reads in progress: (kind, bytes, start)
    b_hbm = [0.0] * n  # of a task's stream after the waits: the bytes that still come from HBM

    def claim(pr: int, t: float, by: int) -> None:
        nonlocal next_index
        if next_index < n:
            prog_next[pr] = (next_index, t + p.atomic, by)
            next_index += 1
        else:
            prog_next.pop(pr, None)

    for pr in range(min(p.grid, n)):  # the claim before the loop: one atomic round trip
        k = next_index
        next_index += 1
        tm[k].program, tm[k].start_by = pr, "launch"
        push(p.atomic, "start", k)

    def stream_start(k: int, kind: str, nbytes: float, t: float) -> None:
        nonlocal hbm_bytes
        s = tasks[k]
        sid = 3 * k + "ABP".index(kind)
        if kind == "B" and s.stream_l2:
            push(t + nbytes / demand(s, p.l2), "b_end", k)
            return
        fluid.advance(t)
        # a prefetch has all its lines in flight; one SM's pull is not the limit (L2 takes them)
        fluid.add(sid, nbytes, max(1e-9, min(nbytes / p.dram, p.hbm_bw)) if kind == "P" else demand(s, p.dram))
        streams[sid] = (k, kind)
        hbm_bytes += nbytes

    def l2_read(k: int, kind: str, nbytes: float, t: float) -> None:
        """`nbytes` of task k's prefetched weights read from L2 from `t` (its first byte's latency
        included), in address order behind the prefetch, which arrives in that order: done at its
        own pace, but not before the prefetch's last line is in L2 and one L2 round trip; then the
        A or B stream's end."""
        pe = tm[k].pf_end
        if math.isnan(pe):
            pf_waiting.setdefault(k, []).append((kind, nbytes, t))
            return
        l2_read_end(k, kind, nbytes, t, pe)

    def l2_read_end(k: int, kind: str, nbytes: float, t: float, pe: float) -> None:
        push(max(t + nbytes / demand(tasks[k], p.l2), pe + p.l2), "a_l2" if kind == "A" else "b_l2", k)

    def a_done(k: int, ts: float) -> None:
        tm[k].a_end = ts
        a_pending[k] = False
        if tasks[k].used_before_poll and math.isnan(tm[k].poll):
            tm[k].poll, tm[k].poll_by = max(ts, tm[k].start + first_rt(k, tasks[k].poll_rt)), "prefetch"
            push(tm[k].poll, "poll", k)
        if b_after_a[k]:
            b_after_a[k] = False
            tm[k].b_start = max(ts, lead_end[k] + b_latency(k))
            if tm[k].b_start > ts:
                push(tm[k].b_start, "b_join", k)
            else:
                b_begin(k, ts)
        elif not math.isnan(chain_end[k]) and tasks[k].stream <= 0:
            body_done(k, ts, "prefetch")

    def covered(k: int) -> float:
        """Bytes of task k that come from L2, prefetched."""
        return tasks[k].l2_bytes if tm[k].l2_pf == "hit" else 0.0

    def b_latency(k: int) -> float:
        s = tasks[k]
        return p.l2 if s.stream_l2 or covered(k) > s.prefetch else p.dram

    def b_begin(k: int, t: float) -> None:
        """The stream after the waits: its bytes the prefetch covers (beyond those the A stream
        read) from L2, then the rest from HBM."""
        s = tasks[k]
        cb = min(s.stream, max(0.0, covered(k) - s.prefetch))
        b_hbm[k] = s.stream - cb
        if cb > 0:
            l2_read(k, "B", cb, t)
        else:
            stream_start(k, "B", s.stream, t)

    def prefetch_next(k: int, nxt: tuple[int, float, int] | None, issue: float) -> None:
        """Task k's L2 prefetch of the task it claimed, issued at `issue`: admitted to L2 now if
        the prefetched bytes not yet consumed leave room for it (else evicted before use)."""
        nonlocal pf_resident
        if nxt is None or nxt[2] != k or tasks[nxt[0]].l2_bytes <= 0:
            return
        j, nb = nxt[0], tasks[nxt[0]].l2_bytes
        if pf_resident + nb <= p.l2_cap:
            pf_resident += nb
            tm[j].l2_pf = "hit"
        else:
            tm[j].l2_pf = "evicted"
        push(issue + p.dram, "p_join", j)

    def free(k: int, t: float) -> None:
        """Task k's program is done with it at t: the prefetch at its end, then its next task."""
        s, tk = tasks[k], tm[k]
        tk.free = t
        pr = tk.program
        if not p.claim_overlapped:
            claim(pr, t, k)
        elif s.l2_next_rt >= 0 and s.l2_next_at_end:  # its last instructions: once the claim has returned
            nxt = prog_next.get(pr)
            prefetch_next(k, nxt, max(t, nxt[1]) if nxt is not None else t)
        nxt = prog_next.pop(pr, None)
        if nxt is not None:
            j, usable, _ = nxt
            tj = tm[j]
            tj.program, tj.prev = pr, k
            tj.start_by = "claim" if usable > t else "program"
            push(max(t, usable), "start", j)

    def first_rt(k: int, rt: float) -> float:
        """µs from a task's start to the point `rt` round trips in (after the claim if it waits for it)."""
        return (p.atomic if tasks[k].claim_waited else 0.0) + rt * p.l2

    def try_wait(k: int) -> None:
        """All signallers of k have finished and k has polled: its waits resolve."""
        s, t = tasks[k], tm[k]
        w, by = t.poll, -1
        for n, group in enumerate(s.waits):
            w += p.l2 * (1.0 if n == 0 else s.poll_gap_rt)
            if group:
                j = max(group, key=lambda j: tm[j].finish)
                r = tm[j].finish + p.sig
                if r > w:
                    w, by = r, j
        t.wait, t.wait_by = w, by
        push(w, "waited", k)

    def body_done(k: int, streamed: float, by: str) -> None:
        """The stream (or the prefetch) of k is done at `streamed`: its body ends when the chain
        beside it ends too; then the tail, the math and the sync instructions."""
        s, t = tasks[k], tm[k]
        end = streamed + s.serial_rt * p.l2
        issued = t.start + s.issue * p.instr
        if issued > end:
            end, by = issued, "issue"
        t.body, t.body_by = (end, by) if end >= chain_end[k] else (chain_end[k], "chain")
        after = min(s.post_rt, s.tail_rt) * p.l2 + min(s.post_instrs, s.instrs) * p.instr  # the signal first
        push(t.body + s.tail_rt * p.l2 + s.instrs * p.instr + s.fences * p.fence + s.invalidations * p.inval
             + s.atomics * p.atomic + s.barriers * p.barrier + p.task - after, "finish", k)

    while ev or fluid.heap:
        te = ev[0][0] if ev else math.inf
        ts = fluid.next_end()
        if ts <= te:
            fluid.advance(ts)
            k, kind = streams.pop(fluid.pop())
            if kind == "A":
                a_done(k, ts)
            elif kind == "P":
                tm[k].pf_end = ts
                for what, nbytes, t0 in pf_waiting.pop(k, []):
                    l2_read_end(k, what, nbytes, t0, ts)
            else:
                tm[k].b_end = ts
                body_done(k, ts, "stream")
            continue
        t, _, kind, k = heapq.heappop(ev)
        fluid.advance(t)
        s, tk = tasks[k], tm[k]
        if kind == "start":
            tk.start = t
            if p.claim_overlapped:
                claim(tk.program, t, k)
                nxt = prog_next.get(tk.program)
                if s.l2_next_rt >= 0 and not s.l2_next_at_end:
                    prefetch_next(k, nxt, nxt[1] + s.l2_next_rt * p.l2 if nxt is not None else t)
            if s.prefetch > 0:
                tk.req = t + first_rt(k, s.pre_rt)
                a_pending[k] = True
                push(tk.req + (p.l2 if covered(k) > 0 else p.dram), "a_join", k)
            if not (s.used_before_poll and s.prefetch > 0):
                tk.poll, tk.poll_by = t + first_rt(k, s.poll_rt), "issue"
                push(tk.poll, "poll", k)
        elif kind == "a_join":
            if covered(k) > 0:
                l2_read(k, "A", s.prefetch, t)
            else:
                stream_start(k, "A", s.prefetch, t)
        elif kind == "p_join":
            stream_start(k, "P", s.l2_bytes, t)
        elif kind == "a_l2":
            a_done(k, t)
        elif kind == "b_l2":
            if b_hbm[k] > 0:  # the bytes no prefetch covers follow from HBM, requested ahead: no gap
                stream_start(k, "B", b_hbm[k], t)
            else:
                tk.b_end = t
                body_done(k, t, "stream")
        elif kind == "poll":
            missing[k] = 0
            for group in s.waits:
                for j in group:
                    if math.isnan(tm[j].finish):
                        waiters.setdefault(j, []).append(k)
                        missing[k] += 1
            if missing[k] == 0:
                try_wait(k)
        elif kind == "waited":
            lead_end[k] = t + s.lead_rt * p.l2 + s.lead_l2 * p.l2
            chain_end[k] = lead_end[k] + s.par_rt * p.l2
            if s.stream > 0:
                if a_pending[k]:
                    b_after_a[k] = True
                else:
                    tk.b_start = lead_end[k] + b_latency(k)
                    push(tk.b_start, "b_join", k)
            elif not a_pending[k]:  # else the prefetch's end finishes the body
                body_done(k, tk.a_end if not math.isnan(tk.a_end) else -math.inf, "prefetch")
        elif kind == "b_join":
            b_begin(k, t)
        elif kind == "b_end":
            tk.b_end = t
            body_done(k, t, "stream")
        elif kind == "finish":
            tk.finish = t
            if tk.l2_pf == "hit":
                pf_resident -= s.l2_bytes
            for w in waiters.pop(k, []):
                missing[w] -= 1
                if missing[w] == 0:
                    try_wait(w)
            after = min(s.post_rt, s.tail_rt) * p.l2 + min(s.post_instrs, s.instrs) * p.instr
            if after > 0:
                push(t + after, "free", k)
            else:
                free(k, t)
        elif kind == "free":
            free(k, t)
    unfinished = [k for k in range(n) if math.isnan(tm[k].finish)]
    if unfinished:
        raise ValueError(f"the simulation left {len(unfinished)} tasks unfinished (first: {unfinished[0]}): a wait "
                         "on a task that never runs")
    end = max((x.finish for x in tm), default=0.0)
    busy = [0.0] * p.grid
    polling = [0.0] * p.grid
    per_op: dict[int, dict[str, float]] = {}
    for s, x in zip(tasks, tm, strict=True):
        busy[x.program] += (x.finish if math.isnan(x.free) else x.free) - x.start
        polling[x.program] += max(0.0, x.wait - x.poll - p.l2 * len(s.waits))
        d = per_op.setdefault(s.op, {"tasks": 0, "busy_us": 0.0, "polling_us": 0.0})
        d["tasks"] += 1
        d["busy_us"] += (x.finish if math.isnan(x.free) else x.free) - x.start
        d["polling_us"] += max(0.0, x.wait - x.poll - p.l2 * len(s.waits))
    return SimResult(p.launch + end, tm, busy, polling, per_op, _critical(tasks, tm, p), hbm_bytes)


def _critical(tasks: list[TaskShape], tm: list[Times], p: SimParams) -> dict[str, Any]:
    """The chain of causes back from the last task to finish, its time split into sync latency
    (signal -> poll, and the polls' round trips), streaming (DRAM / L2 bytes and their first-byte
    latency) and fixed costs (load chains, math, fences, atomics, barriers, claims, launch)."""
    share: dict[str, float] = defaultdict(float)
    chain: list[int] = []
    if not tm:
        return {"tasks": [], "ops": {}, "length": 0, "us": {"fixed": p.launch}, "share": {"fixed": 1.0}}
    k = max(range(len(tm)), key=lambda i: tm[i].finish)
    cursor, point = tm[k].finish, "finish"

    def to(cat: str, t: float) -> None:
        nonlocal cursor
        share[cat] += max(0.0, cursor - t)
        cursor = min(cursor, t)

    for _ in range(8 * len(tm) + 8):
        t = tm[k]
        if point == "finish":
            chain.append(k)
            to("fixed", t.body)
            if t.body_by == "stream":
                seamless = not math.isnan(t.a_end) and abs(t.b_start - t.a_end) < 1e-9 and t.a_end > t.wait
                to("stream", t.b_start)
                if seamless:
                    to("stream", t.req)
                    point = "start"
                else:
                    lat = p.l2 if tasks[k].stream_l2 or t.l2_pf == "hit" else p.dram
                    to("stream", t.b_start - lat)
                    point = "wait"
            elif t.body_by == "prefetch" and not math.isnan(t.req):
                to("stream", t.req)
                point = "start"
            else:
                point = "wait"
        if point == "wait":
            to("fixed", t.wait)
            if t.wait_by >= 0:
                to("sync", tm[t.wait_by].finish)
                k, point = t.wait_by, "finish"
                continue
            to("sync", t.poll)
            if t.poll_by == "prefetch" and not math.isnan(t.req):
                to("stream", t.req)
            point = "start"
        # point == "start": the launch, the program's previous task, or the claim that gave it this one
        to("fixed", t.start)
        if t.start_by == "launch" or t.prev < 0:
            share["fixed"] += cursor + p.launch
            break
        if t.start_by == "claim" and p.claim_overlapped:  # claimed when the previous task started
            to("fixed", tm[t.prev].start)
            k, point = t.prev, "start"
            continue
        to("fixed", tm[t.prev].finish)
        k, point = t.prev, "finish"
    total = sum(share.values()) or 1.0
    ops = Counter(tasks[i].op for i in chain)
    return {"tasks": chain[::-1], "ops": dict(ops), "length": len(chain),
            "us": {c: round(v, 2) for c, v in share.items()},
            "share": {c: round(v / total, 3) for c, v in share.items()}}
