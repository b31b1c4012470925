"""The Anthropic Messages API (`POST /v1/messages`) as one `Api` object, ANTHROPIC: request
validation into a GenerationSpec, the SSE event sequence, the non-streaming message, errors as
{"type": "error", "error": {...}}, and the model list in Anthropic's shape.

Streaming: message_start, content_block_start, ping, content_block_delta (text_delta)*,
content_block_stop, message_delta (stop_reason, usage), message_stop. With tools offered, blocks
open as the model's text and calls arrive (toolcalls.py): a text block when text comes, a
`tool_use` block (content_block_start, one input_json_delta, content_block_stop) per whole call,
and stop_reason `tool_use` when the reply called a tool.
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
from .toolcalls import ToolCallStream, split_reply
from .tools import ToolSetup, anthropic_tools

# Fields that do not change what a text-only model computes: accepted, ignored.
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "speed", "inference_geo", "diagnostics", "user_profile_id",
                            "workspace_id", "cache_control"})
# Fields asking for what zlc does not do: refused with their name (never silently dropped).
REFUSED_FIELDS = ("thinking", "output_config", "container")
KNOWN_FIELDS = frozenset({"model", "messages", "max_tokens", "system", "stop_sequences", "stream", "temperature",
                          "top_p", "top_k", "tools", "tool_choice", *IGNORED_FIELDS, *REFUSED_FIELDS})
STOP_REASON = {"eos": "end_turn", "max_tokens": "max_tokens", "stop_sequence": "stop_sequence"}


def _sse(event: bytes, data: dict[str, Any]) -> bytes:
    return b"event: " + event + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def new_id() -> str:
    return "msg_" + secrets.token_hex(12)


def tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


class MessageReply:
    """One reply's wire form (api_common.Reply). With `tools` offered, the text goes through a
    ToolCallStream and content blocks open as text or calls come (`block`: the next block's index)."""

    def __init__(self, model: str, input_tokens: int, tools: ToolSetup | None = None):
        self.id = new_id()
        self.model = model
        self.input_tokens = input_tokens
        self.calls = ToolCallStream(tools.fmt) if tools is not None and tools.offered else None
        self.block = 0
        self.text_open = False
        self.called = False

    # streaming
    def stream_head(self) -> bytes:
        msg: dict[str, Any] = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.input_tokens, "output_tokens": 0}}
        head = _sse(b"message_start", {"type": "message_start", "message": msg})
        if self.calls is None:
            head += _sse(b"content_block_start", {"type": "content_block_start", "index": 0,
                                                  "content_block": {"type": "text", "text": ""}})
        return head + _sse(b"ping", {"type": "ping"})

    def _text_delta(self, text: str) -> bytes:
        return _sse(b"content_block_delta", {"type": "content_block_delta", "index": self.block,
                                             "delta": {"type": "text_delta", "text": text}})

    def _events(self, events: list[tuple[str, Any]]) -> bytes:
        out = b""
        for kind, v in events:
            if kind == "text":
                if not self.text_open:
                    self.text_open = True
                    out += _sse(b"content_block_start", {"type": "content_block_start", "index": self.block,
                                                         "content_block": {"type": "text", "text": ""}})
                out += self._text_delta(v)
                continue
            out += self._close_text()
            self.called = True
            i = self.block
            out += (_sse(b"content_block_start", {"type": "content_block_start", "index": i, "content_block": {
                        "type": "tool_use", "id": tool_use_id(), "name": v.name, "input": {}}})
                    + _sse(b"content_block_delta", {"type": "content_block_delta", "index": i, "delta": {
                        "type": "input_json_delta", "partial_json": v.arguments_json}})
                    + _sse(b"content_block_stop", {"type": "content_block_stop", "index": i}))
            self.block += 1
        return out

    def _close_text(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        self.block += 1
        return _sse(b"content_block_stop", {"type": "content_block_stop", "index": self.block - 1})

    # The Messages API has one choice and no logprobs: index and logprobs are always 0 and None.
    def stream_delta(self, text: str, index: int = 0, logprobs: list[TokenLogprob] | None = None) -> bytes:
        if self.calls is None:
            return self._text_delta(text)
        return self._events(self.calls.feed(text))

    def stream_end(self, outcome: Outcome, output_tokens: int, last: bool = True) -> bytes:
        if self.calls is None:
            out = _sse(b"content_block_stop", {"type": "content_block_stop", "index": 0})
        else:
            out = self._events(self.calls.finish()) + self._close_text()
        reason = "tool_use" if self.called else STOP_REASON[outcome.reason]
        return (out + _sse(b"message_delta", {"type": "message_delta",
                                              "delta": {"stop_reason": reason,
                                                        "stop_sequence": outcome.stop_sequence},
                                              "usage": {"output_tokens": output_tokens}})
                + _sse(b"message_stop", {"type": "message_stop"}))

    # whole message
    def body(self, outcomes: list[Outcome], output_tokens: int) -> bytes:
        (o,) = outcomes
        content: list[dict[str, Any]] = [{"type": "text", "text": o.text}]
        reason = STOP_REASON[o.reason]
        if self.calls is not None:
            events = split_reply(o.text, self.calls.fmt)
            content = [{"type": "text", "text": v} if kind == "text" else
                       {"type": "tool_use", "id": tool_use_id(), "name": v.name, "input": v.arguments}
                       for kind, v in events]
            if any(kind == "call" for kind, _ in events):
                reason = "tool_use"
        return orjson.dumps({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content,
            "stop_reason": reason, "stop_sequence": o.stop_sequence,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens},
        })


def _tool_turn(role: str, content: list[Any], where: str, names: dict[str, str]) -> list[dict[str, Any]]:
    """A message with tool_use (assistant) or tool_result (user) blocks, in the chat's HF shape."""
    texts, calls, results = [], [], []
    for j, b in enumerate(content):
        kind = b.get("type") if isinstance(b, dict) else None
        at = f"{where}.content.{j}"
        if kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise invalid(f"{at}: a tool_use block needs a string id and name")
            if not isinstance(b.get("input"), dict):
                raise invalid(f"{at}.input: Input should be an object")
            names[b["id"]] = b["name"]
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b["input"]}})
        elif kind == "tool_result" and role == "user":
            tid = b.get("tool_use_id")
            if not isinstance(tid, str):
                raise invalid(f"{at}.tool_use_id: Field required")
            c = b.get("content", "")
            text = text_of(c, at) if c is not None else ""
            results.append({"role": "tool", "tool_call_id": tid, "name": names.get(tid, ""),
                            "content": ("Error: " + text) if b.get("is_error") else text})
        elif kind in ("tool_use", "tool_result"):
            raise invalid(f"{at}: a {kind} block belongs in {'an assistant' if kind == 'tool_use' else 'a user'} "
                          "message")
        else:
            texts.append(text_of([b], where))
    if role == "assistant":
        return [{"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


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
        chat: list[dict[str, Any]] = []
        tools = anthropic_tools(body)
        names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer it
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
            content = m["content"]
            if isinstance(content, list) and any(isinstance(b, dict) and b.get("type") in ("tool_use", "tool_result")
                                                 for b in content):
                chat += _tool_turn(role, content, f"messages.{i}", names)
            else:
                chat.append({"role": role, "content": text_of(content, f"messages.{i}")})
        prompt = ChatPrompt(chat, tools=tools)
        if chat[-1]["role"] == "assistant" and not chat[-1].get("tool_calls"):  # prefill: the reply continues it
            prompt = ChatPrompt(chat[:-1], prefill=chat[-1]["content"], tools=tools)
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
            tools=tools,
        )
        return spec, prompt

    def reply(self, model: str, spec: GenerationSpec) -> MessageReply:
        return MessageReply(model, len(spec.prompt_ids), spec.tools)

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
