"""Converters for default-domain (ai.onnx) ops into zlc IR ops, keyed by the opset version they
apply from. Attribute/input variants across opsets are normalized here so that the IR sees one
form (reduce and squeeze axes as attributes, Split sizes as an attribute, Gemm as MatMul/Add)."""

from __future__ import annotations

from typing import Any

import numpy as np

from zlc.errors import ModelFormatError
from zlc.ir import Value
from zlc.ir.types import DType

from .registry import onnx_op

Cx = Any  # OnnxContext (imported lazily to avoid a cycle)


def _dtype(code: int, cx: Cx) -> DType:
    from .onnx import dtype_from_onnx

    return dtype_from_onnx(code, f" at node '{cx.node.name}'")


def _i64(cx: Cx, values: list[int]) -> Value:
    return cx.const_value(np.array(values, dtype=np.int64))


# ---- elementwise --------------------------------------------------------------------------------

_UNARY = ["Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Sin", "Cos", "Tanh", "Sigmoid", "Erf",
          "Relu", "Floor", "Ceil", "Round", "Identity", "Softplus", "Sign", "Not", "IsNaN",
          "Atan", "Tan", "Asin", "Acos"]
for _op in _UNARY:
    onnx_op(_op)((lambda op: (lambda cx: cx.emit(op, cx.req(0))))(_op))


@onnx_op("IsInf", since=10)
def _isinf(cx: Cx) -> Value:
    x = cx.req(0)
    pos, neg = int(cx.attr("detect_positive", 1)), int(cx.attr("detect_negative", 1))
    inf = cx.emit("IsInf", x)
    if pos and neg:
        return inf
    if not pos and not neg:
        return cx.emit("And", inf, cx.emit("Not", inf))  # all False, same shape
    zero = cx.emit("Cast", cx.const_value(np.array(0, dtype=np.float32)), to=x.dtype.value)
    sign = cx.emit("Greater" if pos else "Less", x, zero)
    return cx.emit("And", inf, sign)

_BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Equal", "Less", "LessOrEqual", "Greater",
           "GreaterOrEqual", "And", "Or", "Xor"]
for _op in _BINARY:
    onnx_op(_op, since=7)((lambda op: (lambda cx: cx.emit(op, cx.req(0), cx.req(1))))(_op))


@onnx_op("Mod", since=10)
def _mod(cx: Cx) -> Value:
    return cx.emit("Mod", cx.req(0), cx.req(1), fmod=int(cx.attr("fmod", 0)))


@onnx_op("LeakyRelu", since=6)
def _leaky(cx: Cx) -> Value:
    return cx.emit("LeakyRelu", cx.req(0), alpha=float(cx.attr("alpha", 0.01)))


@onnx_op("Elu", since=6)
def _elu(cx: Cx) -> Value:
    return cx.emit("Elu", cx.req(0), alpha=float(cx.attr("alpha", 1.0)))


@onnx_op("HardSigmoid", since=6)
def _hsig(cx: Cx) -> Value:
    return cx.emit("HardSigmoid", cx.req(0), alpha=float(cx.attr("alpha", 0.2)), beta=float(cx.attr("beta", 0.5)))


@onnx_op("Gelu", since=20)
def _gelu(cx: Cx) -> Value:
    return cx.emit("Gelu", cx.req(0), approximate=str(cx.attr("approximate", "none")))


def _variadic(op: str) -> Any:
    def conv(cx: Cx) -> Value:
        xs = [v for v in cx.inputs if v is not None]
        acc = xs[0]
        for x in xs[1:]:
            acc = cx.emit(op, acc, x)
        return acc if len(xs) > 1 else cx.emit("Identity", acc)

    return conv


onnx_op("Max", since=8)(_variadic("Max"))
onnx_op("Min", since=8)(_variadic("Min"))
onnx_op("Sum", since=8)(_variadic("Add"))


@onnx_op("Mean", since=8)
def _mean(cx: Cx) -> Value:
    xs = [v for v in cx.inputs if v is not None]
    s = _variadic("Add")(cx)
    n = cx.const_value(np.array(len(xs), dtype=xs[0].dtype.torch.__repr__() and np.float32).astype(
        np.float64 if xs[0].dtype == DType.f64 else np.float32))
    if xs[0].dtype != DType.f32:
        n = cx.emit("Cast", n, to=xs[0].dtype.value)
    return cx.emit("Div", s, n)


@onnx_op("Where", since=9)
def _where(cx: Cx) -> Value:
    return cx.emit("Where", cx.req(0), cx.req(1), cx.req(2))


@onnx_op("Cast", since=6)
def _cast(cx: Cx) -> Value:
    return cx.emit("Cast", cx.req(0), to=_dtype(int(cx.attr("to")), cx).value)


@onnx_op("CastLike", since=15)
def _cast_like(cx: Cx) -> Value:
    return cx.emit("Cast", cx.req(0), to=cx.req(1).dtype.value)


@onnx_op("Clip", since=11)
def _clip(cx: Cx) -> Value:
    x = cx.req(0)
    if cx.inp(1) is not None:
        x = cx.emit("Max", x, cx.inp(1))
    if cx.inp(2) is not None:
        x = cx.emit("Min", x, cx.inp(2))
    return x if x is not cx.req(0) else cx.emit("Identity", x)


def _all_true_mask(cx: Cx, x: Value) -> Value:
    return cx.emit("ConstantOfShape", cx.emit("Shape", x), value=True, dtype=DType.bool.value)


def _dropout_outputs(cx: Cx) -> list[Value | None]:
    """Inference Dropout is the identity; its optional mask output is all True."""
    x = cx.req(0)
    want_mask = len(cx.node.outputs) > 1 and bool(cx.node.outputs[1].name)
    return [cx.emit("Identity", x), _all_true_mask(cx, x) if want_mask else None]


@onnx_op("Dropout", since=1)
def _dropout_attr(cx: Cx) -> list[Value | None]:
    if cx.attr("is_test", 1) == 0 and float(cx.attr("ratio", 0.5)) != 0.0:
        raise cx.unsupported("training-mode Dropout (is_test=0) is random; export in eval mode")
    return _dropout_outputs(cx)


@onnx_op("Dropout", since=12)
def _dropout(cx: Cx) -> list[Value | None]:
    if cx.inp(2) is not None:  # training_mode
        training = cx.const(2)
        if training is None:
            raise cx.unsupported("training_mode (input 2) must be a constant")
        ratio = cx.const(1) if cx.inp(1) is not None else np.array(0.5)
        if ratio is None:
            raise cx.unsupported("ratio (input 1) must be a constant in training mode")
        if bool(np.asarray(training).reshape(-1)[0]) and float(np.asarray(ratio).reshape(-1)[0]) != 0.0:
            raise cx.unsupported("training-mode Dropout is random; export in eval mode")
    return _dropout_outputs(cx)


# ---- linear algebra -------------------------------------------------------------------------------

@onnx_op("MatMul", since=1)
def _matmul(cx: Cx) -> Value:
    return cx.emit("MatMul", cx.req(0), cx.req(1))


@onnx_op("Gemm", since=7)
def _gemm(cx: Cx) -> Value:
    a, b, c = cx.req(0), cx.req(1), cx.inp(2)
    if cx.attr("transA", 0):
        a = cx.emit("Transpose", a, perm=[1, 0])
    if cx.attr("transB", 0):
        b = cx.emit("Transpose", b, perm=[1, 0])
    y = cx.emit("MatMul", a, b)
    alpha, beta = float(cx.attr("alpha", 1.0)), float(cx.attr("beta", 1.0))
    if alpha != 1.0:
        y = cx.emit("Mul", y, cx.const_value(np.array(alpha, dtype=np.float32)))
    if c is not None:
        if beta != 1.0:
            c = cx.emit("Mul", c, cx.const_value(np.array(beta, dtype=np.float32)))
        y = cx.emit("Add", y, c)
    return y


def _flat2d_apply(cx: Cx, op: str, axis: int) -> Value:
    """Softmax/LogSoftmax before opset 13: coerce to 2-D at `axis`, apply on the last axis."""
    x = cx.req(0)
    rank = x.type.rank
    if rank is None:
        raise cx.unsupported("needs a known rank")
    axis = axis % rank if rank else 0
    if axis == rank - 1:
        return cx.emit(op, x, axis=-1)
    shp = cx.emit("Shape", x)
    lead = cx.emit("ReduceProd", cx.emit("Slice", shp, _i64(cx, [0]), _i64(cx, [axis])), axes=[0], keepdims=1)
    flat = cx.emit("Reshape", x, cx.emit("Concat", lead, _i64(cx, [-1]), axis=0))
    y = cx.emit(op, flat, axis=-1)
    return cx.emit("Reshape", y, shp)


for _op in ("Softmax", "LogSoftmax"):
    onnx_op(_op, since=1)((lambda op: (lambda cx: _flat2d_apply(cx, op, int(cx.attr("axis", 1)))))(_op))
    onnx_op(_op, since=13)((lambda op: (lambda cx: cx.emit(op, cx.req(0), axis=int(cx.attr("axis", -1)))))(_op))


# ---- reductions -----------------------------------------------------------------------------------

_REDUCE = ["ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare",
           "ReduceLogSumExp", "ReduceSum"]


def _reduce_attr(op: str) -> Any:
    def conv(cx: Cx) -> Value:
        axes = cx.attr("axes")
        return cx.emit(op, cx.req(0), axes=None if axes is None else [int(a) for a in axes],
                       keepdims=int(cx.attr("keepdims", 1)))

    return conv


def _reduce_input(op: str) -> Any:
    def conv(cx: Cx) -> Value:
        axes = cx.ints(1, "axes") if cx.inp(1) is not None else []
        if not axes:
            if cx.attr("noop_with_empty_axes", 0):
                return cx.emit("Identity", cx.req(0))
            return cx.emit(op, cx.req(0), axes=None, keepdims=int(cx.attr("keepdims", 1)))
        return cx.emit(op, cx.req(0), axes=axes, keepdims=int(cx.attr("keepdims", 1)))

    return conv


for _op in _REDUCE:
    onnx_op(_op, since=1)(_reduce_attr(_op))
    onnx_op(_op, since=13 if _op == "ReduceSum" else 18)(_reduce_input(_op))

for _op in ("ArgMax", "ArgMin"):
    onnx_op(_op, since=1)((lambda op: (lambda cx: cx.emit(
        op, cx.req(0), axis=int(cx.attr("axis", 0)), keepdims=int(cx.attr("keepdims", 1)),
        select_last_index=int(cx.attr("select_last_index", 0)))))(_op))


# ---- shape manipulation ---------------------------------------------------------------------------

@onnx_op("Reshape", since=5)
def _reshape(cx: Cx) -> Value:
    return cx.emit("Reshape", cx.req(0), cx.req(1), allowzero=int(cx.attr("allowzero", 0)))


@onnx_op("Flatten", since=1)
def _flatten(cx: Cx) -> Value:
    x = cx.req(0)
    rank = x.type.rank
    if rank is None:
        raise cx.unsupported("needs a known rank")
    axis = int(cx.attr("axis", 1))
    axis = axis + rank if axis < 0 else axis
    shp = cx.emit("Shape", x)
    lead = cx.emit("ReduceProd", cx.emit("Slice", shp, _i64(cx, [0]), _i64(cx, [axis])), axes=[0], keepdims=1) \
        if axis > 0 else _i64(cx, [1])
    return cx.emit("Reshape", x, cx.emit("Concat", lead, _i64(cx, [-1]), axis=0))


@onnx_op("Transpose", since=1)
def _transpose(cx: Cx) -> Value:
    perm = cx.attr("perm")
    if perm is None:
        rank = cx.req(0).type.rank
        if rank is None:
            raise cx.unsupported("Transpose without perm needs a known rank")
        perm = list(reversed(range(rank)))
    return cx.emit("Transpose", cx.req(0), perm=[int(p) for p in perm])


@onnx_op("Concat", since=4)
def _concat(cx: Cx) -> Value:
    return cx.emit("Concat", *[v for v in cx.inputs if v is not None], axis=int(cx.attr("axis")))


def _split_sizes(cx: Cx, x: Value, axis: int, sizes: list[int] | None, n: int) -> list[int]:
    if sizes:
        return sizes
    rank = x.type.rank
    dim = x.shape[axis] if x.shape is not None and rank else None
    if not isinstance(dim, int):
        raise cx.unsupported("Split without explicit sizes needs a static dimension")
    chunk = -(-dim // n)
    out = [chunk] * (dim // chunk) + ([dim % chunk] if dim % chunk else [])
    return out


@onnx_op("Split", since=2)
def _split_attr(cx: Cx) -> list[Value]:
    x, axis = cx.req(0), int(cx.attr("axis", 0))
    sizes = _split_sizes(cx, x, axis, [int(s) for s in cx.attr("split", [])] or None, len(cx.node.outputs))
    return cx.emit("Split", x, axis=axis, split=sizes, n_outputs=len(sizes))


@onnx_op("Split", since=13)
def _split_input(cx: Cx) -> list[Value]:
    x, axis = cx.req(0), int(cx.attr("axis", 0))
    sizes = cx.ints(1, "split") if cx.inp(1) is not None else None
    n = int(cx.attr("num_outputs", len(cx.node.outputs)))
    sizes = _split_sizes(cx, x, axis, sizes, n)
    outs = cx.emit("Split", x, axis=axis, split=sizes, n_outputs=len(sizes))
    return outs if isinstance(outs, list) else [outs]


@onnx_op("Slice", since=1)
def _slice_attr(cx: Cx) -> Value:
    starts, ends = cx.attr("starts"), cx.attr("ends")
    axes = cx.attr("axes") or list(range(len(starts)))
    return cx.emit("Slice", cx.req(0), _i64(cx, starts), _i64(cx, ends), _i64(cx, axes))


@onnx_op("Slice", since=10)
def _slice(cx: Cx) -> Value:
    return cx.emit("Slice", cx.req(0), cx.req(1), cx.req(2), cx.inp(3), cx.inp(4))


@onnx_op("Gather", since=1)
def _gather(cx: Cx) -> Value:
    return cx.emit("Gather", cx.req(0), cx.req(1), axis=int(cx.attr("axis", 0)))


@onnx_op("GatherElements", since=11)
def _gather_el(cx: Cx) -> Value:
    return cx.emit("GatherElements", cx.req(0), cx.req(1), axis=int(cx.attr("axis", 0)))


@onnx_op("GatherND", since=11)
def _gather_nd(cx: Cx) -> Value:
    return cx.emit("GatherND", cx.req(0), cx.req(1), batch_dims=int(cx.attr("batch_dims", 0)))


@onnx_op("ScatterND", since=11)
def _scatter_nd(cx: Cx) -> Value:
    return cx.emit("ScatterND", cx.req(0), cx.req(1), cx.req(2), reduction=str(cx.attr("reduction", "none")))


@onnx_op("ScatterElements", since=11)
def _scatter_el(cx: Cx) -> Value:
    return cx.emit("ScatterElements", cx.req(0), cx.req(1), cx.req(2), axis=int(cx.attr("axis", 0)),
                   reduction=str(cx.attr("reduction", "none")))


@onnx_op("Unsqueeze", since=1)
def _unsqueeze_attr(cx: Cx) -> Value:
    return cx.emit("Unsqueeze", cx.req(0), axes=[int(a) for a in cx.attr("axes")])


@onnx_op("Unsqueeze", since=13)
def _unsqueeze(cx: Cx) -> Value:
    return cx.emit("Unsqueeze", cx.req(0), axes=cx.ints(1, "axes"))


@onnx_op("Squeeze", since=1)
def _squeeze_attr(cx: Cx) -> Value:
    axes = cx.attr("axes")
    return cx.emit("Squeeze", cx.req(0), axes=None if axes is None else [int(a) for a in axes])


@onnx_op("Squeeze", since=13)
def _squeeze(cx: Cx) -> Value:
    axes = cx.ints(1, "axes") if cx.inp(1) is not None else None
    return cx.emit("Squeeze", cx.req(0), axes=axes)


@onnx_op("Expand", since=8)
def _expand(cx: Cx) -> Value:
    return cx.emit("Expand", cx.req(0), cx.req(1))


@onnx_op("Tile", since=6)
def _tile(cx: Cx) -> Value:
    return cx.emit("Tile", cx.req(0), cx.req(1))


@onnx_op("Shape", since=1)
def _shape(cx: Cx) -> Value:
    attrs: dict[str, int] = {}
    if cx.attr("start") is not None:
        attrs["start"] = int(cx.attr("start"))
    if cx.attr("end") is not None:
        attrs["end"] = int(cx.attr("end"))
    return cx.emit("Shape", cx.req(0), **attrs)


@onnx_op("Size", since=1)
def _size(cx: Cx) -> Value:
    return cx.emit("Size", cx.req(0))


@onnx_op("Range", since=11)
def _range(cx: Cx) -> Value:
    return cx.emit("Range", cx.req(0), cx.req(1), cx.req(2))


@onnx_op("ConstantOfShape", since=9)
def _const_of_shape(cx: Cx) -> Value:
    val = cx.attr("value")
    if val is None:
        value, dt = 0.0, DType.f32
    else:
        arr = np.asarray(val).reshape(-1)
        from .onnx import array_to_ir

        data = array_to_ir(arr)
        dt = DType.from_numpy(arr.dtype) if arr.dtype.name != "bfloat16" else DType.bf16
        value = float(arr[0]) if dt.is_float else (bool(arr[0]) if dt == DType.bool else int(arr[0]))
        del data
    return cx.emit("ConstantOfShape", cx.req(0), value=value, dtype=dt.value)


@onnx_op("Trilu", since=14)
def _trilu(cx: Cx) -> Value:
    return cx.emit("Trilu", cx.req(0), cx.inp(1), upper=int(cx.attr("upper", 1)))


@onnx_op("CumSum", since=11)
def _cumsum(cx: Cx) -> Value:
    return cx.emit("CumSum", cx.req(0), cx.req(1), exclusive=int(cx.attr("exclusive", 0)),
                   reverse=int(cx.attr("reverse", 0)))


@onnx_op("Constant", since=1)
def _constant(cx: Cx) -> Value:
    from .onnx import array_to_ir

    for key, dt in (("value_float", np.float32), ("value_floats", np.float32),
                    ("value_int", np.int64), ("value_ints", np.int64)):
        v = cx.attr(key)
        if v is not None:
            return cx.g.add_const(_out_name(cx), np.array(v, dtype=dt), unique=True)
    v = cx.attr("value")
    if v is None:
        raise ModelFormatError(f"Constant node '{cx.node.name}' has no supported value attribute")
    return cx.g.add_const(_out_name(cx), array_to_ir(np.asarray(v)), unique=True)


def _out_name(cx: Cx) -> str:
    from .onnx import sanitize

    return sanitize(cx.node.outputs[0].name) if cx.node.outputs else cx.name


# ---- normalization and transformer-level standard ops ---------------------------------------------

def _stash_dtype(cx: Cx) -> DType:
    """stash_type: the precision the statistics are computed in (default float32)."""
    return _dtype(int(cx.attr("stash_type", 1)), cx)


def _norm_axes(cx: Cx, x: Value) -> tuple[int, int]:
    rank = x.type.rank
    if rank is None:
        raise cx.unsupported("needs an input of known rank")
    axis = int(cx.attr("axis", -1))
    if not -rank <= axis < rank:
        raise cx.unsupported(f"axis {axis} out of range for rank {rank}")
    return axis % rank, rank


def _scalar_like(cx: Cx, value: float, dt: DType) -> Value:
    c = cx.const_value(np.array(value, dtype=np.float64 if dt == DType.f64 else np.float32))
    return c if c.dtype == dt else cx.emit("Cast", c, to=dt.value)


def _norm_decomposed(cx: Cx, x: Value, axis: int, rank: int, rms: bool, eps: float | None = None
                     ) -> tuple[Value, Value, Value]:
    """(Layer|RMS)Normalization over axes [axis, rank) in primitives, in the stash precision.
    Returns (normalized x in stash dtype, mean (inv_std for RMS), inv_std), stats with keepdims."""
    st = _stash_dtype(cx)
    xs = x if x.dtype == st else cx.emit("Cast", x, to=st.value)
    axes = list(range(axis, rank))
    eps_v = _scalar_like(cx, float(cx.attr("epsilon", 1e-5)) if eps is None else eps, st)
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


def _wants(cx: Cx, i: int) -> bool:
    return len(cx.node.outputs) > i and bool(cx.node.outputs[i].name)


def _is_vector_of(w: Value | None, x: Value) -> bool:
    """The fused IR norms take a weight [D] matching the last axis of x."""
    return w is not None and w.shape is not None and len(w.shape) == 1 and x.shape is not None \
        and w.shape[0] == x.shape[-1]


@onnx_op("LayerNormalization", since=17)
def _layer_norm(cx: Cx) -> list[Value | None]:
    x, w, b = cx.req(0), cx.req(1), cx.inp(2)
    axis, rank = _norm_axes(cx, x)
    eps = float(cx.attr("epsilon", 1e-5))
    # the fused op normalizes the last axis with fp32 statistics (ONNX's default stash_type)
    simple = axis == rank - 1 and not _wants(cx, 1) and not _wants(cx, 2) and x.dtype.is_float \
        and _stash_dtype(cx) == DType.f32 and _is_vector_of(w, x) and (b is None or _is_vector_of(b, x)) \
        and w.dtype == x.dtype and (b is None or b.dtype == x.dtype)
    if simple:
        ins = [x, w] + ([b] if b is not None else [])
        return [cx.emit("LayerNorm", *ins, eps=eps)]
    y, mean, inv_std = _norm_decomposed(cx, x, axis, rank, rms=False)
    y = cx.emit("Cast", y, to=x.dtype.value) if y.dtype != x.dtype else y
    y = cx.emit("Mul", y, w)
    if b is not None:
        y = cx.emit("Add", y, b)
    return [y, mean if _wants(cx, 1) else None, inv_std if _wants(cx, 2) else None]


@onnx_op("RMSNormalization", since=23)
def _rms_norm(cx: Cx) -> Value:
    x, w = cx.req(0), cx.req(1)
    axis, rank = _norm_axes(cx, x)
    if axis == rank - 1 and _is_vector_of(w, x) and _stash_dtype(cx) == DType.f32:
        return cx.emit("RMSNorm", x, w, eps=float(cx.attr("epsilon", 1e-5)))  # fp32 statistics
    y, _, _ = _norm_decomposed(cx, x, axis, rank, rms=True)
    y = cx.emit("Cast", y, to=x.dtype.value) if y.dtype != x.dtype else y
    return cx.emit("Mul", y, w)


# ---- attention building blocks (shared with the com.microsoft converters) -------------------------

def i64_scalar(cx: Cx, value: int) -> Value:
    return cx.const_value(np.array(value, dtype=np.int64))


def dim_of(cx: Cx, x: Value, axis: int) -> Value:
    """x.shape[axis] as an i64 scalar (a constant when static, shape arithmetic otherwise)."""
    if x.shape is not None and isinstance(x.shape[axis], int):
        return i64_scalar(cx, int(x.shape[axis]))
    return cx.emit("Gather", cx.emit("Shape", x), i64_scalar(cx, axis), axis=0)


def split_heads(cx: Cx, x: Value, heads: int) -> Value:
    """[B, S, H*D] -> [B, H, S, D]."""
    x4 = cx.emit("Reshape", x, _i64(cx, [0, 0, heads, -1]))
    return cx.emit("Transpose", x4, perm=[0, 2, 1, 3])


def merge_heads(cx: Cx, x: Value) -> Value:
    """[B, H, S, D] -> [B, S, H*D]."""
    return cx.emit("Reshape", cx.emit("Transpose", x, perm=[0, 2, 1, 3]), _i64(cx, [0, 0, -1]))


def static_heads(cx: Cx, x: Value, what: str) -> int:
    if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[1], int):
        raise cx.unsupported(f"{what} must be 4-D [B, H, S, D] with a static head count, got {x.type}")
    return int(x.shape[1])


def repeat_kv(cx: Cx, x: Value, rep: int) -> Value:
    """[B, Hkv, S, D] -> [B, Hkv*rep, S, D], each KV head repeated rep times in place (GQA)."""
    if rep == 1:
        return x
    shp = cx.emit("Shape", x)
    lead, tail = cx.emit("Slice", shp, _i64(cx, [0]), _i64(cx, [2])), cx.emit("Slice", shp, _i64(cx, [2]), _i64(cx, [4]))
    x5 = cx.emit("Unsqueeze", x, axes=[2])
    x5 = cx.emit("Expand", x5, cx.emit("Concat", lead, _i64(cx, [rep]), tail, axis=0))
    heads = cx.emit("Mul", cx.emit("Slice", shp, _i64(cx, [1]), _i64(cx, [2])), _i64(cx, [rep]))
    target = cx.emit("Concat", cx.emit("Slice", shp, _i64(cx, [0]), _i64(cx, [1])), heads, tail, axis=0)
    return cx.emit("Reshape", x5, target)


def same_dim(a: Any, b: Any) -> bool:
    """Statically known to be equal (equal ints or the same symbol)."""
    return a == b and a is not None


def _bias_from_allowed(cx: Cx, allowed: Value, dt: DType) -> Value:
    """Boolean 'may attend' -> additive bias: 0 where allowed, -inf elsewhere (select, not multiply)."""
    return cx.emit("Where", allowed, _scalar_like(cx, 0.0, dt), _scalar_like(cx, float("-inf"), dt))


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
    pad_len = cx.emit("Sub", cx.emit("Unsqueeze", total, axes=[0]), cx.emit("Slice", shp, _i64(cx, [-1]), _i64(cx, [rank])))
    pad_shape = cx.emit("Concat", cx.emit("Slice", shp, _i64(cx, [0]), _i64(cx, [-1])), pad_len, axis=0) \
        if rank > 1 else pad_len
    fill = False if mask.dtype == DType.bool else float("-inf")
    pad = cx.emit("ConstantOfShape", pad_shape, value=fill, dtype=mask.dtype.value)
    return cx.emit("Concat", mask, pad, axis=-1)


def _attention_bias(cx: Cx, spec: AttentionSpec, q: Value, k: Value) -> Value | None:
    """The additive bias of ONNX Attention: mask, causal frontier, sliding window, key padding."""
    dt = q.dtype
    need_idx = spec.causal or spec.window != (-1, -1) or spec.nonpad is not None
    t_len, s_len = dim_of(cx, q, 2), dim_of(cx, k, 2)
    mask = spec.mask
    if mask is not None:
        mask = _pad_mask(cx, mask, s_len, k.shape[2] if k.shape else None)
        if mask.dtype == DType.bool:
            mask = _bias_from_allowed(cx, mask, dt)
        elif mask.dtype != dt:
            mask = cx.emit("Cast", mask, to=dt.value)
    if not need_idx:
        return mask
    zero, one = i64_scalar(cx, 0), i64_scalar(cx, 1)
    rows = cx.emit("Unsqueeze", cx.emit("Range", zero, t_len, one), axes=[1])  # [T, 1]
    cols = cx.emit("Unsqueeze", cx.emit("Range", zero, s_len, one), axes=[0])  # [1, S]
    offset = spec.offset
    nonpad4 = None
    if spec.nonpad is not None:
        nonpad4 = cx.emit("Reshape", cx.emit("Cast", spec.nonpad, to="i64"), _i64(cx, [-1, 1, 1, 1]))
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
            conds.append(cx.emit("LessOrEqual", diff, i64_scalar(cx, left)))
        if right >= 0:
            conds.append(cx.emit("LessOrEqual", cx.emit("Neg", diff), i64_scalar(cx, right)))
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
    root = _scalar_like(cx, float(np.sqrt(np.float32(scale))), dt)
    scores = cx.emit("MatMul", cx.emit("Mul", q, root),
                     cx.emit("Mul", cx.emit("Transpose", k, perm=[0, 1, 3, 2]), root))
    modes = {0: scores}
    if spec.softcap > 0:
        cap = _scalar_like(cx, spec.softcap, dt)
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
        dead = cx.emit("Equal", row_max, _scalar_like(cx, float("-inf"), dt))
        y = cx.emit("Where", dead, _scalar_like(cx, 0.0, dt), y)
    if qk_mode is None:
        return y, None
    if qk_mode == 3:
        qk = probs if dead is None else cx.emit("Where", dead, _scalar_like(cx, 0.0, dt), probs)
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
    want_qk = _wants(cx, 3)
    fused = mask is None and nonpad is None and window == (-1, -1) and not want_qk and \
        (not causal or _causal_is_bottom_right(q, k_new))
    if fused:
        attrs: dict[str, Any] = {"causal": int(causal), "softcap": softcap}
        if scale is not None:
            attrs["scale"] = float(scale)
        y = cx.emit("Attention", q, k, v, **attrs)
        qk = None
    else:
        offset = dim_of(cx, past_k, 2) if past_k is not None else None
        sm = cx.attr("softmax_precision")
        spec = AttentionSpec(scale=None if scale is None else float(scale), causal=causal, softcap=softcap,
                             mask=mask, offset=offset, nonpad=nonpad, window=window,
                             softmax_dtype=None if sm is None else _dtype(int(sm), cx))
        mode = int(cx.attr("qk_matmul_output_mode", 0)) if want_qk else None
        y, qk = decomposed_attention(cx, q, k, v, spec, mode)
    if three_d:
        y = merge_heads(cx, y)
    return [y, k if _wants(cx, 1) else None, v if _wants(cx, 2) else None, qk]


def rope_4d(cx: Cx, x: Value, cos: Value, sin: Value, pos: Value | None, interleaved: bool) -> Value:
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
