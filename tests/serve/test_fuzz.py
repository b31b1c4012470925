"""A Hypothesis fuzzer over request bodies, against a real `zlc serve` over real sockets: bodies
drawn from each API's own fields (valid values, edge values, wrong JSON types anywhere, the
messages list included), mutated by setting, dropping and adding fields. Every reply must be a
2xx or a 4xx, never a 5xx, and well formed: the API's message / completion (or its whole SSE
stream), or the API's error shape naming what is wrong. At the end, the server's log has no
traceback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from http_wire import MODEL, Response, Wire, post
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

# JSON values of every type, with the edges a validator trips on
leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                 st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64]),
                 st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 1e-300, 1.0, 2.0, 1e300]),
                 st.text(max_size=12),
                 st.sampled_from(["", "user", "assistant", "text", "\x00", "\ud7ff", "\ud800"]))
anything = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                      st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=8)
text_block = st.fixed_dictionaries({"type": st.sampled_from(["text", "image", "image_url", "tool_use", "tool_result"])
                                    | anything, "text": st.text(max_size=20) | anything},
                                   optional={"cache_control": anything, "id": anything, "name": anything,
                                             "input": anything, "tool_use_id": anything, "content": anything})
content = st.one_of(st.text(max_size=30), st.lists(text_block | anything, max_size=3), anything)
message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer",
                                                                     "tool"]) | anything,
                                           "content": content},
                                          optional={"name": anything, "extra": anything, "tool_calls": anything,
                                                    "tool_call_id": anything}),
                    anything)
messages = st.one_of(st.lists(message, min_size=1, max_size=4), anything)

FIELDS = {
    "anthropic": {"max_tokens": st.integers(-2, 8) | st.sampled_from([10**6, 2**40]) | anything,
                  "system": st.text(max_size=20) | st.lists(text_block, max_size=2) | anything,
                  "stop_sequences": st.lists(st.text(max_size=4), max_size=3) | anything,
                  "stream": st.booleans() | anything,
                  "temperature": st.floats(0, 1) | anything, "top_p": st.floats(0, 1) | anything,
                  "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2) | anything,
                  "top_k": st.integers(-2, 50) | anything, "tools": anything, "tool_choice": anything, "thinking": anything,
                  "service_tier": anything},
    "openai": {"max_tokens": st.integers(-2, 8) | anything, "max_completion_tokens": st.integers(-2, 8) | anything,
               "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | anything,
               "stream": st.booleans() | anything,
               "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | anything}) | anything,
               "temperature": st.floats(0, 2) | anything, "top_p": st.floats(0, 1) | anything,
               "seed": st.integers(-2**64, 2**64) | anything, "n": st.integers(0, 3) | anything,
               "frequency_penalty": st.floats(-2, 2) | anything, "presence_penalty": anything,
               "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
                   "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}]) | anything,
               "logprobs": st.booleans() | anything,
               "top_logprobs": st.integers(-1, 22) | anything, "top_k": st.integers(-2, 50) | anything,
               "user": anything,
               "tools": anything, "tool_choice": anything, "parallel_tool_calls": anything,
               "modalities": st.just(["text"]) | anything},
    "completions": {"prompt": st.text(max_size=20) | st.lists(st.integers(-1, 300), max_size=6)
                    | st.lists(st.text(max_size=5) | st.lists(st.integers(0, 300), max_size=4), max_size=3) | anything,
                    "max_tokens": st.integers(-1, 8) | anything, "echo": st.booleans() | anything,
                    "logprobs": st.integers(-1, 22) | anything, "n": st.integers(0, 9) | anything,
                    "best_of": st.integers(0, 3) | anything, "stream": st.booleans() | anything,
                    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | anything,
                    "temperature": st.floats(0, 2) | anything, "top_k": st.integers(-2, 50) | anything,
                    "frequency_penalty": st.floats(-3, 3) | anything, "suffix": anything,
                    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | anything}) | anything},
}


@st.composite
def bodies(draw: Any) -> tuple[str, Any]:
    api = draw(st.sampled_from(["anthropic", "openai", "completions"]))
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    if api == "completions":
        body = {"model": MODEL, "max_tokens": 2, "prompt": "hi"}
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["set", "set", "set", "drop", "messages", "extra", "model"]))
        if op == "set":
            name = draw(st.sampled_from(sorted(FIELDS[api])))
            body[name] = draw(FIELDS[api][name])
        elif op == "drop" and body:
            body.pop(draw(st.sampled_from(sorted(body))))
        elif op == "messages":
            body["messages"] = draw(messages)
        elif op == "extra":
            body[draw(st.text(min_size=1, max_size=8))] = draw(anything)
        else:
            body["model"] = draw(st.sampled_from([MODEL, "other"]) | anything)
    if draw(st.integers(0, 9)) == 0:
        return api, draw(anything)  # not even an object
    return api, body


@pytest.fixture(scope="module")
def fuzzed(chat_bundle: Path, server_process: Any) -> Iterator[Any]:
    s = server_process(chat_bundle, "--device", "reference")
    yield s
    log = s.stop()
    assert "Traceback" not in log, log[-3000:]


def well_formed(api: str, body: Any, r: Response) -> None:
    assert r.status < 500, (r.status, body, r.body[:500])
    if r.status >= 400:
        err = r.json()
        if api == "anthropic":
            assert err["type"] == "error" and isinstance(err["error"]["type"], str), err
            err = err["error"]
        else:
            err = err["error"]
            assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        return
    assert r.status == 200, r.status
    if r.headers["content-type"] == "text/event-stream":
        text = r.body.decode()
        end = 'event: message_stop\ndata: {"type":"message_stop"}' if api == "anthropic" else "data: [DONE]"
        assert text.rstrip().endswith(end), text[-300:]
        assert '"error"' not in text, text[-300:]
        return
    reply = r.json()
    if api == "anthropic":
        assert reply["type"] == "message" and reply["content"][0]["type"] == "text", reply
        assert reply["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence"), reply
    elif api == "openai":
        assert reply["object"] == "chat.completion", reply
        assert reply["choices"][0]["finish_reason"] in ("stop", "length"), reply
    else:
        assert reply["object"] == "text_completion", reply
        assert all(c["finish_reason"] in ("stop", "length") for c in reply["choices"]), reply


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=bodies())
# the three 500s of issue 15, kept as fixed examples
@example(case=("anthropic", {"model": MODEL, "max_tokens": 2, "temperature": 1, "top_p": 0,
                             "messages": [{"role": "user", "content": "hi"}]}))
@example(case=("openai", {"model": MODEL, "max_tokens": 2, "seed": -1,
                          "messages": [{"role": "user", "content": "hi"}]}))
@example(case=("openai", {"model": MODEL, "max_tokens": 2, "messages": [{"role": {}, "content": "hi"}]}))
def test_no_5xx_and_well_formed(fuzzed: Any, case: tuple[str, Any]) -> None:
    api, body = case
    with Wire(fuzzed, timeout=60) as w:
        w.send(post(api, json.dumps(body).encode()))
        well_formed(api, body, w.response())
