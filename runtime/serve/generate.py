"""The HTTP generation path: a request body through its API's validation, the prompt encoder
(prompts.py: off the loop for a big prompt), the engine, and back to the client as SSE events or
one JSON body (HttpReply), in the API's own shapes, errors included.

Every request that reaches the engine ends with exactly one of: the whole reply, the API's error
body (before any byte of the reply), or the API's error event (once a stream has started); an
engine that is lost or a shutdown that runs out of time ends it the same way (EngineError
.UNAVAILABLE results from the supervisor), never with a silently cut stream.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from . import api_anthropic, api_openai
from .api_common import ApiError, GenerationSpec, fit_context
from .http import HttpConnection, HttpRequest
from .protocol import EngineError, ResultFlag
from .rings import Request
from .state import ServerState
from .textstream import TextStream


def error_response(conn: HttpConnection, api: str, e: ApiError, headers: bytes = b"") -> None:
    """The error as a whole response in `api`'s shape (OpenAI: 429 for overload), Retry-After included."""
    if e.retry_after is not None:
        headers += b"retry-after: %d\r\n" % e.retry_after
    if api == "openai":
        conn.respond(api_openai.status_of(e), api_openai.error_body(e), headers=headers)
    else:
        conn.respond(e.status, api_anthropic.error_body(e), headers=headers)


def engine_error(server: ServerState, code: int) -> ApiError:
    if code == EngineError.OVERLOADED:
        return ApiError("overloaded_error",
                        f"the server is overloaded ({server.engine.in_flight} requests waiting); retry later")
    if code == EngineError.BAD_REQUEST:
        return ApiError("invalid_request_error", "the model refused the prompt (see the server log)")
    if code == EngineError.UNAVAILABLE:
        return server.unavailable()
    return ApiError("api_error", "the engine failed while generating (see the server log)")


class HttpReply:
    """One generation request on its way back to an HTTP client."""

    __slots__ = ("server", "conn", "api", "reply", "spec", "text", "rid", "t0", "t_last", "produced", "started",
                 "done", "headers")

    def __init__(self, server: ServerState, conn: HttpConnection, api: str, reply: Any, spec: GenerationSpec, t0: int):
        self.server, self.conn, self.api, self.reply, self.spec = server, conn, api, reply, spec
        self.text = TextStream(server.tokenizer, spec.stop_sequences)
        self.rid = 0
        self.t0 = self.t_last = t0
        self.produced = 0
        self.started = False
        self.done = False
        self.headers = server.id_headers(reply.id)  # sent with the response head

    def cancel(self) -> None:  # the client went away
        if not self.done:
            self.done = True
            self.server.engine.cancel(self.rid)
            self.server.metrics.requests.labels(self.api, "cancelled").inc()

    def on_result(self, token: int, flags: int, t_ns: int) -> None:
        if self.done:
            return
        server, conn = self.server, self.conn
        if flags & ResultFlag.ERROR:
            self.fail(engine_error(server, token))
            return
        now = time.monotonic_ns()
        m = server.metrics
        mc = server.per_api[self.api]
        if self.produced == 0:
            mc.ttft.observe((now - self.t0) * 1e-9)
        else:
            mc.itl.observe((now - self.t_last) * 1e-9)
        self.t_last = now
        self.produced += 1
        m.tokens.inc()
        m.rate.add()
        piece = "" if flags & ResultFlag.EOS else self.text.feed(token)
        stream = self.spec.stream
        # Streams: the headers and message_start go out with the first token, in one write (one
        # syscall, one packet), and every later token in one write of its own.
        head = b""
        if stream and not self.started:
            self.started = True
            head = self.reply.stream_head()
        if self.text.stopped is not None:
            reason = "stop_sequence"
            if not flags & ResultFlag.LAST:
                server.engine.cancel(self.rid)
        elif flags & ResultFlag.LAST:
            reason = "eos" if flags & ResultFlag.EOS else "max_tokens"
            piece += self.text.finish()
            if self.text.stopped is not None:
                reason = "stop_sequence"
        else:
            if stream and (piece or head):
                conn.write_stream(head + (self.reply.stream_delta(piece) if piece else b""),
                                  headers=self.headers)
            return
        self.done = True
        conn.cancel_active = None
        mc.ok.inc()
        if stream:
            tail = self.reply.stream_delta(piece) if piece else b""
            conn.write_stream(head + tail + self.reply.stream_end(reason, self.text.stopped, self.produced),
                              end=True, headers=self.headers)
        else:
            conn.respond(200, self.reply.body(self.text.text, reason, self.text.stopped, self.produced),
                         headers=self.headers)

    def fail(self, e: ApiError) -> None:
        self.done = True
        self.conn.cancel_active = None
        self.server.metrics.requests.labels(self.api, e.kind).inc()
        if self.started:  # headers are out: the error goes in the stream
            self.conn.write_stream(self.reply.stream_error(e), end=True)
        else:
            error_response(self.conn, self.api, e)


class PendingPrompt:
    """A validated request while its prompt is tokenized (at once, or on a thread for a big one)."""

    def __init__(self, server: ServerState, conn: HttpConnection, api: str, spec: GenerationSpec, t0: int):
        self.server, self.conn, self.api, self.spec, self.t0 = server, conn, api, spec, t0
        self.cancelled = False
        server.tokenizing.add(self)

    def cancel(self) -> None:  # the client went away before its prompt was ready
        self.cancelled = True
        self.server.tokenizing.discard(self)

    def fail(self, e: ApiError) -> None:
        """Answers `e` now (the drain ran out before the prompt was ready); the encoding is dropped."""
        self.cancel()
        self.conn.cancel_active = None
        self.server.metrics.requests.labels(self.api, e.kind).inc()
        error_response(self.conn, self.api, e)

    def encoded(self, ids: list[int] | ApiError) -> None:
        server, conn, api, spec = self.server, self.conn, self.api, self.spec
        server.tokenizing.discard(self)
        if self.cancelled or conn.closed:
            return
        try:
            if isinstance(ids, ApiError):
                raise ids
            spec.prompt_ids = ids
            fit_context(spec, server.max_seq)
            server.check_accepting()
        except ApiError as e:
            conn.cancel_active = None
            server.metrics.requests.labels(api, e.kind).inc()
            return error_response(conn, api, e)
        n = len(spec.prompt_ids)
        reply: Any = (api_openai.Reply(server.model, n, spec.include_usage) if api == "openai"
                      else api_anthropic.Reply(server.model, n))
        handler = HttpReply(server, conn, api, reply, spec, self.t0)
        rid = handler.rid = server.engine.new_id()
        server.metrics.prompt_tokens.inc(n)
        if not server.engine.submit(Request(rid, spec.prompt_ids, spec.max_tokens, spec.temperature, spec.top_p,
                                            spec.seed), handler):
            return handler.fail(ApiError("overloaded_error", "the server is overloaded (request ring full); "
                                         "retry later") if server.engine.up else server.unavailable())
        conn.cancel_active = handler.cancel


def generate(server: ServerState, req: HttpRequest, conn: HttpConnection, api: str) -> None:
    """POST /v1/messages or /v1/chat/completions."""
    try:
        if not server.authorized(req):
            raise ApiError("authentication_error", "invalid x-api-key" if api == "anthropic"
                           else "Incorrect API key provided")
        server.check_accepting()
        if server.tokenizer is None:
            raise ApiError("invalid_request_error", "this bundle has no tokenizer (compile with --tokenizer); "
                           "send token ids as binary frames instead")
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            raise ApiError("invalid_request_error", f"the request body is not valid JSON: {e}") from None
        spec, prompt = (api_openai if api == "openai" else api_anthropic).parse(body, server.model)
    except ApiError as e:
        server.metrics.requests.labels(api, e.kind).inc()
        return error_response(conn, api, e)
    pending = PendingPrompt(server, conn, api, spec, req.t_ns)
    conn.cancel_active = pending.cancel
    server.encoder.prompt_ids(prompt, pending.encoded)
