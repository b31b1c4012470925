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


# ---- families whose positions the KV cache must rebase ------------------------------------------
# OPT (learned positions at CumSum(mask) - 1 + 2), GPT-J and CodeGen (sin/cos rows gathered at
# Range(0, T)), Cohere (frequencies times Range(0, T)): prefill was always exact, and every decode
# step used to count from position 0, printing wrong tokens with exit code 0.

POSITION_FAMILIES = ["opt", "gptj", "codegen", "cohere"]
PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8


def _hf_greedy(family: str) -> list[int]:
    return zoo.hf_greedy(family, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("family", POSITION_FAMILIES)
def test_zlc_run_onnx_gives_hugging_faces_greedy_tokens(family: str) -> None:
    from click.testing import CliRunner

    from zlc.cli import cli

    res = CliRunner().invoke(cli, ["run", str(zoo.cached("stateless", family, 20)), "--prompt-ids",
                                   ",".join(map(str, PROMPT)), "--max-new-tokens", str(NEW_TOKENS), "--json"])
    assert res.exit_code == 0, res.output
    import json

    assert json.loads(res.stdout)["generated"] == _hf_greedy(family)


@pytest.mark.parametrize("family", [*POSITION_FAMILIES, "granite", "stablelm", "phi", "gpt_neox"])
def test_the_torch_export_route_gives_hugging_faces_greedy_tokens(family: str) -> None:
    import torch

    import zlc
    from zlc.reference.session import ReferenceSession

    opts = zlc.CompileOptions(max_seq=32)
    lowered = zlc.lower(zoo.hf_model(family), (torch.tensor([PROMPT]),), options=opts)
    assert ReferenceSession.from_lowered(lowered).generate(PROMPT, NEW_TOKENS) == _hf_greedy(family)
    from zlc.verifier import megakernel_fit

    # GPT-J's and CodeGen's sin/cos rows are raised to Embedding(table, Positions(ids)) before
    # their rotary, which reads the ids' extent only (tests/test_family_torch_rotary.py)
    assert megakernel_fit(lowered.decode, lowered.max_seq).compilable


@pytest.mark.parametrize(("kind", "family"), [("stateless", "codegen"), ("optimum_kv", "gptj")])
def test_a_refused_rotary_verifies_but_does_not_fit_the_megakernel(kind: str, family: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With their interleaved rotary refused by raising (a model whose rotary raising does not
    recognise), the numbers still agree with ONNX Runtime; the report says the kernel cannot run it,
    and why."""
    from zlc.passes import raise_rope_forms

    monkeypatch.setattr(raise_rope_forms, "rotary_tables", lambda *a, **k: "refused for the test")
    rep = verify(zoo.cached(kind, family, 20), steps=8, max_seq=64)
    assert rep.ok, rep.summary()
    assert not rep.compilable and rep.megakernel
    assert rep.compilable_line().startswith("compilable: no (")
    assert any(line.startswith("rotary embedding") for line in rep.megakernel), rep.megakernel


# ---- OPT, Granite, Starcoder2, OLMo through the megakernel ------------------------------------
# raise-rows (passes/raise_rows.py) folds OPT's q scale into the q projection and runs its
# feed-forward block on [1, T, H]; its learned positions are a table from row 2 (positions.py).
# Granite's residual multipliers fold into the o_proj / down_proj weights, its logits_scaling into
# the final norm's gain; its embedding multiplier is the kernel's embedding scale (Gemma's).
# Starcoder2 (biases, GELU MLP, LayerNorm) and OLMo (parameter-free LayerNorm) needed nothing new.
# StableLM, Phi-2, GPT-NeoX: partial rotary is one RoPE over the head (rope_partial); Phi-2's and
# GPT-NeoX's parallel blocks sum (x + attn) + mlp, each Add a projection's epilogue, and GPT-NeoX's
# per-head fused QKV becomes three projections (raise-blocks, passes/raise_blocks.py). Cohere's
# interleaved rotary (x*cos + flatten(stack(-x[..., 1::2], x[..., ::2]))*sin) is RoPE(interleaved=1);
# GPT-J's is the same on the first 8 features of [B, T, H, D], before the heads' transpose;
# CodeGen's fused QKV in mp_num groups ([q_g v_g k_g]) is three projections like GPT-NeoX's.

ROTARY_FAMILIES = ["stablelm", "phi", "gpt_neox", "cohere", "gptj", "codegen"]


@pytest.mark.parametrize(("kind", "family"), [("stateless", "opt"), ("optimum_kv", "opt"), ("stateless", "granite"),
                                              ("stateless", "starcoder2"), ("stateless", "olmo"),
                                              *[("stateless", f) for f in ROTARY_FAMILIES],
                                              ("optimum_kv", "gptj"), ("optimum_kv", "codegen")])
def test_verifies_and_fits_the_megakernel(kind: str, family: str) -> None:
    rep = verify(zoo.cached(kind, family, 20), steps=8, max_seq=64)
    assert rep.ok and rep.compilable, (rep.summary(), rep.megakernel)


@pytest.mark.parametrize("family", ["opt", "granite", "starcoder2", "olmo", *ROTARY_FAMILIES])
def test_bundle_gives_hugging_faces_greedy_tokens(family: str, tmp_path: Path) -> None:
    """`zlc compile` (verified against ONNX Runtime), then the bundle's Triton kernel in the
    interpreter and its native C kernel: both print Hugging Face's greedy tokens."""
    pytest.importorskip("triton")
    from bundle_checks import DEVICES, bundle_greedy, compile_bundle

    out = tmp_path / f"{family}.zlc"
    compile_bundle(zoo.cached("stateless", family, 20), out, "--max-seq", "64")
    assert bundle_greedy(out, PROMPT, NEW_TOKENS) == dict.fromkeys(DEVICES, _hf_greedy(family))


@pytest.mark.parametrize("family", ["llama", "gpt2", "gemma"])
def test_core_families_fit_the_megakernel(family: str) -> None:
    rep = verify(zoo.cached("stateless", family, 20), steps=4, max_seq=64)
    assert rep.ok and rep.compilable and rep.compilable_line() == "compilable: yes", rep.megakernel
