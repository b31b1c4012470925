"""Tool calls in the model's text, both ways (runtime/serve/ingress/toolcalls.py), and the request side
(runtime/serve/ingress/tools.py): random calls rendered as the model emits them parse back to themselves
whatever the stream's chunking (Hypothesis), text that is no call stays text, the template's tool
format is detected from its text, the default format's prompt, the forced call's llguidance grammar
compiles, and bad tools are one 400 naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.runtime.serve.ingress.api_anthropic import ANTHROPIC
from zlc.runtime.serve.ingress.api_common import ApiError
from zlc.runtime.serve.ingress.api_openai import OPENAI
from zlc.runtime.serve.ingress.toolcalls import (
    FORMATS,
    OPENER,
    ToolCall,
    ToolCallStream,
    render_calls,
    split_reply,
)
from zlc.runtime.serve.ingress.tools import NAMED, detect_format, render_args, tool_call_grammar

TEXT = st.characters(blacklist_categories=("Cs",))
SCALAR = st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(TEXT, max_size=12)
VALUE = st.recursive(SCALAR, lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(TEXT, max_size=6), v,
                                                                                  max_size=3), max_leaves=8)
CALL = st.builds(ToolCall, st.from_regex(r"[A-Za-z_][A-Za-z0-9_.-]{0,24}", fullmatch=True),
                 st.dictionaries(st.text(TEXT, max_size=8), VALUE, max_size=4))


def events(fmt: str, text: str, cuts: list[int]) -> list[tuple[str, Any]]:
    """The stream's events for `text` fed in pieces cut at `cuts`, text events merged."""
    s = ToolCallStream(fmt)
    out: list[tuple[str, Any]] = []
    bounds = [0, *sorted(c % (len(text) + 1) for c in cuts), len(text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        out += s.feed(text[a:b])
    merged: list[tuple[str, Any]] = []
    for kind, v in out + s.finish():
        if kind == "text" and merged and merged[-1][0] == "text":
            merged[-1] = ("text", merged[-1][1] + v)
        else:
            merged.append((kind, v))
    return merged


@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=60, deadline=None)
@given(calls=st.lists(CALL, min_size=1, max_size=3), prefix=st.text(TEXT, max_size=20),
       cuts=st.lists(st.integers(0, 10**6), max_size=8))
def test_rendered_calls_parse_back_whatever_the_chunking(fmt: str, calls: list[ToolCall], prefix: str,
                                                        cuts: list[int]) -> None:
    if fmt == "llama3" or OPENER[fmt] in prefix or not prefix.strip():
        prefix = ""  # Llama 3's JSON calls open the reply; a prefix of whitespace only is no text
    text = prefix + render_calls(calls, fmt)
    want = ([("text", prefix)] if prefix else []) + [("call", c) for c in calls]
    assert events(fmt, text, cuts) == want
    assert split_reply(text, fmt) == want


@pytest.mark.parametrize(("fmt", "text"), [
    ("hermes", "plain answer"),
    ("hermes", "look: <tool_call>\n{not json}\n</tool_call> done"),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", "cut short <tool_ca"),
    ("llama3", '{"a": 1} is a JSON answer'),
    ("llama3", "The answer is {\"name\": \"f\", \"parameters\": {}}"),  # a call only opens the reply
    ("mistral", "[TOOL_CALLS] not json"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": 3}]'),
])
def test_text_that_is_no_call_stays_text(fmt: str, text: str) -> None:
    assert events(fmt, text, [3, 9, 17]) == [("text", text)]


def test_call_formats_the_models_emit() -> None:
    got = split_reply('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
                      "llama3")
    assert got == [("call", ToolCall("f", {"x": 1})), ("call", ToolCall("g", {}))]
    assert split_reply('[TOOL_CALLS]get[ARGS]{"city": "Oslo"}', "mistral") == [("call", ToolCall("get", {"city": "Oslo"}))]
    # a closer inside an argument's string does not end the call; the call needs no closer at the reply's end
    text = '<tool_call>\n{"name": "echo", "arguments": {"s": "</tool_call>"}}\n</tool_call>'
    assert split_reply(text, "hermes") == [("call", ToolCall("echo", {"s": "</tool_call>"}))]
    assert split_reply('<tool_call>\n{"name": "f", "arguments": {}}', "hermes") == [("call", ToolCall("f", {}))]
    # the arguments as a JSON string (some models) are read as the object
    assert split_reply('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>', "hermes") == [
        ("call", ToolCall("f", {"a": 2}))]


QWEN_LIKE = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
             "</tools>\nCall with <tool_call>...</tool_call><|im_end|>\n{% endif %}"
             "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}"
             "</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
             "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
             "{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_LIKE = ("{% if tools %}Respond in the format {\"name\": function name, \"parameters\": dictionary}."
              "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
MISTRAL_LIKE = ("{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}"
                "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}{% else %}{{ m.content }}{% endif %}"
                "{% endfor %}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}")
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize(("template", "fmt", "native"), [
    (QWEN_LIKE, "hermes", True), (LLAMA_LIKE, "llama3", True), (MISTRAL_LIKE, "mistral", True),
    (CHATML, "hermes", False)])
def test_the_tool_format_is_the_templates(template: str, fmt: str, native: bool) -> None:
    assert detect_format(template) == (fmt, native)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}


def chat_with_tool_turns(api: Any, tools: bool = True) -> Any:
    """A conversation with one call and its result, as the API parses it."""
    if api is OPENAI:
        body = {"model": "m", "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}]}
        if tools:
            body["tools"] = [WEATHER]
    else:
        body = {"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Oslo"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "-3 C, snow"}]}]}]}
        if tools:
            f = WEATHER["function"]
            body["tools"] = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}]
    return api.parse(body, "m")


@pytest.mark.parametrize("api", [OPENAI, ANTHROPIC])
def test_tool_turns_render_through_a_template_with_a_tool_format(api: Any) -> None:
    _, prompt = chat_with_tool_turns(api)
    messages, tools = render_args(prompt.chat, prompt.tools, QWEN_LIKE)
    assert tools == [WEATHER]
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert messages[2] == {"role": "tool", "tool_call_id": messages[1]["tool_calls"][0]["id"],
                           "name": "get_weather" if api is ANTHROPIC else "", "content": "-3 C, snow"}


@pytest.mark.parametrize("api", [OPENAI, ANTHROPIC])
def test_the_default_format_for_a_template_without_one(api: Any, tmp_path: Path) -> None:
    from zlc.runtime.serve.ingress.prompts import PromptEncoder
    from zlc.runtime.tokenizer import BundleTokenizer
    from zlc.testing import zoo

    encoder = PromptEncoder(BundleTokenizer(zoo.save_chat_tokenizer(tmp_path)), 4096)
    _, prompt = chat_with_tool_turns(api)
    (text,) = encoder.texts(prompt)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in system
    assert '<|im_start|>assistant\n' in text and '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
        '\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n-3 C, snow\n</tool_response><|im_end|>" in text
    assert prompt.tools is not None and (prompt.tools.fmt, prompt.tools.native) == ("hermes", False)
    # tool_choice none: the tools are not offered, the earlier turns still render
    _, prompt = chat_with_tool_turns(api, tools=False)
    (plain,) = encoder.texts(prompt)
    assert "# Tools" not in plain and "<tool_response>" in plain


def parse(api: Any, **fields: Any) -> Any:
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **fields}
    return api.parse(body, "m")


SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


@pytest.mark.parametrize(("api", "fields", "param", "words"), [
    (OPENAI, {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function"
     ".parameters", "JSON schema object"),
    (OPENAI, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
                                                                                        {"a": {"type": 5}}}}}]},
     "tools[0].function.parameters", "not a valid JSON schema"),
    (OPENAI, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "type 'object'"),
    (OPENAI, {"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name", "names no tool"),
    (OPENAI, {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (ANTHROPIC, {"tools": [{"name": "f", "input_schema": "object"}]}, "tools.0.input_schema", "JSON schema object"),
    (ANTHROPIC, {"tools": [{"name": "f"}]}, "tools", "input_schema: Field required"),
    (ANTHROPIC, {"tools": [{"name": "f", "input_schema": SCHEMA}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice.name", "names no tool"),
    (ANTHROPIC, {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools", "server tool"),
    (ANTHROPIC, {"tools": [{"name": "f", "input_schema": SCHEMA}] * 2}, "tools", "used twice"),
])
def test_bad_tools_are_one_400_naming_the_field(api: Any, fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as e:
        parse(api, **fields)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message
    assert "\n" not in e.value.message


def test_a_forced_call_sets_the_grammar_a_named_choice_one_tool() -> None:
    tools = [{"name": "f", "input_schema": SCHEMA}, {"name": "g", "input_schema": {"type": "object"}}]
    spec, prompt = parse(ANTHROPIC, tools=tools, tool_choice={"type": "tool", "name": "g"})
    render_args(prompt.chat, prompt.tools, QWEN_LIKE)
    assert spec.tools is prompt.tools and spec.tools.choice == NAMED and spec.tools.grammar is not None
    assert '"const": "g"' in spec.tools.grammar and '"const": "f"' not in spec.tools.grammar
    for choice in ({"type": "auto"}, {"type": "none"}):
        spec, prompt = parse(ANTHROPIC, tools=tools, tool_choice=choice)
        render_args(prompt.chat, prompt.tools, QWEN_LIKE)
        assert spec.tools.grammar is None
    spec, prompt = parse(OPENAI, tools=[WEATHER], tool_choice="none")
    assert not spec.tools.offered  # neither offered nor parsed
    assert render_args(prompt.chat, prompt.tools, QWEN_LIKE)[1] is None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_call_grammars_compile_in_llguidance(fmt: str, choice: str) -> None:
    llguidance = pytest.importorskip("llguidance")
    tools = [WEATHER, {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}}]
    grammar = tool_call_grammar(tools, choice, "get_weather", fmt)
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar)) == ""


JUNK = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=6),
                    lambda v: st.lists(v, max_size=3) | st.dictionaries(st.text(max_size=6), v, max_size=3),
                    max_leaves=6)
SCHEMAS = st.sampled_from([SCHEMA, {"type": "object"}, {"type": "string"}, {"$schema": [1]}]) | JUNK


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["f", "g"]) | JUNK, schema=SCHEMAS,
       choice=st.sampled_from(["auto", "none", "required", {"type": "any"}, {"type": "tool", "name": "f"},
                               {"type": "function", "function": {"name": "f"}}]) | JUNK,
       openai_api=st.booleans(), template=st.sampled_from([QWEN_LIKE, LLAMA_LIKE, MISTRAL_LIKE, CHATML]))
def test_any_tools_are_rendered_or_one_400(name: Any, schema: Any, choice: Any, openai_api: bool,
                                           template: str) -> None:
    """Whatever the tools and tool_choice: a 400 naming a field, or a request whose chat renders."""
    if openai_api:
        fields = {"tools": [{"type": "function", "function": {"name": name, "parameters": schema}}], "tool_choice": choice}
    else:
        fields = {"tools": [{"name": name, "input_schema": schema}], "tool_choice": choice}
    try:
        spec, prompt = parse(OPENAI if openai_api else ANTHROPIC, **fields)
    except ApiError as e:
        assert e.status == 400 and e.param is not None and "\n" not in e.message
        return
    messages, tools = render_args(prompt.chat, prompt.tools, template)
    assert (tools is not None) == (prompt.tools.offered and prompt.tools.native)
    assert (spec.tools.grammar is not None) == spec.tools.forced


def test_tools_without_a_chat_template_are_one_400(tmp_path: Path) -> None:
    from zlc.runtime.serve.ingress.prompts import PromptEncoder
    from zlc.runtime.tokenizer import BundleTokenizer
    from zlc.testing import zoo

    folder = zoo.save_chat_tokenizer(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": None}))
    encoder = PromptEncoder(BundleTokenizer(folder), 4096)
    for tools in (True, False):  # tools offered, or only earlier tool turns
        _, prompt = chat_with_tool_turns(OPENAI, tools=tools)
        with pytest.raises(ApiError) as e:
            encoder.texts(prompt)
        assert e.value.status == 400 and e.value.param == "tools" and "no chat template" in e.value.message
    _, prompt = parse(OPENAI, tools=[WEATHER], tool_choice="none")
    assert encoder.texts(prompt) is None  # not offered: the plain text encoding, as without tools
