"""KVManager, the one owner of a batch's KV pages, driven alone (no kernel): random opens, planned
steps committed or aborted, and closes. After every operation the page invariants hold
(PagePool.check: each page free, held or cached; refcounts equal the holders; shared and cached
pages keyed and full); a plan the free pages cannot hold answers None and changes nothing; a
BatchStep's arrays are each row's id, position and page table; the router's page keys and the
manager's prefix lookup agree on which pages two prompts share."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.errors import ZlcError
from zlc.runtime.kv_manager import KVManager, page_keys
from zlc.runtime.kv_pages import pages_for

PS = 4


def manager(pages: int = 12, cache: int = 6, max_rows: int = 16) -> KVManager:
    return KVManager(pages_total=pages, page_size=PS, max_seq=40, vocab=50, max_rows=max_rows, cache_pages=cache)


def snapshot(kv: KVManager) -> Any:
    return (kv.pages_free(), kv.pages_cached(), {s: (kv.length(s), kv.pages_of(s)) for s in kv.open_seqs()},
            list(kv.pool.refs), list(kv.pool.free))


def test_a_step_value_holds_each_rows_position_and_page_table() -> None:
    kv = manager()
    a, b = kv.open(), kv.open()
    plan = kv.plan([(a, [1, 2, 3, 4, 5]), (b, [7])], [True, False])
    assert plan is not None
    assert plan.tokens.tolist() == [1, 2, 3, 4, 5, 7] and plan.pos.tolist() == [0, 1, 2, 3, 4, 0]
    assert plan.pages.tolist() == kv.pages_of(a) + kv.pages_of(b) and len(kv.pages_of(a)) == 2
    assert plan.pt.tolist() == [0] * 5 + [2] and plan.lrows.tolist() == [4]
    assert all(x.dtype == np.int32 for x in (plan.tokens, plan.pos, plan.pt, plan.pages, plan.lrows))
    assert kv.length(a) == 0  # nothing written until the launch is committed
    kv.commit(plan)
    assert (kv.length(a), kv.length(b)) == (5, 1)
    kv.check()


def test_short_of_pages_is_none_and_changes_nothing() -> None:
    kv = manager(pages=3, cache=0)
    a, b = kv.open(), kv.open()
    plan = kv.plan([(a, list(range(8)))], [True])
    assert plan is not None
    kv.commit(plan)
    before = snapshot(kv)
    assert kv.plan([(a, [1]), (b, [1] * 5)], [True, True]) is None  # 1 + 2 pages, 1 free
    assert kv.allocate_slots(b, 5) is None
    assert snapshot(kv) == before
    assert kv.shortage([(a, [1]), (b, [1] * 5)]) == "the step needs 3 KV pages, 1 of 3 are free"
    kv.check()


@pytest.mark.parametrize(("rows", "msg"), [
    (lambda a: [(a, [1]), (a, [2])], "appears twice"),
    (lambda a: [(99, [1])], "sequence 99 is not open"),
    (lambda a: [(a, [50])], "outside the vocabulary"),
    (lambda a: [(a, [1] * 41)], "past the bundle's max_seq=40"),
    (lambda a: [(a, [1] * 17)], "a step of 17 rows exceeds max_rows=16"),
    (lambda a: [(a, [])], "a step entry with no ids"),
])
def test_malformed_steps_are_one_line_errors(rows: Any, msg: str) -> None:
    kv = manager()
    a = kv.open()
    before = snapshot(kv)
    with pytest.raises(ZlcError, match=msg) as e:
        kv.plan(rows(a), [True] * len(rows(a)))
    assert "\n" not in str(e.value) and snapshot(kv) == before


def test_router_keys_and_the_managers_prefix_agree() -> None:
    """Two prompts share the router's key for page k exactly when the manager maps page k of one
    into the other (same ids from position 0)."""
    kv = manager(pages=20, cache=20)
    p = list(range(1, 14))  # 3 full pages and one id
    q = p[:8] + [40] + p[9:]  # differs in page 2
    s = kv.open()
    plan = kv.plan([(s, p)], [True])
    assert plan is not None
    kv.commit(plan)
    first = kv.pages_of(s)
    kv.close(s)
    kp, kq = page_keys(p, PS), page_keys(q, PS)
    shared_keys = next(i for i, (x, y) in enumerate(zip(kp, kq, strict=True)) if x != y)
    assert kv.lookup(q)[0] == shared_keys * PS == 8 and kv.lookup(p)[0] == 12
    t = kv.open(q)
    assert kv.length(t) == 8 and kv.pages_of(t) == first[:2]  # the cached pages themselves, mapped
    kv.check()


ops = st.lists(st.one_of(
    st.tuples(st.just("open"), st.integers(0, 2), st.integers(0, 12)),  # prompt base, prompt length
    st.tuples(st.just("step"), st.integers(1, 6), st.booleans()),  # ids per row, launch fails
    st.tuples(st.just("close"), st.integers(0, 5), st.just(False)),
), max_size=30)


@settings(max_examples=60, deadline=None)
@given(ops=ops, pages=st.integers(3, 10), cache=st.sampled_from([0, 2, 10]))
def test_invariants_after_every_operation(ops: list[Any], pages: int, cache: int) -> None:
    kv = manager(pages=pages, cache=cache, max_rows=40)
    bases = [[(b * 7 + k) % 50 for k in range(40)] for b in range(3)]
    fed: dict[int, list[int]] = {}  # each open sequence: the prompt it is fed
    for op, a, b in ops:
        if op == "open" and len(fed) < 5:
            prompt = bases[a][:b]
            s = kv.open(prompt)
            fed[s] = prompt
            n = kv.length(s)
            assert n % PS == 0 and n <= max(0, len(prompt) - 1) and kv.lookup(prompt)[0] >= n
        elif op == "step" and fed:
            rows = [(s, (p[kv.length(s):] or [3])[:a]) for s, p in fed.items() if kv.length(s) + a <= 40]
            if not rows:
                continue
            before = snapshot(kv)
            need = sum(kv.slots_needed(s, len(ids)) for s, ids in rows)
            plan = kv.plan(rows, [True] * len(rows))
            if plan is None:
                assert need > kv.pages_free() and snapshot(kv) == before
            elif b:
                kv.abort(plan)  # the launch failed: as before, but cached pages it took are free now
                assert {s: kv.length(s) for s in fed} == {s: v[0] for s, v in before[2].items()}
                assert kv.pages_free() == before[0]
            else:
                kv.commit(plan)
                for s, _ in rows:
                    if len(fed[s]) < kv.length(s):
                        fed[s] = fed[s] + [3] * (kv.length(s) - len(fed[s]))
        elif op == "close" and fed:
            s = list(fed)[a % len(fed)]
            kv.close(s)
            del fed[s]
        kv.check()
        held = {p for s in fed for p in kv.pages_of(s)}
        assert len(held) + kv.pages_free() == kv.pages_total
        for s in fed:
            assert len(kv.pages_of(s)) == pages_for(kv.length(s), PS)
    for s in list(fed):
        kv.close(s)
    kv.check()
    assert kv.pages_free() == kv.pages_total
