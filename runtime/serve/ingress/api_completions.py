"""OpenAI's legacy Completions API (`POST /v1/completions`) as one `Api` object, COMPLETIONS: a plain
prompt (a string, or token ids; no chat template), `echo`, `logprobs` in the legacy shape (tokens,
token_logprobs, top_logprobs, text_offset), `stop`, `n`, streaming. What lm-evaluation-harness's
`local-completions` model sends: its loglikelihood requests are `echo: true, logprobs: 1,
max_tokens: 1` and read the prompt tokens' logprobs back. Errors and the model list are the
Chat Completions API's (api_openai)."""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from ..protocol import MAX_TOP_LOGPROBS
from .api_common import (
    MAX_N,
    ApiError,
    ChatPrompt,
    GenerationSpec,
    Outcome,
    TokenLogprob,
    check_model,
    get_bool,
    get_float,
    get_int,
    get_stops,
    get_top_k,
    invalid,
)
from .api_openai import FINISH_REASON, OPENAI

IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
REFUSED_FIELDS = ("suffix", "logit_bias")
KNOWN_FIELDS = frozenset({"model", "prompt", "max_tokens", "stop", "stream", "stream_options", "temperature", "top_p",
                          "top_k", "seed", "n", "best_of", "frequency_penalty", "presence_penalty", "logprobs", "echo",
                          *IGNORED_FIELDS, *REFUSED_FIELDS})
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions


def legacy_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """Logprobs in the Completions shape; text_offset counts characters from `offset` (where the
    first entry's token starts in the choice's text)."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else dict(e.top) for e in entries], "text_offset": offsets}


def get_prompt(body: dict[str, Any]) -> ChatPrompt:
    """One prompt: a string, token ids, or a list of one of those (what batching clients send)."""
    p = body.get("prompt")
    if p is None:
        raise invalid("prompt: Field required", "prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise invalid("prompt: must not be empty", "prompt")
        return ChatPrompt([], text=p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(not 0 <= t < 2**32 for t in p):
            raise invalid("prompt: token ids must be in [0, 2**32)", "prompt")
        return ChatPrompt([], ids=list(p))
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise invalid(f"prompt: {len(p)} prompts in one request; zlc serve takes one per request (send them "
                      "as separate requests: they run side by side)", "prompt")
    raise invalid("prompt: Input should be a string or a list of token ids", "prompt")


class TextCompletionReply:
    """One reply's wire form (api_common.Reply) in the Completions shape."""

    def __init__(self, model: str, input_tokens: int, include_usage: bool, logprobs: bool, echo: bool):
        self.id = "cmpl-" + secrets.token_hex(12)
        self.model, self.input_tokens = model, input_tokens
        self.include_usage, self.logprobs, self.echo = include_usage, logprobs, echo
        self.created = int(time.time())
        self._prefix = (b'data: {"id":"' + self.id.encode() + b'","object":"text_completion","created":'
                        + str(self.created).encode() + b',"model":' + orjson.dumps(model))
        self._offset: dict[int, int] = {}  # per choice: characters streamed (text_offset of the next token)

    def _chunk(self, text: str, index: int, logprobs: list[TokenLogprob] | None, finish: str | None) -> bytes:
        lp = None
        if self.logprobs:
            at = self._offset.get(index, 0)
            lp = legacy_logprobs(logprobs or [], at)
            self._offset[index] = at + len(text)
        choice = {"text": text, "index": index, "logprobs": lp, "finish_reason": finish}
        return self._prefix + b',"choices":[' + orjson.dumps(choice) + b"]}\n\n"

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.input_tokens, "completion_tokens": output_tokens,
                "total_tokens": self.input_tokens + output_tokens}

    def stream_head(self) -> bytes:
        return b""  # a completion stream has no role chunk: its first event carries text

    def stream_delta(self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None) -> bytes:
        return self._chunk(text, index, logprobs, None)

    def stream_end(self, outcome: Outcome, output_tokens: int, last: bool = True) -> bytes:
        out = self._chunk("", outcome.index, outcome.logprobs, FINISH_REASON[outcome.reason])
        if not last:
            return out
        if self.include_usage:
            out += self._prefix + b',"choices":[],"usage":' + orjson.dumps(self._usage(output_tokens)) + b"}\n\n"
        return out + b"data: [DONE]\n\n"

    def body(self, outcomes: list[Outcome], output_tokens: int) -> bytes:
        choices = []
        for o in outcomes:
            lp = None
            if self.logprobs:
                entries = (o.prompt_logprobs or []) + (o.logprobs or [])
                lp = legacy_logprobs(entries)
            text = o.prompt + o.text if self.echo else o.text
            choices.append({"text": text, "index": o.index, "logprobs": lp, "finish_reason": FINISH_REASON[o.reason]})
        return orjson.dumps({"id": self.id, "object": "text_completion", "created": self.created,
                             "model": self.model, "choices": choices, "usage": self._usage(output_tokens)})


class CompletionsApi:
    """The Completions API's shapes (api_common.Api); errors and models as OpenAI's chat API."""

    name = "completions"
    bad_key = OPENAI.bad_key

    def parse(self, body: Any, served_model: str) -> tuple[GenerationSpec, ChatPrompt]:
        if not isinstance(body, dict):
            raise invalid("the request body must be a JSON object")
        extra = sorted(set(body) - KNOWN_FIELDS)
        if extra:
            raise invalid(f"Unrecognized request argument supplied: {extra[0]}", extra[0])
        check_model(body.get("model"), served_model)
        for unsupported in REFUSED_FIELDS:
            if body.get(unsupported) not in (None, "", {}):
                raise invalid(f"{unsupported}: not supported by zlc serve", unsupported)
        prompt = get_prompt(body)
        n = get_int(body, "n", default=1, lo=1, hi=MAX_N)
        assert n is not None
        best_of = get_int(body, "best_of", default=n, lo=1)
        if best_of != n:
            raise invalid("best_of: only best_of = n is supported (every choice is returned)", "best_of")
        logprobs = get_int(body, "logprobs", lo=0, hi=MAX_TOP_LOGPROBS)
        max_tokens = get_int(body, "max_tokens", default=DEFAULT_MAX_TOKENS, lo=1)
        assert max_tokens is not None
        opts = body.get("stream_options")
        if opts is not None and (not isinstance(opts, dict) or not isinstance(opts.get("include_usage", False), bool)):
            raise invalid("stream_options: Input should be an object with a boolean include_usage", "stream_options")
        seed = get_int(body, "seed")
        if seed is not None and not -2**63 <= seed < 2**63:
            raise invalid("seed: Input should be a 64-bit integer", "seed")
        spec = GenerationSpec(
            prompt_ids=[], max_tokens=max_tokens, stream=get_bool(body, "stream"),
            temperature=get_float(body, "temperature", 1.0, 0.0, 2.0), top_p=get_float(body, "top_p", 1.0, 0.0, 1.0),
            seed=seed % 2**64 if seed is not None else secrets.randbits(63),
            stop_sequences=get_stops(body.get("stop"), "stop", 4), include_usage=bool(opts and opts.get("include_usage")),
            top_k=get_top_k(body), frequency_penalty=get_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=get_float(body, "presence_penalty", 0.0, -2.0, 2.0),
            logprobs=logprobs is not None, top_logprobs=logprobs or 0, n=n, echo=get_bool(body, "echo"),
        )
        return spec, prompt

    def reply(self, model: str, spec: GenerationSpec) -> TextCompletionReply:
        return TextCompletionReply(model, len(spec.prompt_ids), spec.include_usage, spec.logprobs, spec.echo)

    def status(self, e: ApiError) -> int:
        return OPENAI.status(e)

    def error_body(self, e: ApiError) -> bytes:
        return OPENAI.error_body(e)

    def stream_error(self, e: ApiError) -> bytes:
        return OPENAI.stream_error(e)

    def models(self, model: str, created: int, max_seq: int, *, single: bool) -> bytes:
        return OPENAI.models(model, created, max_seq, single=single)


COMPLETIONS = CompletionsApi()
