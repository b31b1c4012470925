"""Admission keeps the capacity the server states: a real `zlc serve --max-batch 2 --max-queue 1`
(capacity 3 requests in flight) and real HTTP clients on loopback. Up to the capacity nothing is
refused, also when every request arrives during one engine step (the engine held with SIGSTOP, so
that all of them reach it in one turn: that refused all but max_queue of them when the queue was
counted alone); beyond it a request is refused at once, 529 (Anthropic) / 429 (OpenAI), with
Retry-After; closed-loop clients as many as the capacity never see a refusal.

Every wait is bounded by a socket timeout or wait_for, so a hang fails the test instead of CI."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import engine_pid, health, wait_for

MAX_BATCH, MAX_QUEUE = 2, 1
CAPACITY = MAX_BATCH + MAX_QUEUE
TIMEOUT_S = 60.0
PATHS = {"anthropic": "/v1/messages", "openai": "/v1/chat/completions"}


@pytest.fixture(scope="module")
def server(chat_bundle: Path, server_process: Any) -> Iterator[Any]:
    s = server_process(chat_bundle, "--device", "reference", "--max-batch", str(MAX_BATCH),
                       "--max-queue", str(MAX_QUEUE))
    yield s
    s.stop()


def send(server: Any, api: str, max_tokens: int = 3) -> socket.socket:
    body = json.dumps({"model": "llama-chat", "max_tokens": max_tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    s = socket.create_connection((server.host, server.port), timeout=TIMEOUT_S)
    s.sendall(f"POST {PATHS[api]} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def head(s: socket.socket) -> str:
    """The response's status line and headers, lower-cased; the socket is closed."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    finally:
        s.close()
    return data.split(b"\r\n\r\n")[0].decode("latin-1").lower()


class Held:
    """The engine stopped (SIGSTOP) while the block runs: what is sent meanwhile waits in the
    ingress and the request ring, and reaches the engine in one turn when it goes on."""

    def __init__(self, server: Any):
        self.pid = engine_pid(server)

    def __enter__(self) -> Held:
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc: object) -> None:
        os.kill(self.pid, signal.SIGCONT)


def in_flight(server: Any) -> int:
    return int(health(server)[1]["in_flight"])


def test_the_capacity_is_stated(server: Any) -> None:
    assert health(server)[1]["capacity"] == CAPACITY


def test_a_burst_of_capacity_in_one_step_is_admitted_whole(server: Any) -> None:
    with Held(server):
        socks = [send(server, "anthropic" if i % 2 else "openai") for i in range(CAPACITY)]
        wait_for(f"{CAPACITY} requests in flight", lambda: in_flight(server) == CAPACITY, timeout=20)
    heads = [head(s) for s in socks]
    assert all(h.startswith("http/1.1 200") for h in heads), heads


def test_beyond_capacity_refused_at_once_with_retry_after(server: Any) -> None:
    with Held(server):
        held = [send(server, "anthropic", max_tokens=2) for _ in range(CAPACITY)]
        wait_for(f"{CAPACITY} requests in flight", lambda: in_flight(server) == CAPACITY, timeout=20)
        # answered by the ingress while the engine is still stopped: no engine turn is needed
        over = {api: head(send(server, api)) for api in PATHS}
        assert in_flight(server) == CAPACITY
    assert over["anthropic"].startswith("http/1.1 529"), over["anthropic"]
    assert over["openai"].startswith("http/1.1 429"), over["openai"]
    for h in over.values():
        assert "retry-after: 1\r\n" in h + "\r\n", h
    heads = [head(s) for s in held]
    assert all(h.startswith("http/1.1 200") for h in heads), heads


def test_cancelled_requests_count_until_the_engine_lets_them_go(server: Any) -> None:
    """Clients that hang up free their place once the engine has read their CANCEL, not before:
    with the engine held, CAPACITY requests whose clients went away still fill it (their CANCELs
    wait in the ring beside them); once it goes on, the place is free again."""
    with Held(server):
        gone = [send(server, "openai", max_tokens=50) for _ in range(CAPACITY)]
        wait_for(f"{CAPACITY} requests in flight", lambda: in_flight(server) == CAPACITY, timeout=20)
        for s in gone:
            s.close()
        wait_for("the hang-ups seen", lambda: in_flight(server) == 0, timeout=20)
        refused = head(send(server, "anthropic"))
    assert refused.startswith("http/1.1 529"), refused
    statuses: list[str] = []

    def served() -> bool:
        statuses.append(head(send(server, "anthropic")).split("\r\n")[0])
        return statuses[-1].startswith("http/1.1 200")

    wait_for("a place freed by the engine", served, timeout=30, every=0.2)
    assert set(statuses[:-1]) <= {"http/1.1 529 overloaded"}, statuses


def test_capacity_closed_loop_clients_never_refused(server: Any) -> None:
    """CAPACITY clients, each sending its next request as soon as its answer has ended (streamed,
    OpenAI), 6 rounds each: every answer is a 200 stream that ends with [DONE]."""
    def client(i: int) -> list[int]:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=TIMEOUT_S)
        statuses = []
        for n in range(6):
            body = json.dumps({"model": "llama-chat", "max_tokens": 2 + (i + n) % 3, "temperature": 0,
                               "stream": True, "messages": [{"role": "user", "content": f"client {i} round {n}"}]})
            conn.request("POST", PATHS["openai"], body, {"content-type": "application/json"})
            r = conn.getresponse()
            text = r.read()
            statuses.append(r.status if r.status != 200 or b"data: [DONE]" in text else -1)
        conn.close()
        return statuses

    with concurrent.futures.ThreadPoolExecutor(CAPACITY) as pool:
        got = list(pool.map(client, range(CAPACITY)))
    assert got == [[200] * 6] * CAPACITY, got


@pytest.mark.parametrize(("max_batch", "max_queue", "max_prompt"), [(2, 1, 128), (64, 32, 2048), (3, 5, 9000), (256, 32, 2048)])
def test_the_request_ring_holds_the_capacity(max_batch: int, max_queue: int, max_prompt: int) -> None:
    """The real ring of an EngineClient (shared memory, no engine started) takes its whole
    capacity of requests with the longest prompt, a CANCEL for each and a PING, with nothing
    popped: it can never be what refuses a request below the capacity."""
    from zlc.runtime.serve.ingress.engine_client import PING_ID, EngineClient
    from zlc.runtime.serve.protocol import RequestFlag
    from zlc.runtime.serve.rings import Request

    c = EngineClient("unused.zlc", max_batch=max_batch, max_queue=max_queue, max_prompt=max_prompt)
    try:
        ring = c.region.requests
        cap = max_batch + max_queue
        assert c.capacity == cap
        for rid in range(1, cap + 1):
            assert ring.push(Request(rid, [7] * max_prompt, 4)), rid
        for rid in range(1, cap + 1):
            assert ring.push(Request(rid, [], 0, flags=RequestFlag.CANCEL)), rid
        assert ring.push(Request(PING_ID, [], 0, flags=RequestFlag.PING))
        assert len(ring.pop_many(4 * cap)) == 2 * cap + 1
    finally:
        c.close()
