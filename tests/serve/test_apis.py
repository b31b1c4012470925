"""The two API objects (api_anthropic.ANTHROPIC, api_openai.OPENAI) on their own: each answers an
error with its own status and body, frames a stream's error its own way, writes replies that its
official SDK's types validate, and lists the model in its own shape; the route picks the object from the path (and
the headers elsewhere). Then, against a real server, the one owner of a request's cancellation: a
client that goes away while its request waits in the engine frees its slot at once."""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import pytest
from http_wire import Wire, exchange, good, post
from serve_helpers import engine_pid, health, metric, wait_for

from zlc.runtime.serve.ingress.api_anthropic import ANTHROPIC
from zlc.runtime.serve.ingress.api_common import ApiError, GenerationSpec, Outcome
from zlc.runtime.serve.ingress.api_openai import OPENAI
from zlc.runtime.serve.ingress.http import HttpRequest
from zlc.runtime.serve.ingress.server import api_of

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

# (error, Anthropic status, OpenAI status, OpenAI type, OpenAI code)
ERRORS = [
    (ApiError("invalid_request_error", "messages: Field required", param="messages"), 400, 400,
     "invalid_request_error", None),
    (ApiError("authentication_error", "no key"), 401, 401, "invalid_request_error", "invalid_api_key"),
    (ApiError("not_found_error", "model: x", param="model"), 404, 404, "invalid_request_error", "model_not_found"),
    (ApiError("overloaded_error", "busy"), 529, 429, "server_error", "overloaded"),
    (ApiError("api_error", "the engine is restarting", status=503), 503, 503, "server_error", None),
]


@pytest.mark.parametrize("e,a_status,o_status,o_type,o_code", ERRORS, ids=[e[0].kind for e in ERRORS])
def test_each_api_answers_an_error_in_its_own_shape(e: ApiError, a_status: int, o_status: int, o_type: str,
                                                    o_code: str | None) -> None:
    assert ANTHROPIC.status(e) == a_status
    assert json.loads(ANTHROPIC.error_body(e)) == {"type": "error", "error": {"type": e.kind, "message": e.message}}
    assert OPENAI.status(e) == o_status
    assert json.loads(OPENAI.error_body(e)) == {"error": {"message": e.message, "type": o_type, "param": e.param,
                                                          "code": o_code}}


def test_each_api_ends_a_stream_with_its_own_error_event() -> None:
    e = ApiError("api_error", "the engine failed")
    assert ANTHROPIC.stream_error(e) == b"event: error\ndata: " + ANTHROPIC.error_body(e) + b"\n\n"
    assert OPENAI.stream_error(e) == b"data: " + OPENAI.error_body(e) + b"\n\n"


def sse_data(stream: bytes) -> list[Any]:
    """The JSON of each `data:` line of an SSE byte stream ([DONE] as the string)."""
    out = []
    for line in stream.decode().splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_anthropic_replies_are_what_its_sdk_validates() -> None:
    spec = GenerationSpec(prompt_ids=[1, 2, 3], max_tokens=4)
    reply = ANTHROPIC.reply("m", spec)
    message = anthropic.types.Message.model_validate(json.loads(reply.body([Outcome("Hi", "stop_sequence", "\n", 2)],
                                                                           2)))
    assert (message.usage.input_tokens, message.usage.output_tokens) == (3, 2)
    assert (message.stop_reason, message.stop_sequence, message.content[0].text) == ("stop_sequence", "\n", "Hi")
    stream = reply.stream_head() + reply.stream_delta("Hi") + reply.stream_end(Outcome("Hi", "eos", None, 2), 2)
    events = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    kinds = [events.validate_python(d).type for d in sse_data(stream) if d["type"] != "ping"]
    assert kinds == ["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                     "message_delta", "message_stop"]


def test_openai_replies_are_what_its_sdk_validates() -> None:
    spec = GenerationSpec(prompt_ids=[1, 2, 3], max_tokens=4, include_usage=True)
    reply = OPENAI.reply("m", spec)
    done = openai.types.chat.ChatCompletion.model_validate(json.loads(reply.body([Outcome("Hi", "max_tokens", None, 4)],
                                                                                 4)))
    assert (done.choices[0].finish_reason, done.choices[0].message.content) == ("length", "Hi")
    assert done.usage is not None and done.usage.total_tokens == 7
    *chunks, last = sse_data(reply.stream_head() + reply.stream_delta("Hi")
                             + reply.stream_end(Outcome("Hi", "eos", None, 2), 2))
    assert last == "[DONE]"
    parsed = [openai.types.chat.ChatCompletionChunk.model_validate(c) for c in chunks]
    assert [c.choices[0].finish_reason if c.choices else "usage" for c in parsed] == [None, None, "stop", "usage"]
    assert parsed[-1].usage is not None and parsed[-1].usage.completion_tokens == 2


def test_model_lists_in_each_apis_shape() -> None:
    created = 1_700_000_000
    entry = {"type": "model", "id": "m", "display_name": "m", "created_at": "2023-11-14T22:13:20Z",
             "max_input_tokens": 128, "max_tokens": 128}
    assert json.loads(ANTHROPIC.models("m", created, 128, single=True)) == entry
    assert json.loads(ANTHROPIC.models("m", created, 128, single=False)) == {
        "data": [entry], "has_more": False, "first_id": "m", "last_id": "m"}
    model = openai.types.Model.model_validate(json.loads(OPENAI.models("m", created, 128, single=True)))
    assert (model.id, model.created, model.owned_by) == ("m", created, "zlc")
    assert json.loads(OPENAI.models("m", created, 128, single=False)) == {"object": "list", "data": [
        {"id": "m", "object": "model", "created": created, "owned_by": "zlc"}]}


@pytest.mark.parametrize("path,headers,api", [
    (b"/v1/messages", {}, ANTHROPIC),
    (b"/v1/chat/completions", {b"anthropic-version": b"2023-06-01"}, OPENAI),
    (b"/v1/models", {b"anthropic-version": b"2023-06-01"}, ANTHROPIC),
    (b"/v1/models", {}, OPENAI),
    (b"/nowhere", {b"anthropic-version": b"2023-06-01"}, ANTHROPIC),
])
def test_the_route_picks_the_api(path: bytes, headers: dict[bytes, bytes], api: Any) -> None:
    """A generation path's API is its own whatever the headers say; elsewhere anthropic-version decides."""
    assert api_of(HttpRequest(b"GET", path, headers, b"", True, False, 0)) is api


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_client_gone_from_a_waiting_request_frees_its_slot(server: Any, api: str, stream: bool) -> None:
    """The engine is held (SIGSTOP) while a request waits in it; its client closes the connection:
    the request leaves the engine's count at once, counted as cancelled under its API, and once the
    engine runs again the next request is answered."""
    cancelled = metric(server, "zlc_requests_total", api=api, outcome="cancelled")
    pid = engine_pid(server)
    os.kill(pid, signal.SIGSTOP)
    try:
        with Wire(server) as w:
            w.send(post(api, good(api, max_tokens=20, stream=stream)))
            wait_for("the request in the engine", lambda: health(server)[1]["in_flight"] == 1, timeout=20)
        wait_for("the request cancelled", lambda: health(server)[1]["in_flight"] == 0, timeout=20)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert metric(server, "zlc_requests_total", api=api, outcome="cancelled") == cancelled + 1
    assert exchange(server, post(api, good(api))).status == 200
