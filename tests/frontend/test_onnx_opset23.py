"""Opset-23+ standard transformer ops (Attention, RotaryEmbedding, RMSNormalization) against ONNX
Runtime's CPU kernels, and the choice between the fused IR op and the primitive decomposition."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

try:
    from .zlc_backend import assert_matches_ort, make_model, run_zlc
except ImportError:
    from zlc_backend import assert_matches_ort, make_model, run_zlc  # type: ignore[no-redef]

RNG = np.random.default_rng(23)


def randn(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def rope_tables(max_pos: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    ang = np.arange(max_pos)[:, None] / (10000 ** (np.arange(half) / half))[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---- RotaryEmbedding-23 -------------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_4d_position_ids(interleaved: int) -> None:
    cos, sin = rope_tables(16, 4)
    feeds = dict(x=randn(2, 3, 5, 8), pos=np.array([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]], np.int64))
    n = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], interleaved=interleaved)
    g = assert_matches_ort(make_model([n], feeds, ["y"], initializers=dict(cos=cos, sin=sin)), feeds)
    assert g.op_histogram() == {"RoPE": 1}


def test_rotary_3d_partial() -> None:
    cos, sin = rope_tables(16, 2)  # rotate 4 of 8 features per head
    feeds = dict(x=randn(1, 5, 3 * 8), pos=np.arange(5, dtype=np.int64)[None])
    n = helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "pos"], ["y"], num_heads=3,
                         rotary_embedding_dim=4)
    assert_matches_ort(make_model([n], feeds, ["y"], initializers=dict(cos=cos, sin=sin)), feeds)


def test_rotary_without_position_ids() -> None:
    """Without position_ids the caches are per token: [B, S, R/2]."""
    feeds = dict(x=randn(2, 2, 4, 8), cos=randn(2, 4, 4), sin=randn(2, 4, 4))
    n = helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"])
    assert_matches_ort(make_model([n], feeds, ["y"]), feeds)


# ---- RMSNormalization-23 ------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [-1, -2])
def test_rms_normalization(axis: int) -> None:
    feeds = dict(x=randn(2, 3, 8))
    w = randn(8) if axis == -1 else randn(3, 8)
    n = helper.make_node("RMSNormalization", ["x", "w"], ["y"], axis=axis, epsilon=1e-5)
    g = assert_matches_ort(make_model([n], feeds, ["y"], initializers=dict(w=w)), feeds)
    assert ("RMSNorm" in g.op_histogram()) == (axis == -1)


# ---- Attention-23/24 ----------------------------------------------------------------------------

def attention(ins: list[str], outs: list[str], **attrs: Any) -> onnx.NodeProto:
    return helper.make_node("Attention", ins, outs, **attrs)


def test_attention_4d_causal_fused() -> None:
    feeds = dict(q=randn(1, 4, 5, 8), k=randn(1, 2, 5, 8), v=randn(1, 2, 5, 8))
    g = assert_matches_ort(make_model([attention(["q", "k", "v"], ["y"], is_causal=1)], feeds, ["y"]), feeds)
    assert g.op_histogram() == {"Attention": 1}


def test_attention_3d_gqa_scale_softcap() -> None:
    feeds = dict(q=randn(2, 3, 4 * 8), k=randn(2, 3, 2 * 8), v=randn(2, 3, 2 * 8))
    n = attention(["q", "k", "v"], ["y"], q_num_heads=4, kv_num_heads=2, is_causal=1, scale=0.2, softcap=2.0)
    g = assert_matches_ort(make_model([n], feeds, ["y"]), feeds)
    assert "Attention" in g.op_histogram()


@pytest.mark.parametrize("past", [0, 3])
def test_attention_causal_with_past_is_bottom_right(past: int) -> None:
    """ONNX (and ORT) align is_causal on the past length: fused IR Attention is exact here."""
    feeds = dict(q=randn(1, 2, 2, 8), k=randn(1, 2, 2, 8), v=randn(1, 2, 2, 8),
                 pk=randn(1, 2, past, 8), pv=randn(1, 2, past, 8))
    outs = ["y", "present_key", "present_value"]
    n = attention(["q", "k", "v", "", "pk", "pv"], outs, is_causal=1)
    g = assert_matches_ort(make_model([n], feeds, outs), feeds)
    assert "Attention" in g.op_histogram()


def test_attention_causal_cross_lengths_is_top_left() -> None:
    """Without a cache, ONNX's causal mask with S_q != S_kv is top-left: decomposed, not fused."""
    feeds = dict(q=randn(1, 2, 2, 8), k=randn(1, 2, 5, 8), v=randn(1, 2, 5, 8))
    g = assert_matches_ort(make_model([attention(["q", "k", "v"], ["y"], is_causal=1)], feeds, ["y"]), feeds)
    assert "Attention" not in g.op_histogram()


@pytest.mark.parametrize("kind", ["bool", "float", "bool_causal"])
def test_attention_masks(kind: str) -> None:
    feeds = dict(q=randn(1, 2, 3, 8), k=randn(1, 2, 4, 8), v=randn(1, 2, 4, 8))
    if kind.startswith("bool"):
        m = RNG.random((3, 4)) > 0.3
        m[:, 0] = True  # keep every row attendable
        feeds["m"] = m
    else:
        feeds["m"] = randn(1, 1, 3, 4)
    n = attention(["q", "k", "v", "m"], ["y"], is_causal=int(kind == "bool_causal"))
    assert_matches_ort(make_model([n], feeds, ["y"]), feeds)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_attention_qk_matmul_output(mode: int) -> None:
    feeds = dict(q=randn(1, 2, 3, 8), k=randn(1, 2, 3, 8), v=randn(1, 2, 3, 8), m=randn(3, 3))
    outs = ["y", "", "", "qk"]
    n = attention(["q", "k", "v", "m"], outs, qk_matmul_output_mode=mode, softcap=1.5)
    assert_matches_ort(make_model([n], feeds, ["y", "qk"]), feeds)


def test_attention_3d_with_past_mask_present() -> None:
    feeds = dict(q=randn(1, 2, 3 * 4), k=randn(1, 2, 3 * 4), v=randn(1, 2, 3 * 4),
                 m=randn(1, 1, 2, 5), pk=randn(1, 3, 3, 4), pv=randn(1, 3, 3, 4))
    outs = ["y", "present_key", "present_value"]
    n = attention(["q", "k", "v", "m", "pk", "pv"], outs, q_num_heads=3, kv_num_heads=3, is_causal=1)
    assert_matches_ort(make_model([n], feeds, outs), feeds)


def _vs_onnx_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    """For what ORT's CPU kernel does not implement, ONNX's reference implementation is the oracle."""
    from onnx.reference import ReferenceEvaluator

    want = ReferenceEvaluator(model).run(None, feeds)
    got = run_zlc(model, feeds)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_attention_short_mask_is_padded() -> None:
    """A mask shorter than the keys is padded with -inf (ORT 1.32's CPU kernel rejects it)."""
    feeds = dict(q=randn(1, 2, 3, 8), k=randn(1, 2, 4, 8), v=randn(1, 2, 4, 8), m=randn(1, 1, 3, 3))
    _vs_onnx_reference(make_model([attention(["q", "k", "v", "m"], ["y"])], feeds, ["y"]), feeds)


def test_attention_24_nonpad_kv_seqlen() -> None:
    """Opset 24: an external cache with per-batch valid lengths (causal offset = nonpad - S_q)."""
    feeds = dict(q=randn(2, 2, 1, 8), k=randn(2, 2, 6, 8), v=randn(2, 2, 6, 8),
                 n=np.array([4, 6], np.int64))
    n = attention(["q", "k", "v", "", "", "", "n"], ["y"], is_causal=1)
    _vs_onnx_reference(make_model([n], feeds, ["y"], opset=24, ms_opset=None), feeds)
