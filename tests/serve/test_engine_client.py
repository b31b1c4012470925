"""The load account an EngineClient keeps for the pool's router (pool.py routes on it), over a real
ring region in shared memory: the client as the ingress uses it, and the region attached a second
time as the engine process attaches it (no engine started). In flight, held and queued prompt
tokens follow submits, first results, LAST results, cancels and fail_all; a cancel says whether
the client held the request (the pool asks each engine until one does)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from zlc.runtime.serve.ingress.engine_client import EngineClient
from zlc.runtime.serve.protocol import EngineError, RequestFlag, ResultFlag
from zlc.runtime.serve.rings import Request, Result, RingRegion


class Heard:
    def __init__(self) -> None:
        self.results: list[tuple[int, int]] = []

    def on_result(self, token: int, flags: int, t_ns: int, logprob: float = 0.0) -> None:
        self.results.append((token, flags))


@pytest.fixture
def client() -> Iterator[tuple[EngineClient, Any]]:
    c = EngineClient("unused.zlc", max_batch=2, max_queue=1, max_prompt=64)
    engine_side = RingRegion.attach(str(c.region.name))
    try:
        yield c, engine_side
    finally:
        engine_side.close()
        c.close()


def test_the_load_account_follows_each_request(client: tuple[EngineClient, Any]) -> None:
    c, engine = client
    a, b = Heard(), Heard()
    assert c.submit(Request(1, [5] * 10, 4), a) and c.submit(Request(2, [6] * 7, 4), b)
    assert (c.in_flight, c.held, c.queued_tokens) == (2, 2, 17)
    got = engine.requests.pop_many(8)
    assert [(r.request_id, len(r.tokens)) for r in got] == [(1, 10), (2, 7)]

    engine.results.push(Result(1, 42))  # request 1's first token: its prompt is no longer queued
    c._drain()
    assert (c.in_flight, c.queued_tokens, a.results) == (2, 7, [(42, 0)])
    engine.results.push(Result(1, 43, ResultFlag.EOS | ResultFlag.LAST))
    c._drain()
    assert (c.in_flight, c.held, c.queued_tokens) == (1, 1, 7)

    assert c.cancel(2) and not c.cancel(2) and not c.cancel(1) and not c.cancel(99)
    assert (c.in_flight, c.held, c.queued_tokens) == (0, 1, 0)  # held until the engine lets it go
    cancel = engine.requests.pop_many(8)
    assert [(r.request_id, r.flags & RequestFlag.CANCEL) for r in cancel] == [(2, RequestFlag.CANCEL)]
    engine.results.push(Result(2, 0, ResultFlag.LAST))
    c._drain()
    assert (c.held, b.results) == (0, [])  # a cancelled request's handler hears nothing more


def test_fail_all_ends_every_request_and_clears_the_account(client: tuple[EngineClient, Any]) -> None:
    c, _ = client
    heard = [Heard() for _ in range(3)]
    for rid, h in enumerate(heard, 1):
        assert c.submit(Request(rid, [1] * rid, 2), h)
    assert not c.submit(Request(4, [1], 2), Heard())  # capacity 3 (max_batch 2 + max_queue 1)
    assert c.cancel(3)
    assert c.fail_all(EngineError.UNAVAILABLE) == 2
    assert [h.results for h in heard] == [[(EngineError.UNAVAILABLE, ResultFlag.ERROR | ResultFlag.LAST)]] * 2 + [[]]
    assert (c.in_flight, c.held, c.queued_tokens) == (0, 0, 0)
