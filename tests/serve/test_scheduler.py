"""The continuous-batching scheduler driven directly (no rings, no HTTP) over SequentialBatch on the
bundle's reference executor. Oracle: every finished request's tokens are the ones its prompt gets
alone (MegakernelSession.stream), whatever ran beside it, whenever it arrived, and however often
it was preempted; cancelled requests free their pages at once; all pages come back."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from zlc.runtime.batch import OutOfPages, SequentialBatch, pages_for
from zlc.runtime.serve.engine.scheduler import Scheduler
from zlc.runtime.serve.protocol import EngineError, ResultFlag
from zlc.runtime.serve.rings import Request

MAX_NEW = 8


@pytest.fixture(scope="module")
def solo(bundle: Any) -> Any:
    """solo(prompt, n): the greedy tokens `prompt` gets alone (cached; a greedy run's first n
    tokens are the n-token run)."""
    cache: dict[tuple[int, ...], list[int]] = {}
    with bundle.session("reference") as s:
        def run(prompt: list[int], n: int) -> list[int]:
            key = tuple(prompt)
            if key not in cache:
                cache[key] = list(s.stream(prompt, MAX_NEW, eos=bundle.eos_token_ids))
            return cache[key][:n]

        yield run


@pytest.fixture(scope="module")
def sessions(bundle: Any) -> Any:
    """Reference sessions shared by the tests' backends (loading one costs more than a step)."""
    made: list[Any] = []
    pool: list[Any] = []

    def make() -> Any:
        if pool:
            return pool.pop()
        made.append(bundle.session("reference"))
        return made[-1]

    yield make, pool
    for s in made:
        s.close()


def backend(bundle: Any, sessions: Any, *, max_seqs: int = 4, pages_total: int | None = None,
            page_size: int = 16) -> SequentialBatch:
    make, _ = sessions
    return SequentialBatch(make, max_seq=bundle.max_seq, max_seqs=max_seqs, max_rows=max_seqs + 16,
                           page_size=page_size, pages_total=pages_total)


def release(b: SequentialBatch, sessions: Any) -> None:
    """Returns b's sessions to the shared pool (instead of close_all, which would end them)."""
    assert not b._open
    sessions[1].extend(b._idle)
    b._idle = []


class Driver:
    """A scheduler over `b` with its results collected per request."""

    def __init__(self, b: SequentialBatch, bundle: Any, **kw: Any):
        self.b = b
        self.out: dict[int, list[tuple[int, int]]] = {}
        self.s = Scheduler(b, lambda rid, tok, flags: self.out.setdefault(rid, []).append((tok, flags)),
                           eos=frozenset(bundle.eos_token_ids), vocab=bundle.vocab, **kw)

    def check_pages(self) -> None:
        """No page counted twice or lost: the pages in use are exactly the open sequences', and the
        KV manager's invariants hold (its pool's states, refcounts, keys)."""
        self.b.kv_manager.check()
        held = sum(pages_for(self.b.length(j.seq), self.b.page_size) for j in self.s.running if j.seq is not None)
        assert held == self.b.pages_total - self.b.pages_free() and self.b.pages_free() >= 0

    def step(self) -> bool:
        ran = self.s.step()
        self.check_pages()
        return ran

    def run(self, limit: int = 2000) -> None:
        for _ in range(limit):
            if not self.step() and self.s.idle:
                assert self.b.pages_free() == self.b.pages_total
                return
        raise AssertionError("the scheduler did not go idle")

    def tokens(self, rid: int) -> list[int]:
        return [t for t, f in self.out[rid] if not f & ResultFlag.ERROR]


def prompt_of(i: int, n: int, vocab: int) -> list[int]:
    return [(i * 131 + k * 17 + 3) % vocab for k in range(n)]


def test_rows_side_by_side_give_their_solo_tokens(bundle: Any, sessions: Any, solo: Any) -> None:
    b = backend(bundle, sessions)
    d = Driver(b, bundle, max_batch=4, prefill_chunk=8)
    prompts = [prompt_of(i, 5 + 6 * i, bundle.vocab) for i in range(6)]
    for i, p in enumerate(prompts, 1):
        d.s.submit(Request(i, p, MAX_NEW))
    d.run()
    for i, p in enumerate(prompts, 1):
        assert d.tokens(i) == solo(p, MAX_NEW), i
        assert d.out[i][-1][1] & ResultFlag.LAST
    assert d.s.stats.steps < sum(len(d.out[i]) for i in d.out)  # rows shared steps
    assert d.s.stats.host_ns > 0 and d.s.stats.backend_ns > 0
    release(b, sessions)


def test_preemption_under_a_tiny_page_budget_keeps_the_tokens(bundle: Any, sessions: Any, solo: Any) -> None:
    """3 pages of 16 tokens for 4 requests of 14 + 8 tokens: three are admitted (a page each), each
    needs a second page at its 17th token, so the youngest are preempted and recompute later;
    every request still gets its solo tokens and all pages come back."""
    b = backend(bundle, sessions, pages_total=3)
    d = Driver(b, bundle, max_batch=4, prefill_chunk=16)
    prompts = [prompt_of(i, 14, bundle.vocab) for i in range(4)]
    for i, p in enumerate(prompts, 1):
        d.s.submit(Request(i, p, MAX_NEW))
    d.run()
    assert d.s.stats.preemptions > 0
    for i, p in enumerate(prompts, 1):
        assert d.tokens(i) == solo(p, MAX_NEW), i
    release(b, sessions)


def test_cancel_frees_the_sequence_at_once(bundle: Any, sessions: Any, solo: Any) -> None:
    b = backend(bundle, sessions)
    d = Driver(b, bundle, max_batch=4)
    prompts = [prompt_of(i, 9, bundle.vocab) for i in range(3)]
    for i, p in enumerate(prompts, 1):
        d.s.submit(Request(i, p, MAX_NEW))
    for _ in range(3):
        d.step()
    before = b.pages_free()
    assert d.s.cancel(2)
    assert b.pages_free() > before and [j.rid for j in d.s.running] == [1, 3]  # freed before the next step
    assert d.out[2][-1] == (EngineError.CANCELLED, ResultFlag.ERROR | ResultFlag.LAST)
    n2 = len(d.out[2])
    d.run()
    assert len(d.out[2]) == n2  # nothing more for it
    assert d.tokens(2) == solo(prompts[1], MAX_NEW)[:len(d.tokens(2))]
    for i in (1, 3):
        assert d.tokens(i) == solo(prompts[i - 1], MAX_NEW)
    release(b, sessions)


def test_a_prompt_beyond_the_whole_budget_is_refused_naming_it(bundle: Any, sessions: Any) -> None:
    b = backend(bundle, sessions, pages_total=2)
    logged: list[str] = []
    d = Driver(b, bundle, log=logged.append)
    d.s.submit(Request(1, prompt_of(1, 40, bundle.vocab), 4))
    assert d.out[1] == [(EngineError.KV_BUDGET, ResultFlag.ERROR | ResultFlag.LAST)]
    assert "KV budget (2 pages of 16)" in logged[0]
    seq = b.open()
    b.step([(seq, prompt_of(2, 20, bundle.vocab))], [False])
    with pytest.raises(OutOfPages, match="needs 1 KV pages, 0 of 2 are free"):
        b.step([(seq, prompt_of(3, 20, bundle.vocab))], [False])
    assert b.length(seq) == 20  # nothing ran
    b.close(seq)
    assert b.pages_free() == 2
    release(b, sessions)


events = st.lists(st.one_of(
    # a burst of arrivals at one step: (prompt length, max_tokens) each
    st.tuples(st.just("arrive"), st.lists(st.tuples(st.integers(1, 24), st.integers(1, MAX_NEW)), min_size=1,
                                          max_size=3), st.just(0)),
    st.tuples(st.just("cancel"), st.integers(1, 6), st.just(0)),
    st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
), max_size=12)


@settings(max_examples=15, deadline=None)
@given(events=events, pages=st.sampled_from([6, 9, None]), chunk=st.sampled_from([4, 16]))
@example(events=[("arrive", [(10, 8), (10, 8)], 0), ("step", 2, 0), ("arrive", [(3, 8)], 0), ("cancel", 3, 0)],
         pages=6, chunk=16)  # two fill the budget, then both need a page: a preemption
def test_random_arrivals_cancels_and_preemptions(bundle: Any, sessions: Any, solo: Any, events: list[Any],
                                                 pages: int | None, chunk: int) -> None:
    # Pages of 4 tokens: sequences cross page boundaries often, so a small budget preempts.
    b = backend(bundle, sessions, max_seqs=3, pages_total=pages, page_size=4)
    d = Driver(b, bundle, max_batch=3, prefill_chunk=chunk)
    asked: dict[int, tuple[list[int], int]] = {}
    cancelled: set[int] = set()
    for kind, a, c in events:  # noqa: B007 (c: a step count or unused)
        if kind == "arrive":
            for length, n in a:
                rid = len(asked) + 1
                asked[rid] = (prompt_of(rid, length, bundle.vocab), n)
                d.s.submit(Request(rid, asked[rid][0], n))
        elif kind == "cancel" and a in asked:
            if d.s.cancel(a):
                cancelled.add(a)
        else:
            for _ in range(a):
                d.step()
    d.run()
    event(f"preempted: {d.s.stats.preemptions > 0}")  # coverage, shown by --hypothesis-show-statistics
    for rid, (prompt, n) in asked.items():
        mine = d.out[rid]
        assert [i for i, (_, f) in enumerate(mine) if f & ResultFlag.LAST] == [len(mine) - 1], (rid, mine)
        # max_tokens is clipped so that the request fits the whole budget alone
        want = solo(prompt, min(n, b.pages_total * b.page_size - len(prompt) + 1))
        if rid in cancelled:
            assert mine[-1] == (EngineError.CANCELLED, ResultFlag.ERROR | ResultFlag.LAST)
            assert d.tokens(rid) == want[:len(d.tokens(rid))]
        else:
            assert d.tokens(rid) == want, (rid, prompt, n)
    release(b, sessions)


def test_sampled_rows_keep_their_own_generator(bundle: Any, sessions: Any) -> None:
    """Seeded temperature/top_p rows beside greedy ones give the tokens the same request gets
    alone (each row samples with its own generator, from its own logits)."""
    make, pool = sessions
    s = make()
    prompts = [prompt_of(i, 7 + i, bundle.vocab) for i in range(3)]
    params = [(0.9, 0.95, 11), (0.0, 1.0, 0), (1.3, 0.8, 5)]
    want = [list(s.stream(p, MAX_NEW, eos=bundle.eos_token_ids, temperature=t, top_p=tp, seed=seed))
            for p, (t, tp, seed) in zip(prompts, params, strict=True)]
    pool.append(s)
    b = backend(bundle, sessions)
    d = Driver(b, bundle, max_batch=3, prefill_chunk=4)
    for i, (p, (t, tp, seed)) in enumerate(zip(prompts, params, strict=True), 1):
        d.s.submit(Request(i, p, MAX_NEW, temperature=t, top_p=tp, seed=seed))
    d.run()
    assert [d.tokens(i) for i in (1, 2, 3)] == want
    release(b, sessions)


def test_a_shared_prefix_comes_from_the_slot_cache(bundle: Any, sessions: Any, solo: Any) -> None:
    """SequentialBatch keeps an idle session's cache: a request starting as an earlier one did takes
    that session and prefills only its own suffix (a hit in the scheduler's counters), with its
    solo tokens; off (reuse_prefixes=False), nothing is reused and the tokens are the same."""
    shared = prompt_of(7, 30, bundle.vocab)
    prompts = [shared + prompt_of(i, 5, bundle.vocab) for i in range(3)]
    for reuse in (True, False):
        make, _ = sessions
        b = SequentialBatch(make, max_seq=bundle.max_seq, max_seqs=2, max_rows=40, reuse_prefixes=reuse)
        d = Driver(b, bundle, max_batch=1, prefill_chunk=16)  # one at a time: each follows the last
        for i, p in enumerate(prompts, 1):
            d.s.submit(Request(i, p, MAX_NEW))
        d.run()
        for i, p in enumerate(prompts, 1):
            assert d.tokens(i) == solo(p, MAX_NEW), (reuse, i)
        if reuse:
            assert d.s.stats.prefix_hits == 2 and d.s.stats.prefix_tokens == 2 * 30
        else:
            assert d.s.stats.prefix_hits == 0
        release(b, sessions)


@pytest.fixture(scope="module")
def native(bundle: Any) -> Any:
    """(a NativeBatch on the bundle with a budget of 11 pages of 4, solo(prompt, n) on the native
    kernel alone), shared by the tests (a session starts threads)."""
    from zlc.codegen.native import find_compiler
    from zlc.runtime.batch import NativeBatch

    if find_compiler()[0] is None:
        pytest.skip("no C compiler on this host")
    cache: dict[tuple[int, ...], list[int]] = {}
    with bundle.session("cpu", threads=2) as s, \
            NativeBatch(bundle.path, bundle.manifest, threads=2, page_size=4, pages=11) as nb:
        def run(prompt: list[int], n: int) -> list[int]:
            if tuple(prompt) not in cache:
                cache[tuple(prompt)] = list(s.stream(prompt, MAX_NEW, eos=bundle.eos_token_ids))
            return cache[tuple(prompt)][:n]

        yield nb, run


class NativeDriver(Driver):
    """Driver over NativeBatch: its own page invariants (refcounts, shared and cached pages) after
    every step, and each running request's sequence holding what it was fed."""

    def check_pages(self) -> None:
        self.b.check_pages()  # type: ignore[attr-defined]
        for j in self.s.running:
            assert j.seq is not None and self.b.length(j.seq) == j.fed


shared_events = st.lists(st.one_of(
    # arrivals at one step: (which shared prefix, its length, own suffix length, max_tokens) each
    st.tuples(st.just("arrive"), st.lists(st.tuples(st.integers(0, 1), st.integers(8, 24), st.integers(1, 8),
                                                    st.integers(1, MAX_NEW)), min_size=1, max_size=3)),
    st.tuples(st.just("cancel"), st.integers(1, 6)),
    st.tuples(st.just("step"), st.integers(1, 3)),
), max_size=10)


@settings(max_examples=20, deadline=None)
@given(events=shared_events, chunk=st.sampled_from([4, 16]))
@example(events=[("arrive", [(0, 24, 4, 8), (0, 24, 6, 8), (0, 24, 2, 8)]), ("step", 3), ("arrive", [(0, 24, 3, 8)])],
         chunk=16)  # three share 6 pages while each needs up to 4 more: preemptions, and readmission through the cache
def test_native_shared_prefixes_with_cancels_and_preemptions(bundle: Any, native: Any, events: list[Any],
                                                             chunk: int) -> None:
    """The scheduler over NativeBatch (11 pages of 4 tokens, its prefix cache on): requests sharing
    random prefixes arrive in bursts, some are cancelled, the youngest are preempted when pages run
    out and come back through the cache; every finished request has the tokens it gets alone on
    the native kernel, the page invariants hold after every step and every page is back (free or
    cached) at the end."""
    nb, solo = native
    d = NativeDriver(nb, bundle, max_batch=3, prefill_chunk=chunk)
    bases = [prompt_of(90 + k, 24, bundle.vocab) for k in range(2)]
    asked: dict[int, tuple[list[int], int]] = {}
    cancelled: set[int] = set()
    hits0, preempted0 = d.s.stats.prefix_hits, d.s.stats.preemptions
    for kind, a in events:
        if kind == "arrive":
            for base, n, m, new in a:
                rid = len(asked) + 1
                asked[rid] = (bases[base][:n] + prompt_of(rid + 40, m, bundle.vocab), new)
                d.s.submit(Request(rid, asked[rid][0], new))
        elif kind == "cancel" and a in asked:
            if d.s.cancel(a):
                cancelled.add(a)
        else:
            for _ in range(a):
                d.step()
    d.run()
    nb.check_pages()
    assert nb.pages_free() == nb.pages_total
    event(f"prefix hits: {d.s.stats.prefix_hits > hits0}")
    event(f"preempted: {d.s.stats.preemptions > preempted0}")
    for rid, (prompt, n) in asked.items():
        want = solo(prompt, min(n, nb.pages_total * nb.page_size - len(prompt) + 1))
        if rid in cancelled:
            assert d.tokens(rid) == want[:len(d.tokens(rid))]
        else:
            assert d.tokens(rid) == want, (rid, prompt, n)


def test_the_default_batch_per_executor(bundle: Any) -> None:
    """`zlc serve` without --max-batch: on the native kernel as many sequences as leave a whole
    prefill chunk beside their decode rows (its rows per step: the tiling's chunk, 128 at max_seq
    128), a session per sequence elsewhere (8); never more than a --kv-pages budget's pages."""
    from zlc.runtime.batch import SEQUENTIAL_MAX_BATCH, default_max_batch
    from zlc.runtime.native import native_entry

    rows = bundle.manifest["tilings"][native_entry(bundle.path, bundle.manifest)["tiling"]]["layout"]["chunk"]
    assert rows == 128
    assert default_max_batch(bundle, "cpu") == 64
    assert default_max_batch(bundle, "cpu", prefill_chunk=16) == 112
    assert default_max_batch(bundle, "cpu", kv_pages=7) == 7
    assert default_max_batch(bundle, "reference") == default_max_batch(bundle, "interpret") == SEQUENTIAL_MAX_BATCH == 8
    assert default_max_batch(bundle, "reference", kv_pages=3) == 3
