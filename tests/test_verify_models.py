"""End-to-end oracle: `zlc.verify` against ONNX Runtime on every exporter's graphs.

For each graph: import, raise, synthesize the KV cache, run prefill + decode on the reference
executor, and compare logits with ONNX Runtime (fp32, max abs 1e-3) and greedy tokens. After
raising, attention, norms and MLPs must have no op-level node left.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

from zlc.testing import zoo  # noqa: E402
from zlc.verifier import verify  # noqa: E402

FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "phi3", "gemma"]
LEFTOVER_OK = {"Add", "Mul"}  # residual adds; Gemma's sqrt(hidden) embedding scale
RAISED = {"Embedding", "RMSNorm", "LayerNorm", "Linear", "SplitHeads", "MergeHeads", "RoPE",
          "Attention", "GatedMLP", "MLP", "LMHead", "Positions"}


def _check(path: Path, steps: int = 8) -> None:
    rep = verify(path, steps=steps, max_seq=64)
    assert rep.ok, rep.summary()
    leftover = set(rep.histogram_after) - RAISED - LEFTOVER_OK - {"Concat"}  # Concat: present.* outputs
    assert not leftover, f"op-level nodes left after raising: {rep.histogram_after}"


@pytest.mark.parametrize("opset", [18, 20, 23])
@pytest.mark.parametrize("family", FAMILIES)
def test_stateless_dynamo_export(family: str, opset: int) -> None:
    _check(zoo.cached("stateless", family, opset), steps=32 if (family, opset) == ("llama", 20) else 8)


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma"])
def test_stateless_sdpa_opset23_attention_op(family: str) -> None:
    _check(zoo.cached("stateless_sdpa", family, 23))


@pytest.mark.parametrize("kind", ["optimum_kv", "optimum_kv_dynamo"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2", "phi3"])
def test_optimum_kv_cache_export(kind: str, family: str) -> None:
    _check(zoo.cached(kind, family, 20))


@pytest.mark.parametrize("kind", ["genai", "genai_rope", "genai_mha"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "phi3", "gemma"])
def test_genai_contrib_op_graph(kind: str, family: str) -> None:
    if not zoo.genai_available():
        pytest.skip("onnxruntime-genai's model builder is not installed")
    _check(zoo.cached(kind, family))


@pytest.mark.slow
def test_smollm2_real_model() -> None:
    """The real SmolLM2-135M-Instruct: 32 greedy tokens equal ONNX Runtime's, logits within 1e-3,
    and the chat answer to the capital question."""
    path = zoo.cached_smollm2()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path.parent / "tokenizer.json"))
    prompt = _smollm2_prompt(path)
    rep = verify(path, prompt_ids=prompt, steps=32, max_seq=128)
    assert rep.ok, rep.summary()
    assert set(rep.histogram_after) <= RAISED | {"Add"}, rep.histogram_after
    assert tok.decode(rep.tokens_zlc).startswith("The capital of France is Paris."), tok.decode(rep.tokens_zlc)


def _smollm2_prompt(path: Path) -> list[int]:
    from transformers import AutoTokenizer

    tk = AutoTokenizer.from_pretrained(path.parent)
    ids = tk.apply_chat_template([{"role": "user", "content": zoo.SMOLLM2_PROMPT}], add_generation_prompt=True)
    if hasattr(ids, "input_ids") or isinstance(ids, dict):
        ids = ids["input_ids"]
    return [int(x) for x in np.asarray(ids).reshape(-1)]
