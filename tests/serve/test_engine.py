"""The engine loop in-process over real rings and the bundle's reference executor (through
SequentialBatch): FIFO order at batch 1, a batch's rows giving the tokens each gives alone,
overload answers, cancellation of waiting and running requests, bad prompts, the supervisor's PING,
top_p 0, and a Hypothesis run of random submit/cancel/step interleavings against a model of what
each request must receive."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.runtime.batch import SequentialBatch
from zlc.runtime.serve.engine.loop import Engine
from zlc.runtime.serve.protocol import EngineError, RequestFlag, ResultFlag
from zlc.runtime.serve.rings import Request, RingRegion

PROMPTS = [[257, 117, 10, 104, 105, 258, 10], [72, 101, 108, 108, 111], [1, 2, 3], [200, 100, 50, 25]]


@pytest.fixture(scope="module")
def expected(bundle: Any, session: Any) -> list[list[int]]:
    return [list(session.stream(p, 5, eos=bundle.eos_token_ids)) for p in PROMPTS]


@pytest.fixture(scope="module")
def backend(bundle: Any) -> Any:
    b = SequentialBatch(lambda: bundle.session("reference"), max_seq=bundle.max_seq, max_seqs=4)
    yield b
    b.close_all()


def make(backend: Any, bundle: Any, max_queue: int = 8, max_batch: int = 4) -> Engine:
    region = RingRegion.anonymous(16, 256)
    return Engine(backend, region, eos=bundle.eos_token_ids, vocab=bundle.vocab, max_queue=max_queue,
                  max_batch=max_batch, spin_us=0)


def run_until_idle(engine: Engine) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for _ in range(1000):
        busy = engine.step()
        out += [(r, t, f) for r, t, f, _, _ in engine.region.results.raw.pop_many(1000)]
        if not busy and engine.idle:
            return out
    raise AssertionError("engine did not go idle")


def test_fifo_run_to_completion_at_batch_1(backend: Any, bundle: Any, expected: list[list[int]]) -> None:
    e = make(backend, bundle, max_batch=1)
    for i, p in enumerate(PROMPTS[:3], 1):
        assert e.region.requests.push(Request(i, p, 5))
    out = run_until_idle(e)
    order = [r for r, _, _ in out]
    assert order == sorted(order)  # request 1's tokens, then 2's, then 3's
    for i in (1, 2, 3):
        toks = [t for r, t, _ in out if r == i]
        flags = [f for r, _, f in out if r == i]
        assert toks == expected[i - 1]
        assert flags[-1] & ResultFlag.LAST and not any(f & ResultFlag.LAST for f in flags[:-1])
    e.region.close()


def test_batch_rows_give_their_solo_tokens(backend: Any, bundle: Any, expected: list[list[int]]) -> None:
    """All four prompts side by side: each request's tokens are the ones it gets alone, and the
    steps interleave them (one token each per step)."""
    e = make(backend, bundle)
    for i, p in enumerate(PROMPTS, 1):
        assert e.region.requests.push(Request(i, p, 5))
    out = run_until_idle(e)
    for i in range(1, len(PROMPTS) + 1):
        assert [t for r, t, _ in out if r == i] == expected[i - 1]
    assert e.scheduler.stats.steps < sum(len(x) for x in expected)  # rows shared steps
    assert backend.pages_free() == backend.pages_total
    e.region.close()


def test_overload_beyond_the_capacity(backend: Any, bundle: Any) -> None:
    """max_batch 4 + max_queue 2: eight requests reaching the engine in one turn (they wait until
    that turn's step admits them): the first six (the capacity) run, the last two are refused."""
    e = make(backend, bundle, max_queue=2, max_batch=4)
    for i in range(1, 9):
        e.region.requests.push(Request(i, PROMPTS[0], 1))
    out = run_until_idle(e)
    overloaded = {r for r, t, f in out if f & ResultFlag.ERROR and t == EngineError.OVERLOADED}
    assert overloaded == {7, 8}
    assert {r for r, _, f in out if f & ResultFlag.LAST} == set(range(1, 9))
    e.region.close()


def test_cancel_running_and_waiting(backend: Any, bundle: Any) -> None:
    e = make(backend, bundle, max_batch=1)
    e.region.requests.push(Request(1, PROMPTS[1], 50))
    e.region.requests.push(Request(2, PROMPTS[2], 50))
    e.step()
    e.step()  # request 1 has produced two tokens
    e.region.requests.push(Request(2, [], 0, flags=RequestFlag.CANCEL))
    e.region.requests.push(Request(1, [], 0, flags=RequestFlag.CANCEL))
    out = [(r, t, f) for r, t, f, _, _ in e.region.results.raw.pop_many(100)] + run_until_idle(e)
    assert [f for r, _, f in out if r == 2] == [ResultFlag.ERROR | ResultFlag.LAST]
    ones = [(t, f) for r, t, f in out if r == 1]
    assert len(ones) < 50 and ones[-1] == (EngineError.CANCELLED, ResultFlag.ERROR | ResultFlag.LAST)
    assert e.idle and backend.pages_free() == backend.pages_total
    e.region.close()


def test_bad_prompt_is_an_error_result(backend: Any, bundle: Any) -> None:
    e = make(backend, bundle)
    e.region.requests.push(Request(1, [bundle.vocab + 5], 3))  # outside the vocabulary
    e.region.requests.push(Request(2, PROMPTS[0], 1))
    out = run_until_idle(e)
    assert (1, EngineError.BAD_REQUEST, ResultFlag.ERROR | ResultFlag.LAST) in out
    assert [r for r, _, f in out if f & ResultFlag.LAST] == [1, 2]  # and it goes on serving
    e.region.close()


def test_ping_is_answered_with_a_pong(backend: Any, bundle: Any, expected: list[list[int]]) -> None:
    """The supervisor's liveness check: a PING gets one PONG|LAST at the next step, even behind a
    running request, which goes on undisturbed."""
    e = make(backend, bundle)
    e.region.requests.push(Request(1, PROMPTS[0], 5))
    e.step()
    e.region.requests.push(Request(0, [], 0, flags=RequestFlag.PING))
    out = run_until_idle(e)
    assert (0, 0, ResultFlag.PONG | ResultFlag.LAST) in out
    assert [t for r, t, _ in out if r == 1] == expected[0]
    e.region.close()


def test_top_p_0_is_greedy(backend: Any, bundle: Any, expected: list[list[int]]) -> None:
    """temperature 1 with top_p 0 keeps the most likely token only: the greedy reply, not an error."""
    e = make(backend, bundle)
    e.region.requests.push(Request(1, PROMPTS[0], 5, temperature=1.0, top_p=0.0, seed=7))
    out = run_until_idle(e)
    assert [t for r, t, f in out if r == 1 and not f & ResultFlag.ERROR] == expected[0]
    e.region.close()


ops = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.integers(0, len(PROMPTS) - 1), st.integers(1, 5)),
    st.tuples(st.just("cancel"), st.integers(1, 8), st.just(0)),
    st.tuples(st.just("step"), st.just(0), st.just(0)),
), max_size=14)


@settings(max_examples=25, deadline=None)
@given(ops=ops)
def test_random_interleavings(backend: Any, bundle: Any, expected: list[list[int]], ops: list[Any]) -> None:
    e = make(backend, bundle, max_queue=3)
    submitted: dict[int, tuple[int, int]] = {}
    cancelled: set[int] = set()
    out: list[tuple[int, int, int]] = []
    for op, a, b in ops:
        if op == "submit":
            rid = len(submitted) + 1
            submitted[rid] = (a, b)
            e.region.requests.push(Request(rid, PROMPTS[a], b))
        elif op == "cancel" and a in submitted:
            cancelled.add(a)
            e.region.requests.push(Request(a, [], 0, flags=RequestFlag.CANCEL))
        else:
            e.step()
        out += [(r, t, f) for r, t, f, _, _ in e.region.results.raw.pop_many(1000)]
    out += run_until_idle(e)
    for rid, (p, n) in submitted.items():
        mine = [(t, f) for r, t, f in out if r == rid]
        lasts = [i for i, (_, f) in enumerate(mine) if f & ResultFlag.LAST]
        assert lasts == [len(mine) - 1], (rid, mine)  # exactly one LAST, at the end
        t_last, f_last = mine[-1]
        if f_last & ResultFlag.ERROR:
            assert t_last == EngineError.OVERLOADED or (t_last == EngineError.CANCELLED and rid in cancelled)
            good = [t for t, _ in mine[:-1]]
            assert good == expected[p][:len(good)]  # what came before a cancel was right
        else:
            assert [t for t, _ in mine] == expected[p][:n][:len(mine)]
            assert len(mine) == n or mine[-1][1] & ResultFlag.EOS
    e.region.close()
