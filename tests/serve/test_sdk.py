"""`zlc serve` through the official Anthropic and OpenAI Python SDKs, streaming and not: the text
equals `zlc run`'s greedy output, max_tokens=1 works, stop sequences and stop reasons are right,
plus /v1/models, /health, /metrics, the architecture header and the API key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import sdk_clients, serve_refused

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "llama-chat"
PROMPT = "Hello there"


def zlc_run(bundle: Path, prompt: str, n: int, device: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "zlc.cli", "run", str(bundle), "--prompt", prompt,
                          "--max-new-tokens", str(n), "--device", device, "--json"],
                         capture_output=True, text=True, timeout=600, check=True)
    return dict(json.loads(out.stdout))


@pytest.fixture(scope="module")
def reference(chat_bundle: Path) -> dict[str, Any]:
    """`zlc run`'s greedy reply on the server's executor (16 tokens)."""
    return zlc_run(chat_bundle, PROMPT, 16, "reference")


def msgs(text: str = PROMPT) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_anthropic_non_streaming_equals_zlc_run(server: Any, reference: dict[str, Any]) -> None:
    a, _ = sdk_clients(server)
    m = a.messages.create(model=MODEL, max_tokens=16, messages=msgs())
    assert m.content[0].text == reference["text"]
    assert m.model == MODEL and m.role == "assistant" and m.type == "message"
    assert m.usage.input_tokens == len(reference["prompt"])
    assert m.usage.output_tokens == len(reference["generated"])
    assert m.stop_reason == ("end_turn" if len(reference["generated"]) < 16 else "max_tokens")


def test_anthropic_streaming_equals_zlc_run(server: Any, reference: dict[str, Any]) -> None:
    a, _ = sdk_clients(server)
    with a.messages.stream(model=MODEL, max_tokens=16, messages=msgs()) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == reference["text"]
    assert final.content[0].text == reference["text"]
    assert final.usage.output_tokens == len(reference["generated"])


def test_anthropic_raw_event_order(server: Any) -> None:
    """The wire sequence (the SDK hides `ping`, so read the raw stream)."""
    import http.client

    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    body = json.dumps({"model": MODEL, "max_tokens": 4, "stream": True, "messages": msgs()})
    conn.request("POST", "/v1/messages", body, {"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and r.getheader("content-type") == "text/event-stream"
    raw = r.read().decode()
    events = [line[len("event: "):] for line in raw.splitlines() if line.startswith("event: ")]
    datas = [json.loads(line[len("data: "):]) for line in raw.splitlines() if line.startswith("data: ")]
    assert [d["type"] for d in datas] == events
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[3:-3]) <= {"content_block_delta"}
    assert all(d["delta"]["type"] == "text_delta" for d in datas[3:-3])


def test_openai_non_streaming_equals_zlc_run(server: Any, reference: dict[str, Any]) -> None:
    _, o = sdk_clients(server)
    r = o.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=msgs())
    assert r.choices[0].message.content == reference["text"]
    assert r.choices[0].finish_reason == ("stop" if len(reference["generated"]) < 16 else "length")
    assert r.usage is not None
    assert r.usage.prompt_tokens == len(reference["prompt"])
    assert r.usage.completion_tokens == len(reference["generated"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_openai_streaming_with_usage_equals_zlc_run(server: Any, reference: dict[str, Any]) -> None:
    _, o = sdk_clients(server)
    chunks = list(o.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=msgs(),
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop" if len(reference["generated"]) < 16 else "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(reference["generated"])


def test_max_tokens_one(server: Any, reference: dict[str, Any]) -> None:
    a, o = sdk_clients(server)
    first = reference["generated"][0]
    m = a.messages.create(model=MODEL, max_tokens=1, messages=msgs())
    assert m.usage.output_tokens == 1
    assert m.stop_reason == ("end_turn" if first in (258,) else "max_tokens")
    with a.messages.stream(model=MODEL, max_tokens=1, messages=msgs()) as s:
        assert "".join(s.text_stream) == m.content[0].text
    r = o.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, messages=msgs())
    assert r.usage is not None and r.usage.completion_tokens == 1
    assert r.choices[0].message.content == m.content[0].text


def _printable_stop(text: str) -> tuple[str, str]:
    """A stop sequence from the middle of `text` and the text before it."""
    for i in range(2, len(text) - 2):
        cand = text[i:i + 2]
        if "\ufffd" not in cand and text.find(cand) == i:
            return cand, text[:i]
    pytest.skip(f"no usable stop sequence in {text!r}")


def test_stop_sequences(server: Any, reference: dict[str, Any]) -> None:
    stop, before = _printable_stop(reference["text"])
    a, o = sdk_clients(server)
    m = a.messages.create(model=MODEL, max_tokens=16, messages=msgs(), stop_sequences=[stop, "never-seen"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == before
    with a.messages.stream(model=MODEL, max_tokens=16, messages=msgs(), stop_sequences=[stop]) as s:
        assert "".join(s.text_stream) == before
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    r = o.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=msgs(), stop=[stop])
    assert r.choices[0].message.content == before and r.choices[0].finish_reason == "stop"
    chunks = list(o.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, messages=msgs(),
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == before


def test_system_prompt_and_prefill(server: Any, chat_bundle: Path) -> None:
    import zlc

    b = zlc.load(chat_bundle)
    tok = b.tokenizer
    a, o = sdk_clients(server)
    sys_ids = tok.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}])
    expect = tok.decode(b.generate(sys_ids, 6, device="reference", eos=b.eos_token_ids))
    m = a.messages.create(model=MODEL, max_tokens=6, system="Be brief.", messages=msgs())
    assert m.content[0].text == expect
    r = o.chat.completions.create(model=MODEL, max_tokens=6, temperature=0,
                                  messages=[{"role": "system", "content": "Be brief."}, *msgs()])
    assert r.choices[0].message.content == expect
    # assistant prefill: the reply continues the given text
    head = tok.encode(tok.apply_chat_template(msgs(), add_generation_prompt=True), add_special_tokens=False)
    prefill_ids = head + tok.encode("Sure", add_special_tokens=False)
    expect2 = tok.decode(b.generate(prefill_ids, 4, device="reference", eos=b.eos_token_ids))
    m2 = a.messages.create(model=MODEL, max_tokens=4, messages=[*msgs(), {"role": "assistant", "content": "Sure"}])
    assert m2.content[0].text == expect2


def test_models_health_metrics_headers(server: Any) -> None:
    a, o = sdk_clients(server)
    assert [m.id for m in o.models.list()] == [MODEL]
    assert [m.id for m in a.models.list()] == [MODEL]
    raw = a.messages.with_raw_response.create(model=MODEL, max_tokens=2, messages=msgs())
    assert raw.headers["x-zlc-architecture"] == "zero-layer-v1"
    assert raw.headers["request-id"].startswith("msg_")
    with urllib.request.urlopen(server.base_url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["model"] == MODEL
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
        assert r.headers["content-type"].startswith("text/plain")
    for name in ("zlc_time_to_first_token_seconds_bucket", "zlc_inter_token_latency_seconds_bucket",
                 "zlc_queue_depth", 'zlc_ring_occupancy{ring="request"}', "zlc_tokens_per_second",
                 "zlc_generated_tokens_total", 'zlc_requests_total{api="anthropic",outcome="ok"}'):
        assert name in text, name
    ok = [float(line.split()[-1]) for line in text.splitlines()
          if line.startswith('zlc_requests_total{api="anthropic",outcome="ok"}')]
    assert ok and ok[0] >= 1


def test_api_key(start_server: Any) -> None:
    s = start_server("--device", "reference", "--api-key", "s3cret")
    for key, ok in (("wrong", False), ("s3cret", True)):
        a, o = sdk_clients(s, key)
        if ok:
            assert a.messages.create(model=MODEL, max_tokens=1, messages=msgs()).usage.output_tokens == 1
            assert o.chat.completions.create(model=MODEL, max_tokens=1, messages=msgs()).choices
            continue
        with pytest.raises(anthropic.AuthenticationError) as ea:
            a.messages.create(model=MODEL, max_tokens=1, messages=msgs())
        assert ea.value.status_code == 401 and ea.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError) as eo:
            o.chat.completions.create(model=MODEL, max_tokens=1, messages=msgs())
        assert eo.value.status_code == 401
        with pytest.raises(anthropic.AuthenticationError):
            a.models.list()
    with urllib.request.urlopen(s.base_url + "/health", timeout=10) as r:  # health stays open for probes
        assert r.status == 200


@pytest.mark.slow
def test_interpreter_executor_equals_zlc_run(start_server: Any, chat_bundle: Path) -> None:
    """The megakernel itself (Triton interpreter) behind the API: the same text as `zlc run`."""
    expect = zlc_run(chat_bundle, PROMPT, 4, "cpu")
    s = start_server("--device", "cpu")
    a, o = sdk_clients(s)
    with a.messages.stream(model=MODEL, max_tokens=4, messages=msgs()) as st:
        assert "".join(st.text_stream) == expect["text"]
    r = o.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=msgs())
    assert r.choices[0].message.content == expect["text"]


def test_warns_when_exposed_without_key(start_server: Any) -> None:
    # (--insecure-frames: the fixture's frame ports beyond loopback need it without a key)
    s = start_server("--device", "reference", "--host", "0.0.0.0", "--insecure-frames")
    assert s.host == "0.0.0.0"
    assert "WARNING: listening on 0.0.0.0 without --api-key" in s.stop()


def test_client_disconnect_frees_the_engine(start_server: Any) -> None:
    """A client that goes away mid-stream cancels its request: on the interpreter (~0.5 s a token)
    the next request is answered in seconds, not after the 40 tokens the first one asked for."""
    import socket
    import time

    s = start_server("--device", "interpret")
    body = json.dumps({"model": MODEL, "max_tokens": 40, "stream": True, "messages": msgs()}).encode()
    raw = socket.create_connection((s.host, s.port), timeout=60)
    raw.sendall(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert raw.recv(65536).startswith(b"HTTP/1.1 200")  # the first token's events are out
    raw.close()
    t0 = time.monotonic()
    a, _ = sdk_clients(s)
    assert a.messages.create(model=MODEL, max_tokens=1, messages=msgs()).usage.output_tokens == 1
    waited = time.monotonic() - t0
    assert waited < 15, f"the next request waited {waited:.1f} s: the first one was not cancelled"
    with urllib.request.urlopen(s.base_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'zlc_requests_total{api="anthropic",outcome="cancelled"} 1.0' in text
    assert "zlc_queue_depth 0.0" in text


@pytest.mark.parametrize("args, message", [
    (("--xdp", "zlc-nosuchif0"), "--xdp needs --udp-port"),
    (("--xdp", "zlc-nosuchif0", "--udp-port", "0", "--insecure-frames"),
     "no such network interface" if os.geteuid() == 0 else "--xdp needs root"),
])
def test_xdp_option_errors_are_one_line(chat_bundle: Path, args: tuple[str, ...], message: str) -> None:
    out = serve_refused(chat_bundle, "--device", "reference", *args)
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], out.stderr
    assert "Traceback" not in out.stderr
