"""Converters for ONNX Runtime's com.microsoft contrib ops, as onnxruntime-genai and ORT's transformer
optimizer emit them (GroupQueryAttention, RotaryEmbedding, (Skip)SimplifiedLayerNormalization,
SkipLayerNormalization, MultiHeadAttention, MatMulNBits, GatherBlockQuantized, the Gelu family).

Each lowers to the same IR as the standard ops: RoPE, Attention (GQA by head counts, bottom-right
causal), RMSNorm/LayerNorm, MatMul. Features that only make sense inside ORT's own kernels (shared
past/present buffers, quantized KV caches, ragged batches, sliding-window caches) are rejected
with a clear error rather than imported approximately. Semantics were checked against ONNX
Runtime 1.32's CPU kernels (tests/frontend/test_onnx_contrib.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from zlc.errors import IRError
from zlc.ir import Value
from zlc.ir.quant import QuantizedWeight, pack_nbits4
from zlc.ir.types import DType

from .onnx_context import OnnxContext as Cx
from .onnx_nn import (
    AttentionSpec,
    decomposed_attention,
    merge_heads,
    norm_axes,
    norm_decomposed,
    rms_norm,
    rope_4d,
    same_dim,
    split_heads,
)
from .registry import onnx_op

MS = "com.microsoft"


def _heads(cx: Cx, name: str) -> int:
    n = cx.attr(name)
    if n is None or int(n) <= 0:
        raise cx.unsupported(f"needs a positive '{name}' attribute")
    return int(n)


def _reject_inputs(cx: Cx, names: dict[int, str]) -> None:
    for i, what in names.items():
        if cx.inp(i) is not None:
            raise cx.unsupported(f"input {i} ({what}) is not supported")


def _static_last(cx: Cx, x: Value, what: str) -> int:
    if x.shape is None or not x.shape or not isinstance(x.shape[-1], int):
        raise cx.unsupported(f"{what} needs a static last dimension, got {x.type}")
    return int(x.shape[-1])


def _split_last(cx: Cx, x: Value, sizes: list[int]) -> list[Value]:
    outs = cx.emit("Split", x, axis=-1, split=sizes, n_outputs=len(sizes))
    return outs if isinstance(outs, list) else [outs]


def _scalar_i64(cx: Cx, v: Value) -> Value:
    """A scalar (or 1-element) integer tensor as an i64 scalar."""
    v = v if v.dtype == DType.i64 else cx.emit("Cast", v, to="i64")
    return cx.emit("Reshape", v, cx.i64([]))


def _fused_or_general(cx: Cx, q: Value, k: Value, v: Value, *, causal: bool, scale: float | None,
                      softcap: float, bias: Value | None, past_len: Value | None, k_new: Value) -> Value:
    """IR Attention when it is exact (its causal mask is bottom-right aligned, i.e. the new keys are
    as many as the queries and follow the past ones); the primitive decomposition otherwise."""
    exact = bias is None and (not causal or (q.shape is not None and k_new.shape is not None
                                              and same_dim(q.shape[2], k_new.shape[2])))
    if exact:
        attrs: dict[str, Any] = {"causal": int(causal), "softcap": softcap}
        if scale:
            attrs["scale"] = scale
        return cx.emit("Attention", q, k, v, **attrs)
    spec = AttentionSpec(scale=scale or None, causal=causal, softcap=softcap, mask=bias, offset=past_len)
    y, _ = decomposed_attention(cx, q, k, v, spec)
    return y


# ---- GroupQueryAttention -----------------------------------------------------------------------

_GQA_UNSUPPORTED_INPUTS = {11: "head_sink", 12: "k_scale", 13: "v_scale", 14: "q_norm_weight",
                           15: "k_norm_weight", 16: "query_seqlens"}


def _gqa_check_attrs(cx: Cx) -> None:
    if int(cx.attr("local_window_size", -1)) != -1:
        raise cx.unsupported("local_window_size (sliding-window attention) is not supported")
    for name in ("smooth_softmax", "qk_output", "sliding_window_cache"):
        if int(cx.attr(name, 0) or 0) > 0:
            raise cx.unsupported(f"attribute {name}={cx.attr(name)} is not supported")
    for name in ("k_quant_type", "v_quant_type"):
        if str(cx.attr(name, "NONE")) not in ("NONE", ""):
            raise cx.unsupported(f"a quantized KV cache ({name}={cx.attr(name)}) is not supported")
    if cx.wants(3):
        raise cx.unsupported("the output_qk output is not supported")


def _gqa_qkv(cx: Cx, hq: int, hkv: int) -> tuple[Value, Value, Value]:
    """query/key/value [B, S, H*D] (or packed QKV in query) -> [B, H, S, D] each."""
    query, key, value = cx.req(0), cx.inp(1), cx.inp(2)
    if query.type.rank != 3:
        raise cx.unsupported(f"query must be [B, S, hidden], got {query.type}")
    if key is None and value is None:  # packed QKV: [B, S, (Hq + 2 Hkv) * D]
        width = _static_last(cx, query, "packed QKV")
        if width % (hq + 2 * hkv):
            raise cx.unsupported(f"packed QKV width {width} is not a multiple of {hq + 2 * hkv} heads")
        d = width // (hq + 2 * hkv)
        query, key, value = _split_last(cx, query, [hq * d, hkv * d, hkv * d])
    elif key is None or value is None:
        raise cx.unsupported("key and value must be given together (or neither, for packed QKV)")
    return split_heads(cx, query, hq), split_heads(cx, key, hkv), split_heads(cx, value, hkv)


@onnx_op("GroupQueryAttention", since=1, domain=MS)
def _group_query_attention(cx: Cx) -> list[Value | None]:
    hq, hkv = _heads(cx, "num_heads"), _heads(cx, "kv_num_heads")
    if hq % hkv:
        raise cx.unsupported(f"num_heads {hq} is not a multiple of kv_num_heads {hkv}")
    _gqa_check_attrs(cx)
    _reject_inputs(cx, _GQA_UNSUPPORTED_INPUTS)
    q, k, v = _gqa_qkv(cx, hq, hkv)
    past_k, past_v = cx.inp(3), cx.inp(4)
    if (past_k is None) != (past_v is None):
        raise cx.unsupported("past_key and past_value must be given together")
    # Assumption (onnxruntime-genai, batch 1, no padding): past_key holds exactly the past tokens
    # (no shared max-length buffer), so past_len = total_sequence_length - S and seqlens_k (which
    # only matters for ragged/padded batches) is not read. New tokens sit at past_len + arange(S).
    seq = cx.dim_of(q, 2)
    past_len = cx.emit("Sub", _scalar_i64(cx, cx.req(6)), seq)
    if int(cx.attr("do_rotary", 0)):
        cos, sin = cx.req(7), cx.req(8)
        pos = cx.inp(9)
        if pos is None:  # Positions: KV-cache synthesis rebinds its past_len to the compiler's cache
            pos = cx.emit("Positions", cx.req(0), past_len)  # [1, S]
        interleaved = bool(cx.attr("rotary_interleaved", 0))
        q, k = rope_4d(cx, q, cos, sin, pos, interleaved), rope_4d(cx, k, cos, sin, pos, interleaved)
    k_new = k
    if past_k is not None:
        k, v = cx.emit("Concat", past_k, k, axis=2), cx.emit("Concat", past_v, v, axis=2)
    causal = bool(int(cx.attr("causal", 1)))
    y = _fused_or_general(cx, q, k, v, causal=causal, scale=_float_attr(cx, "scale"),
                          softcap=float(cx.attr("softcap", 0.0) or 0.0), bias=cx.inp(10),
                          past_len=past_len, k_new=k_new)
    return [merge_heads(cx, y), k, v]


def _float_attr(cx: Cx, name: str) -> float | None:
    """ORT treats an absent or zero scale as 'default' (1/sqrt(head_size))."""
    v = cx.attr(name)
    return float(v) if v else None


# ---- MultiHeadAttention ------------------------------------------------------------------------

def _mha_split_packed(cx: Cx, x: Value, n: int) -> list[Value]:
    """[B, S, H, n, D] -> n tensors [B, H, S, D]."""
    parts = cx.emit("Split", x, axis=3, split=[1] * n, n_outputs=n)
    parts = parts if isinstance(parts, list) else [parts]
    return [cx.emit("Transpose", cx.emit("Squeeze", p, axes=[3]), perm=[0, 2, 1, 3]) for p in parts]


def _mha_bias(cx: Cx, q: Value, k: Value | None, v: Value | None) -> tuple[Value, Value | None, Value | None]:
    """The input-projection bias [Dq + Dk + Dv] is added to 3-D query/key/value."""
    bias = cx.inp(3)
    if bias is None:
        return q, k, v
    if k is None or v is None or k.type.rank != 3 or v.type.rank != 3:
        raise cx.unsupported("bias needs 3-D query, key and value")
    sizes = [_static_last(cx, t, "bias") for t in (q, k, v)]
    bq, bk, bv = _split_last(cx, bias, sizes)
    return cx.emit("Add", q, bq), cx.emit("Add", k, bk), cx.emit("Add", v, bv)


def _mha_qkv(cx: Cx, heads: int) -> tuple[Value, Value, Value]:
    query, key, value = cx.req(0), cx.inp(1), cx.inp(2)
    if query.type.rank == 5:  # packed QKV [B, S, H, 3, D]
        if cx.inp(3) is not None:
            raise cx.unsupported("bias with packed QKV is not supported")
        q, k, v = _mha_split_packed(cx, query, 3)
        return q, k, v
    if query.type.rank != 3:
        raise cx.unsupported(f"query must be [B, S, hidden] or packed [B, S, H, 3, D], got {query.type}")
    if key is not None and key.type.rank == 5:  # packed KV [B, L, H, 2, D]
        if cx.inp(3) is not None:
            raise cx.unsupported("bias with packed KV is not supported")
        k, v = _mha_split_packed(cx, key, 2)
        return split_heads(cx, query, heads), k, v
    if key is None or value is None:
        raise cx.unsupported("key and value are required unless query is packed QKV")
    if key.type.rank == 4 and value.type.rank == 4:  # cross attention on projected [B, H, L, D]
        if cx.inp(3) is not None:
            q_width = _static_last(cx, query, "bias")
            bq = cx.emit("Slice", cx.inp(3), cx.i64([0]), cx.i64([q_width]))
            query = cx.emit("Add", query, bq)
        return split_heads(cx, query, heads), key, value
    query, key, value = _mha_bias(cx, query, key, value)
    assert key is not None and value is not None
    return split_heads(cx, query, heads), split_heads(cx, key, heads), split_heads(cx, value, heads)


@onnx_op("MultiHeadAttention", since=1, domain=MS)
def _multi_head_attention(cx: Cx) -> list[Value | None]:
    heads = _heads(cx, "num_heads")
    _reject_inputs(cx, {4: "key_padding_mask", 8: "past_sequence_length (shared past/present buffer)",
                        9: "cache_indirection (beam search)"})
    if cx.wants(3):
        raise cx.unsupported("the qk output is not supported")
    q, k, v = _mha_qkv(cx, heads)
    past_k, past_v = cx.inp(6), cx.inp(7)
    if (past_k is None) != (past_v is None):
        raise cx.unsupported("past_key and past_value must be given together")
    k_new, past_len = k, None
    if past_k is not None:
        past_len = cx.dim_of(past_k, 2)
        k, v = cx.emit("Concat", past_k, k, axis=2), cx.emit("Concat", past_v, v, axis=2)
    y = _fused_or_general(cx, q, k, v, causal=bool(int(cx.attr("unidirectional", 0))),
                          scale=_float_attr(cx, "scale"), softcap=0.0, bias=cx.inp(5),
                          past_len=past_len, k_new=k_new)
    return [merge_heads(cx, y), k, v]


# ---- RotaryEmbedding (contrib) -----------------------------------------------------------------

@onnx_op("RotaryEmbedding", since=1, domain=MS)
def _rotary_contrib(cx: Cx) -> Value:
    """Inputs: input [B, S, H*D] or [B, H, S, D], position_ids [B, S] (or [1]: a start offset),
    cos_cache, sin_cache [max_pos, R/2]. ORT's CPU kernel ignores the `scale` attribute; so do we."""
    x, pos, cos, sin = cx.req(0), cx.req(1), cx.req(2), cx.req(3)
    if int(cx.attr("is_packed_batching", 0)):
        raise cx.unsupported("is_packed_batching (ragged batches) is not supported")
    interleaved = bool(cx.attr("interleaved", 0))
    half = cos.shape[-1] if cos.shape else None
    rot_dim = int(cx.attr("rotary_embedding_dim", 0))
    if rot_dim and isinstance(half, int) and 2 * half != rot_dim:
        raise cx.unsupported(f"cos_cache has {half} columns but rotary_embedding_dim is {rot_dim}")
    if x.type.rank == 3:
        heads = int(cx.attr("num_heads", 0))
        if heads <= 0:  # full rotation: head_size = 2 * cos_cache columns
            if not isinstance(half, int):
                raise cx.unsupported("needs num_heads or a static cos_cache width")
            heads = _static_last(cx, x, "input") // (2 * half)
        x4 = split_heads(cx, x, heads)
    elif x.type.rank == 4:
        x4 = x
    else:
        raise cx.unsupported(f"input must be [B, S, H*D] or [B, H, S, D], got {x.type}")
    if pos.type.rank == 1:  # a start offset: positions offset + arange(S)
        pos = cx.emit("Positions", x4, _scalar_i64(cx, pos), axis=2)
    y = rope_4d(cx, x4, cos, sin, pos, interleaved)
    return merge_heads(cx, y) if x.type.rank == 3 else y


# ---- normalization -----------------------------------------------------------------------------

def _simplified_layer_norm(cx: Cx) -> list[Value | None]:
    """RMS normalization over axes [axis, rank); optional output 1 is inv_std_var."""
    if not cx.wants(1):
        return [rms_norm(cx)]
    x, w = cx.req(0), cx.req(1)
    axis, rank = norm_axes(cx, x)
    y, _, inv_std = norm_decomposed(cx, x, axis, rank, rms=True)
    y = y if y.dtype == x.dtype else cx.emit("Cast", y, to=x.dtype.value)
    return [cx.emit("Mul", y, w), inv_std]


onnx_op("SimplifiedLayerNormalization", since=1)(_simplified_layer_norm)  # ORT: default domain
onnx_op("SimplifiedLayerNormalization", since=1, domain=MS)(_simplified_layer_norm)


def _skip_sum(cx: Cx, bias_index: int) -> Value:
    s = cx.emit("Add", cx.req(0), cx.req(1))
    if cx.inp(bias_index) is not None:
        s = cx.emit("Add", s, cx.inp(bias_index))
    return s


def _skip_norm(cx: Cx, rms: bool) -> list[Value | None]:
    """output = norm(input + skip (+ bias)); outputs (output, mean, inv_std_var, input_skip_bias_sum)."""
    s = _skip_sum(cx, 3 if rms else 4)
    gamma, beta = cx.req(2), (None if rms else cx.inp(3))
    eps = float(cx.attr("epsilon", 1e-12))
    if rms and cx.wants(1):
        raise cx.unsupported("the mean output of SkipSimplifiedLayerNormalization is not defined")
    stats = cx.wants(1) or cx.wants(2)
    mean = inv_std = None
    if stats or s.dtype != DType.f32:
        rank = s.type.rank
        if rank is None:
            raise cx.unsupported("needs an input of known rank")
        y, mean, inv_std = norm_decomposed(cx, s, rank - 1, rank, rms=rms, eps=eps)
        y = y if y.dtype == s.dtype else cx.emit("Cast", y, to=s.dtype.value)
        y = cx.emit("Mul", y, gamma)
        if beta is not None:
            y = cx.emit("Add", y, beta)
    elif rms:
        y = cx.emit("RMSNorm", s, gamma, eps=eps)
    else:
        y = cx.emit("LayerNorm", *([s, gamma] + ([beta] if beta is not None else [])), eps=eps)
    return [y, mean if cx.wants(1) else None, inv_std if cx.wants(2) else None,
            s if cx.wants(3) else None]


onnx_op("SkipSimplifiedLayerNormalization", since=1, domain=MS)(lambda cx: _skip_norm(cx, rms=True))
onnx_op("SkipLayerNormalization", since=1, domain=MS)(lambda cx: _skip_norm(cx, rms=False))


# ---- Gelu family -------------------------------------------------------------------------------

def _with_bias(cx: Cx, i: int) -> Value:
    x = cx.req(0)
    return x if cx.inp(i) is None else cx.emit("Add", x, cx.inp(i))


# FastGelu: 0.5 x (1 + tanh(0.797885 x + 0.035677 x^3)) is the tanh approximation of GELU
onnx_op("FastGelu", since=1, domain=MS)(lambda cx: cx.emit("Gelu", _with_bias(cx, 1), approximate="tanh"))
onnx_op("BiasGelu", since=1, domain=MS)(lambda cx: cx.emit("Gelu", cx.emit("Add", cx.req(0), cx.req(1)),
                                                           approximate="none"))
onnx_op("Gelu", since=1, domain=MS)(lambda cx: cx.emit("Gelu", cx.req(0), approximate="none"))


@onnx_op("QuickGelu", since=1, domain=MS)
def _quick_gelu(cx: Cx) -> Value:
    """x * sigmoid(alpha * x), alpha = 1.702 by default."""
    x = cx.req(0)
    alpha = cx.const_value(np.array(float(cx.attr("alpha", 1.702)), dtype=np.float32))
    if x.dtype != DType.f32:
        alpha = cx.emit("Cast", alpha, to=x.dtype.value)
    return cx.emit("Mul", x, cx.emit("Sigmoid", cx.emit("Mul", x, alpha)))


# ---- MatMulNBits -------------------------------------------------------------------------------

def _unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [..., n] -> uint8 [..., n * 8/bits], low bits first (ORT's packing along K)."""
    per = 8 // bits
    mask = (1 << bits) - 1
    shifts = np.arange(per, dtype=np.uint8) * bits
    vals = (packed[..., None] >> shifts) & mask
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def dequantize_nbits(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *,
                     n: int, k: int, bits: int, block: int) -> np.ndarray:
    """The float32 weight [N, K] of MatMulNBits: (q - zero_point) * scale, block-wise along K."""
    k_blocks = -(-k // block)
    q = _unpack_bits(np.asarray(b, dtype=np.uint8).reshape(n, k_blocks, -1), bits)  # [N, kb, block]
    q = q[:, :, :block].astype(np.float32)
    sc = np.asarray(scales, dtype=np.float32).reshape(n, k_blocks)
    if zero_points is None:
        zp = np.full((n, k_blocks), float(1 << (bits - 1)), dtype=np.float32)
    elif zero_points.dtype == np.uint8:  # packed like B, along the blocks of each row
        zp = _unpack_bits(zero_points.reshape(n, -1), bits)[:, :k_blocks].astype(np.float32)
    else:  # unpacked, same type as A
        zp = np.asarray(zero_points, dtype=np.float32).reshape(n, k_blocks)
    w = (q - zp[:, :, None]) * sc[:, :, None]
    return w.reshape(n, k_blocks * block)[:, :k]


@onnx_op("MatMulNBits", since=1, domain=MS)
def _matmul_nbits(cx: Cx) -> Value:
    """Y = A @ dequant(B)^T (+ bias). A 4-bit weight stays packed (ir/quant.py nbits4_b<block>):
    the node becomes a Linear whose [N, K] weight constant carries the blocks as `quant` and their
    exact dequantization as data, (q - zero_point) * scale as ORT computes it. Where it cannot
    (bits 2/8, f16 activations, float zero points, K not a multiple of the block), the weight is
    dequantized to a dense constant at import and the graph's metadata["packed_dense"] says
    why (the compile report lists it). accuracy_level only selects ORT's own compute precision (4:
    int8 activations); zlc computes in f32 either way, i.e. what accuracy_level 0 computes."""
    a = cx.req(0)
    bits, block = int(cx.attr("bits", 4)), int(cx.attr("block_size", 0))
    n, k = int(cx.attr("N", 0)), int(cx.attr("K", 0))
    if bits not in (2, 4, 8):
        raise cx.unsupported(f"bits={bits} (supported: 2, 4, 8)")
    if n <= 0 or k <= 0 or block < 16 or block & (block - 1):
        raise cx.unsupported(f"bad attributes N={n}, K={k}, block_size={block}")
    if int(cx.attr("weight_prepacked", 0)):
        raise cx.unsupported("execution-provider prepacked weights are not supported")
    _reject_inputs(cx, {4: "g_idx"})
    b, scales = cx.const(1), cx.const(2)
    zp = cx.const(3) if cx.inp(3) is not None else None
    if b is None or scales is None or (cx.inp(3) is not None and zp is None):
        raise cx.unsupported("B, scales and zero_points must be constants (initializers)")
    b_name = cx.req(1).name
    packed, why = _packed_nbits4(cx, a, b, scales, zp, n=n, k=k, bits=bits, block=block)
    if packed is not None:
        weight = cx.g.add_const(f"{b_name}.nk", packed.dequantize(), unique=True)
        weight.quant = packed
        bias = cx.inp(5)
        if bias is not None and bias.data is None:  # a Linear's bias is a constant vector
            return cx.emit("Add", cx.emit("Linear", a, weight), bias)
        return cx.emit("Linear", a, weight, *([bias] if bias is not None else []))
    try:
        w = dequantize_nbits(b, scales, zp, n=n, k=k, bits=bits, block=block)
    except ValueError as e:
        raise cx.unsupported(f"weight shapes do not fit N={n}, K={k}, bits={bits}, block_size={block}: {e}") \
            from None
    cx.g.metadata.setdefault("packed_dense", {})[b_name] = why
    wt = np.ascontiguousarray(w.T)  # [K, N]
    weight = cx.const_value(wt if a.dtype != DType.f16 else wt.astype(np.float16))
    if a.dtype not in (DType.f32, DType.f16):
        weight = cx.emit("Cast", weight, to=a.dtype.value)
    y = cx.emit("MatMul", a, weight)
    return y if cx.inp(5) is None else cx.emit("Add", y, cx.inp(5))


def _packed_nbits4(cx: Cx, a: Value, b: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, *,
                   n: int, k: int, bits: int, block: int) -> tuple[QuantizedWeight | None, str]:
    """The weight's nbits4 blocks, or None and why it is dequantized instead."""
    if bits != 4:
        return None, f"MatMulNBits bits={bits} (only 4-bit weights have a packed format)"
    if a.dtype != DType.f32:
        return None, f"MatMulNBits on {a.dtype.name} activations (packed weights are read by f32 Linears)"
    bias = cx.inp(5)
    if bias is not None and bias.dtype != DType.f32:
        return None, f"MatMulNBits bias of type {bias.dtype.name}"
    try:
        return pack_nbits4(b, scales, zp, n=n, k=k, block=block), ""
    except IRError as e:
        return None, f"MatMulNBits {e}"


# ---- GatherBlockQuantized --------------------------------------------------------------------------

def _const_through_reshape(cx: Cx, i: int) -> np.ndarray | None:
    """Input i's constant data, also where it is a Reshape of a constant to a static shape (genai's
    tied int4 embedding reads the LM head's blocks [V, H/B, B/2] reshaped to [V, H/2])."""
    c = cx.const(i)
    v = cx.inp(i)
    if c is not None or v is None or v.producer is None or v.producer.op != "Reshape":
        return c
    src = v.producer.inputs[0]
    shape = v.shape
    if src is None or src.data is None or shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return np.asarray(src.const_array()).reshape([int(d) for d in shape])  # type: ignore[arg-type]


@onnx_op("GatherBlockQuantized", since=1, domain=MS)
def _gather_block_quantized(cx: Cx) -> Value:
    """Rows of a 4-bit block-quantized table (onnxruntime-genai's tied int4 embedding, which reads
    the LM head's MatMulNBits blocks): the table is dequantized at import, (q - zero_point) * scale
    (zero point 8 when absent, as for uint4), and gathered like Gather; the LM head itself keeps its
    blocks (MatMulNBits). A decode step reads one row of the table, so it stays dense."""
    bits, block = int(cx.attr("bits", 4)), int(cx.attr("block_size", 128))
    gather_axis, quantize_axis = int(cx.attr("gather_axis", 0)), int(cx.attr("quantize_axis", 1))
    data, scales = _const_through_reshape(cx, 0), cx.const(2)
    zp = cx.const(3) if cx.inp(3) is not None else None
    if data is None or scales is None or (cx.inp(3) is not None and zp is None):
        raise cx.unsupported("data, scales and zero_points must be constants (initializers)")
    if bits != 4 or data.dtype != np.uint8 or data.ndim != 2:
        raise cx.unsupported(f"only uint8 data packing 4-bit values [rows, cols/2] is supported, got bits={bits}, "
                             f"{data.dtype}{list(data.shape)}")
    if gather_axis != 0 or quantize_axis not in (1, -1) or block < 16 or block & (block - 1):
        raise cx.unsupported(f"gather_axis={gather_axis}, quantize_axis={quantize_axis}, block_size={block} "
                             f"(supported: rows gathered, blocks along the last axis, a power of two >= 16)")
    if zp is not None and zp.dtype != np.uint8:
        raise cx.unsupported(f"zero points of type {zp.dtype} (supported: uint8 packed 4-bit)")
    n, k = int(data.shape[0]), int(data.shape[1]) * 2
    try:
        table = dequantize_nbits(data, scales, zp, n=n, k=k, bits=4, block=block)
    except ValueError as e:
        raise cx.unsupported(f"shapes do not fit block_size={block}: {e}") from None
    return cx.emit("Gather", cx.const_value(table.astype(scales.dtype)), cx.req(1), axis=0)
