"""The GGUF frontend against Hugging Face on the same weights: tiny random Llamas written as
llama.cpp's converter writes them (compiler/testing/gguf_files.py: Q/K rows permuted, tied heads
dropped, Q8_0 blocks from gguf's quantizer), then zlc's greedy tokens (reference executor, and the
native `cpu` kernel of a compiled bundle) equal HF generate's. Bad files: one error line naming the
field or tensor, exit 1."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner, Result
from hypothesis import given, settings
from hypothesis import strategies as st

import zlc
from zlc.frontend.gguf import import_gguf, unpermute_qk
from zlc.reference.session import ReferenceSession
from zlc.testing.families import hf_greedy, hf_model
from zlc.testing.gguf_files import permute_qk, quantize_model, write_gguf

gguf = pytest.importorskip("gguf")

PROMPT = [5, 17, 99, 3, 200, 41]
NEW = 8


def zlc_greedy(path: Path, prompt: list[int], new: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens of the lowered GGUF on the reference executor (prefill + cached decode steps)
    and the prefill logits."""
    lowered = zlc.lower(path, options=zlc.CompileOptions(max_seq=64))
    s = ReferenceSession.from_lowered(lowered)
    logits = s.prefill(prompt)
    out = [int(logits[-1].argmax())]
    while len(out) < new:
        out.append(int(s.step(out[-1]).argmax()))
    return out, logits.numpy()


def hf_logits(model: Any, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].numpy()


def cli(*args: Any) -> Result:
    from zlc.cli import cli as root

    return CliRunner().invoke(root, [str(a) for a in args], env={"COLUMNS": "240"})


@settings(max_examples=25, deadline=None)
@given(heads=st.integers(1, 6), half=st.integers(1, 8), cols=st.integers(0, 5))
def test_unpermute_inverts_the_converters_permutation(heads: int, half: int, cols: int) -> None:
    shape = (heads * 2 * half,) + ((cols,) if cols else ())
    w = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(unpermute_qk(permute_qk(w, heads), heads), w)


def test_llama_matches_hugging_face(tmp_path: Path) -> None:
    m = hf_model("llama")
    path = write_gguf(m, tmp_path / "llama.gguf")
    got, logits = zlc_greedy(path, PROMPT, NEW)
    assert got == hf_greedy(m, PROMPT, NEW)
    np.testing.assert_allclose(logits, hf_logits(m, PROMPT), atol=1e-4, rtol=1e-4)
    # Q/K as stored (llama.cpp's interleaved-pair order) would be wrong under rotate-half RoPE:
    g = import_gguf(path, 64)
    assert "output.weight" in g.consts and not g.metadata.get("tied_embeddings")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_matches_hugging_face(tmp_path: Path, family: str) -> None:
    """Qwen2's q/k/v biases, Qwen3's per-head q/k norms; neither is permuted by llama.cpp."""
    m = hf_model(family)
    path = write_gguf(m, tmp_path / f"{family}.gguf")
    ops = import_gguf(path, 64).op_histogram()
    assert ops["RMSNorm"] == 2 * 2 + 1 + (4 if family == "qwen3" else 0)
    got, logits = zlc_greedy(path, PROMPT, NEW)
    assert got == hf_greedy(m, PROMPT, NEW)
    np.testing.assert_allclose(logits, hf_logits(m, PROMPT), atol=1e-4, rtol=1e-4)


def test_tied_embeddings_without_output_weight(tmp_path: Path) -> None:
    m = hf_model("llama")
    m.lm_head.weight = m.model.embed_tokens.weight
    m.config.tie_word_embeddings = True
    path = write_gguf(m, tmp_path / "tied.gguf")
    g = import_gguf(path, 64)
    head = next(n for n in g.nodes if n.op == "LMHead")
    assert head.inputs[1] is g.consts["token_embd.weight"] and g.metadata["tied_embeddings"]
    got, logits = zlc_greedy(path, PROMPT, NEW)
    assert got == hf_greedy(m, PROMPT, NEW)
    np.testing.assert_allclose(logits, hf_logits(m, PROMPT), atol=1e-4, rtol=1e-4)


def test_q8_0_weights_match_hugging_face_on_the_dequantized_weights(tmp_path: Path) -> None:
    q8 = gguf.GGMLQuantizationType.Q8_0
    m = hf_model("llama")
    path = write_gguf(m, tmp_path / "q8.gguf", qtype=q8)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == q8 and types["blk.1.ffn_down.weight"] == q8
    quantize_model(m, q8)  # the same round trip as the file's blocks
    got, logits = zlc_greedy(path, PROMPT, NEW)
    assert got == hf_greedy(m, PROMPT, NEW)
    np.testing.assert_allclose(logits, hf_logits(m, PROMPT), atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def chat_gguf_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Result, Any]:
    """The tiny byte-level chat Llama as a GGUF with a tokenizer and no chat template, compiled
    for the CPU by `zlc compile` (its tokenizer comes from the same file)."""
    tmp = tmp_path_factory.mktemp("gguf")
    m = hf_model("llama-chat")
    path = write_gguf(m, tmp / "chat.gguf", tokenizer=True)
    out = tmp / "chat.zlc"
    res = cli("compile", path, "--target", "cpu", "--max-seq", "64", "-o", out)
    assert res.exit_code == 0, res.output
    return out, res, m


def test_bundle_native_tokens_equal_hugging_face(chat_gguf_bundle: tuple[Path, Result, Any]) -> None:
    out, _, m = chat_gguf_bundle
    man = json.loads((out / "manifest.json").read_text())
    assert man["verification"]["status"] == "passed" and man["native"].get("levels"), man["native"]
    with zlc.load(out) as b:
        assert b.generate(PROMPT, NEW, device="cpu") == hf_greedy(m, PROMPT, NEW)


def test_tokenizer_and_default_chat_template_from_the_file(chat_gguf_bundle: tuple[Path, Result, Any]) -> None:
    from zlc.runtime.tokenizer import DEFAULT_GGUF_CHAT_TEMPLATE, BundleTokenizer

    out, res, _ = chat_gguf_bundle
    assert sum("no chat template" in ln for ln in res.output.splitlines()) == 1, res.output
    cfg = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == DEFAULT_GGUF_CHAT_TEMPLATE and cfg["eos_token_ids"] == [258]
    tok = BundleTokenizer(out / "tokenizer")
    ids = tok.encode_chat("héllo")
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"


def test_verify_inspect_and_run_read_gguf(tmp_path: Path) -> None:
    m = hf_model("llama")
    path = write_gguf(m, tmp_path / "llama.gguf")
    res = cli("run", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "4", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.strip().splitlines()[-1])["generated"] == hf_greedy(m, PROMPT, 4)
    res = cli("verify", path, "--steps", "4")
    assert res.exit_code == 0, res.output
    assert "imported GGUF graph" in res.output
    res = cli("inspect", path, "--ir", "--after", "import")
    assert res.exit_code == 0, res.output
    assert res.output.count("= Attention(") == 2 and "LMHead(" in res.output


# ---- bad input: one line naming the field or tensor, exit 1 ---------------------------------------

def _write_other_arch(path: Path) -> Path:
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _truncated(path: Path) -> Path:
    write_gguf(hf_model("llama"), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 2 // 3])
    return path


BAD: dict[str, tuple[Any, str]] = {
    "architecture": (_write_other_arch, "'general.architecture' = 'mamba' is not supported"),
    "truncated": (_truncated, "truncated"),
    "kv heads": (lambda p: write_gguf(hf_model("llama"), p, config={"num_key_value_heads": 3}),
                 "'llama.attention.head_count' (4) is not a multiple of 'llama.attention.head_count_kv' (3)"),
    "shape": (lambda p: write_gguf(hf_model("llama"), p, config={"intermediate_size": 96}),
              "tensor 'blk.0.ffn_gate.weight' has shape [128, 64] but the metadata implies [96, 64]"),
    "tensor type": (lambda p: write_gguf(hf_model("llama"), p,
                                               raw_types={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.Q8_1}),
                    "tensor 'blk.0.ffn_up.weight' has type Q8_1"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_gguf_is_one_error_line(tmp_path: Path, case: str) -> None:
    make, expect = BAD[case]
    path = make(tmp_path / "bad.gguf")
    res = cli("compile", path, "--target", "cpu", "-o", tmp_path / "out.zlc")
    assert res.exit_code == 1, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.stderr
    assert "bad.gguf" in lines[0] and expect in lines[0], lines[0]
    assert not (tmp_path / "out.zlc").exists()


def test_a_gated_pair_in_two_formats_stays_dense_and_says_why(tmp_path: Path) -> None:
    """One descriptor word holds the gated pair's format: gate Q8_0 beside up Q4_0 is dequantized
    (both named in the report's reasons); the other matrices keep the file's blocks."""
    q = gguf.GGMLQuantizationType
    path = write_gguf(hf_model("llama"), tmp_path / "pair.gguf", qtype=q.Q4_0,
                      types={"blk.0.ffn_gate.weight": q.Q8_0})
    g = import_gguf(path, 64)
    gate, up = g.consts["blk.0.ffn_gate.weight"], g.consts["blk.0.ffn_up.weight"]
    assert gate.quant is None and up.quant is None
    dense = g.metadata["gguf"]["dense"]
    assert "gated pair 'blk.0.ffn_up.weight' is q4_0" in dense["blk.0.ffn_gate.weight"]
    assert g.consts["blk.1.ffn_gate.weight"].quant is not None and g.metadata["gguf"]["packed"]["blk.0.attn_q.weight"] == "q4_0"


def test_a_gpu_target_gets_the_exact_dequantization(tmp_path: Path) -> None:
    """With a GPU target a matrix whose format the Triton kernel does not stream (q5_0) keeps only
    its exact dequantization (listed dense with the reason), as the reference reads it; the formats
    it streams (q4_1) stay packed."""
    q_ = gguf.GGMLQuantizationType
    path = write_gguf(hf_model("llama"), tmp_path / "q41.gguf", qtype=q_.Q4_1, types={"blk.0.ffn_down.weight": q_.Q5_0})
    res = zlc.compile(path, targets=["a10", "cpu"], out=tmp_path / "x.zlc", max_seq=64, verify=False,
                      stop_after="quantize")
    q = res.build.quantization
    assert "q5_0 dequantized: the Triton kernel (a10)" in q["dense"]["blk.0.ffn_down.weight"]
    assert q["formats"] == {"q4_1": q["packed"]} and q["tensors"]["blk.0.ffn_up.weight"] == "q4_1"
    consts = res.build.lowered.decode.consts.values()
    assert [v.name for v in consts if v.name.endswith("ffn_down.weight") and v.quant is None] == ["blk.0.ffn_down.weight"]
