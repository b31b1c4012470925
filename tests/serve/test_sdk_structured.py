"""Structured output (OpenAI `response_format`) through a real `zlc serve` on the native CPU kernel
and the official `openai` SDK: json_schema answers validate against their schema (`jsonschema`),
streamed and not, greedy and sampled; the SDK's own structured-output example
(`chat.completions.parse` with a pydantic model) gets its parsed object; a schema llguidance cannot
compile or an unknown response_format is one 400 naming the field, and nothing reaches the engine."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from serve_helpers import metric

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

MODEL = "llama-chat"
USER = [{"role": "user", "content": "Who?"}]
# bounded so that the tiny random-weight model's answer fits its 128-token context
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "color"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


class Person(pydantic.BaseModel):
    name: Annotated[str, pydantic.StringConstraints(max_length=4)]
    age: Annotated[int, pydantic.Field(ge=0, le=99)]
    ok: bool


@pytest.fixture(scope="module")
def cpu_server(chat_bundle: Path, server_process: Any) -> Iterator[Any]:
    """The server on the native CPU kernel (the engine's batched backend): fast enough for answers
    of ~50 tokens."""
    s = server_process(chat_bundle, "--device", "cpu")
    yield s
    s.stop()


def client(server: Any) -> Any:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0, timeout=120)


def test_json_schema_answers_validate_streamed_and_not(cpu_server: Any) -> None:
    o = client(cpu_server)
    for seed, temperature in [(0, 0.0), (3, 1.0), (4, 1.0)]:
        kw: dict[str, Any] = dict(model=MODEL, messages=USER, response_format=FORMAT, temperature=temperature,
                                  seed=seed)
        r = o.chat.completions.create(**kw)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
        streamed, finish = "", None
        for ch in o.chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                streamed += c.delta.content or ""
                finish = c.finish_reason or finish
        assert (streamed, finish) == (text, "stop")


def test_the_sdks_parse_gives_the_pydantic_object(cpu_server: Any) -> None:
    o = client(cpu_server)
    for seed in (1, 2):
        r = o.chat.completions.parse(model=MODEL, messages=USER, response_format=Person, temperature=0.8, seed=seed)
        person = r.choices[0].message.parsed
        assert isinstance(person, Person) and 0 <= person.age <= 99 and len(person.name) <= 4


def test_json_object_is_a_json_object(cpu_server: Any) -> None:
    r = client(cpu_server).chat.completions.create(model=MODEL, messages=USER, temperature=0, max_tokens=40,
                                                   response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":  # a random model may still be inside a string at max_tokens
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(("param", "words", "response_format"), [
    ("response_format.json_schema", "Invalid type: foo",
     {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}),
    ("response_format.json_schema", "look-around",
     {"type": "json_schema", "json_schema": {"name": "x", "strict": True,
                                             "schema": {"type": "string", "pattern": "(?=a)"}}}),
    ("response_format.json_schema", "name", {"type": "json_schema", "json_schema": {"schema": SCHEMA}}),
    ("response_format.type", "'yaml'", {"type": "yaml"}),
])
def test_a_bad_response_format_is_one_400_naming_the_field(cpu_server: Any, param: str, words: str,
                                                           response_format: dict[str, Any]) -> None:
    before = metric(cpu_server, "zlc_prompt_tokens_total")
    with pytest.raises(openai.BadRequestError) as e:
        client(cpu_server).chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                                   response_format=response_format)  # type: ignore[arg-type]
    assert e.value.status_code == 400 and e.value.param == param
    assert f"- {param}" in e.value.message and words in e.value.message and "\n" not in e.value.message
    assert metric(cpu_server, "zlc_prompt_tokens_total") == before  # nothing reached the engine
