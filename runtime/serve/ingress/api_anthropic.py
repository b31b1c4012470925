"""The Anthropic Messages API (`POST /v1/messages`) as one `Api` object, ANTHROPIC: request
validation into a GenerationSpec, the SSE event sequence, the non-streaming message, errors as
{"type": "error", "error": {...}}, and the model list in Anthropic's shape.

Streaming: message_start, content_block_start, ping, content_block_delta (text_delta)*,
content_block_stop, message_delta (stop_reason, usage), message_stop.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from .api_common import (
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

# Fields that do not change what a text-only model computes: accepted, ignored.
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "speed", "inference_geo", "diagnostics", "user_profile_id",
                            "workspace_id", "cache_control"})
# Fields asking for what zlc does not do: refused with their name (never silently dropped).
REFUSED_FIELDS = ("tools", "tool_choice", "thinking", "output_config", "container")
KNOWN_FIELDS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
                          "top_p", "top_k", *IGNORED_FIELDS, *REFUSED_FIELDS})
STOP_REASON = {"eos": "end_turn", "max_tokens": "max_tokens", "stop_sequence": "stop_sequence"}


def _sse(event: bytes, data: dict[str, Any]) -> bytes:
    return b"event: " + event + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def new_id() -> str:
    return "msg_" + secrets.token_hex(12)


class MessageReply:
    """One reply's wire form (api_common.Reply)."""

    def __init__(self, model: str, input_tokens: int):
        self.id = new_id()
        self.model = model
        self.input_tokens = input_tokens

    # streaming
    def stream_head(self) -> bytes:
        msg: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        return (_sse(b"message_start", {"type": "message_start", "message": msg})
                + _sse(b"content_block_start", {"type": "content_block_start", "index": 0,
                                                "content_block": {"type": "text", "text": ""}})
                + _sse(b"ping", {"type": "ping"}))

    # The Messages API has one choice and no logprobs: index and logprobs are always 0 and None.
    @staticmethod
    def stream_delta(text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None) -> bytes:
        return _sse(b"content_block_delta", {"type": "content_block_delta", "index": 0,
                                             "delta": {"type": "text_delta", "text": text}})

    def stream_end(self, outcome: Outcome, output_tokens: int, last: bool = True) -> bytes:
        return (_sse(b"content_block_stop", {"type": "content_block_stop", "index": 0})
                + _sse(b"message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": STOP_REASON[outcome.reason],
                                                    "stop_sequence": outcome.stop_sequence},
                                          "usage": {"output_tokens": output_tokens}})
                + _sse(b"message_stop", {"type": "message_stop"}))

    # whole message
    def body(self, outcomes: list[Outcome], output_tokens: int) -> bytes:
        (o,) = outcomes
        return orjson.dumps({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [{"type": "text", "text": o.text}],
            "stop_reason": STOP_REASON[o.reason], "stop_sequence": o.stop_sequence,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens},
        })


class AnthropicApi:
    """The Messages API's shapes (api_common.Api)."""

    name = "anthropic"
    bad_key = "invalid x-api-key"

    def parse(self, body: Any, served_model: str) -> tuple[GenerationSpec, ChatPrompt]:
        body = request_fields(body, KNOWN_FIELDS, "{}: Extra inputs are not permitted", served_model)
        max_tokens = get_int(body, "max_tokens", required=True, lo=1)
        assert max_tokens is not None
        for unsupported in REFUSED_FIELDS:
            if body.get(unsupported) not in (None, [], {}):
                raise invalid(f"{unsupported}: not supported by zlc serve (text generation with "
                              "temperature/top_p/top_k sampling only)", unsupported)
        metadata = body.get("metadata")
        if metadata is not None and not isinstance(metadata, dict):
            raise invalid("metadata: Input should be an object", "metadata")
        messages = get_messages(body)
        chat: list[dict[str, str]] = []
        system = body.get("system")
        if system is not None:
            if isinstance(system, list):
                system = text_of(system, "system")
            elif not isinstance(system, str):
                raise invalid("system: Input should be a string or a list of text blocks", "system")
            if system:
                chat.append({"role": "system", "content": system})
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise invalid(f"messages.{i}: Input should be an object")
            role = m.get("role")
            if not isinstance(role, str) or role not in ("user", "assistant"):
                raise invalid(f"messages.{i}.role: Input should be 'user' or 'assistant'")
            if "content" not in m:
                raise invalid(f"messages.{i}.content: Field required")
            chat.append({"role": role, "content": text_of(m["content"], f"messages.{i}")})
        prompt = ChatPrompt(chat)
        if chat[-1]["role"] == "assistant":  # prefill: the reply continues this text
            prompt = ChatPrompt(chat[:-1], prefill=chat[-1]["content"])
        spec = GenerationSpec(
            prompt_ids=[],
            max_tokens=max_tokens,
            stream=get_bool(body, "stream"),
            # Greedy unless asked: today's Messages API (and its SDK) has no sampling parameters, so a
            # client that cannot send temperature gets the deterministic reply; older clients (or
            # extra_body) may still send temperature/top_p.
            temperature=get_float(body, "temperature", 0.0, 0.0, 1.0),
            top_p=get_float(body, "top_p", 1.0, 0.0, 1.0),
            top_k=get_top_k(body),
            seed=secrets.randbits(63),
            stop_sequences=get_stops(body.get("stop_sequences"), "stop_sequences", 16),
        )
        return spec, prompt

    def reply(self, model: str, spec: GenerationSpec) -> MessageReply:
        return MessageReply(model, len(spec.prompt_ids))

    def status(self, e: ApiError) -> int:
        return e.status

    def error_body(self, e: ApiError) -> bytes:
        return orjson.dumps({"type": "error", "error": {"type": e.kind, "message": e.message}})

    def stream_error(self, e: ApiError) -> bytes:
        return b"event: error\ndata: " + self.error_body(e) + b"\n\n"

    def models(self, model: str, created: int, max_seq: int, *, single: bool) -> bytes:
        entry = {"type": "model", "id": model, "display_name": model,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                 "max_input_tokens": max_seq, "max_tokens": max_seq}
        return orjson.dumps(entry if single else {"data": [entry], "has_more": False, "first_id": model,
                                                  "last_id": model})


ANTHROPIC = AnthropicApi()
