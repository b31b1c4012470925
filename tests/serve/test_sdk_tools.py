"""Tool calling through the official `anthropic` and `openai` SDKs, streaming and not.

A random tiny model rarely calls a tool by itself, so the replies' shapes are tested twice:
- model text with calls in it (what a tool-trained model emits) fed, piece by piece, through the
  reply objects the server uses (MessageReply / CompletionReply, exactly as generate.py feeds them),
  served on loopback to the SDKs: their typed tool-call objects parse the calls, streaming and not;
- a real `zlc serve` on the tiny model: tools offered (auto) or not (none) and tool results in later
  turns, the prompt's tokens those of the rendered tools (the default format for its ChatML
  template), the streamed reply equal to the whole one, bad tools one 400 that reaches no engine
  (slow: the tools' system block needs a bundle with a longer context than the shared one).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from serve_helpers import metric

from zlc.runtime.serve.ingress.api_anthropic import ANTHROPIC
from zlc.runtime.serve.ingress.api_common import Outcome
from zlc.runtime.serve.ingress.api_openai import OPENAI
from zlc.runtime.serve.ingress.toolcalls import ToolCall, render_calls
from zlc.runtime.serve.ingress.tools import default_system_block

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "llama-chat"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                                  "parameters": SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": SCHEMA}]
USER = [{"role": "user", "content": "Weather in Oslo?"}]
CALLS = [ToolCall("get_weather", {"city": "Oslo", "days": 2}), ToolCall("get_weather", {"city": "Bergen"})]
MODEL_TEXT = "I will look that up. " + render_calls(CALLS, "hermes")


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def reply_bytes(api: Any, body: dict[str, Any], text: str) -> tuple[bytes, str]:
    """The server's reply to `body` had the model produced `text` (one token per 3 characters)."""
    spec, prompt = api.parse(body, MODEL)
    if spec.tools is not None:
        spec.tools.fmt = "hermes"  # the tiny model's ChatML template has no tool format: the default
    spec.prompt_ids = [1, 2, 3]
    reply = api.reply(MODEL, spec)
    produced = len(pieces(text))
    outcome = Outcome(text, "eos", None, produced)
    if not spec.stream:
        return reply.body([outcome], produced), "application/json"
    out = reply.stream_head() + b"".join(reply.stream_delta(p) for p in pieces(text))
    return out + reply.stream_end(outcome, produced), "text/event-stream"


@pytest.fixture(scope="module")
def replay() -> Iterator[Any]:
    """A loopback HTTP server answering each POST with the reply objects' bytes for `replay.text`."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["content-length"])))
            api = ANTHROPIC if self.path.endswith("/messages") else OPENAI
            data, kind = reply_bytes(api, body, httpd.text)  # type: ignore[attr-defined]
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.text = MODEL_TEXT  # type: ignore[attr-defined]
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    httpd.base_url = f"http://127.0.0.1:{httpd.server_address[1]}"  # type: ignore[attr-defined]
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def openai_client(base_url: str) -> Any:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="k", max_retries=0, timeout=120)


def anthropic_client(base_url: str) -> Any:
    return anthropic.Anthropic(base_url=base_url, api_key="k", max_retries=0, timeout=120)


def test_openai_sdk_parses_the_tool_calls_streaming_and_not(replay: Any) -> None:
    o = openai_client(replay.base_url)
    r = o.chat.completions.create(model=MODEL, messages=USER, tools=OPENAI_TOOLS)  # type: ignore[arg-type]
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look that up. "
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        (c.name, c.arguments) for c in CALLS]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    text, calls, finish = "", {}, None
    for chunk in o.chat.completions.create(model=MODEL, messages=USER, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                           stream=True):
        d = chunk.choices[0].delta
        text += d.content or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += tc.function.name or "" if tc.function else ""
            entry["arguments"] += tc.function.arguments or "" if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and text == "I will look that up. "
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        (c.name, c.arguments) for c in CALLS]
    # the SDK's own stream accumulator agrees
    with o.chat.completions.stream(model=MODEL, messages=USER, tools=OPENAI_TOOLS) as s:  # type: ignore[arg-type]
        final = s.get_final_completion()
    assert [json.loads(c.function.arguments) for c in final.choices[0].message.tool_calls] == [c.arguments
                                                                                               for c in CALLS]


def test_anthropic_sdk_parses_the_tool_use_blocks_streaming_and_not(replay: Any) -> None:
    a = anthropic_client(replay.base_url)
    m = a.messages.create(model=MODEL, max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["text", "tool_use", "tool_use"]
    assert m.content[0].text == "I will look that up. "
    assert [(b.name, b.input) for b in m.content[1:]] == [(c.name, c.arguments) for c in CALLS]
    with a.messages.stream(model=MODEL, max_tokens=64, messages=USER, tools=ANTHROPIC_TOOLS) as s:  # type: ignore[arg-type]
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use", "tool_use"]
    assert [(b.name, b.input) for b in final.content[1:]] == [(c.name, c.arguments) for c in CALLS]
    assert final.content[0].text == "I will look that up. " and "input_json" in kinds


def test_without_tools_offered_calls_stay_text(replay: Any) -> None:
    o = openai_client(replay.base_url)
    r = o.chat.completions.create(model=MODEL, messages=USER, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                  tool_choice="none")
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == MODEL_TEXT
    assert not r.choices[0].message.tool_calls


# ---- a real zlc serve on the tiny model


@pytest.fixture(scope="module")
def tools_bundle(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny chat model with a context that holds the tools' system block (its byte-level
    tokenizer spends a token per byte: the shared chat bundle's 128 do not)."""
    pytest.importorskip("transformers", reason="exporting the tiny model needs the 'hf' extra")
    import zlc
    from zlc.testing import zoo

    root = tmp_path_factory.mktemp("tools")
    out = root / "llama-chat.zlc"
    zlc.compile(zoo.cached("stateless", "llama-chat", 20), targets=["cpu"], out=out, max_seq=1024,
                tokenizer=zoo.save_chat_tokenizer(root / "tokenizer"), name=MODEL)
    return out


@pytest.fixture(scope="module")
def server(tools_bundle: Any, server_process: Any) -> Iterator[Any]:
    s = server_process(tools_bundle, "--device", "reference", "--request-timeout", "5")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tokenizer(tools_bundle: Any) -> Any:
    import zlc

    return zlc.load(tools_bundle).tokenizer


def tokens_of(tokenizer: Any, messages: list[dict[str, Any]]) -> int:
    return len(tokenizer.encode_chat(messages))


@pytest.mark.slow  # the module's server: a 1,024-token bundle compiled first (~110 s on 2 cores)
def test_tools_offered_or_not_through_a_real_server(server: Any, tokenizer: Any) -> None:
    o = openai_client(server.base_url)
    system = default_system_block(OPENAI_TOOLS)
    r = o.chat.completions.create(model=MODEL, messages=USER, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                  max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == tokens_of(tokenizer, [{"role": "system", "content": system}, *USER])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    text = "".join(c.choices[0].delta.content or "" for c in o.chat.completions.create(
        model=MODEL, messages=USER, tools=OPENAI_TOOLS, max_tokens=8, temperature=0, stream=True)  # type: ignore[arg-type]
        if c.choices)
    assert text == (r.choices[0].message.content or "")
    plain = o.chat.completions.create(model=MODEL, messages=USER, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                      tool_choice="none", max_tokens=8, temperature=0)
    assert plain.usage.prompt_tokens == tokens_of(tokenizer, USER)


@pytest.mark.slow  # the module's server: a 1,024-token bundle compiled first (~110 s on 2 cores)
def test_tool_results_in_later_turns_through_a_real_server(server: Any, tokenizer: Any) -> None:
    a = anthropic_client(server.base_url)
    turns = [*USER,
             {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Oslo"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "-3 C, snow"}]}]
    m = a.messages.create(model=MODEL, max_tokens=8, messages=turns, tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]
    rendered = [{"role": "system", "content": default_system_block(OPENAI_TOOLS)}, *USER,
                {"role": "assistant", "content": render_calls([ToolCall("get_weather", {"city": "Oslo"})], "hermes")},
                {"role": "user", "content": "<tool_response>\n-3 C, snow\n</tool_response>"}]
    assert m.usage.input_tokens == tokens_of(tokenizer, rendered)
    with a.messages.stream(model=MODEL, max_tokens=8, messages=turns, tools=ANTHROPIC_TOOLS) as s:  # type: ignore[arg-type]
        streamed = s.get_final_message()
    assert [b.model_dump() for b in streamed.content] == [b.model_dump() for b in m.content] or any(
        b.type == "tool_use" for b in m.content)  # tool_use ids are fresh per reply
    assert streamed.stop_reason == m.stop_reason
    o = openai_client(server.base_url)
    r = o.chat.completions.create(model=MODEL, max_tokens=8, tools=OPENAI_TOOLS, messages=[  # type: ignore[arg-type]
        *USER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C, snow"}])
    assert r.usage.prompt_tokens == m.usage.input_tokens  # the same conversation, the same prompt


@pytest.mark.slow  # the module's server: a 1,024-token bundle compiled first (~110 s on 2 cores)
def test_bad_tools_are_one_400_and_reach_no_engine(server: Any) -> None:
    before = metric(server, "zlc_prompt_tokens_total")
    o = openai_client(server.base_url)
    with pytest.raises(openai.BadRequestError) as e:
        o.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, tools=[  # type: ignore[arg-type]
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "city"}}}])
    assert e.value.param == "tools[0].function.parameters" and "JSON schema" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        o.chat.completions.create(model=MODEL, messages=USER, max_tokens=2, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                  tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.param == "tool_choice.function.name"
    a = anthropic_client(server.base_url)
    with pytest.raises(anthropic.BadRequestError) as ea:
        a.messages.create(model=MODEL, max_tokens=2, messages=USER, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                          tool_choice={"type": "tool", "name": "nope"})
    assert "tool_choice.name" in ea.value.body["error"]["message"]
    assert metric(server, "zlc_prompt_tokens_total") == before


@pytest.mark.slow  # the module's server (above)
@pytest.mark.parametrize("stream", [False, True])
def test_a_named_tool_choice_is_a_valid_call(server: Any, stream: bool) -> None:
    """A forced call from a random model: the grammar makes it one call of the named tool whose
    arguments validate against its schema, in both SDKs' typed objects."""
    import jsonschema

    # bounded arguments (an enum, a small integer): a random model's call ends within max_tokens
    schema = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Bergen"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["city", "days"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
    o = openai_client(server.base_url)
    forced = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        with o.chat.completions.stream(model=MODEL, messages=USER, tools=tools, tool_choice=forced,  # type: ignore[arg-type]
                                       max_tokens=200) as s:
            r = s.get_final_completion()
    else:
        r = o.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice=forced,  # type: ignore[arg-type]
                                      max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schema)
    a = anthropic_client(server.base_url)
    kwargs: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "messages": USER,
                              "tools": [{"name": "get_weather", "input_schema": schema}],
                              "tool_choice": {"type": "tool", "name": "get_weather"}}
    if stream:
        with a.messages.stream(**kwargs) as s:
            m = s.get_final_message()
    else:
        m = a.messages.create(**kwargs)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and [b.name for b in uses] == ["get_weather"]
    jsonschema.validate(uses[0].input, schema)
