"""OpenAI's Chat Completions API (`POST /v1/chat/completions`) as one `Api` object, OPENAI:
validation into a GenerationSpec, `chat.completion.chunk` SSE events ending in `data: [DONE]` (with
a usage chunk when `stream_options.include_usage`), the non-streaming completion, OpenAI-shaped
errors, and the model list in OpenAI's shape. With tools offered, each choice's text goes through a
ToolCallStream (toolcalls.py): a whole call streams as `delta.tool_calls[i]` (its id and name, then
its `function.arguments`), and the choice finishes with `tool_calls`."""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

import orjson

from ..constraints import ANY_OBJECT, grammar_for_json_schema
from ..protocol import MAX_TOP_LOGPROBS
from .api_common import (
    MAX_N,
    ApiError,
    ChatPrompt,
    GenerationSpec,
    Outcome,
    TokenLogprob,
    get_bool,
    get_float,
    get_int,
    get_messages,
    get_stops,
    get_top_k,
    invalid,
    request_fields,
    text_of,
)
from .toolcalls import ToolCallStream, split_reply
from .tools import ToolSetup, openai_tools

# Fields that do not change what a text-only, non-reasoning model computes: accepted, ignored.
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
                            "prompt_cache_retention", "prompt_cache_options", "reasoning_effort", "verbosity"})
# Asking for what zlc does not do: refused with their name when set (never silently dropped).
REFUSED_FIELDS = ("functions", "function_call", "audio", "prediction",
                  "web_search_options", "logit_bias", "moderation")
KNOWN_FIELDS = frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "stop", "stream",
                          "tools", "tool_choice", "parallel_tool_calls",
                          "stream_options", "temperature", "top_p", "top_k", "seed", "n", "frequency_penalty",
                          "presence_penalty", "logprobs", "top_logprobs", "response_format", "modalities",
                          *IGNORED_FIELDS, *REFUSED_FIELDS})
FINISH_REASON = {"eos": "stop", "max_tokens": "length", "stop_sequence": "stop"}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Anthropic error type -> (OpenAI type, code)
_KINDS = {
    "invalid_request_error": ("invalid_request_error", None),
    "authentication_error": ("invalid_request_error", "invalid_api_key"),
    "permission_error": ("invalid_request_error", "permission_denied"),
    "not_found_error": ("invalid_request_error", "model_not_found"),
    "request_too_large": ("invalid_request_error", "request_too_large"),
    "rate_limit_error": ("rate_limit_error", "rate_limit_exceeded"),
    "api_error": ("server_error", None),
    "overloaded_error": ("server_error", "overloaded"),
}


_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})


def response_format_grammar(v: Any) -> tuple[str | None, str]:
    """`response_format` as the grammar the answer must match (None: plain text) and the field an
    uncompilable schema is named by. json_object: any JSON object; json_schema: its schema, strict
    or not (zlc constrains both; a non-strict schema's keywords llguidance does not implement are
    ignored rather than refused)."""
    if v is None:
        return None, "response_format"
    if not isinstance(v, dict):
        raise invalid("response_format: Input should be an object", "response_format")
    kind = v.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return grammar_for_json_schema(ANY_OBJECT), "response_format"
    if kind != "json_schema":
        raise invalid(f"response_format.type: {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                      "response_format.type")
    where = "response_format.json_schema"
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise invalid(f"{where}: " + ("Field required" if js is None else "Input should be an object"), where)
    extra = sorted(set(js) - _JSON_SCHEMA_FIELDS)
    if extra:
        raise invalid(f"{where}.{extra[0]}: Extra inputs are not permitted", where)
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise invalid(f"{where}.name: required, 1 to 64 of a-z, A-Z, 0-9, _ and -", where)
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid(f"{where}.strict: Input should be a valid boolean", where)
    schema = js.get("schema", ANY_OBJECT)
    if not isinstance(schema, dict):
        raise invalid(f"{where}.schema: Input should be a JSON Schema object", where)
    return grammar_for_json_schema(schema, lenient=not strict), where


def chat_logprobs(entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's logprobs in the Chat Completions shape (token text, its UTF-8 bytes, alternatives)."""
    if entries is None:
        return None
    return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.token.encode()),
                         "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top]}
                        for e in entries], "refusal": None}


class CompletionReply:
    """One reply's wire form (api_common.Reply)."""

    def __init__(self, model: str, input_tokens: int, include_usage: bool = False, n: int = 1,
                 logprobs: bool = False, tools: ToolSetup | None = None):
        self.id = "chatcmpl-" + secrets.token_hex(12)
        self.model = model
        self.created = int(time.time())
        self.input_tokens = input_tokens
        self.include_usage = include_usage
        self.n, self.logprobs = n, logprobs
        # the constant part of every chunk, serialized once
        self._prefix = (b'data: {"id":"' + self.id.encode() + b'","object":"chat.completion.chunk","created":'
                        + str(self.created).encode() + b',"model":' + orjson.dumps(model))
        self._usage_null = b',"usage":null' if include_usage else b""
        self.fmt = tools.fmt if tools is not None and tools.offered else None
        # per choice: its parser and how many calls it made
        self.calls = [ToolCallStream(self.fmt) for _ in range(n)] if self.fmt else []
        self.called = [0] * n

    def _chunk(self, delta: dict[str, Any], finish: str | None, index: int = 0,
               logprobs: list[TokenLogprob] | None = None) -> bytes:
        lp = chat_logprobs(logprobs if logprobs is not None else []) if self.logprobs else None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return self._prefix + b',"choices":[' + orjson.dumps(choice) + b"]" + self._usage_null + b"}\n\n"

    def _usage(self, output_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.input_tokens, "completion_tokens": output_tokens,
                "total_tokens": self.input_tokens + output_tokens}

    def stream_head(self) -> bytes:
        return b"".join(self._chunk({"role": "assistant", "content": ""}, None, i) for i in range(self.n))

    def stream_delta(self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None) -> bytes:
        if not self.calls:
            return self._chunk({"content": text}, None, index, logprobs)
        out = self._events(self.calls[index].feed(text), index, logprobs)
        if not out and logprobs and self.logprobs:  # the text is held (a call may be coming): its logprobs go now
            out = self._chunk({"content": ""}, None, index, logprobs)
        return out

    def _events(self, events: list[tuple[str, Any]], index: int, logprobs: list[TokenLogprob] | None) -> bytes:
        out = b""
        for kind, v in events:
            if kind == "text":
                out += self._chunk({"content": v}, None, index, logprobs)
            else:
                k = self.called[index]
                self.called[index] += 1
                out += (self._chunk({"tool_calls": [{"index": k, "id": call_id(), "type": "function",
                                                     "function": {"name": v.name, "arguments": ""}}]},
                                    None, index, logprobs)
                        + self._chunk({"tool_calls": [{"index": k, "function": {"arguments": v.arguments_json}}]},
                                      None, index))
            logprobs = None
        return out

    def stream_end(self, outcome: Outcome, output_tokens: int, last: bool = True) -> bytes:
        i = outcome.index
        out = self._events(self.calls[i].finish(), i, None) if self.calls else b""
        reason = "tool_calls" if self.calls and self.called[i] else FINISH_REASON[outcome.reason]
        out += self._chunk({}, reason, i, outcome.logprobs)
        if not last:
            return out
        if self.include_usage:
            out += (self._prefix + b',"choices":[],"usage":' + orjson.dumps(self._usage(output_tokens)) + b"}\n\n")
        return out + b"data: [DONE]\n\n"

    def body(self, outcomes: list[Outcome], output_tokens: int) -> bytes:
        return orjson.dumps({
            "id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
            "choices": [self._choice(o) for o in outcomes],
            "usage": self._usage(output_tokens),
        })


    def _choice(self, o: Outcome) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": o.text, "refusal": None}
        reason = FINISH_REASON[o.reason]
        if self.fmt:
            events = split_reply(o.text, self.fmt)
            calls = [{"id": call_id(), "type": "function", "function": {"name": v.name, "arguments": v.arguments_json}}
                     for kind, v in events if kind == "call"]
            if calls:
                text = "".join(v for kind, v in events if kind == "text")
                message.update(content=text or None, tool_calls=calls)
                reason = "tool_calls"
        return {"index": o.index, "message": message, "logprobs": chat_logprobs(o.logprobs) if self.logprobs else None,
                "finish_reason": reason}


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _message(m: dict[str, Any], role: str, i: int) -> dict[str, Any]:
    """An assistant message with tool_calls, or a tool message, in the chat's HF shape."""
    content = m.get("content")
    text = "" if content is None else text_of(content, f"messages[{i}]")
    if role == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise invalid(f"messages[{i}].tool_call_id: Field required", "messages")
        return {"role": "tool", "tool_call_id": m["tool_call_id"], "name": m["name"] if isinstance(m.get("name"), str) else "",
                "content": text}
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise invalid(f"messages[{i}].tool_calls: Input should be a valid list", "messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise invalid(f"{where}: Input should be {{\"id\", \"type\": \"function\", \"function\": "
                          "{\"name\", \"arguments\": a JSON string}}", "messages")
        try:
            args = orjson.loads(fn["arguments"])
        except orjson.JSONDecodeError:
            raise invalid(f"{where}.function.arguments: not valid JSON", "messages") from None
        if not isinstance(args, dict):
            raise invalid(f"{where}.function.arguments: Input should be a JSON object", "messages")
        out.append({"id": c.get("id") or call_id(), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return {"role": "assistant", "content": text, "tool_calls": out}


class OpenAiApi:
    """The Chat Completions API's shapes (api_common.Api)."""

    name = "openai"
    bad_key = "Incorrect API key provided"

    def parse(self, body: Any, served_model: str) -> tuple[GenerationSpec, ChatPrompt]:
        body = request_fields(body, KNOWN_FIELDS, "Unrecognized request argument supplied: {}", served_model)
        for unsupported in REFUSED_FIELDS:
            if body.get(unsupported) not in (None, [], {}, "none"):
                raise invalid(f"{unsupported}: not supported by zlc serve (text generation only)",
                              unsupported)
        grammar, grammar_param = response_format_grammar(body.get("response_format"))
        if body.get("modalities") not in (None, ["text"]):
            raise invalid("modalities: only [\"text\"] is supported", "modalities")
        logprobs = get_bool(body, "logprobs")
        top_logprobs = get_int(body, "top_logprobs", default=0, lo=0, hi=MAX_TOP_LOGPROBS)
        assert top_logprobs is not None
        if top_logprobs and not logprobs:
            raise invalid("top_logprobs: logprobs must be true when top_logprobs is set", "top_logprobs")
        n = get_int(body, "n", default=1, lo=1, hi=MAX_N)
        assert n is not None
        max_tokens = get_int(body, "max_completion_tokens", lo=1)
        if max_tokens is None:
            max_tokens = get_int(body, "max_tokens", lo=1)
        tools = openai_tools(body)
        messages = get_messages(body)
        chat: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise invalid(f"messages[{i}]: Input should be an object", "messages")
            given = m.get("role")
            role = ROLES.get(given) if isinstance(given, str) else None
            if role is None:
                raise invalid(f"messages[{i}].role: {m.get('role')!r} is not supported "
                              "(system, developer, user, assistant, tool)", "messages")
            if role == "tool" or (role == "assistant" and m.get("tool_calls")):
                chat.append(_message(m, role, i))
                continue
            content = m.get("content")
            if content is None:
                raise invalid(f"messages[{i}].content: Field required", "messages")
            chat.append({"role": role, "content": text_of(content, f"messages[{i}]")})
        opts = body.get("stream_options")
        if opts is not None and not isinstance(opts, dict):
            raise invalid("stream_options: Input should be an object", "stream_options")
        if opts is not None and not isinstance(opts.get("include_usage", False), bool):
            raise invalid("stream_options.include_usage: Input should be a valid boolean", "stream_options")
        seed = get_int(body, "seed")
        if seed is not None and not -2**63 <= seed < 2**63:
            raise invalid("seed: Input should be a 64-bit integer", "seed")
        spec = GenerationSpec(
            prompt_ids=[],
            # 0: the rest of the context (fit_context)
            max_tokens=max_tokens if max_tokens is not None else 0,
            stream=get_bool(body, "stream"),
            temperature=get_float(body, "temperature", 1.0, 0.0, 2.0),
            top_p=get_float(body, "top_p", 1.0, 0.0, 1.0),
            top_k=get_top_k(body),
            frequency_penalty=get_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=get_float(body, "presence_penalty", 0.0, -2.0, 2.0),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            n=n,
            # the ring carries a u64: a negative seed is its two's complement, still one seed per value
            seed=seed % 2**64 if seed is not None else secrets.randbits(63),
            stop_sequences=get_stops(body.get("stop"), "stop", 4),
            include_usage=bool(opts and opts.get("include_usage")),
            tools=tools,
            grammar=grammar,
            grammar_param=grammar_param,
        )
        return spec, ChatPrompt(chat, tools=tools)

    def reply(self, model: str, spec: GenerationSpec) -> CompletionReply:
        return CompletionReply(model, len(spec.prompt_ids), spec.include_usage, spec.n, spec.logprobs, spec.tools)

    def status(self, e: ApiError) -> int:
        """OpenAI answers overload with 429 (its SDK retries 429 with backoff), not Anthropic's 529."""
        return 429 if e.kind == "overloaded_error" else e.status

    def error_body(self, e: ApiError) -> bytes:
        kind, code = _KINDS.get(e.kind, ("server_error", None))
        return orjson.dumps({"error": {"message": e.message, "type": kind, "param": e.param, "code": code}})

    def stream_error(self, e: ApiError) -> bytes:
        return b"data: " + self.error_body(e) + b"\n\n"

    def models(self, model: str, created: int, max_seq: int, *, single: bool) -> bytes:
        entry = {"id": model, "object": "model", "created": created, "owned_by": "zlc"}
        return orjson.dumps(entry if single else {"object": "list", "data": [entry]})


OPENAI = OpenAiApi()
