"""A model's tool calls in its own text format, both ways: what the model emits for a call
(`render_calls`, also how a template without a tool format sees earlier calls) and the parse back
of a reply, streaming (`ToolCallStream`: text before a call streams as text; from the call's opener
on, text is held until a whole call has arrived) or whole (`split_reply`).

Formats (chosen from the chat template's text, tools.detect_format):

- ``hermes``: ``<tool_call>\\n{"name": .., "arguments": {..}}\\n</tool_call>`` per call (Qwen2.5/Qwen3,
  Hermes, and zlc's default for templates without a tool format);
- ``llama3``: the reply is JSON ``{"name": .., "parameters": {..}}`` (``;``-separated for several),
  optionally after ``<|python_tag|>`` (Llama 3.1-3.3);
- ``mistral``: ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ..]``, or ``[TOOL_CALLS]name[ARGS]{..}``
  (newer Mistral tokenizers).

A body that does not parse as a call is released as text, opener and all: never a wrong call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3", "mistral")
OPENER = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "llama3": "<|python_tag|>"}
HERMES_CLOSE = "</tool_call>"
_DECODER = json.JSONDecoder()


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def render_calls(calls: list[ToolCall], fmt: str) -> str:
    """The calls as the model emits them in format `fmt`."""
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments}, ensure_ascii=False)}"
                         "\n</tool_call>" for c in calls)
    if fmt == "llama3":
        return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls)
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps([{"name": c.name, "arguments": c.arguments} for c in calls],
                                           ensure_ascii=False)
    raise ValueError(f"unknown tool-call format {fmt!r}")


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """A parsed JSON value as a call: {"name": str, <args_key> or "arguments": object}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return ToolCall(obj["name"], args) if isinstance(args, dict) else None


def _decode(text: str) -> tuple[Any, int] | None:
    """The JSON value at the start of `text` (after whitespace) and where it ends, or None."""
    start = len(text) - len(text.lstrip())
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None


class ToolCallStream:
    """One reply's text in, (kind, value) events out: ("text", str) and ("call", ToolCall)."""

    def __init__(self, fmt: str):
        if fmt not in FORMATS:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.fmt = fmt
        self.buf = ""
        self.in_call = False
        self.calls = 0
        self.started = False  # llama3: a call can only open the reply

    def feed(self, piece: str) -> list[tuple[str, Any]]:
        self.buf += piece
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, Any]]:
        return self._drain(final=True)

    def _text(self, out: list[tuple[str, Any]], text: str) -> None:
        if text and not (self.calls and not text.strip()):  # whitespace between calls is no text
            out.append(("text", text))
            self.started = True

    def _drain(self, final: bool) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        while self.buf:
            if not self.in_call:
                if not self._open(out, final):
                    break
                continue
            step = self._take(final)
            if step is None:  # the call is not complete yet
                break
            calls, rest = step
            if calls is None:  # not a call after all: its text, opener and all
                self._text(out, OPENER[self.fmt] + self.buf if self.fmt != "llama3" else self.buf)
                self.buf, self.in_call = "", False
                continue
            for c in calls:
                out.append(("call", c))
                self.calls += 1
            self.buf, self.in_call = rest, False
        return out

    def _open(self, out: list[tuple[str, Any]], final: bool) -> bool:
        """Text mode: releases the text before an opener and enters the call; False: wait for more."""
        buf = self.buf
        if self.fmt == "llama3":
            if self.started and not self.calls:
                self._text(out, buf)
                self.buf = ""
                return False
            head = buf.lstrip(" \t\n;" if self.calls else None)  # calls are ";"-separated
            tag = OPENER["llama3"]
            if head.startswith(tag):
                head = head[len(tag):].lstrip()
            if not head or (tag.startswith(buf.lstrip()) and not final):
                if final:
                    self._text(out, "" if self.calls and not head else buf)
                    self.buf = ""
                return False
            if head[0] == "{":
                self.buf, self.in_call = head, True
                return True
            self._text(out, buf)
            self.buf = ""
            return False
        opener = OPENER[self.fmt]
        i = buf.find(opener)
        if i >= 0:
            self._text(out, buf[:i])
            self.buf, self.in_call = buf[i + len(opener):], True
            return True
        keep = 0 if final else next((n for n in range(min(len(opener) - 1, len(buf)), 0, -1)
                                     if buf.endswith(opener[:n])), 0)
        self._text(out, buf[:len(buf) - keep])
        self.buf = buf[len(buf) - keep:]
        return False

    def _take(self, final: bool) -> tuple[list[ToolCall] | None, str] | None:
        """In a call: (calls, the text after them), (None, _) when the body is no call, None to wait."""
        buf = self.buf
        if self.fmt == "hermes":
            # the first closer after a whole call (a closer inside an argument's string is no end)
            j = buf.find(HERMES_CLOSE)
            while j >= 0:
                got = _decode(buf[:j])
                if got and not buf[got[1]:j].strip():
                    call = _call(got[0], "arguments")
                    return ([call], buf[j + len(HERMES_CLOSE):]) if call else (None, "")
                j = buf.find(HERMES_CLOSE, j + 1)
            if not final:
                return None
            got = _decode(buf)  # the reply ended without the closer
            call = _call(got[0], "arguments") if got and not buf[got[1]:].strip() else None
            return ([call], "") if call else (None, "")
        if not final and not buf.rstrip().endswith(("}", "]")):
            return None  # a JSON value ends with one of these: no parse before
        if self.fmt == "llama3":
            calls, pos = [], 0
            while True:
                got = _decode(buf[pos:])
                call = _call(got[0], "parameters") if got else None
                if call is None:
                    break
                calls.append(call)
                pos += got[1]  # type: ignore[index]
                nxt = buf[pos:].lstrip()
                if not nxt.startswith(";"):
                    break
                pos = len(buf) - len(nxt) + 1
            if not calls:
                return None if not final else (None, "")
            return calls, buf[pos:]
        head = buf.lstrip()  # mistral
        if head.startswith(("[", "{")):
            got = _decode(head)
            if got is None:
                return None if not final else (None, "")
            items = got[0] if isinstance(got[0], list) else [got[0]]
            parsed = [_call(x, "arguments") for x in items]
            found = [c for c in parsed if c is not None]
            if not found or len(found) < len(parsed):
                return None, ""
            return found, head[got[1]:]
        name, sep, args = head.partition("[ARGS]")
        if not sep:
            return None if not final else (None, "")
        got = _decode(args)
        if got is None:
            return None if not final else (None, "")
        call = _call({"name": name.strip(), "arguments": got[0]}, "arguments")
        return ([call], args[got[1]:]) if call else (None, "")


def split_reply(text: str, fmt: str) -> list[tuple[str, Any]]:
    """A whole reply's events, text pieces merged."""
    s = ToolCallStream(fmt)
    merged: list[tuple[str, Any]] = []
    for kind, v in s.feed(text) + s.finish():
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + v)
        else:
            merged.append((kind, v))
    return merged
