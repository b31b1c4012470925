"""ATen lowerings that compute: elementwise math, comparisons and selection, reductions and
softmax, linear algebra and layer norm, and the Python arithmetic on sizes (SymInts) that
torch.export records as `operator.*` calls. Each emits op-level IR only; the shared passes raise it.
fx_layout.py lowers the ops that move and create data."""

from __future__ import annotations

import math
from typing import Any

import torch

from zlc.ir import Value
from zlc.ir.types import DType

from .fx_context import FxContext
from .fx_registry import Args, Lowering, aten_op

# ---- elementwise ---------------------------------------------------------------------------------

_UNARY = {
    "neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "reciprocal": "Reciprocal",
    "sin": "Sin", "cos": "Cos", "tanh": "Tanh", "sigmoid": "Sigmoid", "erf": "Erf", "relu": "Relu",
    "floor": "Floor", "ceil": "Ceil", "round": "Round", "sign": "Sign", "atan": "Atan", "tan": "Tan",
    "asin": "Asin", "acos": "Acos", "silu": "Silu",
}


def _unary(ir_op: str) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        return cx.emit(ir_op, cx.cast(a["self"], cx.out_dtype()))  # ints promote to float first

    return lower


for _aten, _ir in _UNARY.items():
    aten_op(f"aten::{_aten}.default")(_unary(_ir))


@aten_op("aten::rsqrt.default")
def _rsqrt(cx: FxContext, a: Args) -> Value:
    # Reciprocal(Sqrt(x)): the spelling the RMSNorm raising rule reads
    return cx.emit("Reciprocal", cx.emit("Sqrt", cx.cast(a["self"], cx.out_dtype())))


@aten_op("aten::log1p.default", "aten::expm1.default", "aten::exp2.default", "aten::log2.default",
         "aten::log10.default")
def _log_exp_variants(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    x = cx.cast(a["self"], dt)
    kind = cx.key.split("::")[1].split(".")[0]
    if kind == "log1p":
        return cx.emit("Log", cx.emit("Add", x, cx.scalar(1.0, dt)))
    if kind == "expm1":
        return cx.emit("Sub", cx.emit("Exp", x), cx.scalar(1.0, dt))
    if kind == "exp2":
        return cx.emit("Pow", cx.scalar(2.0, dt), x)
    return cx.emit("Div", cx.emit("Log", x), cx.scalar(math.log(2.0 if kind == "log2" else 10.0), dt))


@aten_op("aten::isnan.default", "aten::isinf.default")
def _isnan(cx: FxContext, a: Args) -> Value:
    return cx.emit("IsNaN" if "isnan" in cx.key else "IsInf", a["self"])


@aten_op("aten::logical_not.default", "aten::bitwise_not.default")
def _not(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    if cx.key.startswith("aten::bitwise") and x.dtype != DType.bool:
        raise cx.unsupported("bitwise ops on integers (the IR has logical ops on bool only)")
    return cx.emit("Not", cx.cast(x, DType.bool))


@aten_op("aten::gelu.default")
def _gelu(cx: FxContext, a: Args) -> Value:
    return cx.emit("Gelu", a["self"], approximate=str(a["approximate"]))


@aten_op("aten::leaky_relu.default")
def _leaky_relu(cx: FxContext, a: Args) -> Value:
    return cx.emit("LeakyRelu", a["self"], alpha=float(a["negative_slope"]))


@aten_op("aten::elu.default")
def _elu(cx: FxContext, a: Args) -> Value:
    if float(a["scale"]) != 1.0 or float(a["input_scale"]) != 1.0:
        raise cx.unsupported("elu with scale or input_scale != 1")
    return cx.emit("Elu", a["self"], alpha=float(a["alpha"]))


@aten_op("aten::softplus.default")
def _softplus(cx: FxContext, a: Args) -> Value:
    if float(a["beta"]) != 1.0 or float(a["threshold"]) != 20.0:
        raise cx.unsupported("softplus with beta != 1 or threshold != 20")
    return cx.emit("Softplus", a["self"])


def _operands(a: Args) -> list[Any]:
    return list(a.values())


def _promoted(x: Any, y: Any) -> DType:
    """torch's type promotion of two operands (0-D tensors count like scalars)."""

    def proto(v: Any) -> Any:
        if isinstance(v, Value):
            return torch.empty((1,) if v.shape is None or len(v.shape) else (), dtype=v.dtype.torch)
        return v

    px, py = proto(x), proto(y)
    if not isinstance(px, torch.Tensor) and not isinstance(py, torch.Tensor):
        px = torch.tensor(px)
    return DType.from_torch(torch.result_type(px, py))


_ARITH = {  # overloads -> IR op; operands in schema order (self, other[, alpha])
    ("add", "Tensor", "Scalar"): "Add", ("sub", "Tensor", "Scalar"): "Sub",
    ("mul", "Tensor", "Scalar"): "Mul", ("div", "Tensor", "Scalar"): "Div",
    ("pow", "Tensor_Tensor", "Tensor_Scalar", "Scalar"): "Pow", ("maximum", "default"): "Max",
    ("minimum", "default"): "Min", ("fmod", "Tensor", "Scalar"): "Mod",
}


def _arith(ir_op: str, reverse: bool = False) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        ops = _operands(a)
        x, y = (ops[1], ops[0]) if reverse else (ops[0], ops[1])
        dt = cx.out_dtype()  # e.g. int / int -> f32: cast first, then true division
        alpha = a.get("alpha", 1)
        yv = cx.tensor(y, dt)
        if alpha not in (None, 1):
            yv = cx.emit("Mul", yv, cx.scalar(alpha, dt))
        attrs = {"fmod": 1} if ir_op == "Mod" else {}  # torch.fmod: C semantics (sign of x)
        return cx.emit(ir_op, cx.tensor(x, dt), yv, **attrs)

    return lower


for (_aten, *_overloads), _ir in _ARITH.items():
    aten_op(*[f"aten::{_aten}.{o}" for o in _overloads])(_arith(_ir))
aten_op("aten::rsub.Tensor", "aten::rsub.Scalar")(_arith("Sub", reverse=True))


@aten_op("aten::remainder.Tensor", "aten::remainder.Scalar", "aten::remainder.Scalar_Tensor")
def _remainder(cx: FxContext, a: Args) -> Value:
    """Python's mod (sign of y): the IR's Mod for ints; x - floor(x / y) * y for floats."""
    dt = cx.out_dtype()
    x, y = (cx.tensor(o, dt) for o in _operands(a)[:2])
    if not dt.is_float:
        return cx.emit("Mod", x, y)
    return cx.emit("Sub", x, cx.emit("Mul", cx.floordiv(x, y), y))


@aten_op("aten::div.Tensor_mode", "aten::div.Scalar_mode", "aten::floor_divide.default")
def _div_mode(cx: FxContext, a: Args) -> Value:
    ops = _operands(a)
    dt = cx.out_dtype()
    x, y = cx.tensor(ops[0], dt), cx.tensor(ops[1], dt)
    mode = a.get("rounding_mode", "floor")
    if mode is None:
        return cx.emit("Div", x, y)
    if mode == "floor":
        return cx.floordiv(x, y)
    q = cx.emit("Div", x, y)  # integer Div truncates already
    if not dt.is_float:
        return q
    return cx.emit("Mul", cx.emit("Sign", q), cx.emit("Floor", cx.emit("Abs", q)))


_COMPARE = {"eq": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual"}


def _compare(ir_op: str, negate: bool = False) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        x, y = _operands(a)[:2]
        dt = _promoted(x, y)
        out = cx.emit(ir_op, cx.tensor(x, dt), cx.tensor(y, dt))
        return cx.emit("Not", out) if negate else out

    return lower


for _aten, _ir in _COMPARE.items():
    aten_op(f"aten::{_aten}.Tensor", f"aten::{_aten}.Scalar")(_compare(_ir))
aten_op("aten::ne.Tensor", "aten::ne.Scalar")(_compare("Equal", negate=True))


def _logical(ir_op: str) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        x, y = _operands(a)[:2]
        if cx.key.startswith("aten::bitwise") and (_promoted(x, y) != DType.bool):
            raise cx.unsupported("bitwise ops on integers (the IR has logical ops on bool only)")
        return cx.emit(ir_op, cx.tensor(x, DType.bool), cx.tensor(y, DType.bool))

    return lower


for _aten, _ir in (("and", "And"), ("or", "Or"), ("xor", "Xor")):
    aten_op(f"aten::logical_{_aten}.default", f"aten::bitwise_{_aten}.Tensor",
            f"aten::bitwise_{_aten}.Scalar")(_logical(_ir))


@aten_op("aten::where.self", "aten::where.ScalarSelf", "aten::where.ScalarOther", "aten::where.Scalar")
def _where(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    return cx.emit("Where", cx.tensor(a["condition"], DType.bool), cx.tensor(a["self"], dt),
                   cx.tensor(a["other"], dt))


@aten_op("aten::masked_fill.Scalar", "aten::masked_fill.Tensor")
def _masked_fill(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    return cx.emit("Where", cx.tensor(a["mask"], DType.bool), cx.tensor(a["value"], dt), a["self"])


@aten_op("aten::clamp.default", "aten::clamp.Tensor", "aten::clamp_min.default", "aten::clamp_max.default",
         "aten::hardtanh.default")
def _clamp(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    ops = _operands(a)
    x = cx.tensor(ops[0], dt)
    lo, hi = a.get("min", a.get("min_val")), a.get("max", a.get("max_val"))
    if cx.key.startswith("aten::clamp_max"):
        lo, hi = None, ops[1]
    elif cx.key.startswith("aten::clamp_min"):
        lo, hi = ops[1], None
    if lo is not None:
        x = cx.emit("Max", x, cx.tensor(lo, dt))
    if hi is not None:
        x = cx.emit("Min", x, cx.tensor(hi, dt))
    return x


# ---- reductions and softmax -----------------------------------------------------------------------

def _axes(dims: Any) -> list[int] | None:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None  # torch: no dims reduces everything
    return [int(d) for d in dims] if isinstance(dims, (list, tuple)) else [int(dims)]


def _reduce(ir_op: str) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        dt = cx.out_dtype()
        x = cx.cast(a["self"], DType.bool if dt == DType.bool else dt)  # sum(bool) -> i64, any(f) -> bool
        keep = int(bool(a.get("keepdim", False)))
        return cx.emit(ir_op, x, axes=_axes(a.get("dim")), keepdims=keep)

    return lower


aten_op("aten::mean.dim", "aten::mean.default")(_reduce("ReduceMean"))
aten_op("aten::sum.dim_IntList", "aten::sum.default")(_reduce("ReduceSum"))
aten_op("aten::amax.default", "aten::max.default", "aten::any.dim", "aten::any.dims",
        "aten::any.default")(_reduce("ReduceMax"))
aten_op("aten::amin.default", "aten::min.default", "aten::all.dim", "aten::all.dims",
        "aten::all.default")(_reduce("ReduceMin"))
aten_op("aten::prod.dim_int", "aten::prod.default")(_reduce("ReduceProd"))
aten_op("aten::logsumexp.default")(_reduce("ReduceLogSumExp"))


@aten_op("aten::max.dim", "aten::min.dim")
def _max_dim(cx: FxContext, a: Args) -> list[Value]:
    keep = int(bool(a["keepdim"]))
    red, arg = ("ReduceMax", "ArgMax") if cx.key.startswith("aten::max") else ("ReduceMin", "ArgMin")
    x, d = a["self"], int(a["dim"])
    return [cx.emit(red, x, axes=[d], keepdims=keep), cx.emit(arg, x, axis=d, keepdims=keep)]


@aten_op("aten::topk.default")
def _topk(cx: FxContext, a: Args) -> list[Value]:
    return cx.emit_multi("TopK", [a["self"]], 2, k=int(a["k"]), axis=int(a["dim"]), largest=int(bool(a["largest"])),
                         sorted=int(bool(a["sorted"])))


@aten_op("aten::argmax.default", "aten::argmin.default")
def _argmax(cx: FxContext, a: Args) -> Value:
    op = "ArgMax" if "argmax" in cx.key else "ArgMin"
    x, d = a["self"], a["dim"]
    if d is None:
        flat = cx.emit("Reshape", x, cx.ints([-1]))
        return cx.emit(op, flat, axis=0, keepdims=0)
    return cx.emit(op, x, axis=int(d), keepdims=int(bool(a["keepdim"])))


@aten_op("aten::var.correction", "aten::var_mean.correction")
def _var(cx: FxContext, a: Args) -> Value | list[Value]:
    dt = cx.out_dtype()
    x, axes, keep = cx.cast(a["self"], dt), _axes(a["dim"]), int(bool(a["keepdim"]))
    mean = cx.emit("ReduceMean", x, axes=axes, keepdims=1)
    d = cx.emit("Sub", x, mean)
    ss = cx.emit("ReduceSum", cx.emit("Mul", d, d), axes=axes, keepdims=keep)
    n = cx.cast(cx.emit("Div", cx.emit("Size", x), cx.emit("Size", mean)), dt)  # elements reduced
    corr = a["correction"]
    denom = cx.emit("Sub", n, cx.scalar(float(1 if corr is None else corr), dt))
    var = cx.emit("Div", ss, denom)
    if "var_mean" not in cx.key:
        return var
    return [var, mean if keep else cx.emit("ReduceMean", x, axes=axes, keepdims=0)]


@aten_op("aten::_softmax.default", "aten::_log_softmax.default")
def _softmax(cx: FxContext, a: Args) -> Value:
    x = cx.cast(a["self"], cx.out_dtype())  # half_to_float: compute in the output dtype
    op = "LogSoftmax" if "log_softmax" in cx.key else "Softmax"
    return cx.emit(op, x, axis=int(a["dim"]))


@aten_op("aten::cumsum.default")
def _cumsum(cx: FxContext, a: Args) -> Value:
    return cx.emit("CumSum", cx.cast(a["self"], cx.out_dtype()), cx.scalar(int(a["dim"]), DType.i64))


# ---- linear algebra and normalization -------------------------------------------------------------

@aten_op("aten::mm.default", "aten::bmm.default", "aten::matmul.default")
def _matmul(cx: FxContext, a: Args) -> Value:
    return cx.emit("MatMul", a["self"], a["mat2"] if "mat2" in a else a["other"])


@aten_op("aten::addmm.default", "aten::baddbmm.default")
def _addmm(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    y = cx.emit("MatMul", a["mat1"] if "mat1" in a else a["batch1"], a["mat2"] if "mat2" in a else a["batch2"])
    if a["alpha"] != 1:
        y = cx.emit("Mul", y, cx.scalar(a["alpha"], dt))
    bias = a["self"]
    if a["beta"] == 0:
        return y
    if a["beta"] != 1:
        bias = cx.emit("Mul", bias, cx.scalar(a["beta"], dt))
    return cx.emit("Add", y, bias)


@aten_op("aten::linear.default")
def _linear(cx: FxContext, a: Args) -> Value:
    y = cx.emit("MatMul", a["input"], cx.permute(a["weight"], [1, 0]))
    return y if a["bias"] is None else cx.emit("Add", y, a["bias"])


@aten_op("aten::native_layer_norm.default")
def _layer_norm(cx: FxContext, a: Args) -> list[Value | None]:
    x, shape, eps = a["input"], a["normalized_shape"], float(a["eps"])
    dt = cx.out_dtype()
    if len(shape) == 1 and cx.used_outputs() <= {0}:
        # one ATen op, one IR op: the same mapping as ONNX LayerNormalization
        w = a["weight"] if a["weight"] is not None else \
            cx.g.add_const("ones", torch.ones(int(shape[0]), dtype=dt.torch), unique=True)
        ins = [x, w] + ([a["bias"]] if a["bias"] is not None else [])
        return [cx.emit("LayerNorm", *ins, eps=eps), None, None]
    axes = list(range(-len(shape), 0))
    mean = cx.emit("ReduceMean", x, axes=axes, keepdims=1)
    d = cx.emit("Sub", x, mean)
    var = cx.emit("ReduceMean", cx.emit("Mul", d, d), axes=axes, keepdims=1)
    rstd = cx.emit("Reciprocal", cx.emit("Sqrt", cx.emit("Add", var, cx.scalar(eps, dt))))
    y = cx.emit("Mul", d, rstd)
    if a["weight"] is not None:
        y = cx.emit("Mul", y, a["weight"])
    if a["bias"] is not None:
        y = cx.emit("Add", y, a["bias"])
    return [y, mean, rstd]


# ---- sizes (SymInt arithmetic) ------------------------------------------------------------------------

@aten_op("aten::sym_size.int")
def _sym_size(cx: FxContext, a: Args) -> Value:
    m = cx.meta()
    if isinstance(m, torch.SymInt) and m.node.expr in cx.sym_sources:
        return cx.dim(m)  # one Shape node per symbol, shared by every use
    x, d = a["self"], int(a["dim"])
    return cx.emit("Squeeze", cx.emit("Shape", x, start=d, end=d + 1 if d != -1 else None), axes=[0])


@aten_op("aten::sym_numel.default")
def _sym_numel(cx: FxContext, a: Args) -> Value:
    return cx.emit("Size", a["self"])


def _size_binary(ir_op: str) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        x, y = a["arg0"], a["arg1"]
        dt = _promoted(x, y) if ir_op in _COMPARE.values() else cx.out_dtype()
        return cx.emit(ir_op, cx.tensor(x, dt), cx.tensor(y, dt))

    return lower


for _py, _ir in (("add", "Add"), ("sub", "Sub"), ("mul", "Mul"), ("truediv", "Div"), ("mod", "Mod"),
                 ("eq", "Equal"), ("lt", "Less"), ("le", "LessOrEqual"), ("gt", "Greater"),
                 ("ge", "GreaterOrEqual")):
    aten_op(f"operator.{_py}")(_size_binary(_ir))
aten_op("torch.sym_max")(_size_binary("Max"))
aten_op("torch.sym_min")(_size_binary("Min"))


@aten_op("operator.floordiv")
def _size_floordiv(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    return cx.floordiv(cx.tensor(a["arg0"], dt), cx.tensor(a["arg1"], dt))


@aten_op("operator.neg")
def _size_neg(cx: FxContext, a: Args) -> Value:
    return cx.emit("Neg", cx.tensor(a["arg0"], cx.out_dtype()))


@aten_op("operator.getitem")
def _getitem(cx: FxContext, a: Args) -> Value:
    seq, i = a["arg0"], int(a["arg1"])
    if not isinstance(seq, (list, tuple)) or seq[i] is None:
        raise cx.unsupported(f"result {i} of a multi-output op that has no lowering")
    return seq[i]
