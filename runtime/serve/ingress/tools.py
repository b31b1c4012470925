"""Tools in a request: the definitions and tool_choice of either API checked into one `ToolSetup`,
the chat rendered for the model's template (its own tool format through the template's `tools`
variable, or zlc's default), and the grammar a forced call must match.

Messages reach here in Hugging Face's chat shape, whatever API they came in through: an assistant
message's calls as ``tool_calls: [{"id", "type": "function", "function": {"name", "arguments": {..}}}]``
and a tool's result as ``{"role": "tool", "tool_call_id", "name", "content"}``; that is the shape
the templates of Qwen2.5/Qwen3, Llama 3.x and Mistral read.

**The default** (a template that never mentions ``tools``, e.g. plain ChatML): the tools are
described in a system-prompt block (Hermes/Qwen style) asking for
``<tool_call>{"name": .., "arguments": ..}</tool_call>``; earlier calls are rendered that way in
the assistant's text and tool results as a user message of ``<tool_response>`` blocks, so the
template sees only roles and strings. A bundle without a chat template cannot be offered tools.

**tool_choice**: ``auto`` (offered, parsed), ``none`` (not offered, not parsed), ``required``/``any``
and a named tool (forced: `tool_call_grammar` is the llguidance Lark grammar the reply must match,
sent to the engine as the request's grammar; constrained decoding enforces it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ..constraints import JSON_OPTIONS
from .api_common import invalid
from .toolcalls import OPENER, ToolCall, render_calls

NAMED = "named"


@dataclass(slots=True)
class ToolSetup:
    """A request's tools (HF/OpenAI function shape), its choice (auto, none, required or NAMED with
    `name`), and once the template is known, the format and a forced call's grammar."""

    tools: list[dict[str, Any]]
    choice: str = "auto"
    name: str | None = None
    fmt: str = "hermes"
    native: bool = False  # the template renders the tools itself
    grammar: str | None = None
    parallel: bool = True

    @property
    def offered(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.offered and self.choice in ("required", NAMED)


def check_schema(schema: Any, where: str) -> dict[str, Any]:
    """A tool's parameters: a JSON schema object (type "object" if it says a type) that jsonschema accepts."""
    import jsonschema

    if not isinstance(schema, dict):
        raise invalid(f"{where}: Input should be a JSON schema object, got {type(schema).__name__}", where)
    if schema.get("type", "object") != "object":
        raise invalid(f"{where}.type: a tool's input schema must have type 'object', got {schema['type']!r}", where)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        path = ".".join(str(p) for p in e.path)
        raise invalid(f"{where}{'.' + path if path else ''}: not a valid JSON schema ({e.message})", where) from None
    except Exception as e:  # a "$schema" that names no draft, a reference that does not resolve...
        raise invalid(f"{where}: not a valid JSON schema ({type(e).__name__}: {e})".split("\n")[0], where) from None
    return schema


def _tool(name: Any, description: Any, schema: Any, where: str, schema_key: str) -> dict[str, Any]:
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name: Field required (a non-empty string)", where)
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description: Input should be a valid string", where)
    fn: dict[str, Any] = {"name": name, **({"description": description} if description else {}),
                          "parameters": check_schema(schema, f"{where}.{schema_key}")}
    return {"type": "function", "function": fn}


def _unique(tools: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    seen: set[str] = set()
    for i, t in enumerate(tools):
        n = t["function"]["name"]
        if n in seen:
            raise invalid(f"{key}.{i}.name: tool name {n!r} is used twice", key)
        seen.add(n)
    return tools


def _named(setup: ToolSetup, name: Any, key: str) -> ToolSetup:
    names = [t["function"]["name"] for t in setup.tools]
    if not isinstance(name, str) or name not in names:
        raise invalid(f"{key}: names no tool in tools ({name!r}; tools: {', '.join(names) or 'none'})", key)
    setup.choice, setup.name = NAMED, name
    return setup


def anthropic_tools(body: dict[str, Any]) -> ToolSetup | None:
    """Messages API `tools` ([{"name", "description", "input_schema"}]) and `tool_choice`."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None and choice is None:
        return None
    if raw is not None and not isinstance(raw, list):
        raise invalid("tools: Input should be a valid list", "tools")
    tools = []
    for i, t in enumerate(raw or []):
        if not isinstance(t, dict):
            raise invalid(f"tools.{i}: Input should be an object", "tools")
        if t.get("type") not in (None, "custom"):
            raise invalid(f"tools.{i}.type: server tool {t['type']!r} is not supported by zlc serve (custom "
                          "tools only)", "tools")
        if "input_schema" not in t:
            raise invalid(f"tools.{i}.input_schema: Field required", "tools")
        tools.append(_tool(t.get("name"), t.get("description"), t["input_schema"], f"tools.{i}", "input_schema"))
    setup = ToolSetup(_unique(tools, "tools"))
    if choice is None:
        return setup
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice: Input should be an object with type 'auto', 'any', 'tool' or 'none'", "tool_choice")
    setup.parallel = not choice.get("disable_parallel_tool_use", False)
    if kind != "none" and not tools:
        raise invalid(f"tool_choice: {kind!r} needs tools", "tool_choice")
    if kind == "tool":
        return _named(setup, choice.get("name"), "tool_choice.name")
    setup.choice = "required" if kind == "any" else str(kind)
    return setup


def openai_tools(body: dict[str, Any]) -> ToolSetup | None:
    """Chat Completions `tools` ([{"type": "function", "function": {"name", "description",
    "parameters"}}]), `tool_choice` and `parallel_tool_calls`."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    if raw is None and choice is None:
        return None
    if raw is not None and not isinstance(raw, list):
        raise invalid("tools: Input should be a valid list", "tools")
    tools = []
    for i, t in enumerate(raw or []):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}]: Input should be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        schema = fn.get("parameters", {"type": "object", "properties": {}})
        tools.append(_tool(fn.get("name"), fn.get("description"), schema, f"tools[{i}].function", "parameters"))
    setup = ToolSetup(_unique(tools, "tools"), parallel=body.get("parallel_tool_calls") is not False)
    if choice is None or choice in ("auto", "none", "required"):
        setup.choice = choice or "auto"
        if setup.choice == "required" and not tools:
            raise invalid("tool_choice: 'required' needs tools", "tool_choice")
        return setup
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict):
        raise invalid("tool_choice: Input should be 'none', 'auto', 'required' or {\"type\": \"function\", "
                      "\"function\": {\"name\": ...}}", "tool_choice")
    return _named(setup, fn.get("name"), "tool_choice.function.name")


def detect_format(template: str) -> tuple[str, bool]:
    """(format, native) from a chat template's text: native when it renders `tools` itself."""
    native = "tools" in template
    if "[TOOL_CALLS]" in template:
        return "mistral", native
    if "<tool_call>" in template or not native:
        return "hermes", native
    if '"parameters"' in template or "<|python_tag|>" in template:
        return "llama3", native
    return "hermes", native


def default_system_block(tools: list[dict[str, Any]]) -> str:
    """The default format's description of the tools (Hermes/Qwen style)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
            f"{lines}\n</tools>\n\nFor each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _default_chat(chat: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The chat in roles and strings only, for a template without a tool format."""
    out: list[dict[str, Any]] = []
    for m in chat:
        content = m.get("content") or ""
        if m["role"] == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
            continue
        if m.get("tool_calls"):
            calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
            content = (content + "\n" if content else "") + render_calls(calls, "hermes")
        out.append({"role": m["role"], "content": content})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        block = default_system_block(tools)
        if out and out[0]["role"] == "system":
            out[0]["content"] = out[0]["content"] + "\n\n" + block
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _mistral_ids(chat: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mistral's templates want 9-character alphanumeric call ids: the ids mapped, consistently."""
    import hashlib

    def short(i: Any) -> str:
        return hashlib.sha256(str(i).encode()).hexdigest()[:9]

    out = []
    for m in chat:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "id": short(c.get("id"))} for c in m["tool_calls"]]
        if m["role"] == "tool":
            m["tool_call_id"] = short(m.get("tool_call_id"))
        out.append(m)
    return out


def render_args(chat: list[dict[str, Any]], setup: ToolSetup | None,
                template: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) to render `chat` with `template`; sets the setup's format and grammar."""
    fmt, native = detect_format(template)
    has_tool_turns = any(m["role"] == "tool" or m.get("tool_calls") for m in chat)
    offered = setup.tools if setup is not None and setup.offered else None
    if setup is not None:
        setup.fmt, setup.native = fmt, native
        setup.grammar = tool_call_grammar(setup.tools, setup.choice, setup.name, fmt) if setup.forced else None
    if not native:
        return (_default_chat(chat, offered) if offered or has_tool_turns else chat), None
    return (_mistral_ids(chat) if fmt == "mistral" else chat), offered


def _call_schema(tool: dict[str, Any], fmt: str) -> dict[str, Any]:
    fn = tool["function"]
    args = "parameters" if fmt == "llama3" else "arguments"
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args: fn["parameters"]},
            "required": ["name", args], "additionalProperties": False}


def tool_call_grammar(tools: list[dict[str, Any]], choice: str, name: str | None, fmt: str) -> str:
    """The llguidance Lark grammar of a forced reply: one call (of the named tool, or of any tool for
    `required`) in format `fmt`, its JSON valid for the tool's schema."""
    chosen = [t for t in tools if choice != NAMED or t["function"]["name"] == name]
    # compact JSON, as response_format's (constraints.JSON_OPTIONS): a weak model could otherwise
    # spend its max_tokens on the whitespace JSON allows between tokens
    rules = [f"call_{i}: %json {json.dumps({**_call_schema(t, fmt), 'x-guidance': JSON_OPTIONS}, ensure_ascii=False)}"
             for i, t in enumerate(chosen)]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(chosen)))
    if fmt == "hermes":
        start = f'start: "{OPENER["hermes"]}\\n" call "\\n</tool_call>"'
    elif fmt == "mistral":
        start = 'start: "[TOOL_CALLS][" call "]"'
    else:
        start = "start: call"
    return "\n".join([start, call, *rules]) + "\n"
