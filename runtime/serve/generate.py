"""The HTTP generation path: one request from its body to the end of its reply. The route has
chosen the request's API (api_common.Api); the body goes through that API's validation, the prompt
encoder (prompts.py: off the loop for a big prompt), the engine, and back to the client as SSE
events or one JSON body (HttpGeneration), in the API's own shapes, errors included.

Every request that reaches the engine ends with exactly one of: the whole reply, the API's error
body (before any byte of the reply), or the API's error event (once a stream has started); an
engine that is lost or a shutdown that runs out of time ends it the same way (EngineError
.UNAVAILABLE results from the supervisor), never with a silently cut stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson

from .api_common import Api, ApiError, GenerationSpec, Reply, fit_context
from .http import HttpConnection, HttpRequest
from .protocol import EngineError, RequestFlag, ResultFlag
from .rings import Request
from .state import ServerState
from .textstream import TextStream


def error_response(conn: HttpConnection, api: Api, e: ApiError, headers: bytes = b"") -> None:
    """The error as a whole response in `api`'s shape, Retry-After included."""
    if e.retry_after is not None:
        headers += b"retry-after: %d\r\n" % e.retry_after
    conn.respond(api.status(e), api.error_body(e), headers=headers)


def engine_error(server: ServerState, code: int) -> ApiError:
    if code == EngineError.OVERLOADED:
        return ApiError("overloaded_error",
                        f"the server is overloaded ({server.engine.in_flight} requests waiting); retry later")
    if code == EngineError.BAD_REQUEST:
        return ApiError("invalid_request_error", "the model refused the prompt (see the server log)")
    if code == EngineError.KV_BUDGET:
        pages = server.engine.kv_pages()
        return ApiError("invalid_request_error", f"prompt is too long for the engine's whole KV cache budget "
                        f"(--kv-pages {pages}); send a shorter prompt or raise --kv-pages")
    if code == EngineError.UNAVAILABLE:
        return server.unavailable()
    return ApiError("api_error", "the engine failed while generating (see the server log)")


class HttpGeneration:
    """One generation request while its prompt is tokenized (at once, or on a thread for a big one,
    listed in ``server.tokenizing`` meanwhile) and then while the engine produces its reply.

    It alone ends the request: ``done`` is set once, by the reply's end, ``fail`` or ``cancel`` (the
    client went away: the connection calls it, generate() having handed it over), and every later
    event (a result, the prompt's ids) asks ``done`` and is dropped."""

    __slots__ = ("server", "conn", "api", "spec", "reply", "text", "rid", "t0", "t_last", "produced",
                 "started", "done", "headers")
    reply: Reply  # made once the prompt's length is known (encoded); results come only after that

    def __init__(self, server: ServerState, conn: HttpConnection, api: Api, spec: GenerationSpec, t0: int):
        self.server, self.conn, self.api, self.spec = server, conn, api, spec
        self.text = TextStream(server.tokenizer, spec.stop_sequences)
        self.rid = 0  # the engine's id, once submitted
        self.t0 = self.t_last = t0
        self.produced = 0
        self.started = False
        self.done = False
        self.headers = b""  # the request-id headers, sent with the response head
        server.tokenizing.add(self)

    def cancel(self) -> None:
        """The client went away: the prompt is dropped, or the engine frees the request's slot."""
        if self.done:
            return
        self.done = True
        self.server.tokenizing.discard(self)
        if self.rid:
            self.server.engine.cancel(self.rid)
            self.server.metrics.requests.labels(self.api.name, "cancelled").inc()

    def fail(self, e: ApiError) -> None:
        """Ends the request with `e`: its body, or its event once the stream has started."""
        if self.done:
            return
        self.done = True
        self.server.tokenizing.discard(self)
        self.server.metrics.requests.labels(self.api.name, e.kind).inc()
        if self.started:  # headers are out: the error goes in the stream
            self.conn.write_stream(self.api.stream_error(e), end=True)
        else:
            error_response(self.conn, self.api, e)

    def encoded(self, ids: list[int] | ApiError) -> None:
        """The prompt's ids (or why there are none): the request goes to the engine."""
        server, spec = self.server, self.spec
        server.tokenizing.discard(self)
        if self.done or self.conn.closed:
            return
        try:
            if isinstance(ids, ApiError):
                raise ids
            spec.prompt_ids = ids
            fit_context(spec, server.max_seq)
            server.check_accepting()
        except ApiError as e:
            return self.fail(e)
        self.reply = self.api.reply(server.model, spec)
        self.headers = server.id_headers(self.reply.id)
        rid = self.rid = server.engine.new_id()
        server.metrics.prompt_tokens.inc(len(spec.prompt_ids))
        request = Request(rid, spec.prompt_ids, spec.max_tokens, spec.temperature, spec.top_p, spec.seed,
                          RequestFlag.LOGPROBS if spec.logprobs else 0, spec.top_k, spec.frequency_penalty,
                          spec.presence_penalty, spec.top_logprobs)
        if not server.engine.submit(request, self):
            self.fail(ApiError("overloaded_error", "the server is overloaded (request ring full); retry "
                               "later") if server.engine.up else server.unavailable())

    def on_result(self, token: int, flags: int, t_ns: int) -> None:
        if self.done:
            return
        server, conn = self.server, self.conn
        if flags & ResultFlag.ERROR:
            self.fail(engine_error(server, token))
            return
        now = time.monotonic_ns()
        m = server.metrics
        mc = server.per_api[self.api.name]
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
        mc.ok.inc()
        if stream:
            tail = self.reply.stream_delta(piece) if piece else b""
            conn.write_stream(head + tail + self.reply.stream_end(reason, self.text.stopped, self.produced),
                              end=True, headers=self.headers)
        else:
            conn.respond(200, self.reply.body(self.text.text, reason, self.text.stopped, self.produced),
                         headers=self.headers)


def generate(server: ServerState, req: HttpRequest, conn: HttpConnection,
             api: Api) -> Callable[[], None] | None:
    """POST /v1/messages or /v1/chat/completions in `api`. Returns what to call if the client goes
    away before its answer is complete (None when it is answered already)."""
    try:
        if not server.authorized(req):
            raise ApiError("authentication_error", api.bad_key)
        server.check_accepting()
        if server.tokenizer is None:
            raise ApiError("invalid_request_error", "this bundle has no tokenizer (compile with --tokenizer); "
                           "send token ids as binary frames instead")
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            raise ApiError("invalid_request_error", f"the request body is not valid JSON: {e}") from None
        spec, prompt = api.parse(body, server.model)
    except ApiError as e:
        server.metrics.requests.labels(api.name, e.kind).inc()
        error_response(conn, api, e)
        return None
    generation = HttpGeneration(server, conn, api, spec, req.t_ns)
    server.encoder.prompt_ids(prompt, generation.encoded)
    return generation.cancel
