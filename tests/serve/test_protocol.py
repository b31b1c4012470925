"""What HTTP/1.1 asks of a server beyond parsing, against a real `zlc serve` over real sockets:
`Expect: 100-continue` gets its 100 (after the answers owed to earlier pipelined requests, never in
the middle of one), other expectations 417; an `Upgrade` request gets exactly one response (served
as plain HTTP) and the connection closes; transfer codings other than a lone `chunked` get 501.
And the inputs the API accepts that used to answer 500: `top_p` 0, negative or huge seeds, a
`role` that is not a string, a multi-megabyte prompt (refused before tokenizing)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from http_wire import MODEL, PATHS, Wire, check_error, exchange, good, http_request, post
from serve_helpers import anthropic_client, openai_client

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")


def head_of(data: bytes) -> bytes:
    return data[:data.index(b"\r\n\r\n") + 4]


# --------------------------------------------------------------------------------------------------
# Expect


def test_expect_100_continue(server: Any) -> None:
    body = json.dumps(good()).encode()
    req = post("anthropic", body, {"Expect": "100-continue"})
    with Wire(server) as w:
        w.send(head_of(req))
        assert w.until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue"
        w.send(body)
        r = w.response()
    assert r.status == 200 and r.json()["type"] == "message"


def test_expect_100_continue_waits_for_earlier_answers(server: Any) -> None:
    """Pipelined behind a stream: the 100 comes after the stream's last chunk, not inside it."""
    stream = post("anthropic", good(stream=True, max_tokens=30))
    body = json.dumps(good()).encode()
    with Wire(server) as w:
        w.send(stream + head_of(post("anthropic", body, {"Expect": "100-continue"})))
        first = w.response()
        assert first.status == 200 and first.body.rstrip().endswith(b'data: {"type":"message_stop"}')
        assert w.until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue"
        w.send(body)
        assert w.response().status == 200


def test_other_expectations_417(server: Any) -> None:
    with Wire(server) as w:
        w.send(post("anthropic", good(), {"Expect": "something-else"}))
        check_error("anthropic", w.response(), 417)
        assert w.closed_within(2.0)


# --------------------------------------------------------------------------------------------------
# Upgrade


@pytest.mark.parametrize("upgrade", [{"Upgrade": "h2c", "Connection": "Upgrade, HTTP2-Settings",
                                      "HTTP2-Settings": "AAMAAABkAARAAAAAAAIAAAAA"},
                                     {"Upgrade": "websocket", "Connection": "Upgrade"}], ids=["h2c", "websocket"])
def test_upgrade_gets_one_response(server: Any, upgrade: dict[str, str]) -> None:
    for request in (http_request("GET", "/health", None, upgrade), post("anthropic", good(), upgrade)):
        with Wire(server) as w:
            w.send(request + http_request("GET", "/health"))  # what follows is not HTTP to us any more
            r = w.response()
            assert r.status == 200 and r.headers.get("connection") == "close", r
            assert w.closed_within(2.0)
            assert not w.buf, f"a second response: {bytes(w.buf)!r}"


# --------------------------------------------------------------------------------------------------
# Transfer-Encoding


@pytest.mark.parametrize("codings", [["gzip, chunked"], ["gzip", "chunked"], ["deflate,chunked"]],
                         ids=["one header", "two headers", "no space"])
def test_unsupported_transfer_coding_501(server: Any, codings: list[str]) -> None:
    body = json.dumps(good()).encode()
    te = "".join(f"Transfer-Encoding: {c}\r\n" for c in codings)
    data = (f"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{te}\r\n".encode()
            + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body))
    with Wire(server) as w:
        w.send(data)
        r = w.response()
        check_error("anthropic", r, 501, mentions="not supported")
        assert r.headers.get("connection") == "close" and w.closed_within(2.0)


def test_plain_chunked_still_works(server: Any) -> None:
    r = exchange(server, http_request("POST", PATHS["openai"], json.dumps(good()).encode(), chunked=True))
    assert r.status == 200 and r.json()["object"] == "chat.completion"


# --------------------------------------------------------------------------------------------------
# inputs the API accepts


def test_top_p_0_is_greedy(server: Any) -> None:
    a = anthropic_client(server, timeout=30)
    greedy = a.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    m = a.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                          extra_body={"temperature": 1, "top_p": 0})  # (not arguments of the 2.x SDK)
    assert m.content[0].text == greedy.content[0].text  # (temperature 1, top_p 0: the top token each step)


@pytest.mark.parametrize(("seed", "status"), [(-1, 200), (-2**63, 200), (2**63 - 1, 200), (2**63, 400),
                                              (-2**63 - 1, 400)])
def test_openai_seeds(server: Any, seed: int, status: int) -> None:
    r = exchange(server, post("openai", good(seed=seed, temperature=1)))
    if status == 200:
        assert r.status == 200 and r.json()["object"] == "chat.completion", r.body
    else:
        check_error("openai", r, 400, mentions="seed")


def test_openai_negative_seed_is_a_seed(server: Any) -> None:
    o = openai_client(server, timeout=30)

    def text(seed: int) -> str:
        c = o.chat.completions.create(model=MODEL, max_tokens=8, seed=seed, temperature=1,
                                      messages=[{"role": "user", "content": "hi"}])
        return c.choices[0].message.content or ""

    assert text(-1) == text(-1)  # the same seed, the same sample


@pytest.mark.parametrize("api", ["anthropic", "openai"])
@pytest.mark.parametrize("role", [{}, [], 1, None, True])
def test_role_of_any_type_is_a_400(server: Any, api: str, role: Any) -> None:
    check_error(api, exchange(server, post(api, good(messages=[{"role": role, "content": "hi"}]))), 400,
                mentions="role")


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_megabytes_of_prompt_are_refused_before_tokenizing(server: Any, api: str) -> None:
    big = "x" * 3_900_000
    with Wire(server, timeout=60) as w:
        w.send(post(api, good(messages=[{"role": "user", "content": big}])))
        check_error(api, w.response(), 400, mentions="prompt is too long")


def test_big_prompts_are_tokenized_off_the_loop(chat_bundle: Path) -> None:
    """The encoder hands a prompt over 64 KiB to a thread that runs without the GIL: the loop keeps
    turning meanwhile (counted in loop turns, not seconds), and the ids are the bundle tokenizer's."""
    import zlc
    from zlc.runtime.serve.ingress.api_common import ChatPrompt
    from zlc.runtime.serve.ingress.prompts import THREAD_BYTES, PromptEncoder

    tok = zlc.load(chat_bundle).tokenizer
    enc = PromptEncoder(tok, max_seq=10**9)  # a context big enough that nothing is refused
    chat = [{"role": "user", "content": "hello there, " * 60_000}]
    assert len(chat[0]["content"]) > 10 * THREAD_BYTES

    async def run() -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        got: asyncio.Future[Any] = loop.create_future()
        turns = 0
        enc.prompt_ids(ChatPrompt(chat), got.set_result)
        assert not got.done()  # not encoded inline
        while not got.done():
            turns += 1
            await asyncio.sleep(0)
        return got.result(), turns

    t0 = time.monotonic()
    ids, turns = asyncio.run(run())
    took = time.monotonic() - t0
    assert ids == tok.encode_chat(chat)
    assert turns > 100, f"the loop turned {turns} times in {took:.2f} s of encoding"
