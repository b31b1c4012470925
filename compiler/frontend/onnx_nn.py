"""Converters for the default-domain (ai.onnx) normalization, attention and rotary-embedding ops
(LayerNormalization, RMSNormalization, Attention-23, RotaryEmbedding-23), and the building blocks
the com.microsoft converters (onnx_contrib.py) lower their variants with: decomposed norms, head
splitting, GQA head repetition, the general attention decomposition."""

from __future__ import annotations

from typing import Any

import numpy as np

from zlc.ir import Value
from zlc.ir.types import DType

from .onnx_context import OnnxContext as Cx
from .registry import onnx_op

# ---- normalization and transformer-level standard ops ---------------------------------------------

def _stash_dtype(cx: Cx) -> DType:
    """stash_type: the precision the statistics are computed in (default float32)."""
    return cx.onnx_dtype(int(cx.attr("stash_type", 1)))


def norm_axes(cx: Cx, x: Value) -> tuple[int, int]:
    """The normalized axis (attribute `axis`, default -1) as a non-negative index, and the rank."""
    rank = x.type.rank
    if rank is None:
        raise cx.unsupported("needs an input of known rank")
    axis = int(cx.attr("axis", -1))
    if not -rank <= axis < rank:
        raise cx.unsupported(f"axis {axis} out of range for rank {rank}")
    return axis % rank, rank


def norm_decomposed(cx: Cx, x: Value, axis: int, rank: int, rms: bool, eps: float | None = None
                     ) -> tuple[Value, Value, Value]:
    """(Layer|RMS)Normalization over axes [axis, rank) in primitives, in the stash precision.
    Returns (normalized x in stash dtype, mean (inv_std for RMS), inv_std), stats with keepdims."""
    st = _stash_dtype(cx)
    xs = x if x.dtype == st else cx.emit("Cast", x, to=st.value)
    axes = list(range(axis, rank))
    eps_v = cx.scalar_like(float(cx.attr("epsilon", 1e-5)) if eps is None else eps, st)
    if rms:
        mean = None
        centered = xs
    else:
        mean = cx.emit("ReduceMean", xs, axes=axes, keepdims=1)
        centered = cx.emit("Sub", xs, mean)
    var = cx.emit("ReduceMean", cx.emit("Mul", centered, centered), axes=axes, keepdims=1)
    inv_std = cx.emit("Reciprocal", cx.emit("Sqrt", cx.emit("Add", var, eps_v)))
    y = cx.emit("Mul", centered, inv_std)
    return y, (mean if mean is not None else inv_std), inv_std


def _is_vector_of(w: Value | None, x: Value) -> bool:
    """The fused IR norms take a weight [D] matching the last axis of x."""
    return w is not None and w.shape is not None and len(w.shape) == 1 and x.shape is not None \
        and w.shape[0] == x.shape[-1]


@onnx_op("LayerNormalization", since=17)
def _layer_norm(cx: Cx) -> list[Value | None]:
    x, w, b = cx.req(0), cx.req(1), cx.inp(2)
    axis, rank = norm_axes(cx, x)
    eps = float(cx.attr("epsilon", 1e-5))
    # the fused op normalizes the last axis with fp32 statistics (ONNX's default stash_type)
    simple = axis == rank - 1 and not cx.wants(1) and not cx.wants(2) and x.dtype.is_float \
        and _stash_dtype(cx) == DType.f32 and _is_vector_of(w, x) and (b is None or _is_vector_of(b, x)) \
        and w.dtype == x.dtype and (b is None or b.dtype == x.dtype)
    if simple:
        ins = [x, w] + ([b] if b is not None else [])
        return [cx.emit("LayerNorm", *ins, eps=eps)]
    y, mean, inv_std = norm_decomposed(cx, x, axis, rank, rms=False)
    y = cx.emit("Cast", y, to=x.dtype.value) if y.dtype != x.dtype else y
    y = cx.emit("Mul", y, w)
    if b is not None:
        y = cx.emit("Add", y, b)
    return [y, mean if cx.wants(1) else None, inv_std if cx.wants(2) else None]


@onnx_op("RMSNormalization", since=23)
def rms_norm(cx: Cx) -> Value:
    """RMSNormalization-23; also the contrib SimplifiedLayerNormalization without its optional output."""
    x, w = cx.req(0), cx.req(1)
    axis, rank = norm_axes(cx, x)
    if axis == rank - 1 and _is_vector_of(w, x) and _stash_dtype(cx) == DType.f32:
        return cx.emit("RMSNorm", x, w, eps=float(cx.attr("epsilon", 1e-5)))  # fp32 statistics
    y, _, _ = norm_decomposed(cx, x, axis, rank, rms=True)
    y = cx.emit("Cast", y, to=x.dtype.value) if y.dtype != x.dtype else y
    return cx.emit("Mul", y, w)


# ---- attention building blocks (shared with onnx_contrib.py) ----------------------------------------

def split_heads(cx: Cx, x: Value, heads: int) -> Value:
    """[B, S, H*D] -> [B, H, S, D]."""
    x4 = cx.emit("Reshape", x, cx.i64([0, 0, heads, -1]))
    return cx.emit("Transpose", x4, perm=[0, 2, 1, 3])


def merge_heads(cx: Cx, x: Value) -> Value:
    """[B, H, S, D] -> [B, S, H*D]."""
    return cx.emit("Reshape", cx.emit("Transpose", x, perm=[0, 2, 1, 3]), cx.i64([0, 0, -1]))


def static_heads(cx: Cx, x: Value, what: str) -> int:
    """The head count of a [B, H, S, D] input, which must be static."""
    if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[1], int):
        raise cx.unsupported(f"{what} must be 4-D [B, H, S, D] with a static head count, got {x.type}")
    return int(x.shape[1])


def repeat_kv(cx: Cx, x: Value, rep: int) -> Value:
    """[B, Hkv, S, D] -> [B, Hkv*rep, S, D], each KV head repeated rep times in place (GQA)."""
    if rep == 1:
        return x
    shp = cx.emit("Shape", x)
    lead, tail = cx.emit("Slice", shp, cx.i64([0]), cx.i64([2])), cx.emit("Slice", shp, cx.i64([2]), cx.i64([4]))
    x5 = cx.emit("Unsqueeze", x, axes=[2])
    x5 = cx.emit("Expand", x5, cx.emit("Concat", lead, cx.i64([rep]), tail, axis=0))
    heads = cx.emit("Mul", cx.emit("Slice", shp, cx.i64([1]), cx.i64([2])), cx.i64([rep]))
    target = cx.emit("Concat", cx.emit("Slice", shp, cx.i64([0]), cx.i64([1])), heads, tail, axis=0)
    return cx.emit("Reshape", x5, target)


def same_dim(a: Any, b: Any) -> bool:
    """Statically known to be equal (equal ints or the same symbol)."""
    return a == b and a is not None


def _bias_from_allowed(cx: Cx, allowed: Value, dt: DType) -> Value:
    """Boolean 'may attend' -> additive bias: 0 where allowed, -inf elsewhere (select, not multiply)."""
    return cx.emit("Where", allowed, cx.scalar_like(0.0, dt), cx.scalar_like(float("-inf"), dt))


def _add_bias(cx: Cx, bias: Value | None, more: Value) -> Value:
    return more if bias is None else cx.emit("Add", bias, more)


class AttentionSpec:
    """What the general (decomposed) attention needs; mirrors ONNX Attention-23..25 semantics."""

    def __init__(self, scale: float | None = None, causal: bool = False, softcap: float = 0.0,
                 mask: Value | None = None, offset: Value | None = None, nonpad: Value | None = None,
                 window: tuple[int, int] = (-1, -1), softmax_dtype: DType | None = None):
        self.scale = scale
        self.causal = causal
        self.softcap = softcap
        self.mask = mask  # bool (True = attend) or additive float, broadcastable to [B, H, T, S]
        self.offset = offset  # causal/window frontier: query i may see key j <= i + offset
        self.nonpad = nonpad  # [B] valid key counts (external cache)
        self.window = window  # (left, right) sliding window, -1 = unbounded
        self.softmax_dtype = softmax_dtype


def _pad_mask(cx: Cx, mask: Value, total: Value, total_dim: Any) -> Value:
    """A mask shorter than the key length is padded with 'masked' (False / -inf) on the right."""
    if mask.shape is not None and mask.shape and same_dim(mask.shape[-1], total_dim):
        return mask
    rank = mask.type.rank
    if rank is None:
        return mask
    shp = cx.emit("Shape", mask)
    pad_len = cx.emit("Sub", cx.emit("Unsqueeze", total, axes=[0]), cx.emit("Slice", shp, cx.i64([-1]), cx.i64([rank])))
    pad_shape = cx.emit("Concat", cx.emit("Slice", shp, cx.i64([0]), cx.i64([-1])), pad_len, axis=0) \
        if rank > 1 else pad_len
    fill = False if mask.dtype == DType.bool else float("-inf")
    pad = cx.emit("ConstantOfShape", pad_shape, value=fill, dtype=mask.dtype.value)
    return cx.emit("Concat", mask, pad, axis=-1)


def _attention_bias(cx: Cx, spec: AttentionSpec, q: Value, k: Value) -> Value | None:
    """The additive bias of ONNX Attention: mask, causal frontier, sliding window, key padding."""
    dt = q.dtype
    need_idx = spec.causal or spec.window != (-1, -1) or spec.nonpad is not None
    t_len, s_len = cx.dim_of(q, 2), cx.dim_of(k, 2)
    mask = spec.mask
    if mask is not None:
        mask = _pad_mask(cx, mask, s_len, k.shape[2] if k.shape else None)
        if mask.dtype == DType.bool:
            mask = _bias_from_allowed(cx, mask, dt)
        elif mask.dtype != dt:
            mask = cx.emit("Cast", mask, to=dt.value)
    if not need_idx:
        return mask
    zero, one = cx.i64_scalar(0), cx.i64_scalar(1)
    rows = cx.emit("Unsqueeze", cx.emit("Range", zero, t_len, one), axes=[1])  # [T, 1]
    cols = cx.emit("Unsqueeze", cx.emit("Range", zero, s_len, one), axes=[0])  # [1, S]
    offset = spec.offset
    nonpad4 = None
    if spec.nonpad is not None:
        nonpad4 = cx.emit("Reshape", cx.emit("Cast", spec.nonpad, to="i64"), cx.i64([-1, 1, 1, 1]))
        if offset is None:
            offset = cx.emit("Sub", nonpad4, t_len)  # per batch: [B, 1, 1, 1]
    frontier = rows if offset is None else cx.emit("Add", rows, cx.emit("Cast", offset, to="i64"))
    bias = mask
    if spec.causal:
        bias = _add_bias(cx, bias, _bias_from_allowed(cx, cx.emit("LessOrEqual", cols, frontier), dt))
    left, right = spec.window
    if left >= 0 or right >= 0:
        diff = cx.emit("Sub", frontier, cols)
        conds = []
        if left >= 0:
            conds.append(cx.emit("LessOrEqual", diff, cx.i64_scalar(left)))
        if right >= 0:
            conds.append(cx.emit("LessOrEqual", cx.emit("Neg", diff), cx.i64_scalar(right)))
        allowed = conds[0] if len(conds) == 1 else cx.emit("And", conds[0], conds[1])
        bias = _add_bias(cx, bias, _bias_from_allowed(cx, allowed, dt))
    if nonpad4 is not None:
        bias = _add_bias(cx, bias, _bias_from_allowed(cx, cx.emit("Less", cols, nonpad4), dt))
    return bias


def decomposed_attention(cx: Cx, q: Value, k: Value, v: Value, spec: AttentionSpec,
                         qk_mode: int | None = None) -> tuple[Value, Value | None]:
    """Attention in primitives (MatMul/Softmax/Add/Where), exactly as ONNX's reference computes it.
    q/k/v are [B, H, T|S, D]; returns Y [B, Hq, T, Dv] and, when qk_mode is given, ONNX's
    qk_matmul_output (0: q.k^T scaled, 1: after softcap, 2: plus bias, 3: softmax).

    The shape is the one raising recognizes: Softmax(q.k^T * scale + bias) feeding MatMul(., v)
    directly. The guard that zeroes query rows that may see no key at all (ONNX and ONNX Runtime
    give 0 there, a plain softmax NaN) is applied to the product instead, which is the same."""
    dt = q.dtype
    hq, hk = static_heads(cx, q, "Q"), static_heads(cx, k, "K")
    if hq % hk:
        raise cx.unsupported(f"{hq} query heads are not a multiple of {hk} key/value heads")
    bias = _attention_bias(cx, spec, q, k)  # before repeating heads: it reads k's length only
    k, v = repeat_kv(cx, k, hq // hk), repeat_kv(cx, v, hq // hk)
    scale = spec.scale
    if scale is None:
        if q.shape is None or not isinstance(q.shape[3], int):
            raise cx.unsupported("the default scale needs a static head size")
        scale = 1.0 / float(np.sqrt(q.shape[3]))
    # like the reference: scale q and k by sqrt(scale) before the product (avoids fp16 overflow)
    root = cx.scalar_like(float(np.sqrt(np.float32(scale))), dt)
    scores = cx.emit("MatMul", cx.emit("Mul", q, root),
                     cx.emit("Mul", cx.emit("Transpose", k, perm=[0, 1, 3, 2]), root))
    modes = {0: scores}
    if spec.softcap > 0:
        cap = cx.scalar_like(spec.softcap, dt)
        scores = cx.emit("Mul", cx.emit("Tanh", cx.emit("Div", scores, cap)), cap)
    modes[1] = scores
    if bias is not None:
        scores = cx.emit("Add", scores, bias)
    modes[2] = scores
    sm_dt = spec.softmax_dtype or dt
    probs = cx.emit("Softmax", scores if sm_dt == dt else cx.emit("Cast", scores, to=sm_dt.value), axis=-1)
    if sm_dt != dt:
        probs = cx.emit("Cast", probs, to=dt.value)
    y = cx.emit("MatMul", probs, v)
    dead = None
    if bias is not None:  # rows whose bias is all -inf
        row_max = cx.emit("ReduceMax", bias, axes=[-1], keepdims=1)
        dead = cx.emit("Equal", row_max, cx.scalar_like(float("-inf"), dt))
        y = cx.emit("Where", dead, cx.scalar_like(0.0, dt), y)
    if qk_mode is None:
        return y, None
    if qk_mode == 3:
        qk = probs if dead is None else cx.emit("Where", dead, cx.scalar_like(0.0, dt), probs)
    elif qk_mode in modes:
        qk = modes[qk_mode]
    else:
        raise cx.unsupported(f"qk_matmul_output_mode {qk_mode} (expected 0..3)")
    return y, qk


# ---- opset-23+ Attention and RotaryEmbedding ---------------------------------------------------------

def _attention_inputs(cx: Cx) -> tuple[Value, Value, Value, bool]:
    """Q, K, V as [B, H, S, D] (3-D inputs are split by q_num_heads / kv_num_heads)."""
    q, k, v = cx.req(0), cx.req(1), cx.req(2)
    ranks = {q.type.rank, k.type.rank, v.type.rank}
    if ranks == {4}:
        return q, k, v, False
    if ranks != {3}:
        raise cx.unsupported(f"Q, K, V must all be 3-D or all 4-D, got {q.type}, {k.type}, {v.type}")
    hq, hkv = cx.attr("q_num_heads"), cx.attr("kv_num_heads")
    if not hq or not hkv:
        raise cx.unsupported("3-D Q/K/V need the q_num_heads and kv_num_heads attributes")
    return split_heads(cx, q, int(hq)), split_heads(cx, k, int(hkv)), split_heads(cx, v, int(hkv)), True


def _causal_is_bottom_right(q: Value, k_new: Value) -> bool:
    """IR Attention's causal mask is bottom-right aligned (query i sees keys j <= S - T + i). ONNX
    aligns on the past length (offset = past_len, or 0 without a cache; ONNX Runtime 1.32 agrees),
    which is the same frontier exactly when the new keys are as many as the queries."""
    return q.shape is not None and k_new.shape is not None and same_dim(q.shape[2], k_new.shape[2])


@onnx_op("Attention", since=23)
def _attention_std(cx: Cx) -> list[Value | None]:
    q, k_new, v_new, three_d = _attention_inputs(cx)
    mask, past_k, past_v = cx.inp(3), cx.inp(4), cx.inp(5)
    nonpad = cx.inp(6)
    if (past_k is None) != (past_v is None):
        raise cx.unsupported("past_key and past_value must be given together")
    if nonpad is not None and past_k is not None:
        raise cx.unsupported("nonpad_kv_seqlen cannot be combined with past_key/past_value")
    k = cx.emit("Concat", past_k, k_new, axis=2) if past_k is not None else k_new
    v = cx.emit("Concat", past_v, v_new, axis=2) if past_v is not None else v_new
    causal = bool(cx.attr("is_causal", 0))
    scale = cx.attr("scale")
    softcap = float(cx.attr("softcap", 0.0) or 0.0)
    window = (int(cx.attr("left_window_size", -1)), int(cx.attr("right_window_size", -1)))
    want_qk = cx.wants(3)
    fused = mask is None and nonpad is None and window == (-1, -1) and not want_qk and \
        (not causal or _causal_is_bottom_right(q, k_new))
    if fused:
        attrs: dict[str, Any] = {"causal": int(causal), "softcap": softcap}
        if scale is not None:
            attrs["scale"] = float(scale)
        y = cx.emit("Attention", q, k, v, **attrs)
        qk = None
    else:
        offset = cx.dim_of(past_k, 2) if past_k is not None else None
        sm = cx.attr("softmax_precision")
        spec = AttentionSpec(scale=None if scale is None else float(scale), causal=causal, softcap=softcap,
                             mask=mask, offset=offset, nonpad=nonpad, window=window,
                             softmax_dtype=None if sm is None else cx.onnx_dtype(int(sm)))
        mode = int(cx.attr("qk_matmul_output_mode", 0)) if want_qk else None
        y, qk = decomposed_attention(cx, q, k, v, spec, mode)
    if three_d:
        y = merge_heads(cx, y)
    return [y, k if cx.wants(1) else None, v if cx.wants(2) else None, qk]


def rope_4d(cx: Cx, x: Value, cos: Value, sin: Value, pos: Value | None, interleaved: bool) -> Value:
    """IR RoPE of x [B, H, S, D]: cos/sin tables indexed by pos, or per-token without it."""
    ins = [x, cos, sin] + ([pos] if pos is not None else [])
    return cx.emit("RoPE", *ins, interleaved=int(interleaved))


def _check_rotary_dim(cx: Cx, cos: Value, rot_dim: int) -> None:
    half = cos.shape[-1] if cos.shape else None
    if rot_dim and isinstance(half, int) and 2 * half != rot_dim:
        raise cx.unsupported(f"cos_cache has {half} columns but rotary_embedding_dim is {rot_dim}")


@onnx_op("RotaryEmbedding", since=23)
def _rotary_std(cx: Cx) -> Value:
    x, cos, sin, pos = cx.req(0), cx.req(1), cx.req(2), cx.inp(3)
    interleaved = bool(cx.attr("interleaved", 0))
    _check_rotary_dim(cx, cos, int(cx.attr("rotary_embedding_dim", 0)))
    if x.type.rank == 4:  # [B, H, S, D]
        return rope_4d(cx, x, cos, sin, pos, interleaved)
    if x.type.rank != 3:
        raise cx.unsupported(f"input must be [B, H, S, D] or [B, S, H*D], got {x.type}")
    heads = int(cx.attr("num_heads", 0))
    if heads <= 0:
        raise cx.unsupported("a 3-D input needs the num_heads attribute")
    y = rope_4d(cx, split_heads(cx, x, heads), cos, sin, pos, interleaved)
    return merge_heads(cx, y)
