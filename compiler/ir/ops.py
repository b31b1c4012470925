"""The IR's op set: one table of op definitions with shape/dtype inference.

Op-level ops follow ONNX semantics (broadcasting, negative axes) with attributes normalized by the
frontends (e.g. reduce axes and squeeze axes are always attributes, Gemm is lowered to MatMul/Add).
Transformer-level ops are what raising produces and what codegen tiles. Both live in one graph.
Besides static shapes, inference propagates the *symbolic elements* of small integer tensors
(`Value.sym`) so that shape arithmetic (Shape -> Gather -> Concat -> Reshape) yields exact shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zlc.errors import ShapeError

from .graph import Node, Value
from .types import Dim, DType, TensorType

Infer = Callable[[Node], list[TensorType]]


@dataclass(frozen=True)
class OpDef:
    name: str
    level: str  # "primitive" | "transformer"
    infer: Infer
    min_inputs: int
    max_inputs: int  # -1: variadic
    doc: str = ""
    optional: tuple[int, ...] = ()  # inputs below min_inputs that may still be absent (None)


OPS: dict[str, OpDef] = {}


def _def(name: str, level: str, min_in: int, max_in: int, doc: str = "",
         optional: tuple[int, ...] = ()) -> Callable[[Infer], Infer]:
    def deco(fn: Infer) -> Infer:
        OPS[name] = OpDef(name, level, fn, min_in, max_in, doc, optional)
        return fn

    return deco


# ---- symbolic dim arithmetic -------------------------------------------------------------------

def _is_int(d: Any) -> bool:
    return isinstance(d, (int, np.integer)) and not isinstance(d, bool)


def dim_add(a: Dim, b: Dim) -> Dim:
    if _is_int(a) and _is_int(b):
        return int(a) + int(b)
    if _is_int(b) and int(b) == 0:
        return a
    if _is_int(a) and int(a) == 0:
        return b
    if _is_int(b) and int(b) < 0:
        return f"{a}-{-int(b)}"
    return f"{a}+{b}"


def dim_sub(a: Dim, b: Dim) -> Dim:
    if _is_int(a) and _is_int(b):
        return int(a) - int(b)
    if _is_int(b) and int(b) == 0:
        return a
    if isinstance(a, str) and isinstance(b, str) and a.endswith("+" + b):
        return a[: -len(b) - 1]
    if a == b:
        return 0
    return f"{a}-{b}"


def dim_mul(a: Dim, b: Dim) -> Dim:
    if _is_int(a) and _is_int(b):
        return int(a) * int(b)
    if _is_int(a) and int(a) == 1:
        return b
    if _is_int(b) and int(b) == 1:
        return a
    return f"{a}*{b}"


def broadcast(shapes: Sequence[tuple[Dim, ...] | None], node: Node | None = None) -> tuple[Dim, ...] | None:
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes if s is not None)
    out: list[Dim] = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if s is not None and len(s) - rank + i >= 0]
        d: Dim = 1
        for x in dims:
            if x == 1 or x == d:
                continue
            if d == 1:
                d = x
            elif _is_int(d) and _is_int(x):
                where = f" at node '{node.name}' ({node.op})" if node else ""
                raise ShapeError(f"cannot broadcast shapes {list(map(list, shapes))}{where}")  # type: ignore[arg-type]
            elif isinstance(d, str) and _is_int(x):
                d = x  # a static extent pins the symbol
        out.append(d)
    return tuple(out)


def norm_axis(axis: int, rank: int, node: Node) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < max(rank, 1) and not (rank == 0 and a == 0):
        raise ShapeError(f"axis {axis} out of range for rank {rank} at node '{node.name}' ({node.op})")
    return a


def _t(v: Value | None) -> TensorType:
    assert v is not None
    return v.type


def _elems(v: Value | None) -> list[Dim] | None:
    """Known elements of a small 0-D/1-D integer tensor (constant data or symbolic)."""
    if v is None:
        return None
    if v.sym is not None:
        return list(v.sym)
    if v.data is not None:
        a = v.const_array()
        if a is not None and a.ndim <= 1 and a.size <= 64 and a.dtype.kind in "iub":
            return [int(x) for x in a.reshape(-1)]
    return None


# ---- op-level definitions --------------------------------------------------------------------

def _same(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


UNARY = ["Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Sin", "Cos", "Tanh", "Sigmoid", "Erf",
         "Relu", "Floor", "Ceil", "Round", "Identity", "Softplus", "Sign", "Gelu", "LeakyRelu",
         "Not", "Silu", "HardSigmoid", "Elu", "Atan", "Tan", "Asin", "Acos"]
for _n in UNARY:
    _def(_n, "primitive", 1, 1)(_same)

BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod"]
COMPARE = ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"]
LOGICAL = ["And", "Or", "Xor"]


def _binary(node: Node) -> list[TensorType]:
    a, b = _t(node.inputs[0]), _t(node.inputs[1])
    out_dt = DType.bool if node.op in COMPARE or node.op in LOGICAL else a.dtype
    return [TensorType(out_dt, broadcast([a.shape, b.shape], node))]


for _n in BINARY + COMPARE + LOGICAL:
    _def(_n, "primitive", 2, 2)(_binary)
OPS["Mod"] = OpDef("Mod", "primitive", _binary, 2, 2,
                   "attrs: fmod (1: C fmod, the result has the dividend's sign; 0: Python-style mod, "
                   "the result has the divisor's sign), for integer and float inputs alike")

for _n in ("IsNaN", "IsInf"):
    _def(_n, "primitive", 1, 1)(lambda n: [TensorType(DType.bool, _t(n.inputs[0]).shape)])


@_def("Where", "primitive", 3, 3)
def _where(node: Node) -> list[TensorType]:
    c, a, b = (_t(v) for v in node.inputs)
    return [TensorType(a.dtype, broadcast([c.shape, a.shape, b.shape], node))]


@_def("Cast", "primitive", 1, 1, "attrs: to (dtype name)")
def _cast(node: Node) -> list[TensorType]:
    return [TensorType(DType(node.attrs["to"]), _t(node.inputs[0]).shape)]


@_def("MatMul", "primitive", 2, 2)
def _matmul(node: Node) -> list[TensorType]:
    a, b = _t(node.inputs[0]), _t(node.inputs[1])
    if a.shape is None or b.shape is None:
        return [TensorType(a.dtype, None)]
    sa, sb = list(a.shape), list(b.shape)
    if len(sa) == 0 or len(sb) == 0:
        raise ShapeError(f"MatMul of a scalar at node '{node.name}'")
    va, vb = len(sa) == 1, len(sb) == 1
    if va:
        sa.insert(0, 1)
    if vb:
        sb.append(1)
    k1, k2 = sa[-1], sb[-2]
    if _is_int(k1) and _is_int(k2) and k1 != k2:
        raise ShapeError(f"MatMul inner dims {k1} != {k2} at node '{node.name}' "
                         f"(shapes {list(a.shape)} x {list(b.shape)})")
    batch = broadcast([tuple(sa[:-2]), tuple(sb[:-2])], node) or ()
    out = list(batch) + [sa[-2], sb[-1]]
    if va:
        out.pop(-2)
    if vb:
        out.pop(-1)
    return [TensorType(a.dtype, tuple(out))]


def _axis_reduce(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    r = len(x.shape)
    axes = node.attrs.get("axes")
    ax = set(range(r)) if axes is None else {norm_axis(a, r, node) for a in axes}
    keep = bool(node.attrs.get("keepdims", 1))
    shape = tuple((1 if i in ax else d) for i, d in enumerate(x.shape) if keep or i not in ax)
    dt = DType.i64 if node.op in ("ArgMax", "ArgMin") else x.dtype
    return [TensorType(dt, shape)]


for _n in ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2",
           "ReduceSumSquare", "ReduceLogSumExp"):
    _def(_n, "primitive", 1, 1, "attrs: axes (list or None = all), keepdims" +
         ("; over an empty axis the result is the identity (-inf / int min / False for max, "
          "+inf / int max / True for min)" if _n in ("ReduceMax", "ReduceMin") else ""))(_axis_reduce)


def _arg_reduce(node: Node) -> list[TensorType]:
    n2 = Node(node.op, node.inputs, [], {"axes": [node.attrs.get("axis", 0)],
                                         "keepdims": node.attrs.get("keepdims", 1)}, node.name)
    return _axis_reduce(n2)


for _n in ("ArgMax", "ArgMin"):
    _def(_n, "primitive", 1, 1, "attrs: axis, keepdims, select_last_index")(_arg_reduce)

for _n in ("Softmax", "LogSoftmax"):
    _def(_n, "primitive", 1, 1, "attrs: axis")(_same)


@_def("Reshape", "primitive", 2, 2, "inputs: x, shape (i64[r]); attrs: allowzero")
def _reshape(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    target = _elems(node.inputs[1])
    if target is None:
        st = _t(node.inputs[1]).shape
        if st is not None and len(st) == 1 and _is_int(st[0]):
            return [TensorType(x.dtype, tuple(f"?{i}" for i in range(int(st[0]))))]
        return [TensorType(x.dtype, None)]
    allowzero = bool(node.attrs.get("allowzero", 0))
    out: list[Dim] = []
    for i, d in enumerate(target):
        if d == 0 and not allowzero:
            if x.shape is None or i >= len(x.shape):
                raise ShapeError(f"Reshape copies dim {i} that the input lacks at node '{node.name}'")
            out.append(x.shape[i])
        else:
            out.append(d)
    if -1 in out:
        i = out.index(-1)
        total = x.numel()
        known = 1
        ok = True
        for j, d in enumerate(out):
            if j != i:
                if _is_int(d):
                    known *= int(d)
                else:
                    ok = False
        if total is not None and ok:
            if known == 0 or total % known:
                raise ShapeError(f"Reshape of {x} to {target} is impossible at node '{node.name}'")
            out[i] = total // known
        else:
            out[i] = _solve_minus_one(x.shape, out, i)
    return [TensorType(x.dtype, tuple(out))]


def _solve_minus_one(src: tuple[Dim, ...] | None, out: list[Dim], i: int) -> Dim:
    """-1 in a reshape over symbolic dims: cancel factors that appear on both sides."""
    if src is None:
        return f"?{i}"
    num: list[Dim] = [d for d in src if d != 1]
    den: list[Dim] = [d for j, d in enumerate(out) if j != i and d != 1]
    for d in list(den):
        if d in num:
            num.remove(d)
            den.remove(d)
    ni = [int(d) for d in num if _is_int(d)]
    di = [int(d) for d in den if _is_int(d)]
    ns = [d for d in num if not _is_int(d)]
    ds = [d for d in den if not _is_int(d)]
    if ds:
        return f"?{i}"
    p = int(np.prod(ni)) if ni else 1
    q = int(np.prod(di)) if di else 1
    if p % q:
        return f"?{i}"
    res: Dim = p // q
    for s in ns:
        res = dim_mul(res, s)
    return res


@_def("Transpose", "primitive", 1, 1, "attrs: perm")
def _transpose(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    perm = node.attrs.get("perm") or list(reversed(range(len(x.shape))))
    if sorted(perm) != list(range(len(x.shape))):
        raise ShapeError(f"Transpose perm {perm} does not fit rank {len(x.shape)} at node '{node.name}'")
    return [TensorType(x.dtype, tuple(x.shape[p] for p in perm))]


@_def("Concat", "primitive", 1, -1, "attrs: axis")
def _concat(node: Node) -> list[TensorType]:
    ts = [_t(v) for v in node.inputs]
    if any(t.shape is None for t in ts):
        return [TensorType(ts[0].dtype, None)]
    r = len(ts[0].shape or ())
    ax = norm_axis(node.attrs["axis"], r, node)
    out = list(ts[0].shape or ())
    total: Dim = 0
    for t in ts:
        if len(t.shape or ()) != r:
            raise ShapeError(f"Concat of ranks {[len(t.shape or ()) for t in ts]} at node '{node.name}'")
        total = dim_add(total, (t.shape or ())[ax])
    out[ax] = total
    for i in range(r):  # other dims must agree: a static extent pins a symbolic one
        if i != ax and not _is_int(out[i]):
            static = [t.shape[i] for t in ts if t.shape is not None and _is_int(t.shape[i])]
            if static:
                out[i] = static[0]
    return [TensorType(ts[0].dtype, tuple(out))]


@_def("Split", "primitive", 1, 1, "attrs: axis, split (sizes)")
def _split(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    sizes = node.attrs["split"]
    if x.shape is None:
        return [TensorType(x.dtype, None) for _ in sizes]
    ax = norm_axis(node.attrs.get("axis", 0), len(x.shape), node)
    outs = []
    for s in sizes:
        sh = list(x.shape)
        sh[ax] = s
        outs.append(TensorType(x.dtype, tuple(sh)))
    return outs


def _slice_dim(d: Dim, start: int, end: int, step: int) -> Dim:
    if _is_int(d):
        return len(range(*slice(start, end, step).indices(int(d))))
    big = 2**62
    if step == 1 and start >= 0 and end >= big:
        return dim_sub(d, start) if start else d
    if step == 1 and start >= 0 and 0 <= end < big:
        return f"min({d},{end})-{start}" if start else f"min({d},{end})"
    if step == 1 and start < 0 and end >= big:
        return f"min({d},{-start})"
    return f"slice({d})"


@_def("Slice", "primitive", 3, 5, "inputs: x, starts, ends, axes?, steps?")
def _slice(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    starts, ends = _elems(node.input(1)), _elems(node.input(2))
    axes = _elems(node.input(3)) if node.input(3) is not None else None
    steps = _elems(node.input(4)) if node.input(4) is not None else None
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    r = len(x.shape)
    if starts is None or ends is None or (node.input(3) is not None and axes is None) or \
            (node.input(4) is not None and steps is None):
        if axes is not None:
            out = list(x.shape)
            for a in axes:
                if _is_int(a):
                    out[norm_axis(int(a), r, node)] = f"?{node.name}"
            return [TensorType(x.dtype, tuple(out))]
        return [TensorType(x.dtype, tuple(f"?{i}" for i in range(r)))]
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    out = list(x.shape)
    for s, e, a, st in zip(starts, ends, axes, steps, strict=False):
        ax = norm_axis(int(a), r, node)  # type: ignore[arg-type]
        if not (_is_int(s) and _is_int(e) and _is_int(st)):
            out[ax] = f"?{node.name}.{ax}"
            continue
        out[ax] = _slice_dim(out[ax], int(s), min(int(e), 2**62), int(st))  # type: ignore[arg-type]
    return [TensorType(x.dtype, tuple(out))]


@_def("Gather", "primitive", 2, 2, "attrs: axis")
def _gather(node: Node) -> list[TensorType]:
    x, idx = _t(node.inputs[0]), _t(node.inputs[1])
    if x.shape is None or idx.shape is None:
        return [TensorType(x.dtype, None)]
    ax = norm_axis(node.attrs.get("axis", 0), len(x.shape), node)
    return [TensorType(x.dtype, tuple(x.shape[:ax]) + tuple(idx.shape) + tuple(x.shape[ax + 1:]))]


@_def("GatherElements", "primitive", 2, 2, "attrs: axis")
def _gather_el(node: Node) -> list[TensorType]:
    return [TensorType(_t(node.inputs[0]).dtype, _t(node.inputs[1]).shape)]


@_def("GatherND", "primitive", 2, 2, "attrs: batch_dims")
def _gather_nd(node: Node) -> list[TensorType]:
    x, idx = _t(node.inputs[0]), _t(node.inputs[1])
    if x.shape is None or idx.shape is None or not _is_int(idx.shape[-1]):
        return [TensorType(x.dtype, None)]
    b = node.attrs.get("batch_dims", 0)
    k = int(idx.shape[-1])
    return [TensorType(x.dtype, tuple(idx.shape[:-1]) + tuple(x.shape[b + k:]))]


@_def("ScatterND", "primitive", 3, 3, "attrs: reduction")
def _scatter_nd(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


@_def("ScatterElements", "primitive", 3, 3, "attrs: axis, reduction")
def _scatter_el(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


@_def("Unsqueeze", "primitive", 1, 1, "attrs: axes")
def _unsqueeze(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    r = len(x.shape) + len(node.attrs["axes"])
    axes = sorted(norm_axis(a, r, node) for a in node.attrs["axes"])
    out = list(x.shape)
    for a in axes:
        out.insert(a, 1)
    return [TensorType(x.dtype, tuple(out))]


@_def("Squeeze", "primitive", 1, 1, "attrs: axes (None = all size-1 dims)")
def _squeeze(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    axes = node.attrs.get("axes")
    if axes is None:
        return [TensorType(x.dtype, tuple(d for d in x.shape if d != 1))]
    ax = {norm_axis(a, len(x.shape), node) for a in axes}
    for a in ax:
        if _is_int(x.shape[a]) and x.shape[a] != 1:
            raise ShapeError(f"Squeeze of dim {a} with size {x.shape[a]} at node '{node.name}'")
    return [TensorType(x.dtype, tuple(d for i, d in enumerate(x.shape) if i not in ax))]


@_def("Expand", "primitive", 2, 2, "inputs: x, shape")
def _expand(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    target = _elems(node.inputs[1])
    if target is None:
        st = _t(node.inputs[1]).shape
        if x.shape is not None and st is not None and len(st) == 1 and _is_int(st[0]):
            # Rank is known even when the target's elements are not.
            r = max(len(x.shape), int(st[0]))
            return [TensorType(x.dtype, tuple(f"?{node.name}.{i}" for i in range(r)))]
        return [TensorType(x.dtype, None)]
    return [TensorType(x.dtype, broadcast([x.shape, tuple(target)], node))]


@_def("Tile", "primitive", 2, 2, "inputs: x, repeats")
def _tile(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    reps = _elems(node.inputs[1])
    if x.shape is None or reps is None:
        return [TensorType(x.dtype, None)]
    return [TensorType(x.dtype, tuple(dim_mul(d, r) for d, r in zip(x.shape, reps, strict=False)))]


@_def("Shape", "primitive", 1, 1, "attrs: start, end")
def _shape(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    if x.shape is None:
        return [TensorType(DType.i64, ("?rank",))]
    sl = x.shape[slice(node.attrs.get("start", 0), node.attrs.get("end"))]
    return [TensorType(DType.i64, (len(sl),))]


@_def("Size", "primitive", 1, 1)
def _size(node: Node) -> list[TensorType]:
    return [TensorType(DType.i64, ())]


@_def("Range", "primitive", 3, 3, "inputs: start, limit, delta (scalars)")
def _range(node: Node) -> list[TensorType]:
    s, l_, d = (_elems(v) for v in node.inputs)
    dt = _t(node.inputs[0]).dtype
    if s and l_ and d and all(_is_int(x) for x in s + l_ + d):
        n = max(0, -(-(int(l_[0]) - int(s[0])) // int(d[0])))  # type: ignore[arg-type]
        return [TensorType(dt, (n,))]
    if s and l_ and d and d[0] == 1:
        return [TensorType(dt, (dim_sub(l_[0], s[0]),))]
    return [TensorType(dt, (f"?{node.name}",))]


@_def("ConstantOfShape", "primitive", 1, 1, "inputs: shape; attrs: value, dtype")
def _const_of_shape(node: Node) -> list[TensorType]:
    target = _elems(node.inputs[0])
    dt = DType(node.attrs.get("dtype", "f32"))
    if target is None:
        st = _t(node.inputs[0]).shape
        if st and _is_int(st[0]):
            return [TensorType(dt, tuple(f"?{i}" for i in range(int(st[0]))))]
        return [TensorType(dt, None)]
    return [TensorType(dt, tuple(target))]


@_def("Trilu", "primitive", 1, 2, "inputs: x, k?; attrs: upper")
def _trilu(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


@_def("CumSum", "primitive", 2, 2, "inputs: x, axis; attrs: exclusive, reverse")
def _cumsum(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


# ---- transformer-level definitions -----------------------------------------------------------

def _need_rank(v: Value | None, rank: int, node: Node, what: str) -> tuple[Dim, ...]:
    t = _t(v)
    if t.shape is None or len(t.shape) != rank:
        raise ShapeError(f"{node.op} '{node.name}': {what} must have rank {rank}, got {t}")
    return t.shape


@_def("Embedding", "transformer", 2, 2, "inputs: weight[V, H], ids")
def _embedding(node: Node) -> list[TensorType]:
    w, ids = _t(node.inputs[0]), _t(node.inputs[1])
    ws = _need_rank(node.inputs[0], 2, node, "weight")
    return [TensorType(w.dtype, None if ids.shape is None else tuple(ids.shape) + (ws[1],))]


@_def("RMSNorm", "transformer", 2, 2, "inputs: x, weight; attrs: eps")
def _rmsnorm(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


@_def("LayerNorm", "transformer", 2, 3, "inputs: x, weight, bias?; attrs: eps")
def _layernorm(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


def _linear_like(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    ws = _need_rank(node.inputs[1], 2, node, "weight [out, in]")
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    k = x.shape[-1]
    if _is_int(k) and _is_int(ws[1]) and k != ws[1]:
        raise ShapeError(f"{node.op} '{node.name}': input features {k} != weight in-features {ws[1]}")
    return [TensorType(x.dtype, tuple(x.shape[:-1]) + (ws[0],))]


_def("Linear", "transformer", 2, 3, "inputs: x[..., K], weight[N, K], bias[N]?")(_linear_like)
_def("LMHead", "transformer", 2, 3, "inputs: x[..., K], weight[V, K], bias[V]?")(_linear_like)


@_def("RoPE", "transformer", 3, 4,
      "inputs: x[B, H, T, D], cos, sin, positions?; with positions[B|1, T], cos/sin are tables "
      "[P, R/2] indexed by position; without, they are per-token [B|1, T, R/2]. R <= D rotates the "
      "first R features (partial rotary). attrs: interleaved")
def _rope(node: Node) -> list[TensorType]:
    _need_rank(node.inputs[0], 4, node, "x [B, H, T, D]")
    return [_t(node.inputs[0])]


@_def("Attention", "transformer", 3, 6,
      "inputs: q[B, Hq, T, D], k[B, Hkv, S, D], v[B, Hkv, S, Dv], past_len?, k_cache?, v_cache?; "
      "attrs: scale, causal, softcap. With a cache, k/v are the new tokens: they are written at "
      "past_len and q attends over cache[:past_len+T].")
def _attention(node: Node) -> list[TensorType]:
    q = _need_rank(node.inputs[0], 4, node, "q [B, Hq, T, D]")
    k = _need_rank(node.inputs[1], 4, node, "k [B, Hkv, S, D]")
    v = _need_rank(node.inputs[2], 4, node, "v [B, Hkv, S, Dv]")
    if _is_int(q[1]) and _is_int(k[1]) and int(q[1]) % int(k[1]):
        raise ShapeError(f"Attention '{node.name}': {q[1]} query heads not a multiple of {k[1]} KV heads")
    if _is_int(q[3]) and _is_int(k[3]) and q[3] != k[3]:
        raise ShapeError(f"Attention '{node.name}': query head size {q[3]} != key head size {k[3]}")
    return [TensorType(_t(node.inputs[0]).dtype, (q[0], q[1], q[2], v[3]))]


@_def("GatedMLP", "transformer", 4, 4,
      "inputs: x, w_gate[F, H], w_up[F, H], w_down[H, F]; attrs: activation (silu|gelu|gelu_tanh)")
def _gated_mlp(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


@_def("MLP", "transformer", 5, 5,
      "inputs: x, w_up[F, H], b_up?, w_down[H, F], b_down?; attrs: activation", optional=(2, 4))
def _mlp(node: Node) -> list[TensorType]:
    return [_t(node.inputs[0])]


@_def("Positions", "transformer", 1, 2,
      "inputs: ids[B, T] (or any activation with the tokens on axis `axis`: only that extent is "
      "read), past_len? (i64 scalar); attrs: axis (default 1); output i64[1, T] = past_len + "
      "arange(T): the absolute positions of the current tokens, what RoPE tables are indexed by")
def _positions(node: Node) -> list[TensorType]:
    x = _t(node.inputs[0])
    if x.shape is None or len(x.shape) < 2:
        raise ShapeError(f"Positions '{node.name}': input must have a token axis, got {x}")
    return [TensorType(DType.i64, (1, x.shape[norm_axis(int(node.attrs.get("axis", 1)), len(x.shape), node)]))]


@_def("SplitHeads", "transformer", 1, 1, "x[B, T, H*D] -> [B, H, T, D]; attrs: heads")
def _split_heads(node: Node) -> list[TensorType]:
    b, t, hd = _need_rank(node.inputs[0], 3, node, "x [B, T, H*D]")
    h = int(node.attrs["heads"])
    if not _is_int(hd) or int(hd) % h:
        raise ShapeError(f"SplitHeads '{node.name}': {hd} features do not split into {h} heads")
    return [TensorType(_t(node.inputs[0]).dtype, (b, h, t, int(hd) // h))]


@_def("MergeHeads", "transformer", 1, 1, "x[B, H, T, D] -> [B, T, H*D]")
def _merge_heads(node: Node) -> list[TensorType]:
    b, h, t, d = _need_rank(node.inputs[0], 4, node, "x [B, H, T, D]")
    return [TensorType(_t(node.inputs[0]).dtype, (b, t, dim_mul(h, d)))]


TRANSFORMER_OPS = frozenset(k for k, v in OPS.items() if v.level == "transformer")


# ---- inference entry points -----------------------------------------------------------------

def infer_types(node: Node, n_outputs: int = 1) -> list[TensorType]:
    d = OPS.get(node.op)
    if d is None:
        raise ShapeError(f"unknown IR op '{node.op}' at node '{node.name}'")
    n = len(node.inputs)
    if n < d.min_inputs or (d.max_inputs >= 0 and n > d.max_inputs):
        raise ShapeError(f"{node.op} '{node.name}' takes {d.min_inputs}..{d.max_inputs} inputs, got {n}")
    for i, v in enumerate(node.inputs):
        if v is None and i < d.min_inputs and i not in d.optional:
            raise ShapeError(f"{node.op} '{node.name}': required input {i} is missing")
    return d.infer(node)


def _sym_binary(op: str, a: Dim, b: Dim) -> Dim | None:
    if op == "Add":
        return dim_add(a, b)
    if op == "Sub":
        return dim_sub(a, b)
    if op == "Mul":
        return dim_mul(a, b)
    if op == "Div" and _is_int(a) and _is_int(b) and int(b) != 0:
        return int(a) // int(b)
    if op == "Div" and _is_int(b) and int(b) == 1:
        return a
    if op in ("Max", "Min") and _is_int(a) and _is_int(b):
        return max(int(a), int(b)) if op == "Max" else min(int(a), int(b))
    return None


def _sym_equal(a: Dim, b: Dim) -> int | None:
    """1/0 when the equality of two dims is decidable: ints, the same symbol, or a symbol (a
    non-negative extent) against a negative int; None otherwise."""
    if _is_int(a) and _is_int(b):
        return int(int(a) == int(b))
    if a == b:
        return 1
    if (_is_int(a) and int(a) < 0) or (_is_int(b) and int(b) < 0):
        return 0
    return None


def infer_sym(node: Node) -> None:
    """Propagates known elements of small integer tensors (shape arithmetic)."""
    if not node.outputs:
        return
    if node.op == "Equal" and node.outputs[0].dtype == DType.bool:
        a, b = _elems(node.inputs[0]), _elems(node.inputs[1])
        if a is not None and b is not None and len(a) == len(b):
            eq = [_sym_equal(x, y) for x, y in zip(a, b, strict=False)]
            if all(e is not None for e in eq):
                node.outputs[0].sym = tuple(eq)  # type: ignore[arg-type]
        return
    if node.op == "Where" and node.outputs[0].dtype in (DType.i64, DType.i32):
        c, a, b = (_elems(v) for v in node.inputs)
        if c is not None and a is not None and b is not None and len(c) == len(a) == len(b):
            node.outputs[0].sym = tuple(x if k else y for k, x, y in zip(c, a, b, strict=False))
        return
    if node.outputs[0].dtype not in (DType.i64, DType.i32):
        return
    out = node.outputs[0]
    op = node.op
    ins = node.inputs
    res: list[Dim] | None = None
    if op == "Shape":
        x = _t(ins[0])
        if x.shape is not None:
            res = list(x.shape[slice(node.attrs.get("start", 0), node.attrs.get("end"))])
    elif op == "Size":
        x = _t(ins[0])
        if x.shape is not None:
            n: Dim = 1
            for d in x.shape:
                n = dim_mul(n, d)
            res = [n]
    elif op in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape"):
        e = _elems(ins[0])
        if e is not None and out.shape is not None and len(out.shape) <= 1:
            res = e
    elif op == "Concat":
        parts = [_elems(v) for v in ins]
        if all(p is not None for p in parts):
            res = [x for p in parts for x in p]  # type: ignore[union-attr]
    elif op == "Gather":
        e, idx = _elems(ins[0]), _elems(ins[1])
        if e is not None and idx is not None and all(_is_int(i) for i in idx):
            try:
                res = [e[int(i)] for i in idx]  # type: ignore[arg-type]
            except IndexError:
                res = None
    elif op == "Slice":
        e = _elems(ins[0])
        s, en = _elems(node.input(1)), _elems(node.input(2))
        st = _elems(node.input(4)) if node.input(4) is not None else [1]
        if e is not None and s and en and st and all(_is_int(x) for x in s + en + st):
            res = e[int(s[0]):int(min(int(en[0]), 2**62)):int(st[0])]  # type: ignore[arg-type]
    elif op in ("Add", "Sub", "Mul", "Div", "Max", "Min"):
        a, b = _elems(ins[0]), _elems(ins[1])
        if a is not None and b is not None and (len(a) == len(b) or len(a) == 1 or len(b) == 1):
            m = max(len(a), len(b))
            a2 = a * m if len(a) == 1 else a
            b2 = b * m if len(b) == 1 else b
            vals = [_sym_binary(op, x, y) for x, y in zip(a2, b2, strict=False)]
            if all(v is not None for v in vals):
                res = vals  # type: ignore[assignment]
    elif op == "ConstantOfShape":
        tgt = _elems(ins[0])
        if tgt is not None and len(tgt) <= 1 and all(_is_int(x) for x in tgt):
            val = node.attrs.get("value", 0)
            if float(val).is_integer():
                res = [int(val)] * (int(tgt[0]) if tgt else 1)  # type: ignore[arg-type]
    elif op == "Range":
        r_s, r_lim, r_d = (_elems(v) for v in ins)
        if r_s and r_lim and r_d and all(_is_int(x) for x in r_s + r_lim + r_d):
            start, limit, delta = int(r_s[0]), int(r_lim[0]), int(r_d[0])
            if delta and abs((limit - start) // abs(delta)) <= 64:
                res = list(range(start, limit, delta))
    if res is not None:
        if out.shape is not None and len(out.shape) == 0 and len(res) != 1:
            return
        out.sym = tuple(int(x) if _is_int(x) else x for x in res)


def is_transformer_op(op: str) -> bool:
    return op in TRANSFORMER_OPS
