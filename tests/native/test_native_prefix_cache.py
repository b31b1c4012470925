"""The shared-prefix cache of NativeBatch (runtime/batch.py's PagePool): full KV pages keyed by
their tokens from position 0, shared by reference count, kept after close and evicted least
recently used. Oracles: a sequence opened on cached pages gives the logits (1e-4) and greedy
tokens of the same request with no cache (a miss) and of MegakernelSession alone; the page
invariants hold after every step; keyed pages (shared or cached) are never written (their K/V
checksums do not move while they stay keyed); every page is free or cached at the end."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from native_helpers import Alone, Built
from test_native_batch import _assert_row, _batch, _prompt

from zlc.codegen.native import find_compiler
from zlc.runtime.batch import NativeBatch

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")


class Keyed:
    """Checksums of the K/V of every keyed page (shared or cached): `check()` asserts that none of
    those still keyed changed since they were first seen, then records the new ones."""

    def __init__(self, nb: NativeBatch):
        self.nb, self.sums = nb, {}

    def check(self) -> None:
        pool = self.nb.pool
        for page, key in pool.key.items():
            kv = self.nb.page_kv(page).tobytes()
            seen = self.sums.get(page)
            if seen is not None and seen[0] == key:
                assert seen[1] == kv, f"keyed page {page} was written"
            self.sums[page] = (key, kv)


def _run(nb: NativeBatch, prompt: list[int], steps: int, keyed: Keyed | None = None,
         chunk: int | None = None) -> tuple[int, int, list[np.ndarray]]:
    """Opens a sequence on `prompt` (reusing what the cache holds), prefills the rest in chunks,
    then `steps` greedy steps; returns (seq, positions reused, [logits after the prompt, then each step])."""
    seq = nb.open(prompt)
    reused = nb.length(seq)
    fed, out = reused, None
    while fed < len(prompt):
        n = min(chunk or len(prompt), len(prompt) - fed)
        (out,) = nb.step([(seq, prompt[fed:fed + n])], [fed + n == len(prompt)])
        fed += n
        nb.check_pages()
        if keyed:
            keyed.check()
    assert out is not None
    got = [out]
    for _ in range(steps):
        (o,) = nb.step([(seq, [int(np.argmax(got[-1]))])], [True])
        assert o is not None
        got.append(o)
        nb.check_pages()
        if keyed:
            keyed.check()
    return seq, reused, got


def _assert_all_back(nb: NativeBatch) -> None:
    nb.check_pages()
    assert nb.pages_free() == nb.pages_total
    assert len(nb.pool.free) + nb.pages_cached() == nb.pages_total


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_a_hit_gives_the_logits_of_a_miss_and_of_the_request_alone(built: Callable[..., Built], model: str) -> None:
    """A prompt run twice: the second time its first 36 of 37 positions come from the cache (whole
    pages, never the last id), and its logits and greedy tokens equal the first run's and the
    request alone; a prompt sharing the first 22 ids reuses 5 pages of 4 (20 positions, the 6th
    page differs); one with a different first page reuses nothing; the second copy of the prompt
    running beside the first shares its pages (refcount 2), and the cached pages stay unwritten."""
    b = built(model)
    alone = Alone(b)
    rng = random.Random(11)
    a = _prompt(rng, 37, b.vocab)
    near = a[:22] + _prompt(rng, 9, b.vocab)
    other = [(a[0] + 1) % b.vocab] + a[1:]
    with _batch(b, page_size=4) as nb:
        keyed = Keyed(nb)
        s1, r1, miss = _run(nb, a, 3, keyed, chunk=10)
        assert r1 == 0
        s2, r2, hit = _run(nb, a, 3, keyed)  # while s1 still holds the pages
        assert r2 == 36 and nb.pages_of(s2)[:9] == nb.pages_of(s1)[:9]
        assert all(nb.pool.refs[p] == 2 for p in nb.pages_of(s1)[:9])
        want = alone.logits(a, 3)
        for k in range(4):
            _assert_row(miss[k], want[k], f"{model} miss step {k}")
            _assert_row(hit[k], want[k], f"{model} hit step {k}")
            assert float(np.abs(hit[k] - miss[k]).max()) <= 1e-4
        nb.close(s1)
        nb.close(s2)
        assert nb.pages_cached() == 10  # 40 positions: the 37 + 3 of s1 fill 10 pages (s2's last pages duplicate them)
        s3, r3, got = _run(nb, near, 2, keyed)
        assert r3 == 20
        for k, w in enumerate(alone.logits(near, 2)):
            _assert_row(got[k], w, f"{model} partial hit step {k}")
        s4, r4, got = _run(nb, other, 1, keyed)
        assert r4 == 0
        for k, w in enumerate(alone.logits(other, 1)):
            _assert_row(got[k], w, f"{model} different first page step {k}")
        nb.close(s3)
        nb.close(s4)
        keyed.check()
        _assert_all_back(nb)
    alone.close()


def test_eviction_least_recently_used_before_out_of_pages(llama: tuple[Built, Alone]) -> None:
    """12 pages of 4: two 16-id prompts p, q leave 8 cached pages and 4 free; p again reuses its
    first 3 pages (its 4th, computed anew, duplicates the cached one and stays private), which
    makes p's old 4th page and then q's chain the least recently used; a 32-id prompt needing 8
    pages takes the 4 free ones and evicts those 4, q's chain from its end, never OutOfPages:
    p still hits whole, q on its first page. With cache_pages=2 at most two pages stay cached."""
    b, alone = llama
    rng = random.Random(12)
    p, q, r = _prompt(rng, 16, b.vocab), _prompt(rng, 16, b.vocab), _prompt(rng, 32, b.vocab)
    with _batch(b, page_size=4, pages=12) as nb:
        for prompt in (p, q):
            s, _, _ = _run(nb, prompt, 0)
            nb.close(s)
        assert nb.pages_cached() == 8 and nb.pages_free() == 12
        assert nb.lookup(p) == (12, 0) and nb.lookup(q) == (12, 0)
        s, reused, _ = _run(nb, p, 0)
        assert reused == 12 and nb.lookup(p) == (12, 3)  # held by s: shared for free
        nb.close(s)
        s, reused, got = _run(nb, r, 0)
        assert reused == 0 and nb.pages_cached() == 4 and nb.pages_free() == 4
        assert nb.lookup(p) == (12, 0) and nb.lookup(q) == (4, 0)
        _assert_row(got[0], alone.logits(r, 0)[0], "the prompt that evicted")
        nb.close(s)
        s, reused, got = _run(nb, q, 1)
        assert reused == 4
        for k, w in enumerate(alone.logits(q, 1)):
            _assert_row(got[k], w, f"q after its eviction step {k}")
        nb.close(s)
        _assert_all_back(nb)
    with _batch(b, page_size=4, pages=12, cache_pages=2) as nb:
        s, _, _ = _run(nb, p, 0)
        nb.close(s)
        assert nb.pages_cached() == 2 and nb.lookup(p) == (8, 0)  # the chain's first two pages stayed
        _assert_all_back(nb)
    with _batch(b, page_size=4, cache_pages=0) as nb:  # off: nothing keyed, nothing reused
        s, _, _ = _run(nb, p, 0)
        nb.close(s)
        assert nb.pages_cached() == 0 and nb.lookup(p) == (0, 0)
        _assert_all_back(nb)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 20), st.integers(1, 12), st.integers(1, 4),
                          st.booleans()), min_size=2, max_size=6),
       st.sampled_from([2, 4, 8]), st.integers(4, 24), st.integers(3, 16), st.integers(0, 2**16))
def test_random_shared_prefixes_closes_evictions_and_preemptions(
        llama: tuple[Built, Alone], requests: list[tuple[int, int, int, int, bool]], page_size: int, pages: int,
        chunk: int, seed: int) -> None:
    """Hypothesis: requests (which of 3 shared prefixes, how much of it, own suffix length, new
    tokens, closed early) wait in a queue and run 3 at a time in a small budget, prefilled in
    chunks beside the running sequences' decode rows; when a step is short of pages the youngest
    sequence is preempted (closed, and reopened later on its prompt + tokens so far: through the
    cache). Every token's logits equal the request's alone; the page invariants and the keyed
    pages' checksums hold after every step; at the end every page is free or cached."""
    from zlc.runtime.batch import OutOfPages

    b, alone = llama
    rng = random.Random(seed)
    bases = [_prompt(rng, 20, b.vocab) for _ in range(3)]
    reqs = [(bases[i][:n] + _prompt(rng, m, b.vocab), new, early) for i, n, m, new, early in requests]
    pages = max(pages, max(-(-(len(p) + new) // page_size) for p, new, _ in reqs))  # any request fits alone
    state = [{"ctx": list(p), "logits": [], "seq": None, "fed": 0, "order": 0} for p, _, _ in reqs]
    waiting, live, order, hits, preempted = list(range(len(reqs))), [], 0, 0, 0
    with _batch(b, page_size=page_size, pages=pages) as nb:
        keyed = Keyed(nb)
        while waiting or live:
            if waiting and len(live) < 3:
                i = waiting.pop(0)
                v = state[i]
                v["seq"] = nb.open(v["ctx"])
                v["fed"], v["order"], order = nb.length(v["seq"]), order + 1, order + 1
                hits += v["fed"] > 0
                live.append(i)
            while True:
                rows, want, who, room = [], [], [], chunk
                for i in live:
                    v = state[i]
                    left = len(v["ctx"]) - v["fed"]
                    n = 1 if left == 1 else min(room, left)  # a decode row, or a prefill chunk
                    if n <= 0:
                        continue
                    room -= n if left > 1 else 0
                    rows.append((v["seq"], v["ctx"][v["fed"]:v["fed"] + n]))
                    want.append(n == left)
                    who.append(i)
                try:
                    out = nb.step(rows, want)
                    break
                except OutOfPages:  # preempt the youngest: back to the front of the queue
                    young = max(live, key=lambda i: state[i]["order"])
                    live.remove(young)
                    nb.close(state[young]["seq"])
                    state[young]["seq"] = None
                    waiting.insert(0, young)
                    preempted += 1
                    nb.check_pages()
            for i, (_, ids), o in zip(who, rows, out, strict=True):
                v = state[i]
                v["fed"] += len(ids)
                if o is not None:
                    v["logits"].append(o)
                    v["ctx"].append(int(np.argmax(o)))
            nb.check_pages()
            keyed.check()
            for i in list(live):
                v, (prompt, new, early) = state[i], reqs[i]
                if len(v["logits"]) >= (max(1, new // 2) if early else new):
                    for k, w in enumerate(alone.logits(prompt, len(v["logits"]) - 1)):
                        _assert_row(v["logits"][k], w, f"request {i} token {k}")
                    nb.close(v["seq"])
                    live.remove(i)
        _assert_all_back(nb)
    event(f"prefix hits: {hits > 0}")
    event(f"preempted: {preempted > 0}")
    event(f"evicted: {nb.pool.evictions > 0}")
