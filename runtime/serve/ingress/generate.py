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

from ..constraints import GrammarError
from ..protocol import EngineError, RequestFlag, ResultFlag
from ..rings import Request
from .api_common import Api, ApiError, GenerationSpec, Outcome, Reply, TokenLogprob, fit_context, invalid
from .http import HttpConnection, HttpRequest
from .state import ServerState
from .textstream import TextStream


def error_response(conn: HttpConnection, api: Api, e: ApiError, headers: bytes = b"") -> None:
    """The error as a whole response in `api`'s shape, Retry-After included."""
    if e.retry_after is not None:
        headers += b"retry-after: %d\r\n" % e.retry_after
    conn.respond(api.status(e), api.error_body(e), headers=headers)


def overloaded(server: ServerState) -> ApiError:
    """The 529 (Anthropic) / 429 (OpenAI) with Retry-After: every engine holds its capacity."""
    return ApiError("overloaded_error", f"the server is overloaded ({server.engine.in_flight} requests in flight, "
                    f"capacity {server.engine.capacity}: --max-batch + --max-queue per engine); retry later")


def engine_error(server: ServerState, code: int) -> ApiError:
    if code == EngineError.OVERLOADED:
        return overloaded(server)
    if code == EngineError.BAD_REQUEST:
        return ApiError("invalid_request_error", "the model refused the prompt (see the server log)")
    if code == EngineError.KV_BUDGET:
        pages = server.engine.kv_pages()
        return ApiError("invalid_request_error", f"prompt is too long for the engine's whole KV cache budget "
                        f"(--kv-pages {pages}); send a shorter prompt or raise --kv-pages")
    if code == EngineError.UNAVAILABLE:
        return server.unavailable()
    if code == EngineError.GRAMMAR:
        return ApiError("api_error", "constrained decoding failed in the engine: the output grammar did not compile "
                        "there or its matcher failed (see the server log)")
    return ApiError("api_error", "the engine failed while generating (see the server log)")


class _Choice:
    """One choice of a reply: its engine request (the results of `rid` come here), its text and,
    when asked, its tokens' logprobs."""

    __slots__ = ("gen", "index", "rid", "text", "produced", "done", "outcome", "alts", "logprobs", "sent",
                 "prompt_logprobs", "echoed")

    def __init__(self, gen: HttpGeneration, index: int):
        self.gen, self.index = gen, index
        self.rid = 0  # the engine's id, once submitted
        self.text = TextStream(gen.server.tokenizer, gen.spec.stop_sequences)
        self.produced = 0
        self.done = False
        self.outcome: Outcome | None = None
        self.alts: list[tuple[str, float]] = []  # TOP results before the next token's own
        self.logprobs: list[TokenLogprob] | None = [] if gen.spec.logprobs else None
        self.sent = 0  # logprobs entries already streamed
        self.prompt_logprobs: list[TokenLogprob] | None = None
        self.echoed = False  # echo: the prompt went out as this choice's first stream event

    def on_result(self, token: int, flags: int, t_ns: int, logprob: float = 0.0) -> None:
        self.gen.on_result(self, token, flags, logprob)

    def unsent(self) -> list[TokenLogprob] | None:
        """The logprobs entries not streamed yet (they go with the next event)."""
        if self.logprobs is None:
            return None
        out, self.sent = self.logprobs[self.sent:], len(self.logprobs)
        return out


class HttpGeneration:
    """One generation request while its prompt is tokenized (at once, or on a thread for a big one,
    listed in ``server.tokenizing`` meanwhile) and then while the engine produces its reply: one
    engine request per choice (spec.n). Choice 0 goes first; the others once its first result is
    back, when its prompt's pages are in the prefix cache, so n choices cost one prefill.

    It alone ends the request: ``done`` is set once, by the reply's end, ``fail`` or ``cancel`` (the
    client went away: the connection calls it, generate() having handed it over), and every later
    event (a result, the prompt's ids) asks ``done`` and is dropped."""

    __slots__ = ("server", "conn", "api", "spec", "reply", "rid", "t0", "t_last", "produced", "started", "done",
                 "headers", "choices", "prompt_text", "_token_text")
    reply: Reply  # made once the prompt's length is known (encoded); results come only after that

    def __init__(self, server: ServerState, conn: HttpConnection, api: Api, spec: GenerationSpec, t0: int,
                 prompt_text: str | None = None):
        self.server, self.conn, self.api, self.spec = server, conn, api, spec
        self.choices = [_Choice(self, i) for i in range(spec.n)]
        self.rid = 0  # the first choice's engine id, once submitted
        self.t0 = self.t_last = t0
        self.produced = 0  # tokens of all choices
        self.started = False
        self.done = False
        self.headers = b""  # the request-id headers, sent with the response head
        self.prompt_text = prompt_text  # echo: the prompt as the client sent it (None: decoded from the ids)
        self._token_text: dict[int, str] = {}
        server.tokenizing.add(self)

    def cancel(self) -> None:
        """The client went away: the prompt is dropped, or the engine frees the request's slots."""
        if self.done:
            return
        self.done = True
        self.server.tokenizing.discard(self)
        if self.rid:
            for c in self.choices:
                if c.rid and not c.done:
                    self.server.engine.cancel(c.rid)
            self.server.metrics.requests.labels(self.api.name, "cancelled").inc()

    def fail(self, e: ApiError) -> None:
        """Ends the request with `e`: its body, or its event once the stream has started (the
        choices still running are cancelled)."""
        if self.done:
            return
        self.done = True
        self.server.tokenizing.discard(self)
        for c in self.choices:
            if c.rid and not c.done:
                self.server.engine.cancel(c.rid)
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
            if spec.tools is not None and spec.tools.grammar is not None:
                # a forced call: its grammar is known once prompts.py has rendered the template's format
                spec.grammar, spec.grammar_param = spec.tools.grammar, "tool_choice"
                check_grammar(server, spec)
        except ApiError as e:
            return self.fail(e)
        if spec.tools is not None:
            if spec.tools.offered and spec.tools.fmt == "mistral":  # [TOOL_CALLS] is a special token
                for c in self.choices:
                    c.text = TextStream(server.tokenizer, spec.stop_sequences, skip_special_tokens=False)
        self.reply = self.api.reply(server.model, spec)
        self.headers = server.id_headers(self.reply.id)
        server.metrics.prompt_tokens.inc(len(spec.prompt_ids))
        self._submit(self.choices[0])
        self.rid = self.choices[0].rid

    def _submit(self, choice: _Choice) -> bool:
        """Sends one choice's request (seed + index: n choices equal n requests with those seeds)."""
        server, spec = self.server, self.spec
        rid = choice.rid = server.engine.new_id()
        flags = (RequestFlag.LOGPROBS if spec.logprobs else 0) | (RequestFlag.PROMPT_LOGPROBS if spec.echo and
                                                                  spec.logprobs else 0)
        request = Request(rid, spec.prompt_ids, spec.max_tokens, spec.temperature, spec.top_p,
                          (spec.seed + choice.index) % 2**64, flags, spec.top_k, spec.frequency_penalty,
                          spec.presence_penalty, spec.top_logprobs, spec.grammar)
        if not server.engine.submit(request, choice):
            self.fail(overloaded(server) if server.engine.up else server.unavailable())
            return False
        return True

    def token_text(self, token: int) -> str:
        """A token's own text for logprobs (special tokens spelled out; cached per reply)."""
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.server.tokenizer.decode([token], skip_special_tokens=False)
        return text

    def on_result(self, choice: _Choice, token: int, flags: int, logprob: float) -> None:
        if self.done or choice.done:
            return
        server, conn = self.server, self.conn
        if flags & ResultFlag.ERROR:
            self.fail(engine_error(server, token))
            return
        if choice.index == 0 and len(self.choices) > 1 and not self.choices[1].rid:
            # choice 0's prompt is in the KV cache now: the others find its pages there
            for c in self.choices[1:]:
                if not self._submit(c):
                    return
        if flags & ResultFlag.TOP:
            choice.alts.append((self.token_text(token), logprob))
            return
        if flags & ResultFlag.PROMPT:
            self._prompt_entries(choice).append(TokenLogprob(self.token_text(token), logprob, choice.alts))
            choice.alts = []
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
        choice.produced += 1
        m.tokens.inc()
        m.rate.add()
        eos = bool(flags & ResultFlag.EOS)
        if choice.logprobs is not None and not eos and choice.text.stopped is None:
            choice.logprobs.append(TokenLogprob(self.token_text(token), logprob, choice.alts))
        choice.alts = []
        text = choice.text
        piece = "" if eos else text.feed(token)
        stream = self.spec.stream
        # Streams: the headers and the head go out with the first token, in one write (one syscall,
        # one packet), and every later token in one write of its own.
        head = b""
        if stream and not self.started:
            self.started = True
            head = self.reply.stream_head()
        if stream and self.spec.echo and not choice.echoed:
            choice.echoed = True
            head += self.reply.stream_delta(self._prompt_text(), choice.index,
                                            self._prompt_entries(choice) if choice.logprobs is not None else None)
        if text.stopped is not None:
            reason = "stop_sequence"
            if not flags & ResultFlag.LAST:
                server.engine.cancel(choice.rid)
        elif flags & ResultFlag.LAST:
            # COMPLETE: the grammar is complete (constrained decoding), an end as at end-of-sequence
            reason = "eos" if eos or flags & ResultFlag.COMPLETE else "max_tokens"
            piece += text.finish()
            if text.stopped is not None:
                reason = "stop_sequence"
        else:
            if stream and (piece or head):
                conn.write_stream(head + (self.reply.stream_delta(piece, choice.index, choice.unsent())
                                          if piece else b""), headers=self.headers)
            return
        choice.done = True
        last = all(c.done for c in self.choices)
        if last:
            self.done = True
            server.per_api[self.api.name].ok.inc()
        if stream:
            tail = self.reply.stream_delta(piece, choice.index, choice.unsent()) if piece else b""
            outcome = Outcome(text.text, reason, text.stopped, choice.produced, choice.index, choice.unsent())
            conn.write_stream(head + tail + self.reply.stream_end(outcome, self.produced, last), end=last,
                              headers=self.headers)
            return
        echo = self.spec.echo
        choice.outcome = Outcome(text.text, reason, text.stopped, choice.produced, choice.index, choice.logprobs,
                                 self._prompt_text() if echo else "",
                                 self._prompt_entries(choice) if echo and choice.logprobs is not None else None)
        if last:
            conn.respond(200, self.reply.body([c.outcome for c in self.choices if c.outcome is not None],
                                              self.produced), headers=self.headers)

    def _prompt_entries(self, choice: _Choice) -> list[TokenLogprob]:
        """The echoed prompt's logprobs so far: its first token (nothing predicts it: null) and
        the PROMPT results after it."""
        if choice.prompt_logprobs is None:
            choice.prompt_logprobs = [TokenLogprob(self.token_text(self.spec.prompt_ids[0]), None, [])]
        return choice.prompt_logprobs

    def _prompt_text(self) -> str:
        if self.prompt_text is None:
            self.prompt_text = self.server.tokenizer.decode(self.spec.prompt_ids)
        return self.prompt_text


def check_grammar(server: ServerState, spec: GenerationSpec) -> None:
    """A 400 naming spec.grammar_param unless llguidance compiles the grammar for the model's
    tokenizer (here, before anything reaches the engine)."""
    if server.grammars is None:
        raise invalid(f"{spec.grammar_param}: this server cannot constrain output (llguidance is not installed or "
                      "cannot load the bundle's tokenizer; see the server log)", spec.grammar_param)
    try:
        server.grammars.check(spec.grammar)
    except GrammarError as e:
        raise invalid(f"{spec.grammar_param}: {e}", spec.grammar_param) from None


def generate(server: ServerState, req: HttpRequest, conn: HttpConnection,
             api: Api) -> Callable[[], None] | None:
    """POST /v1/messages, /v1/chat/completions or /v1/completions in `api`. Returns what to call if the client goes
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
        if spec.grammar is not None:
            check_grammar(server, spec)
    except ApiError as e:
        server.metrics.requests.labels(api.name, e.kind).inc()
        error_response(conn, api, e)
        return None
    generation = HttpGeneration(server, conn, api, spec, req.t_ns, prompt.text)
    server.encoder.prompt_ids(prompt, generation.encoded)
    return generation.cancel
