"""`zlc serve --devices cpu:0,cpu:1`: two native engines on disjoint cores behind one ingress, real
processes and real HTTP clients (streaming OpenAI chat off the socket, on threads). Oracles: each
stream's text is its prompt's alone on the native kernel (Bundle.generate, greedy); the router's
counters (zlc_routed_total) against the rule docs/serving.md states; the engines' own step counts."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import get, metric, process_state, serve_refused, wait_for

from zlc.runtime.serve.ingress.router import PAGES_PER_EXTRA_REQUEST

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two engines need two cores")

MODEL = "llama-chat"
MAX_TOKENS = 12
PROMPTS = [f"prompt {i}: tell me about {w}" for i, w in enumerate(["rings", "kernels", "caches", "sockets"])]
# A system prompt that makes the questions share 6 full KV pages (16 tokens each, the chat template
# included): the router lets its engine have one more request in flight than the least loaded
# (slack 6 // 4 = 1).
SYSTEM = "You are a terse assistant. Answer in one short line, no lists, no code."
QUESTIONS = ["what is a ring?", "what is a page?", "what is a step?", "what is a core?"]


def messages(user: str, system: str | None = None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def alone(bundle: Any, msgs: list[dict[str, str]], n: int = MAX_TOKENS) -> str:
    tok = bundle.tokenizer
    return str(tok.decode(bundle.generate(tok.encode_chat(msgs), n, device="cpu", eos=bundle.eos_token_ids)))


def chat(server: Any, msgs: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> tuple[int, str]:
    """(status, the streamed text, or the error body / the stream's error line)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "messages": msgs})
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        text = r.read().decode()
        conn.close()
        return r.status, text
    text = ""
    while line := r.readline():
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return 500, json.dumps(chunk)
        if chunk.get("choices"):
            text += chunk["choices"][0]["delta"].get("content") or ""
    r.close()
    conn.close()
    return r.status, text


def engine_pids(server: Any) -> dict[int, int]:
    """core -> pid of the engine confined to it (each engine here has one core)."""
    out = {}
    for children in Path(f"/proc/{server.proc.pid}/task").glob("*/children"):
        for pid in children.read_text().split():
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            except FileNotFoundError:
                continue
            if "zlc.runtime.serve.engine.loop" in argv and "--cpus" in argv:
                out[int(argv[argv.index("--cpus") + 1])] = int(pid)
    return out


def resume(pid: int) -> None:
    """SIGCONT, unless the process is gone (killed and reaped)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def routed(server: Any, engine: int, how: str | None = None) -> float:
    labels = {"engine": str(engine)} | ({"how": how} if how else {})
    return metric(server, "zlc_routed_total", **labels)


@pytest.fixture(scope="module")
def two(chat_bundle: Path, server_process: Any) -> Any:
    s = server_process(chat_bundle, "--devices", "cpu:0,cpu:1", "--threads", "1", "--max-batch", "4")
    yield s
    pids = engine_pids(s)
    log = s.stop()  # SIGTERM: the drain stops both engines and the server exits 0
    assert s.proc.returncode == 0 and "stopped after" in log, log
    assert all(process_state(pid) is None for pid in pids.values())


def test_both_engines_serve_concurrent_streams_each_with_its_solo_text(two: Any, bundle: Any) -> None:
    want = [alone(bundle, messages(p)) for p in PROMPTS]
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: chat(two, messages(p)), PROMPTS))
    assert got == [(200, w) for w in want]
    for e in (0, 1):
        assert routed(two, e) > 0 and metric(two, "zlc_engine_steps", engine=str(e)) > 0
        assert metric(two, "zlc_engine_rows", engine=str(e), device=f"cpu:{e}") > 0
    # the unlabelled sample is the total of the labelled ones
    total = [s for s in _samples(two, "zlc_engine_rows") if not s.labels]
    assert len(total) == 1 and total[0].value == sum(metric(two, "zlc_engine_rows", engine=str(e)) for e in (0, 1))
    status, body = get(two, "/health")
    assert status == 200 and [e["device"] for e in body["engines"]] == ["cpu:0", "cpu:1"]
    assert sorted(engine_pids(two)) == [0, 1]
    for core, pid in engine_pids(two).items():  # each engine (all its threads) on its own core
        assert all(os.sched_getaffinity(int(t.name)) == {core} for t in Path(f"/proc/{pid}/task").iterdir())


def _samples(server: Any, name: str) -> list[Any]:
    from prometheus_client.parser import text_string_to_metric_families

    _, text = get(server, "/metrics")
    return [s for f in text_string_to_metric_families(str(text)) for s in f.samples if s.name == name]


def test_tcp_frames_are_routed_over_both_engines(two: Any, bundle: Any) -> None:
    """Four frame requests in one packet: submitted one after another, each to the least loaded
    (prompts under a page: no affinity), so they alternate; each gets its greedy tokens."""
    from zlc.runtime.serve.ingress import frames

    prompts = {i: [(31 * i + 7 * k) % 250 + 3 for k in range(9)] for i in range(1, 5)}
    before = [routed(two, e, "least_loaded") for e in (0, 1)]
    got: dict[int, list[int]] = {i: [] for i in prompts}
    with socket.create_connection((two.host, two.frame_port), timeout=60) as sock:
        sock.sendall(b"".join(frames.encode_request(i, p, 10) for i, p in prompts.items()))
        buf, pending = bytearray(), set(prompts)
        while pending:
            data = sock.recv(65536)
            assert data, "the server closed the connection"
            buf += data
            for f in frames.decode_results(buf):
                assert not f.flags & frames.FrameFlag.ERROR, f
                got[f.request_id] += f.tokens
                if f.flags & frames.FrameFlag.LAST:
                    pending.discard(f.request_id)
    assert got == {i: bundle.generate(p, 10, device="cpu", eos=bundle.eos_token_ids) for i, p in prompts.items()}
    assert [routed(two, e, "least_loaded") - before[e] for e in (0, 1)] == [2, 2]


def test_a_shared_system_prompt_stays_on_its_engine_until_it_is_too_busy(two: Any, bundle: Any) -> None:
    """S+q1 is served by engine A. With A stopped (its requests stay in flight), S+q2 goes to A
    (loads equal: affinity), S+q3 too (A one more in flight: within the slack of 1 for 6 pages),
    S+q4 to the other (A two more: rebalanced); once A runs again each gets its solo text."""
    tok = bundle.tokenizer
    pages = len(os.path.commonprefix([tok.encode_chat(messages(q, SYSTEM)) for q in QUESTIONS])) // 16
    assert pages // PAGES_PER_EXTRA_REQUEST == 1  # what the slack of 1 below assumes
    want = {q: alone(bundle, messages(q, SYSTEM)) for q in QUESTIONS}
    before = [routed(two, e) for e in (0, 1)]
    assert chat(two, messages(QUESTIONS[0], SYSTEM)) == (200, want[QUESTIONS[0]])
    a = 0 if routed(two, 0) > before[0] else 1
    b = 1 - a
    pid = engine_pids(two)[a]
    affinity, rebalanced = routed(two, a, "affinity"), routed(two, b, "rebalanced")
    os.kill(pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = {}
            for n, q in enumerate(QUESTIONS[1:3], 1):
                futures[q] = pool.submit(chat, two, messages(q, SYSTEM))
                wait_for(f"S+q{n + 1} routed to A by affinity",
                         lambda n=n: routed(two, a, "affinity") == affinity + n, timeout=30)
            futures[QUESTIONS[3]] = pool.submit(chat, two, messages(QUESTIONS[3], SYSTEM))
            wait_for("S+q4 rebalanced to B", lambda: routed(two, b, "rebalanced") == rebalanced + 1, timeout=30)
            assert futures[QUESTIONS[3]].result(timeout=60) == (200, want[QUESTIONS[3]])  # B serves it meanwhile
            os.kill(pid, signal.SIGCONT)
            assert {q: f.result(timeout=60) for q, f in futures.items()} == {q: (200, want[q]) for q in futures}
    finally:
        resume(pid)


def test_a_killed_engine_fails_its_requests_the_other_serves_on_and_it_is_restarted(two: Any, bundle: Any) -> None:
    pids = engine_pids(two)
    for pid in pids.values():
        os.kill(pid, signal.SIGSTOP)
    before = [routed(two, e) for e in (0, 1)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            stuck = pool.submit(chat, two, messages(PROMPTS[0]), 40)
            wait_for("the request routed", lambda: sum(routed(two, e) for e in (0, 1)) == sum(before) + 1)
            victim = 0 if routed(two, 0) > before[0] else 1
            other = 1 - victim
            os.kill(pids[victim], signal.SIGKILL)
        finally:
            for pid in pids.values():
                resume(pid)
        status, body = stuck.result(timeout=60)  # today's single-engine error: 503 before any token
        assert status == 503 and "not available" in body, body
    wait_for("the dead engine reaped", lambda: process_state(pids[victim]) is None, timeout=10)
    # the server stays up on the other engine while the killed one restarts, and serves on
    status, body = get(two, "/health")
    assert status == 200 and body["status"] == "ok", body
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: chat(two, messages(p)), PROMPTS))
    assert got == [(200, alone(bundle, messages(p))) for p in PROMPTS]
    wait_for("the killed engine back", lambda: get(two, "/health")[1]["engines"][victim]["status"] == "up",
             timeout=120)
    new = engine_pids(two)
    assert new[other] == pids[other] and new[victim] != pids[victim]
    assert metric(two, "zlc_engine_restarts_total", engine=str(victim), reason="exited") == 1
    assert metric(two, "zlc_engine_restarts_total", engine=str(other)) == 0
    assert chat(two, messages(PROMPTS[1])) == (200, alone(bundle, messages(PROMPTS[1])))


@pytest.mark.parametrize("args, message", [
    (("--devices", "cpu:0,,cpu:1"), "bad --devices 'cpu:0,,cpu:1': an empty part"),
    (("--devices", "cpu:0,tpu:1"), "bad --devices part 'tpu:1': unknown device 'tpu'"),
    (("--devices", "cpu:0-1", "--threads", "3"), "--threads 3 is more than the 2 core(s) of cpu:0-1"),
    (("--devices", "cpu:0", "--device", "cpu"), "give --device or --devices, not both"),
    # no GPU here: the cuda engine's start fails (the cpu one is stopped), named by its device
    (("--devices", "cpu:0,cuda:0"), "cuda:0: the engine failed to start"),
])
def test_bad_devices_are_one_line_errors(chat_bundle: Path, args: tuple[str, ...], message: str) -> None:
    out = serve_refused(chat_bundle, *args)
    assert out.returncode in (1, 2), out.stderr
    errors = [line for line in out.stderr.splitlines() if message in line]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
