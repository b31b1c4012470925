"""The latency model's L2 prefetch of the next task's weights (event_sim, docs/kernel-model.md):
a hand-checked two-task timeline (the prefetch lands in L2 while the first task runs; the second
reads it from L2, waiting for its arrival), the capacity rule (over `l2_cap` the bytes move twice
and buy nothing), the claim wait, and monotone properties on one program."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.kernelmodel.event_sim import SimParams, TaskShape, simulate
from zlc.kernelmodel.latency import CASES, params_for, sim_params

# round numbers: every event time below is checked by hand
P = SimParams(grid=1, l2=1.0, dram=2.0, atomic=1.0, fence=0.0, inval=0.0, barrier=0.0, sig=0.0, launch=0.0,
              sm_bw=1e9, hbm_bw=1e9, instr=0.0)


def _pair(prefetch: bool, in_flight: float = 100.0) -> list[TaskShape]:
    # task 0 does nothing but (maybe) prefetch task 1's weights; task 1 streams 1000 bytes with
    # `in_flight` in flight after its (empty) waits
    first = TaskShape(op=1, waits=[], l2_next_rt=2.0 if prefetch else -1.0)
    second = TaskShape(op=1, waits=[], stream=1000.0, in_flight=in_flight, l2_bytes=1000.0)
    return [first, second]


def test_the_next_task_reads_its_prefetched_weights_from_l2() -> None:
    base = simulate(_pair(False), P)
    # no prefetch: task 1 starts at 2 (its claim, at task 0's start 1, returns an atomic later),
    # requests at 2, first byte a DRAM latency later, 1000 B at 100 / 2 B per µs: 4 + 20
    assert base.times[1].start == 2.0 and base.step_us == 24.0 and base.hbm_bytes == 1000.0
    r = simulate(_pair(True), P)
    t0, t1 = r.times
    # the prefetch issues when the claim returned (2) and 2 round trips later (4); its bytes leave
    # DRAM at 6, all in flight: 1000 B / 2 µs, in L2 at 8
    assert t1.l2_pf == "hit" and t1.pf_end == 8.0
    # task 1 asks L2 at 2 + 1 = 3 and reads behind the prefetch at 100 B in flight / 1 µs: 3 + 10
    # (the prefetch's last line was in L2 at 8, one L2 round trip before 9)
    assert t1.b_end == 13.0 and r.step_us == 13.0
    assert r.hbm_bytes == 1000.0  # the same bytes leave DRAM once, earlier
    # a reader faster than the prefetch (1000 B / µs) waits for its last line: 8 + 1, where without
    # the prefetch it streams from 4 at 500 B / µs (the prefetch came later than its own request)
    fast = simulate(_pair(True, 1000.0), P)
    assert fast.times[1].b_end == 9.0 and simulate(_pair(False, 1000.0), P).step_us == 6.0


def test_a_prefetch_at_the_tasks_end_issues_once_its_claim_has_returned() -> None:
    tasks = _pair(True)
    tasks[0] = replace(tasks[0], l2_next_rt=0.0, l2_next_at_end=True)
    r = simulate(tasks, P)
    # task 0 ends at 1, its claim returns at 2: issued then, in L2 at 2 + 2 + 2; task 1 (started at
    # 2) reads from 3 for 10 µs, behind it
    assert r.times[0].finish == 1.0 and r.times[1].pf_end == 6.0 and r.step_us == 13.0


def test_prefetches_beyond_l2_capacity_move_the_bytes_twice_for_nothing() -> None:
    r = simulate(_pair(True), replace(P, l2_cap=500.0))
    assert r.times[1].l2_pf == "evicted"
    assert r.step_us == 24.0 and r.hbm_bytes == 2000.0
    # what fits is admitted: the same pair with room for it
    assert simulate(_pair(True), replace(P, l2_cap=1000.0)).times[1].l2_pf == "hit"


def test_a_task_that_waits_for_its_claim_requests_an_atomic_later() -> None:
    t = TaskShape(op=1, waits=[], pre_rt=1.0, poll_rt=2.0, prefetch=100.0, in_flight=100.0, claim_waited=True)
    r = simulate([t], P)
    # starts at 1 (the launch's claim); the claim it issues returns at 2, then one round trip
    assert r.times[0].req == 3.0 and r.times[0].poll == 4.0
    assert simulate([replace(t, claim_waited=False)], P).times[0].req == 2.0


@st.composite
def chains(draw: st.DrawFn) -> list[TaskShape]:
    """Tasks of one program (grid 1: no claim changes hands), each waiting on some earlier ones,
    every one prefetching its successor's weights."""
    n = draw(st.integers(2, 10))
    out = []
    for i in range(n):
        waits = [[j] for j in sorted(draw(st.sets(st.integers(0, i - 1), max_size=2)))] if i else []
        stream = draw(st.floats(0, 1 << 18))
        pre = draw(st.floats(0, 4))
        out.append(TaskShape(
            op=1, waits=waits, pre_rt=pre, poll_rt=pre + draw(st.floats(0, 3)), prefetch=draw(st.floats(0, 1 << 14)),
            used_before_poll=draw(st.booleans()), lead_rt=draw(st.floats(0, 3)), stream=stream,
            in_flight=draw(st.floats(1024, 1 << 16)), tail_rt=draw(st.floats(0, 3)), instrs=draw(st.floats(0, 300)),
            fences=draw(st.integers(0, 1)), l2_next_rt=draw(st.floats(0, 3)), l2_next_at_end=draw(st.booleans()),
            claim_waited=draw(st.booleans()),
            l2_bytes=draw(st.floats(0, 1 << 18))))
    return out


def _params(target: str, case: str) -> SimParams:
    return replace(sim_params(params_for(target, case), 1, 8, True), hbm_bw=1e12)  # never oversubscribed


@settings(max_examples=60, deadline=None)
@given(chains(), st.sampled_from(("a10", "h200")))
def test_with_prefetches_the_slow_end_of_every_range_is_never_faster(tasks: list[TaskShape], target: str) -> None:
    times = [simulate(tasks, _params(target, c)).step_us for c in CASES]
    assert times == sorted(times)


@settings(max_examples=60, deadline=None)
@given(chains(), st.floats(0.0, 4.0), st.sampled_from(("a10", "h200")))
def test_a_later_prefetch_is_never_faster(tasks: list[TaskShape], extra: float, target: str) -> None:
    p = _params(target, "central")
    later = [replace(t, l2_next_rt=t.l2_next_rt + extra) for t in tasks]
    assert simulate(later, p).step_us >= simulate(tasks, p).step_us - 1e-9


def test_what_follows_the_signal_keeps_the_program_not_the_dependents() -> None:
    # task 0: two round trips after its stream, the last one after its signal (the prefetch
    # record's load); task 1 waits for it on the same program
    first = TaskShape(op=1, waits=[], tail_rt=2.0, post_rt=1.0)
    second = TaskShape(op=1, waits=[[0]])
    r = simulate([first, second], P)
    assert r.times[0].finish == 2.0 and r.times[0].free == 3.0 and r.times[1].start == 3.0
    # two programs: the dependent on the other one polls from its start and sees the signal at 2
    r2 = simulate([first, second], replace(P, grid=2))
    assert r2.times[1].wait == 2.0 + P.sig


def test_each_further_wait_costs_its_poll_gap() -> None:
    """The first wait resolves one round trip after its poll, each further one `poll_gap_rt` after
    the previous (its signaller long done): started at 1 (the launch's claim), polled at 3, 3 waits
    resolve at 6 with a gap of 1, at 8 with a gap of 2 (a wait's words loaded behind the previous
    poll's barrier)."""
    done = TaskShape(op=1, waits=[])
    t = TaskShape(op=1, waits=[[0], [0], [0]], poll_rt=2.0)
    assert simulate([done, replace(t, poll_gap_rt=1.0)], replace(P, grid=2)).times[1].wait == 6.0
    assert simulate([done, replace(t, poll_gap_rt=2.0)], replace(P, grid=2)).times[1].wait == 8.0
