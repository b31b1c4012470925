"""Continuous batching through the real server: `zlc serve` processes on the reference executor
(SequentialBatch) and on the native kernel (NativeBatch: one launch per step, paged KV cache), real
HTTP clients on threads (streaming OpenAI chat, read as SSE off the socket). Oracle: each stream's
text is the one its prompt gets alone on the same executor (Bundle.generate, greedy)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import engine_pid, metric, wait_for

MODEL = "llama-chat"
WORDS = ["rings", "kernels", "caches", "sockets", "frames", "tokens", "queues", "fences"]
PROMPTS = [f"prompt {i}: tell me about {w}" for i, w in enumerate(WORDS)]  # 48 tokens each, chat template in
MAX_TOKENS = 12


def alone_texts(bundle: Any, n: int, prompts: list[str] = PROMPTS, device: str = "reference") -> dict[str, str]:
    tok = bundle.tokenizer
    return {p: tok.decode(bundle.generate(tok.encode_chat(p), n, device=device, eos=bundle.eos_token_ids))
            for p in prompts}


@pytest.fixture(scope="module")
def alone(bundle: Any) -> dict[str, str]:
    return alone_texts(bundle, MAX_TOKENS)


def chat(server: Any, prompt: str, max_tokens: int = MAX_TOKENS, hang_up_after: int | None = None) -> tuple[int, str]:
    """(status, the streamed text or the error body). `hang_up_after`: close the connection after
    that many content events (a client going away mid-stream)."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "messages": [{"role": "user", "content": prompt}]})
    conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        text = r.read().decode()
        conn.close()
        return r.status, text
    text, events = "", 0
    while line := r.readline():
        if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("choices"):
            text += chunk["choices"][0]["delta"].get("content") or ""
            events += 1
            if hang_up_after is not None and events >= hang_up_after:
                break
    r.close()  # the response holds the socket too: both go for the peer to see the close
    conn.close()
    return r.status, text


def run_together(server: Any, prompts: list[str], **kw: Any) -> list[tuple[int, str]]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: chat(server, p, **kw), prompts))


def all_pages_back(server: Any) -> bool:
    return (metric(server, "zlc_engine_running") == 0
            and metric(server, "zlc_engine_pages_free") == metric(server, "zlc_engine_pages_total") > 0)


@pytest.fixture(scope="module")
def batch_server(chat_bundle: Path, server_process: Any) -> Any:
    s = server_process(chat_bundle, "--device", "reference", "--max-batch", "4", "--prefill-chunk", "32")
    yield s
    s.stop()


def test_concurrent_streams_each_get_their_solo_text(batch_server: Any, alone: dict[str, str]) -> None:
    got = run_together(batch_server, PROMPTS)
    assert got == [(200, alone[p]) for p in PROMPTS]
    steps = metric(batch_server, "zlc_engine_steps")
    rows = metric(batch_server, "zlc_engine_rows")
    assert 0 < steps < rows  # steps carried several rows
    assert metric(batch_server, "zlc_engine_host_seconds") > 0 and metric(batch_server, "zlc_engine_backend_seconds") > 0
    wait_for("all sequences closed", lambda: all_pages_back(batch_server), timeout=10)


def test_a_client_hanging_up_mid_batch_frees_its_sequence(batch_server: Any, alone: dict[str, str]) -> None:
    """One long stream is dropped after its first tokens; its sequence is closed (running drops to
    0 and every page is back once the others end) and the others finish with their solo text."""
    cancelled = metric(batch_server, "zlc_requests_total", outcome="cancelled")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        quitter = pool.submit(chat, batch_server, PROMPTS[0], 80, 2)
        others = [pool.submit(chat, batch_server, p) for p in PROMPTS[1:4]]
        assert quitter.result()[0] == 200
        assert [f.result() for f in others] == [(200, alone[p]) for p in PROMPTS[1:4]]
    wait_for("the dropped stream's cancel", lambda: metric(batch_server, "zlc_requests_total", outcome="cancelled")
             == cancelled + 1, timeout=10)
    wait_for("all sequences closed", lambda: all_pages_back(batch_server), timeout=10)


def four_at_one_step(server: Any, max_tokens: int) -> list[tuple[int, str]]:
    """The first four prompts, arriving at one step: the engine is stopped until all four are in the ring."""
    pid = engine_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(chat, server, p, max_tokens) for p in PROMPTS[:4]]
            wait_for("the 4 submitted", lambda: metric(server, "zlc_queue_depth") == 4, timeout=30)
            os.kill(pid, signal.SIGCONT)
            return [f.result() for f in futures]
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def tiny_budget_server(chat_bundle: Path, server_process: Any) -> Any:
    # 7 pages of 16: two 48-token prompts are admitted (3 pages each, the third must wait), and
    # answers of 40 tokens take 6 pages each: the younger is preempted and recomputed later.
    s = server_process(chat_bundle, "--device", "reference", "--max-batch", "4", "--kv-pages", "7")
    yield s
    s.stop()


def test_preemption_under_a_tiny_page_budget_keeps_the_text(tiny_budget_server: Any, bundle: Any) -> None:
    alone = alone_texts(bundle, 40, PROMPTS[:4])
    assert four_at_one_step(tiny_budget_server, 40) == [(200, alone[p]) for p in PROMPTS[:4]]
    assert metric(tiny_budget_server, "zlc_engine_preemptions") > 0
    wait_for("all pages back", lambda: all_pages_back(tiny_budget_server), timeout=10)


def test_a_prompt_beyond_the_kv_budget_is_a_400_naming_it(tiny_budget_server: Any, bundle: Any) -> None:
    words = "history"
    while len(bundle.tokenizer.encode_chat(words)) <= 7 * 16:
        words += " history"
    assert len(bundle.tokenizer.encode_chat(words)) <= bundle.max_seq  # within max_seq: the budget refuses it
    status, body = chat(tiny_budget_server, words, max_tokens=4)
    assert status == 400, body
    assert "--kv-pages 7" in json.loads(body)["error"]["message"]


@pytest.fixture(scope="module")
def native_server(chat_bundle: Path, server_process: Any) -> Any:
    # The batched native kernel with a budget of 7 pages of 16 (as tiny_budget_server's).
    s = server_process(chat_bundle, "--device", "cpu", "--threads", "2", "--max-batch", "4", "--kv-pages", "7")
    yield s
    s.stop()


def test_native_batched_steps_give_each_stream_its_solo_text(native_server: Any, bundle: Any) -> None:
    """Four greedy streams at once on NativeBatch, preempted under the page budget, each equal to
    its prompt run alone on the native kernel (MegakernelSession, batch 1)."""
    alone = alone_texts(bundle, 40, PROMPTS[:4], device="cpu")
    assert four_at_one_step(native_server, 40) == [(200, alone[p]) for p in PROMPTS[:4]]
    assert metric(native_server, "zlc_engine_steps") < metric(native_server, "zlc_engine_rows")
    assert metric(native_server, "zlc_engine_preemptions") > 0
    wait_for("all pages back", lambda: all_pages_back(native_server), timeout=10)


SYSTEM = "You answer in short plain sentences."  # ~1 token a character: 3 pages with the template


def chat_messages(server: Any, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS) -> tuple[int, str]:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps({"model": MODEL, "max_tokens": max_tokens,
                                                             "temperature": 0, "messages": messages}),
                 {"content-type": "application/json"})
    r = conn.getresponse()
    body = json.loads(r.read())
    conn.close()
    return r.status, body["choices"][0]["message"]["content"] if r.status == 200 else str(body)


def test_a_repeated_system_prompt_comes_from_the_prefix_cache(native_server: Any, bundle: Any) -> None:
    """Two requests with the same long system prompt, one after the other, on the native kernel:
    each gets the text it gets alone, and the second maps the first's full pages of their common
    prefix (16-token pages: /metrics counts a hit and exactly those tokens) instead of prefilling
    them; the first's pages stay cached (in pages_free) once both are done."""
    tok = bundle.tokenizer
    asks = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
            for q in ("tell me about rings", "and kernels?")]
    ids = [tok.encode_chat(m) for m in asks]
    common = next(k for k, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)
    assert common >= 32, common  # at least two whole pages of the system prompt
    solo = [tok.decode(bundle.generate(i, MAX_TOKENS, device="cpu", eos=bundle.eos_token_ids)) for i in ids]
    assert chat_messages(native_server, asks[0]) == (200, solo[0])
    hits, reused = metric(native_server, "zlc_engine_prefix_hits"), metric(native_server, "zlc_engine_prefix_tokens")
    assert chat_messages(native_server, asks[1]) == (200, solo[1])
    assert metric(native_server, "zlc_engine_prefix_hits") == hits + 1
    assert metric(native_server, "zlc_engine_prefix_tokens") == reused + common // 16 * 16
    wait_for("all pages back", lambda: all_pages_back(native_server), timeout=10)
    assert metric(native_server, "zlc_engine_pages_cached") >= common // 16
