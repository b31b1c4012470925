"""com.microsoft contrib ops: zlc's import (run by the reference executor) against ONNX Runtime's
CPU kernels, on small graphs built with onnx.helper."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from zlc.errors import ZlcError
from zlc.frontend.onnx import import_onnx
from zlc.frontend.onnx_contrib import dequantize_nbits

try:
    from .zlc_backend import assert_matches_ort, make_model, run_ort, run_zlc
except ImportError:
    from zlc_backend import assert_matches_ort, make_model, run_ort, run_zlc  # type: ignore[no-redef]

MS = "com.microsoft"
RNG = np.random.default_rng(1234)


def randn(*shape: int, dtype: type = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


def node(op: str, ins: list[str], outs: list[str], **attrs: Any) -> onnx.NodeProto:
    return helper.make_node(op, ins, outs, domain=MS, **attrs)


def rope_tables(max_pos: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / (10000 ** (np.arange(half) / half))
    ang = np.arange(max_pos)[:, None] * inv[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---- GroupQueryAttention -------------------------------------------------------------------------

B, S, HQ, HKV, D = 1, 3, 4, 2, 16  # ORT's CPU rotary wants head_size % 16 == 0


def _gqa_case(past: int | None, *, rotary: bool = False, interleaved: bool = False, packed: bool = False,
              **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    feeds: dict[str, np.ndarray] = {}
    q, k, v = randn(B, S, HQ * D), randn(B, S, HKV * D), randn(B, S, HKV * D)
    if packed:
        feeds["qkv"] = np.concatenate([q, k, v], -1)
        ins = ["qkv", "", ""]
    else:
        feeds.update(q=q, k=k, v=v)
        ins = ["q", "k", "v"]
    p = past or 0
    if past is not None:
        feeds.update(pk=randn(B, HKV, p, D), pv=randn(B, HKV, p, D))
        ins += ["pk", "pv"]
    else:
        ins += ["", ""]
    feeds.update(seqlens_k=np.array([p + S - 1], np.int32), total=np.array(p + S, np.int32))
    ins += ["seqlens_k", "total"]
    inits = {}
    if rotary:
        inits["cos"], inits["sin"] = rope_tables(32, D // 2)
        ins += ["cos", "sin"]
        attrs.update(do_rotary=1, rotary_interleaved=int(interleaved))
    outs = ["y", "present_key", "present_value"]
    n = node("GroupQueryAttention", ins, outs, num_heads=HQ, kv_num_heads=HKV, **attrs)
    return make_model([n], feeds, outs, initializers=inits), feeds


@pytest.mark.parametrize("past", [None, 0, 2])
@pytest.mark.parametrize("rotary", [False, True])
def test_gqa_past_lengths(past: int | None, rotary: bool) -> None:
    model, feeds = _gqa_case(past, rotary=rotary)
    g = assert_matches_ort(model, feeds)
    assert "Attention" in g.op_histogram()  # causal, new keys == queries: the fused op is exact
    if rotary:
        assert g.op_histogram()["RoPE"] == 2


def test_gqa_rotary_interleaved_packed_decode() -> None:
    model, feeds = _gqa_case(5, rotary=True, interleaved=True, packed=True)
    assert_matches_ort(model, feeds)


def test_gqa_scale_and_softcap() -> None:
    model, feeds = _gqa_case(2, scale=0.2, softcap=3.0)
    assert_matches_ort(model, feeds)


def test_gqa_decode_one_token() -> None:
    global S
    saved, S = S, 1
    try:
        model, feeds = _gqa_case(4, rotary=True)
        assert_matches_ort(model, feeds)
    finally:
        S = saved


def test_gqa_attention_bias() -> None:
    """An additive bias takes the decomposed path; its causal frontier must sit at past_len."""
    model, feeds = _gqa_case(2)
    feeds["bias"] = randn(1, 1, S, 2 + S)
    n = model.graph.node[0]
    n.input.extend(["", "", "", "bias"])  # cos_cache, sin_cache, position_ids, attention_bias
    model.graph.input.append(helper.make_tensor_value_info("bias", 1, [1, 1, S, 2 + S]))
    g = assert_matches_ort(model, feeds)
    assert "Attention" not in g.op_histogram()


def test_gqa_rejects_local_window() -> None:
    model, _ = _gqa_case(0, local_window_size=2)
    with pytest.raises(ZlcError, match="local_window_size"):
        import_onnx(model)


# ---- MultiHeadAttention -------------------------------------------------------------------------

H, DH = 2, 4


def test_mha_self_attention_with_bias() -> None:
    feeds = dict(q=randn(2, 3, H * DH), k=randn(2, 3, H * DH), v=randn(2, 3, H * DH))
    inits = {"bias": randn(3 * H * DH)}
    n = node("MultiHeadAttention", ["q", "k", "v", "bias"], ["y"], num_heads=H)
    assert_matches_ort(make_model([n], feeds, ["y"], initializers=inits), feeds)


@pytest.mark.parametrize("past_len", [0, 3])
def test_mha_unidirectional_with_past(past_len: int) -> None:
    feeds = dict(q=randn(1, 2, H * DH), k=randn(1, 2, H * DH), v=randn(1, 2, H * DH),
                 pk=randn(1, H, past_len, DH), pv=randn(1, H, past_len, DH))
    outs = ["y", "present_key", "present_value"]
    n = node("MultiHeadAttention", ["q", "k", "v", "", "", "", "pk", "pv"], outs, num_heads=H,
             unidirectional=1)
    assert_matches_ort(make_model([n], feeds, outs), feeds)


def test_mha_attention_bias_and_scale() -> None:
    feeds = dict(q=randn(1, 3, H * DH), k=randn(1, 5, H * DH), v=randn(1, 5, H * DH),
                 ab=randn(1, H, 3, 5))
    n = node("MultiHeadAttention", ["q", "k", "v", "", "", "ab"], ["y"], num_heads=H, scale=0.3)
    g = assert_matches_ort(make_model([n], feeds, ["y"]), feeds)
    assert "Softmax" in g.op_histogram()  # an additive bias needs the decomposition


def test_mha_packed_qkv_and_kv() -> None:
    """ORT's CPU kernel lacks packed QKV [B, S, H, 3, D] and packed KV [B, L, H, 2, D]; compare
    with ORT on the same data unpacked."""
    qkv, kv = randn(1, 3, H, 3, DH), randn(1, 4, H, 2, DH)
    q = randn(1, 3, H * DH)
    plain = node("MultiHeadAttention", ["q", "k", "v"], ["y"], num_heads=H)
    for packed_node, feeds, unpacked in [
        (node("MultiHeadAttention", ["qkv"], ["y"], num_heads=H), dict(qkv=qkv),
         {n: qkv[:, :, :, i].reshape(1, 3, H * DH) for i, n in enumerate("qkv")}),
        (node("MultiHeadAttention", ["q", "kv"], ["y"], num_heads=H), dict(q=q, kv=kv),
         dict(q=q, k=kv[:, :, :, 0].reshape(1, 4, H * DH), v=kv[:, :, :, 1].reshape(1, 4, H * DH))),
    ]:
        ref = run_ort(make_model([plain], unpacked, ["y"]), unpacked)[0]
        got = run_zlc(make_model([packed_node], feeds, ["y"]), feeds)[0]
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_mha_cross_attention_projected_kv() -> None:
    feeds = dict(q=randn(1, 3, H * DH), k=randn(1, H, 6, DH), v=randn(1, H, 6, DH))
    n = node("MultiHeadAttention", ["q", "k", "v"], ["y"], num_heads=H)
    assert_matches_ort(make_model([n], feeds, ["y"]), feeds)


def test_mha_rejects_key_padding_mask() -> None:
    feeds = dict(q=randn(1, 3, H * DH), k=randn(1, 3, H * DH), v=randn(1, 3, H * DH),
                 m=np.ones((1, 3), np.int32))
    n = node("MultiHeadAttention", ["q", "k", "v", "", "m"], ["y"], num_heads=H)
    with pytest.raises(ZlcError, match="key_padding_mask"):
        import_onnx(make_model([n], feeds, ["y"]))


# ---- RotaryEmbedding (contrib) ------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["bsd", "bhsd"])
def test_rotary_contrib(interleaved: int, layout: str) -> None:
    cos, sin = rope_tables(16, DH // 2)
    x = randn(2, 3, H * DH) if layout == "bsd" else randn(2, H, 3, DH)
    feeds = dict(x=x, pos=np.array([[0, 1, 2], [5, 6, 7]], np.int64))
    n = node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], interleaved=interleaved)
    assert_matches_ort(make_model([n], feeds, ["y"], initializers=dict(cos=cos, sin=sin)), feeds)


def test_rotary_contrib_offset_and_partial() -> None:
    cos, sin = rope_tables(16, 2)  # rotate 4 of 8 features
    feeds = dict(x=randn(1, 3, H * 8), pos=np.array([4], np.int64))
    n = node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], num_heads=H, rotary_embedding_dim=4)
    assert_matches_ort(make_model([n], feeds, ["y"], initializers=dict(cos=cos, sin=sin)), feeds)


# ---- normalization ------------------------------------------------------------------------------

@pytest.mark.parametrize("domain", ["", MS])
def test_simplified_layer_norm(domain: str) -> None:
    """ORT registers it in the default domain only; zlc also takes com.microsoft (some exporters)."""
    feeds, inits = dict(x=randn(2, 3, 8)), dict(w=randn(8))

    def model(dom: str) -> onnx.ModelProto:
        n = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], domain=dom, epsilon=1e-5)
        return make_model([n], feeds, ["y"], initializers=inits)

    np.testing.assert_allclose(run_zlc(model(domain), feeds)[0], run_ort(model(""), feeds)[0],
                               rtol=1e-5, atol=1e-5)
    assert "RMSNorm" in import_onnx(model(domain)).op_histogram()


def test_simplified_layer_norm_inv_std_output() -> None:
    feeds = dict(x=randn(2, 3, 8))
    n = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y", "inv"], epsilon=1e-5)
    assert_matches_ort(make_model([n], feeds, ["y", "inv"], initializers=dict(w=randn(8))), feeds)


def test_skip_simplified_layer_norm() -> None:
    feeds = dict(x=randn(2, 3, 8), skip=randn(2, 3, 8))
    outs = ["y", "", "", "sum"]
    n = node("SkipSimplifiedLayerNormalization", ["x", "skip", "w", "b"], outs, epsilon=1e-6)
    inits = dict(w=randn(8), b=randn(8))
    assert_matches_ort(make_model([n], feeds, ["y", "sum"], initializers=inits), feeds)


def test_skip_layer_norm() -> None:
    feeds = dict(x=randn(2, 3, 8), skip=randn(2, 3, 8))
    outs = ["y", "", "", "sum"]
    n = node("SkipLayerNormalization", ["x", "skip", "w", "beta", "b"], outs, epsilon=1e-5)
    inits = dict(w=randn(8), beta=randn(8), b=randn(8))
    g = assert_matches_ort(make_model([n], feeds, ["y", "sum"], initializers=inits), feeds)
    assert "LayerNorm" in g.op_histogram()


def test_skip_layer_norm_stats_outputs() -> None:
    feeds = dict(x=randn(2, 3, 8), skip=randn(2, 3, 8))
    outs = ["y", "mean", "inv_std"]
    n = node("SkipLayerNormalization", ["x", "skip", "w"], outs, epsilon=1e-5)
    assert_matches_ort(make_model([n], feeds, outs, initializers=dict(w=randn(8))), feeds)


# ---- Gelu family --------------------------------------------------------------------------------

def test_gelu_family() -> None:
    feeds = dict(x=randn(2, 3, 8))
    inits = dict(b=randn(8))
    nodes = [node("FastGelu", ["x"], ["fast"]), node("FastGelu", ["x", "b"], ["fast_b"]),
             node("BiasGelu", ["x", "b"], ["bias_gelu"]), node("QuickGelu", ["x"], ["quick"]),
             node("QuickGelu", ["x"], ["quick2"], alpha=1.1), node("Gelu", ["x"], ["gelu"])]
    outs = ["fast", "fast_b", "bias_gelu", "quick", "quick2", "gelu"]
    assert_matches_ort(make_model(nodes, feeds, outs, initializers=inits), feeds)


# ---- MatMulNBits --------------------------------------------------------------------------------

def _quantize(w: np.ndarray, bits: int, block: int, with_zp: bool) -> dict[str, np.ndarray]:
    """ORT's packing of a weight [N, K]: blocks along K, low bits first."""
    n, k = w.shape
    kb = -(-k // block)
    wp = np.zeros((n, kb * block), np.float32)
    wp[:, :k] = w
    blocks = wp.reshape(n, kb, block)
    qmax = (1 << bits) - 1
    if with_zp:
        lo, hi = blocks.min(-1), blocks.max(-1)
        scale = np.maximum(hi - lo, 1e-6) / qmax
        zp = np.clip(np.round(-lo / scale), 0, qmax).astype(np.uint8)
    else:
        scale = np.maximum(np.abs(blocks).max(-1), 1e-6) / (1 << (bits - 1))
        zp = np.full((n, kb), 1 << (bits - 1), np.uint8)
    q = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    per = 8 // bits

    def pack(vals: np.ndarray) -> np.ndarray:
        pad = (-vals.shape[-1]) % per
        vals = np.concatenate([vals, np.zeros(vals.shape[:-1] + (pad,), np.uint8)], -1)
        vals = vals.reshape(*vals.shape[:-1], -1, per).astype(np.uint16)
        out = np.zeros(vals.shape[:-1], np.uint16)
        for i in range(per):
            out |= vals[..., i] << (bits * i)
        return out.astype(np.uint8)

    out = {"B": pack(q), "scales": scale.astype(np.float32)}
    if with_zp:
        out["zp"] = pack(zp)
    return out


@pytest.mark.parametrize("bits,with_zp", [(4, False), (4, True), (8, True), (2, True)])
def test_matmul_nbits(bits: int, with_zp: bool) -> None:
    n, k, block = 6, 40, 16  # K not a multiple of the block: the last block is padded
    q = _quantize(randn(n, k), bits, block, with_zp)
    ins = ["a", "B", "scales"] + (["zp"] if with_zp else [])
    nd = node("MatMulNBits", ins, ["y"], K=k, N=n, bits=bits, block_size=block)
    feeds = dict(a=randn(2, 3, k))
    g = assert_matches_ort(make_model([nd], feeds, ["y"], initializers=q), feeds, rtol=1e-4, atol=1e-4)
    assert g.op_histogram() == {"MatMul": 1}
    # dequantized at import, and the graph says why (the compile report lists it)
    why = f"bits={bits}" if bits != 4 else "K=40 is not a multiple of block_size=16"
    assert why in g.metadata["packed_dense"]["B"]


@pytest.mark.parametrize("block,with_zp", [(16, True), (32, False)])
def test_matmul_nbits_int4_stays_packed(block: int, with_zp: bool) -> None:
    """A 4-bit weight becomes a Linear's packed [N, K] constant (nbits4): blocks and exact data."""
    n, k = 6, 64
    q = _quantize(randn(n, k), 4, block, with_zp)
    q["bias"] = randn(n)
    ins = ["a", "B", "scales", "zp" if with_zp else "", "", "bias"]
    nd = node("MatMulNBits", ins, ["y"], K=k, N=n, bits=4, block_size=block)
    feeds = dict(a=randn(2, 3, k))
    g = assert_matches_ort(make_model([nd], feeds, ["y"], initializers=q), feeds, rtol=1e-4, atol=1e-4)
    assert g.op_histogram() == {"Linear": 1} and "packed_dense" not in g.metadata
    w = g.nodes[0].inputs[1]
    assert w is not None and w.quant is not None and w.quant.format.name == f"nbits4_b{block}"
    want = dequantize_nbits(q["B"], q["scales"], q.get("zp"), n=n, k=k, bits=4, block=block)
    assert np.array_equal(np.asarray(w.data).view(np.uint32), want.view(np.uint32))


def test_matmul_nbits_bias() -> None:
    n, k, block = 4, 32, 32
    q = _quantize(randn(n, k), 4, block, False)
    q["bias"] = randn(n)
    nd = node("MatMulNBits", ["a", "B", "scales", "", "", "bias"], ["y"], K=k, N=n, bits=4, block_size=block)
    feeds = dict(a=randn(3, k))
    assert_matches_ort(make_model([nd], feeds, ["y"], initializers=q), feeds, rtol=1e-4, atol=1e-4)


# ---- GatherBlockQuantized -------------------------------------------------------------------------

@pytest.mark.parametrize("block,with_zp", [(16, True), (32, False)])
def test_gather_block_quantized(block: int, with_zp: bool) -> None:
    """onnxruntime-genai's tied int4 embedding: rows of the LM head's blocks [V, H/B, B/2] read
    through a Reshape to [V, H/2]; dequantized at import (exactly ORT's values: rtol/atol 0)."""
    v, h = 10, 64
    q = _quantize(randn(v, h), 4, block, with_zp)
    inits = {"B": q["B"], "shape": np.array([v, h // 2], np.int64), "scales": q["scales"].reshape(v, -1)}
    ins = ["flat", "ids", "scales"]
    if with_zp:
        inits["zp"] = q["zp"]
        ins.append("zp")
    nodes = [helper.make_node("Reshape", ["B", "shape"], ["flat"]),
             node("GatherBlockQuantized", ins, ["y"], bits=4, block_size=block, gather_axis=0, quantize_axis=1)]
    feeds = dict(ids=np.array([[3, 0, 9, 3]], np.int64))
    g = assert_matches_ort(make_model(nodes, feeds, ["y"], initializers=inits), feeds, rtol=0, atol=0)
    assert "Gather" in g.op_histogram()
