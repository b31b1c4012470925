"""`zlc serve` under its own faults, for real: the engine process SIGKILLed and SIGSTOPped mid-stream
(and stopped while idle), the server SIGTERMed with streams in flight (drained in time, and cut at
--drain-timeout), and a restart loop that gives up. Clients are the official SDKs and a TCP frame
connection on threads (fault_clients.py); every request in flight at the fault must end with its
whole reply or the API's error, none silently (the "lost" column must be 0).

The figures of docs/serving.md's fault table come from here:

    ZLC_FAULT_FIGURES=faults.md python -m pytest -q -p no:cacheprovider tests/serve/test_faults.py -m "slow or not slow"
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fault_clients import (
    Client,
    Tally,
    anthropic_message,
    anthropic_stream,
    frame_request,
    openai_stream,
    wait_first_token,
    warm_up,
)
from serve_helpers import engine_pid, health, metric, process_state, wait_for

pytestmark = pytest.mark.slow

STEP_DEADLINE_S = 4.0  # the faulty server's: longer than holding its engine takes (below)
PROMPT_IDS = [72, 101, 108, 108, 111]
TABLE_HEAD = ["| fault | requests in flight | completed | ended with an error | lost silently |",
              "|---|---|---|---|---|"]


@pytest.fixture(scope="module")
def figures() -> Iterator[list[Tally]]:
    """The tallies of this module's faults; printed (and written to $ZLC_FAULT_FIGURES) at the end."""
    tallies: list[Tally] = []
    yield tallies
    table = "\n".join(TABLE_HEAD + [t.row() for t in tallies]) + "\n"
    print("\n" + table)
    out = os.environ.get("ZLC_FAULT_FIGURES")
    if out:
        Path(out).write_text(table)


@pytest.fixture(scope="module")
def faulty(chat_bundle: Path, server_process: Any) -> Iterator[Any]:
    """A server for the engine faults: a short step deadline, a short drain."""
    s = server_process(chat_bundle, "--device", "reference", "--step-deadline", str(STEP_DEADLINE_S),
                       "--drain-timeout", "2")
    warm_up(s.base_url)
    yield s
    s.stop()


class HealthWatch(threading.Thread):
    """Polls /health every 50 ms; ``statuses`` is what it answered, in order (repeats collapsed)."""

    def __init__(self, server: Any):
        super().__init__(daemon=True)
        self.server = server
        self.statuses: list[tuple[int, str]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        # One poll always follows the halt, so the last status is the one after the test's own
        # recovery check (a poll that was sleeping or slow when it passed cannot end the list).
        while True:
            stopping = self.halt.is_set()
            try:
                code, body = health(self.server)
                seen = (code, str(body.get("status")))
            except OSError as e:
                seen = (0, type(e).__name__)
            if not self.statuses or self.statuses[-1] != seen:
                self.statuses.append(seen)
            if stopping:
                return
            self.halt.wait(0.05)

    def __enter__(self) -> HealthWatch:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.halt.set()
        self.join(15)


def in_flight(server: Any) -> int:
    return int(health(server)[1]["in_flight"])


def all_in_flight(server: Any, clients: list[Client], extra: int = 0) -> int:
    """Starts the clients with the engine held (SIGSTOP) until the server has every request in
    flight (plus `extra` sent otherwise), then lets it go: a token takes well under a millisecond
    here, so without the hold the first replies would end before the last clients are in. Returns
    the engine's pid."""
    pid = engine_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        for c in clients:
            c.start()
        wait_for("every request in flight", lambda: in_flight(server) >= len(clients) + extra, timeout=20)
    finally:
        os.kill(pid, signal.SIGCONT)
    return pid


def mixed_clients(server: Any, n: int, max_tokens: int) -> list[Client]:
    base = server.base_url
    kinds = [lambda: anthropic_stream(base, max_tokens), lambda: openai_stream(base, max_tokens),
             lambda: anthropic_message(base, max_tokens),
             lambda: frame_request(server.host, server.frame_port, PROMPT_IDS, max_tokens)]
    return [kinds[i % len(kinds)]() for i in range(n)]


def assert_api_errors(clients: list[Client]) -> None:
    """Each error is the API's own: a 503 with api_error, an error event, or an UNAVAILABLE frame."""
    from zlc.runtime.serve.ingress.frames import FrameErrorCode

    for c in clients:
        if c.kind != "error":
            continue
        if c.name == "tcp frames":
            assert c.error_body == FrameErrorCode.UNAVAILABLE, c.detail
        elif c.name.startswith("openai"):
            err = c.error_body.get("error", c.error_body)
            assert err["type"] == "server_error", c.error_body
        else:
            assert c.error_body["type"] == "error" and c.error_body["error"]["type"] == "api_error", c.error_body


def recovered(server: Any) -> None:
    wait_for("the engine back up", lambda: health(server)[0] == 200, timeout=120)
    done = anthropic_message(server.base_url, 3)
    done.start()
    done.join(60)
    assert done.kind == "ok", done.detail


def test_engine_sigkill_mid_stream(faulty: Any, figures: list[Tally]) -> None:
    clients = mixed_clients(faulty, 6, 100)
    with HealthWatch(faulty) as watch:
        old = all_in_flight(faulty, clients)
        wait_first_token(clients)
        t_fault = time.monotonic()
        os.kill(old, signal.SIGKILL)
        tally = Tally("engine SIGKILL mid-stream (SDK streams, messages, TCP frames)", clients, t_fault)
        recovered(faulty)
    figures.append(tally)
    assert tally.rows["lost"] == 0, tally.explain()
    # (the first reply may just have ended between its first token and the kill)
    assert tally.rows["in_flight"] >= len(clients) - 1, tally.explain()
    assert tally.rows["error"] == tally.rows["in_flight"], tally.explain()
    assert_api_errors(clients)
    assert (503, "engine_restarting") in watch.statuses and watch.statuses[-1] == (200, "ok"), watch.statuses
    assert process_state(old) is None, "the dead engine was not reaped"
    assert metric(faulty, "zlc_engine_restarts_total", reason="exited") == 1
    assert metric(faulty, "zlc_engine_up") == 1


def test_engine_sigstop_mid_stream(faulty: Any, figures: list[Tally]) -> None:
    clients = mixed_clients(faulty, 5, 100)
    with HealthWatch(faulty) as watch:
        old = all_in_flight(faulty, clients)
        wait_first_token(clients)
        t_fault = time.monotonic()
        os.kill(old, signal.SIGSTOP)
        try:
            tally = Tally("engine SIGSTOP mid-stream (--step-deadline 4)", clients, t_fault)
        finally:
            if process_state(old) not in (None, "Z"):
                os.kill(old, signal.SIGCONT)  # (only if the watchdog failed to kill it)
        recovered(faulty)
    figures.append(tally)
    assert tally.rows["lost"] == 0 and tally.rows["error"] == tally.rows["in_flight"], tally.explain()
    assert tally.rows["in_flight"] >= len(clients) - 1, tally.explain()
    assert_api_errors(clients)
    assert (503, "engine_restarting") in watch.statuses and watch.statuses[-1] == (200, "ok"), watch.statuses
    assert process_state(old) is None, "the hung engine was not killed and reaped"
    assert metric(faulty, "zlc_engine_restarts_total", reason="hung") == 1


def test_engine_sigstop_while_idle_is_noticed(faulty: Any) -> None:
    """No request running: the supervisor's PING goes unanswered, and /health says so."""
    old = engine_pid(faulty)
    os.kill(old, signal.SIGSTOP)
    try:
        wait_for("/health 503 for a stopped idle engine", lambda: health(faulty)[0] == 503,
                 timeout=STEP_DEADLINE_S + 30)
    finally:
        if process_state(old) not in (None, "Z"):
            os.kill(old, signal.SIGCONT)
    recovered(faulty)
    assert metric(faulty, "zlc_engine_restarts_total", reason="hung") == 2


def test_sigterm_cuts_at_the_drain_timeout(faulty: Any, figures: list[Tally]) -> None:
    """8 streams in flight at SIGTERM, --drain-timeout 2; once the first has finished (a short
    one: the 8 run side by side, so the long ones finish together), the engine is stopped
    (SIGSTOP), so the others cannot finish in time: they get the API's error at the drain deadline.
    The server exits 0 without a traceback."""
    base = faulty.base_url
    clients = [anthropic_stream(base, 10 if i == 0 else 120) if i % 2 == 0 else openai_stream(base, 120)
               for i in range(8)]
    pid = all_in_flight(faulty, clients)
    os.kill(pid, signal.SIGSTOP)
    t_fault = time.monotonic()
    faulty.proc.send_signal(signal.SIGTERM)
    os.kill(pid, signal.SIGCONT)
    wait_for("a first reply done", lambda: any(c.kind == "ok" for c in clients), timeout=30, every=0.001)
    os.kill(pid, signal.SIGSTOP)  # (the server's shutdown sends it SIGTERM and SIGCONT)
    tally = Tally("server SIGTERM, 8 streams, the drain runs out (--drain-timeout 2)", clients, t_fault)
    assert faulty.proc.wait(30) == 0
    log = faulty.stop()
    figures.append(tally)
    assert tally.rows["lost"] == 0, tally.explain()
    assert tally.rows["in_flight"] == len(clients), tally.explain()
    assert tally.rows["ok"] >= 1 and tally.rows["error"] >= 1, tally.explain()
    assert_api_errors(clients)
    assert "Traceback" not in log, log
    assert "ended with an error" in log
    assert process_state(pid) is None


def test_sigterm_drains_streams_in_flight(chat_bundle: Path, server_process: Any, figures: list[Tally]) -> None:
    """8 streams in flight at SIGTERM all finish; new connections are refused meanwhile; a /health
    pipelined behind a stream answers 503 "draining"; exit 0, no traceback."""
    s = server_process(chat_bundle, "--device", "reference")
    try:
        base = s.base_url
        warm_up(base)
        clients = [anthropic_stream(base, 100) if i % 2 == 0 else openai_stream(base, 100) for i in range(8)]
        pipelined = socket.create_connection((s.host, s.port), timeout=30)
        body = b'{"model":"llama-chat","max_tokens":20,"stream":true,"messages":[{"role":"user","content":"hi"}]}'
        pid = engine_pid(s)
        os.kill(pid, signal.SIGSTOP)  # held until SIGTERM: every request is in flight at the signal
        try:
            for c in clients:
                c.start()
            wait_for("the 8 in flight", lambda: in_flight(s) >= len(clients), timeout=20)
            pipelined.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                              b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
                              + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            wait_for("the pipelined stream queued", lambda: in_flight(s) > len(clients), timeout=20)
            t_fault = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)

            def refused() -> bool:
                try:
                    socket.create_connection((s.host, s.port), timeout=5).close()
                    return False
                except ConnectionRefusedError:
                    return True

            # (the engine is still held: the server is draining, not gone)
            wait_for("new connections refused after SIGTERM", refused, timeout=10)
            assert s.proc.poll() is None
        finally:
            os.kill(pid, signal.SIGCONT)
        tally = Tally("server SIGTERM, 8 streams, the drain finishes (--drain-timeout 30)", clients, t_fault)
        raw = bytearray()
        while chunk := pipelined.recv(65536):
            raw += chunk
        pipelined.close()
        assert s.proc.wait(30) == 0
    finally:
        log = s.stop()
    figures.append(tally)
    assert tally.rows == {"in_flight": 8, "ok": 8, "error": 0, "lost": 0}, tally.explain()
    assert b"event: message_stop" in raw, raw[-300:]
    tail = raw[raw.rindex(b"HTTP/1.1 "):]
    assert tail.startswith(b"HTTP/1.1 503") and b'"status":"draining"' in tail, tail
    assert b"connection: close" in tail
    assert "Traceback" not in log, log


def test_restart_loop_gives_up(chat_bundle: Path, server_process: Any, tmp_path: Path) -> None:
    """The engine dies and its bundle is gone, so every restart fails: after --restart-limit
    failures the server exits 1 with one error line (systemd's Restart=on-failure takes over)."""
    bundle = tmp_path / "copy.zlc"
    shutil.copytree(chat_bundle, bundle)
    s = server_process(bundle, "--device", "reference", "--restart-limit", "2")
    try:
        bundle.rename(tmp_path / "moved.zlc")
        os.kill(engine_pid(s), signal.SIGKILL)
        code = s.proc.wait(120)
    finally:
        log = s.stop()
    assert code == 1, log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the engine failed 2 times within 60 s" in errors[0], log
    assert "did not restart" in log and "Traceback" not in log, log
