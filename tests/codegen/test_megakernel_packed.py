"""The Triton megakernel streaming packed GGUF blocks (q8_0, q4_0, q4_1: zlc.targets), in
Triton's interpreter. One tiny Llama GGUF compiled for a GPU and the CPU target keeps its blocks
(manifest.quantization): q4_1 in layer 0, q4_0 / q8_0 in layer 1 (the gated pair shares one
format), a tied q8_0 embedding whose LM head streams the blocks as its own copy, a q5_0 matrix that
the Triton kernel does not stream (dense, said why). Oracle: the reference executor on the bundle's
blocks dequantized by gguf (max abs 1e-4, equal greedy tokens), decode equals prefill; on the cpu
tiling (prefill's tl.dot tiles dequantized in registers, decode's blocks body) and on the GPU's
shape of work (one 16-column block per task, split-KV partials merged by a packed o projection).
The planes the runtime lays the blocks out in dequantize exactly as gguf's own blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from megakernel_cases import assert_decode_equals_prefill
from megakernel_checks import ATOL, Built, gpu_like

import zlc
from zlc.ir.quant import quantize
from zlc.runtime.q_planes import to_planes
from zlc.targets import TRITON_WEIGHT_FORMATS

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
TYPES = {
    **{f"blk.0.{m}.weight": Q.Q4_1 for m in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                            "ffn_down")},
    "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.Q5_0,
    "blk.1.attn_output.weight": Q.Q4_0, "blk.1.ffn_gate.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q8_0,
    "blk.1.ffn_down.weight": Q.Q4_1, "token_embd.weight": Q.Q8_0,
}
PROMPT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    from zlc.testing.families import hf_model
    from zlc.testing.gguf_files import write_gguf

    tmp = tmp_path_factory.mktemp("triton-packed")
    m = hf_model("llama", hidden_size=64, intermediate_size=128, head_dim=16, tie_word_embeddings=True)
    path = write_gguf(m, tmp / "packed.gguf", types=TYPES)
    out = tmp / "packed.zlc"
    return out, zlc.compile(path, targets=["a10", "cpu"], out=out, max_seq=64)


def _run(s: Any, ref: Any, steps: int = 3) -> tuple[list[float], list[int], list[int]]:
    """Prefill (all logits) then `steps` decode steps fed the reference's greedy tokens: the max abs
    error per launch, the kernel's tokens and the reference's."""
    ref.reset()
    tok, lg = s.prefill(PROMPT, all_logits=True, want_logits=True)
    _, want = ref.prefill(PROMPT, all_logits=True, want_logits=True)
    errs, got, exp = [float(np.abs(lg - want).max())], [tok], [int(want[-1].argmax())]
    for _ in range(steps):
        tok, lg = s.step(exp[-1], want_logits=True)
        _, w = ref.step(exp[-1], want_logits=True)
        errs.append(float(np.abs(lg - w).max()))
        got.append(tok)
        exp.append(int(w[-1].argmax()))
    return errs, got, exp


def test_gpu_compile_keeps_the_triton_formats_packed(packed: tuple[Path, Any]) -> None:
    _, res = packed
    q = res.manifest["quantization"]
    assert q["formats"] == {"q4_1": 8, "q4_0": 2, "q8_0": 4}  # 7 + 1 ffn_down; 2 q4_0; attn_k, gate, up, head
    # the tied head streams the table's blocks; the embedding reads a dense copy (Triton reads no packed table)
    assert q["tensors"]["token_embd.weight"] == "q8_0"
    assert "reads no packed embedding table" in q["dense"]["token_embd.weight.dense"]
    assert "the Triton kernel (a10) does not stream this format" in q["dense"]["blk.1.attn_v.weight"]
    assert sorted(res.manifest["weights"]["Q"]["formats"]) == ["q4_0", "q4_1", "q8_0"]
    assert set(res.manifest["kernel"]["features"]) >= {"q4_0", "q4_1", "q8_0"}


def test_triton_kernel_streams_blocks_on_the_cpu_tiling(packed: tuple[Path, Any]) -> None:
    out, _ = packed
    ref = zlc.load(out).session("reference")
    s = Built(out, None).session()
    try:
        errs, got, exp = _run(s, ref)
        assert max(errs) <= ATOL, errs
        assert got == exp
        assert_decode_equals_prefill(s, PROMPT, 3)
    finally:
        s.close()


def test_triton_kernel_streams_blocks_with_the_gpu_shape_of_work(packed: tuple[Path, Any], program_bundle: Any,
                                                                 tmp_path: Path) -> None:
    """16 columns per task, split-KV merged by the packed o projection as it loads its row, the MLP
    down left unfused (its weights are packed), rows of 2 and 4 blocks in steps of 8 (masked)."""
    from zlc.codegen.schedule import schedule

    out, res = packed
    b = zlc.load(out)
    graphs = {"decode": res.build.lowered.decode}
    program = schedule(graphs["decode"], gpu_like(block_k=64, fuse_mlp_down=True), b.max_seq)
    assert any(k.endswith(".merged") for k in program.desc_labels)
    path = program_bundle(out, tmp_path / "gpu-like.zlc", program)
    s = Built(path, None).session()
    try:
        errs, got, exp = _run(s, b.session("reference"), steps=2)
        assert max(errs) <= ATOL, errs
        assert got == exp
    finally:
        s.close()


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(sorted(TRITON_WEIGHT_FORMATS)), st.integers(1, 5), st.integers(1, 4),
       st.integers(0, 2**31))
def test_planes_dequantize_exactly_as_the_blocks(fmt: str, n: int, kb: int, seed: int) -> None:
    """Reading the planes as the kernel does (quants, then f16 d, then f16 m) gives gguf's dequantization."""
    w = np.random.default_rng(seed).normal(size=(n, 32 * kb)).astype(np.float32)
    q = quantize(w, fmt)
    planes = to_planes(q.blocks, fmt)
    assert planes.nbytes == q.nbytes
    qbytes = 32 if fmt == "q8_0" else 16
    quants = planes[:n * kb * qbytes].reshape(n, kb, qbytes)
    d = planes[n * kb * qbytes:].view(np.float16)[:n * kb].reshape(n, kb, 1).astype(np.float32)
    if fmt == "q8_0":
        got = d * quants.view(np.int8).astype(np.float32)
    else:
        nib = np.concatenate([quants & 15, quants >> 4], axis=2).astype(np.float32)
        m = (planes[n * kb * qbytes:].view(np.float16)[n * kb:].reshape(n, kb, 1).astype(np.float32)
             if fmt == "q4_1" else -8.0 * d)
        got = d * nib + m
    np.testing.assert_array_equal(got.reshape(n, -1), q.dequantize())
