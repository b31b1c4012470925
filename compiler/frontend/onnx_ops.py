"""Converters for default-domain (ai.onnx) ops into zlc IR ops, keyed by the opset version they
apply from. Attribute/input variants across opsets are normalized here so that the IR sees one
form (reduce and squeeze axes as attributes, Split sizes as an attribute, Gemm as MatMul/Add).

This module holds the elementwise, linear-algebra, reduction and shape ops; normalization,
attention and rotary embeddings are onnx_nn.py's."""

from __future__ import annotations

from typing import Any

import numpy as np

from zlc.errors import ModelFormatError
from zlc.ir import Value
from zlc.ir.types import DType

from .onnx_context import OnnxContext as Cx
from .onnx_context import array_to_ir, sanitize
from .registry import onnx_op

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
    return cx.emit("Cast", cx.req(0), to=cx.onnx_dtype(int(cx.attr("to"))).value)


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
    lead = cx.emit("ReduceProd", cx.emit("Slice", shp, cx.i64([0]), cx.i64([axis])), axes=[0], keepdims=1)
    flat = cx.emit("Reshape", x, cx.emit("Concat", lead, cx.i64([-1]), axis=0))
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



@onnx_op("TopK", since=1)
def _topk_attr(cx: Cx) -> list[Value]:
    return _topk(cx, int(cx.attr("k")))


@onnx_op("TopK", since=10)
def _topk_input(cx: Cx) -> list[Value]:
    k = cx.ints(1, "k")
    if len(k) != 1:
        raise cx.unsupported(f"k must be one value, got {k}")
    return _topk(cx, k[0])


def _topk(cx: Cx, k: int) -> list[Value]:
    outs = cx.emit("TopK", cx.req(0), n_outputs=2, k=k, axis=int(cx.attr("axis", -1)),
                   largest=int(bool(cx.attr("largest", 1))),
                   sorted=int(cx.attr("sorted", 1)))
    return list(outs)


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
    lead = cx.emit("ReduceProd", cx.emit("Slice", shp, cx.i64([0]), cx.i64([axis])), axes=[0], keepdims=1) \
        if axis > 0 else cx.i64([1])
    return cx.emit("Reshape", x, cx.emit("Concat", lead, cx.i64([-1]), axis=0))


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
    return cx.emit("Slice", cx.req(0), cx.i64(starts), cx.i64(ends), cx.i64(axes))


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
    return sanitize(cx.node.outputs[0].name) if cx.node.outputs else cx.name
