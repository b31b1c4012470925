"""Bad HTTP requests against a real `zlc serve` subprocess over real sockets: malformed JSON, wrong
types, missing fields, empty messages, bad roles, unknown models and fields, refused features, a
prompt over the context, oversize bodies (Content-Length and chunked), slowloris-style partial
requests, oversize headers, garbage bytes, unknown routes and methods, API keys. Each gets its error
(or a closed connection) within a bounded time, and the server keeps serving others: after the bad
cases, and alongside them (a concurrent stream on another connection is not disturbed). Plus
HTTP/1.1 keep-alive and pipelining (answers in order).

Every wait is bounded by a socket timeout, so a hang fails the test instead of hanging CI."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from http_wire import PATHS, USER, Wire, check_error, exchange, good, http_request, post, without
from serve_helpers import sdk_clients

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "llama-chat"
MAX_SEQ = 128  # the chat bundle's context (conftest compiles it with max_seq=128)
REQUEST_TIMEOUT_S = 2.0  # the module `server` runs with --request-timeout 2
TIMEOUT_S = 10.0  # bound on any single socket wait


# --------------------------------------------------------------------------------------------------
# helpers (the raw HTTP client is http_wire.py)


def assert_serving(server: Any, **headers: str) -> None:
    """A good non-streaming request is answered normally."""
    r = exchange(server, post("anthropic", good(), headers))
    assert r.status == 200, r.body
    m = r.json()
    assert m["type"] == "message" and m["usage"]["output_tokens"] == 2


# --------------------------------------------------------------------------------------------------
# the JSON body


@pytest.mark.parametrize("api", ["anthropic", "openai"])
@pytest.mark.parametrize("raw", [b"{bad", b'{"model": "llama-chat",', b"", b"\xff\xfe\x00", b"null x"])
def test_malformed_json(server: Any, api: str, raw: bytes) -> None:
    err = check_error(api, exchange(server, post(api, raw)), 400)
    assert "not valid JSON" in err["message"]


@pytest.mark.parametrize("api", ["anthropic", "openai"])
@pytest.mark.parametrize("body", [[1, 2], "text", 3, None])
def test_body_not_an_object(server: Any, api: str, body: Any) -> None:
    check_error(api, exchange(server, post(api, body)), 400, mentions="JSON object")


@pytest.mark.parametrize("api", ["anthropic", "openai"])
@pytest.mark.parametrize(("field", "value"), [("max_tokens", "8"), ("max_tokens", 0), ("messages", "hi"),
                                              ("messages", {"role": "user"}), ("temperature", "hot"),
                                              ("stream", 1), ("model", 7), ("top_p", 3)])
def test_wrong_types(server: Any, api: str, field: str, value: Any) -> None:
    err = check_error(api, exchange(server, post(api, good(**{field: value}))), 400, mentions=field)
    if api == "openai":
        assert err["param"] == field


@pytest.mark.parametrize(("api", "field"), [("anthropic", "max_tokens"), ("anthropic", "messages"),
                                            ("anthropic", "model"), ("openai", "messages"),
                                            ("openai", "model")])
def test_missing_fields(server: Any, api: str, field: str) -> None:
    err = check_error(api, exchange(server, post(api, without(good(), field))), 400,
                      mentions=f"{field}: Field required")
    if api == "openai":
        assert err["param"] == field


@pytest.mark.parametrize("api", ["anthropic", "openai"])
@pytest.mark.parametrize("messages", [[], [{"role": "robot", "content": "hi"}], [{"role": "user"}], ["hi"],
                                      [{"role": "user", "content": [{"type": "image", "source": {}}]}]])
def test_bad_messages(server: Any, api: str, messages: list[Any]) -> None:
    check_error(api, exchange(server, post(api, good(messages=messages))), 400, mentions="messages")


def test_unknown_model(server: Any) -> None:
    a, o = sdk_clients(server, timeout=TIMEOUT_S)
    with pytest.raises(anthropic.NotFoundError) as ea:
        a.messages.create(model="claude-nope", max_tokens=2, messages=USER)
    assert ea.value.status_code == 404
    assert ea.value.body["type"] == "error" and ea.value.body["error"]["type"] == "not_found_error"
    assert "claude-nope" in ea.value.body["error"]["message"]
    with pytest.raises(openai.NotFoundError) as eo:
        o.chat.completions.create(model="gpt-nope", max_tokens=2, messages=USER)  # type: ignore[arg-type]
    assert eo.value.status_code == 404
    assert eo.value.code == "model_not_found" and eo.value.type == "invalid_request_error"
    assert eo.value.param == "model"


def test_unknown_extra_field_is_named(server: Any) -> None:
    a, o = sdk_clients(server, timeout=TIMEOUT_S)
    with pytest.raises(anthropic.BadRequestError) as ea:
        a.messages.create(model=MODEL, max_tokens=2, messages=USER, extra_body={"frobnicate": 1})
    assert ea.value.status_code == 400
    assert ea.value.body["error"]["type"] == "invalid_request_error"
    assert "frobnicate" in ea.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as eo:
        o.chat.completions.create(model=MODEL, max_tokens=2, messages=USER,  # type: ignore[arg-type]
                                  extra_body={"frobnicate": 1})
    assert eo.value.status_code == 400 and eo.value.param == "frobnicate"
    assert "frobnicate" in eo.value.message


FUNCTION = {"name": "get_time", "parameters": {"type": "object"}}


@pytest.mark.parametrize(("field", "kwargs"), [
    ("container", {"extra_body": {"container": "c"}}),
    ("thinking", {"thinking": {"type": "enabled", "budget_tokens": 1024}}),
])
def test_refused_feature_anthropic(server: Any, field: str, kwargs: dict[str, Any]) -> None:
    a, _ = sdk_clients(server, timeout=TIMEOUT_S)
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(model=MODEL, max_tokens=2, messages=USER, **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith(f"{field}: not supported")


@pytest.mark.parametrize(("field", "kwargs"), [("functions", {"extra_body": {"functions": [FUNCTION]}}),
                                               ("logit_bias", {"logit_bias": {"5": 1}})])
def test_refused_feature_openai(server: Any, field: str, kwargs: dict[str, Any]) -> None:
    _, o = sdk_clients(server, timeout=TIMEOUT_S)
    with pytest.raises(openai.BadRequestError) as e:
        o.chat.completions.create(model=MODEL, max_tokens=2, messages=USER,  # type: ignore[arg-type]
                                  **kwargs)
    assert e.value.status_code == 400 and e.value.param == field
    assert field in e.value.message


def test_prompt_over_the_context(server: Any) -> None:
    a, o = sdk_clients(server, timeout=TIMEOUT_S)
    long = [{"role": "user", "content": "x" * (2 * MAX_SEQ)}]  # byte-level: ~1 token per character
    with pytest.raises(anthropic.BadRequestError) as ea:
        a.messages.create(model=MODEL, max_tokens=2, messages=long)  # type: ignore[arg-type]
    assert ea.value.body["error"]["type"] == "invalid_request_error"
    assert "prompt is too long" in ea.value.body["error"]["message"]
    assert f"> {MAX_SEQ} maximum" in ea.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as eo:
        o.chat.completions.create(model=MODEL, max_tokens=2, messages=long)  # type: ignore[arg-type]
    assert eo.value.status_code == 400 and "prompt is too long" in eo.value.message
    # a long reply is clipped to the context instead of refused
    m = a.messages.create(model=MODEL, max_tokens=10_000, messages=[{"role": "user", "content": "x" * 100}])
    assert m.stop_reason in ("max_tokens", "end_turn")
    assert m.usage.input_tokens + m.usage.output_tokens <= MAX_SEQ + 1
    assert_serving(server)


# --------------------------------------------------------------------------------------------------
# routes and methods


@pytest.mark.parametrize(("method", "path"), [("GET", "/nope"), ("POST", "/v1/complete"),
                                              ("GET", "/v1/models/other"), ("POST", "/v2/messages")])
def test_unknown_path_404(server: Any, method: str, path: str) -> None:
    body = b"{}" if method == "POST" else None
    r = exchange(server, http_request(method, path, body, {"anthropic-version": "2023-06-01"}))
    check_error("anthropic", r, 404, "not_found_error", mentions=path)
    r = exchange(server, http_request(method, path, body))
    check_error("openai", r, 404, "invalid_request_error")


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_wrong_method_405(server: Any, api: str, method: str) -> None:
    check_error(api, exchange(server, http_request(method, PATHS[api])), 405)


# --------------------------------------------------------------------------------------------------
# the HTTP layer: garbage, oversize headers, slow clients


@pytest.mark.parametrize("garbage", [
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(64),  # a TLS client hello
    b"HELLO\r\n\r\n",
    b"GET / SPDY/3\r\n\r\n",
    b"\x00" * 100,
    b"POST /v1/messages HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
    b"POST /v1/messages HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
])
def test_garbage_bytes_400_then_closed(server: Any, garbage: bytes) -> None:
    with Wire(server) as w:
        w.send(garbage)
        r = w.response()
        check_error("anthropic", r, 400)
        assert r.headers.get("connection") == "close"
        assert w.closed_within(2.0)
    assert_serving(server)


def test_headers_too_large_431(server: Any) -> None:
    many = {f"x-filler-{i}": "a" * 1000 for i in range(40)}  # 40 KB > the 32 KiB limit
    with Wire(server) as w:
        w.send(http_request("GET", "/health", None, many))
        r = w.response()
        check_error("anthropic", r, 431, "request_too_large", mentions="headers")
        assert w.closed_within(2.0)
    long_url = "/health?" + "q" * 40_000
    with Wire(server) as w:
        w.send(http_request("GET", long_url))
        check_error("anthropic", w.response(), 431, "request_too_large")
    assert_serving(server)


def test_unterminated_header_over_the_limit_431(server: Any) -> None:
    """A header line longer than the limit that never ends is refused as soon as the limit is
    passed, not buffered until the request deadline (which at loopback speed is hundreds of MB)."""
    with Wire(server) as w:
        t0 = time.monotonic()
        try:
            w.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Filler: " + b"a" * 256 * 1024)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before it was all sent: the answer is still there to read
        r = w.response()
        took = time.monotonic() - t0
    check_error("anthropic", r, 431, "request_too_large")
    assert took < REQUEST_TIMEOUT_S / 2, f"431 after {took:.2f} s"
    assert_serving(server)


def test_slow_clients_time_out_and_others_are_served(server: Any) -> None:
    """Slowloris: partial headers, a body that stalls, a chunked body that stalls; each gets 408 and
    a close at the request deadline (2 s), while a good request in the meantime is served at once."""
    body = json.dumps(good()).encode()
    stalls = {
        "half headers": b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Le",
        "request line only": b"GET /health HTTP/1.1\r\n",
        "body stalls": post("anthropic", body)[:-5],
        "chunked body stalls": http_request("POST", PATHS["openai"], body, chunked=True)[:-20],
    }
    wires = {}
    try:
        t0 = time.monotonic()
        for name, data in stalls.items():
            wires[name] = w = Wire(server)
            w.send(data)
        crowd = []
        for i in range(24):  # more idle half-requests
            wires[f"crowd {i}"] = c = Wire(server)
            c.send(b"POST /v1/messages HTTP/1.1\r\nHo")
            crowd.append(c)
        t_good = time.monotonic()
        assert_serving(server)
        assert time.monotonic() - t_good < REQUEST_TIMEOUT_S, "a good request waited behind slow ones"
        for name in stalls:
            w = wires[name]
            r = w.response()
            took = time.monotonic() - t0
            check_error("anthropic", r, 408, "timeout_error")
            assert r.headers.get("connection") == "close", name
            assert w.closed_within(1.0), name
            assert REQUEST_TIMEOUT_S - 0.2 < took < REQUEST_TIMEOUT_S + 2.0, (name, took)
        for c in crowd:
            assert c.response().status == 408
            assert c.closed_within(1.0)
    finally:
        for w in wires.values():
            w.sock.close()
    assert_serving(server)


def test_request_deadline_covers_a_keep_alive_connection(server: Any) -> None:
    """After a complete exchange on a keep-alive connection, a second request that stalls still
    meets the deadline."""
    with Wire(server) as w:
        w.send(http_request("GET", "/health"))
        assert w.response().status == 200
        t0 = time.monotonic()
        w.send(b"GET /health HTTP/1.1\r\nHo")
        r = w.response()
        assert r.status == 408
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_S + 2.0
        assert w.closed_within(1.0)


# --------------------------------------------------------------------------------------------------
# keep-alive, pipelining, isolation


def test_keep_alive_two_requests_one_connection(server: Any) -> None:
    with Wire(server) as w:
        w.send(post("anthropic", good()))
        r1 = w.response()
        w.send(post("anthropic", b"{bad"))
        r2 = w.response()
        w.send(post("openai", good(temperature=0)))
        r3 = w.response()
        w.send(http_request("GET", "/health"))
        r4 = w.response()
    assert r1.status == 200 and r1.json()["type"] == "message"
    check_error("anthropic", r2, 400)  # an API error keeps the connection
    assert r3.status == 200 and r3.json()["object"] == "chat.completion"
    assert r4.status == 200 and r4.json()["status"] == "ok"
    assert "close" not in (r1.headers.get("connection"), r2.headers.get("connection"))


def test_pipelining_answers_in_order(server: Any) -> None:
    with Wire(server) as w:
        w.send(post("anthropic", good(max_tokens=3)) + post("anthropic", b"{bad")
               + http_request("GET", "/nope") + post("openai", good(temperature=0))
               + http_request("GET", "/health") + post("anthropic", good(stream=True)))
        rs = [w.response() for _ in range(6)]
    assert rs[0].status == 200 and rs[0].json()["usage"]["output_tokens"] == 3
    check_error("anthropic", rs[1], 400)
    check_error("openai", rs[2], 404)
    assert rs[3].status == 200 and rs[3].json()["id"].startswith("chatcmpl-")
    assert rs[4].status == 200 and rs[4].json()["status"] == "ok"
    assert rs[5].status == 200 and rs[5].headers["content-type"] == "text/event-stream"
    assert rs[5].body.rstrip().endswith(b'event: message_stop\ndata: {"type":"message_stop"}')


def test_pipelined_garbage_after_a_good_request(server: Any) -> None:
    """The good request pipelined before the garbage gets its answer first; then the 400 and the
    close (an error must not overtake, nor erase, the answer to an earlier request)."""
    with Wire(server) as w:
        w.send(post("anthropic", good(max_tokens=3)) + b"\x00\x01 garbage \r\n\r\n")
        r1 = w.response()
        assert r1.status == 200, r1.body
        assert r1.json()["usage"]["output_tokens"] == 3
        r2 = w.response()
        check_error("anthropic", r2, 400)
        assert w.closed_within(2.0)


def test_bad_requests_do_not_disturb_a_concurrent_stream(server: Any) -> None:
    a, _ = sdk_clients(server, timeout=TIMEOUT_S)
    want = a.messages.create(model=MODEL, max_tokens=24, messages=USER).content[0].text
    bad = [post("anthropic", b"{bad"), post("openai", good(messages="x")),
           post("anthropic", good(model="nope")), b"\x16\x03\x01garbage\r\n\r\n",
           http_request("GET", "/v1/messages"),
           post("anthropic", good(messages=[{"role": "user", "content": "x" * 300}]))]
    pieces = []
    with a.messages.stream(model=MODEL, max_tokens=24, messages=USER) as s:
        it = iter(s.text_stream)
        pieces.append(next(it))
        statuses = [exchange(server, b).status for b in bad]
        with Wire(server) as stall:  # and a half request left hanging
            stall.send(b"POST /v1/messages HTTP/1.1\r\nCont")
            pieces.extend(it)
        final = s.get_final_message()
    assert statuses == [400, 400, 404, 400, 405, 400]
    assert "".join(pieces) == want
    assert final.usage.output_tokens == 24 or final.stop_reason == "end_turn"


# --------------------------------------------------------------------------------------------------
# options that need their own server


def test_oversize_body_413(start_server: Any) -> None:
    s = start_server("--device", "reference", "--max-body", "4096")
    big = json.dumps(good(messages=[{"role": "user", "content": "y" * 6000}])).encode()
    for api in ("anthropic", "openai"):
        # Content-Length over the limit: refused from the headers, before the body arrives
        with Wire(s) as w:
            head = post(api, big)
            w.send(head[:head.index(b"\r\n\r\n") + 4])
            t0 = time.monotonic()
            r = w.response()
            assert time.monotonic() - t0 < 1.0
            # (the HTTP layer answers in the Anthropic shape on both paths)
            check_error("anthropic", r, 413, "request_too_large", mentions="4096")
            assert w.closed_within(2.0)
        # the whole body sent anyway
        with Wire(s) as w:
            w.send(post(api, big))
            check_error("anthropic", w.response(), 413, "request_too_large")
        # chunked: no length up front; refused once the chunks pass the limit
        with Wire(s) as w:
            w.send(http_request("POST", PATHS[api], big, chunked=True))
            r = w.response()
            check_error("anthropic", r, 413, "request_too_large")
            assert r.headers.get("connection") == "close"
            assert w.closed_within(2.0)
    # under the limit: through to the API (chunked too), which then refuses the long prompt itself
    near = json.dumps(good(messages=[{"role": "user", "content": "y" * 3000}])).encode()
    check_error("anthropic", exchange(s, post("anthropic", near)), 400, mentions="prompt is too long")
    check_error("openai", exchange(s, http_request("POST", PATHS["openai"], near, chunked=True)), 400,
                mentions="prompt is too long")
    r = exchange(s, http_request("POST", PATHS["anthropic"], json.dumps(good()).encode(), chunked=True))
    assert r.status == 200 and r.json()["type"] == "message"
    assert_serving(s)


def test_api_key(start_server: Any) -> None:
    s = start_server("--device", "reference", "--api-key", "secret")
    for key in ("wrong", "secret2"):
        a, o = sdk_clients(s, key=key, timeout=TIMEOUT_S)
        with pytest.raises(anthropic.AuthenticationError) as ea:  # the SDK sends x-api-key
            a.messages.create(model=MODEL, max_tokens=2, messages=USER)
        assert ea.value.status_code == 401
        assert ea.value.body["type"] == "error" and ea.value.body["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError) as eo:  # ... and OpenAI's Authorization: Bearer
            o.chat.completions.create(model=MODEL, max_tokens=2, messages=USER)  # type: ignore[arg-type]
        assert eo.value.status_code == 401 and eo.value.code == "invalid_api_key"
    # no key at all, and the key in the wrong scheme; the key is checked before anything else
    for headers in ({}, {"authorization": "Basic secret"}, {"x-api-key": "secre"}, {"x-api-key": "secret2"}):
        for api in ("anthropic", "openai"):
            r = exchange(s, post(api, good(model="other"), headers))
            if api == "anthropic":
                check_error(api, r, 401, "authentication_error")
            else:
                assert check_error(api, r, 401, "invalid_request_error")["code"] == "invalid_api_key"
    r = exchange(s, http_request("GET", "/v1/models", None, {"anthropic-version": "2023-06-01"}))
    check_error("anthropic", r, 401, "authentication_error")
    # /health stays open
    r = exchange(s, http_request("GET", "/health"))
    assert r.status == 200 and r.json()["status"] == "ok"
    # the right key works, both ways of sending it
    a, o = sdk_clients(s, key="secret", timeout=TIMEOUT_S)
    assert a.messages.create(model=MODEL, max_tokens=2, messages=USER).usage.output_tokens == 2
    c = o.chat.completions.create(model=MODEL, max_tokens=2, messages=USER)  # type: ignore[arg-type]
    assert c.usage is not None and c.usage.completion_tokens == 2
    assert_serving(s, **{"x-api-key": "secret"})
    assert_serving(s, authorization="Bearer secret")
