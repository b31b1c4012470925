"""Op-level definitions: ONNX semantics (broadcasting, negative axes) with attributes normalized by
the frontends (reduce and squeeze axes are always attributes, Gemm is lowered to MatMul/Add).
ops.py assembles the op table from these and the transformer-level definitions."""

from __future__ import annotations

from functools import partial

import numpy as np

from zlc.errors import ShapeError

from .opdef import OpDef, broadcast, define, dim_add, dim_mul, dim_sub, elements, is_int, norm_axis, type_of
from .types import Dim, DType, TensorType
from .values import Node

DEFS: dict[str, OpDef] = {}
_def = partial(define, DEFS)


def _same(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]


UNARY = ["Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Sin", "Cos", "Tanh", "Sigmoid", "Erf",
         "Relu", "Floor", "Ceil", "Round", "Identity", "Softplus", "Sign", "Gelu", "LeakyRelu",
         "Not", "Silu", "HardSigmoid", "Elu", "Atan", "Tan", "Asin", "Acos"]
for _n in UNARY:
    _def(_n, "primitive", 1, 1)(_same)

BINARY = ["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Mod"]
COMPARE = ["Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"]
LOGICAL = ["And", "Or", "Xor"]


def _binary(node: Node) -> list[TensorType]:
    a, b = type_of(node.inputs[0]), type_of(node.inputs[1])
    out_dt = DType.bool if node.op in COMPARE or node.op in LOGICAL else a.dtype
    return [TensorType(out_dt, broadcast([a.shape, b.shape], node))]


for _n in BINARY + COMPARE + LOGICAL:
    _def(_n, "primitive", 2, 2)(_binary)
DEFS["Mod"] = OpDef("Mod", "primitive", _binary, 2, 2,
                    "attrs: fmod (1: C fmod, the result has the dividend's sign; 0: Python-style mod, "
                    "the result has the divisor's sign), for integer and float inputs alike")

for _n in ("IsNaN", "IsInf"):
    _def(_n, "primitive", 1, 1)(lambda n: [TensorType(DType.bool, type_of(n.inputs[0]).shape)])


@_def("Where", "primitive", 3, 3)
def _where(node: Node) -> list[TensorType]:
    c, a, b = (type_of(v) for v in node.inputs)
    return [TensorType(a.dtype, broadcast([c.shape, a.shape, b.shape], node))]


@_def("Cast", "primitive", 1, 1, "attrs: to (dtype name)")
def _cast(node: Node) -> list[TensorType]:
    return [TensorType(DType(node.attrs["to"]), type_of(node.inputs[0]).shape)]


@_def("MatMul", "primitive", 2, 2)
def _matmul(node: Node) -> list[TensorType]:
    a, b = type_of(node.inputs[0]), type_of(node.inputs[1])
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
    if is_int(k1) and is_int(k2) and k1 != k2:
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
    x = type_of(node.inputs[0])
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

@_def("TopK", "primitive", 1, 1, "outputs: values, indices (i64); attrs: k (static), axis, largest (1: the k largest, "
      "0: the k smallest), sorted; ties go to the lower index")
def _topk(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
    if x.shape is None:
        return [TensorType(x.dtype, None), TensorType(DType.i64, None)]
    ax = norm_axis(node.attrs.get("axis", -1), len(x.shape), node)
    k = int(node.attrs["k"])
    if is_int(x.shape[ax]) and k > int(x.shape[ax]):
        raise ShapeError(f"TopK '{node.name}': k={k} exceeds the axis extent {x.shape[ax]}")
    sh = tuple(k if i == ax else d for i, d in enumerate(x.shape))
    return [TensorType(x.dtype, sh), TensorType(DType.i64, sh)]


for _n in ("Softmax", "LogSoftmax"):
    _def(_n, "primitive", 1, 1, "attrs: axis")(_same)


@_def("Reshape", "primitive", 2, 2, "inputs: x, shape (i64[r]); attrs: allowzero")
def _reshape(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
    target = elements(node.inputs[1])
    if target is None:
        st = type_of(node.inputs[1]).shape
        if st is not None and len(st) == 1 and is_int(st[0]):
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
                if is_int(d):
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
    ni = [int(d) for d in num if is_int(d)]
    di = [int(d) for d in den if is_int(d)]
    ns = [d for d in num if not is_int(d)]
    ds = [d for d in den if not is_int(d)]
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
    x = type_of(node.inputs[0])
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    perm = node.attrs.get("perm") or list(reversed(range(len(x.shape))))
    if sorted(perm) != list(range(len(x.shape))):
        raise ShapeError(f"Transpose perm {perm} does not fit rank {len(x.shape)} at node '{node.name}'")
    return [TensorType(x.dtype, tuple(x.shape[p] for p in perm))]


@_def("Concat", "primitive", 1, -1, "attrs: axis")
def _concat(node: Node) -> list[TensorType]:
    ts = [type_of(v) for v in node.inputs]
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
        if i != ax and not is_int(out[i]):
            static = [t.shape[i] for t in ts if t.shape is not None and is_int(t.shape[i])]
            if static:
                out[i] = static[0]
    return [TensorType(ts[0].dtype, tuple(out))]


@_def("Split", "primitive", 1, 1, "attrs: axis, split (sizes)")
def _split(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
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
    if is_int(d):
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
    x = type_of(node.inputs[0])
    starts, ends = elements(node.input(1)), elements(node.input(2))
    axes = elements(node.input(3)) if node.input(3) is not None else None
    steps = elements(node.input(4)) if node.input(4) is not None else None
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    r = len(x.shape)
    if starts is None or ends is None or (node.input(3) is not None and axes is None) or \
            (node.input(4) is not None and steps is None):
        if axes is not None:
            out = list(x.shape)
            for a in axes:
                if is_int(a):
                    out[norm_axis(int(a), r, node)] = f"?{node.name}"
            return [TensorType(x.dtype, tuple(out))]
        return [TensorType(x.dtype, tuple(f"?{i}" for i in range(r)))]
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    out = list(x.shape)
    for s, e, a, st in zip(starts, ends, axes, steps, strict=False):
        ax = norm_axis(int(a), r, node)  # type: ignore[arg-type]
        if not (is_int(s) and is_int(e) and is_int(st)):
            out[ax] = f"?{node.name}.{ax}"
            continue
        out[ax] = _slice_dim(out[ax], int(s), min(int(e), 2**62), int(st))  # type: ignore[arg-type]
    return [TensorType(x.dtype, tuple(out))]


@_def("Gather", "primitive", 2, 2, "attrs: axis")
def _gather(node: Node) -> list[TensorType]:
    x, idx = type_of(node.inputs[0]), type_of(node.inputs[1])
    if x.shape is None or idx.shape is None:
        return [TensorType(x.dtype, None)]
    ax = norm_axis(node.attrs.get("axis", 0), len(x.shape), node)
    return [TensorType(x.dtype, tuple(x.shape[:ax]) + tuple(idx.shape) + tuple(x.shape[ax + 1:]))]


@_def("GatherElements", "primitive", 2, 2, "attrs: axis")
def _gather_el(node: Node) -> list[TensorType]:
    return [TensorType(type_of(node.inputs[0]).dtype, type_of(node.inputs[1]).shape)]


@_def("GatherND", "primitive", 2, 2, "attrs: batch_dims")
def _gather_nd(node: Node) -> list[TensorType]:
    x, idx = type_of(node.inputs[0]), type_of(node.inputs[1])
    if x.shape is None or idx.shape is None or not is_int(idx.shape[-1]):
        return [TensorType(x.dtype, None)]
    b = node.attrs.get("batch_dims", 0)
    k = int(idx.shape[-1])
    return [TensorType(x.dtype, tuple(idx.shape[:-1]) + tuple(x.shape[b + k:]))]


@_def("ScatterND", "primitive", 3, 3, "attrs: reduction")
def _scatter_nd(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]


@_def("ScatterElements", "primitive", 3, 3, "attrs: axis, reduction")
def _scatter_el(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]


@_def("Unsqueeze", "primitive", 1, 1, "attrs: axes")
def _unsqueeze(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
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
    x = type_of(node.inputs[0])
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    axes = node.attrs.get("axes")
    if axes is None:
        return [TensorType(x.dtype, tuple(d for d in x.shape if d != 1))]
    ax = {norm_axis(a, len(x.shape), node) for a in axes}
    for a in ax:
        if is_int(x.shape[a]) and x.shape[a] != 1:
            raise ShapeError(f"Squeeze of dim {a} with size {x.shape[a]} at node '{node.name}'")
    return [TensorType(x.dtype, tuple(d for i, d in enumerate(x.shape) if i not in ax))]


@_def("Expand", "primitive", 2, 2, "inputs: x, shape")
def _expand(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
    target = elements(node.inputs[1])
    if target is None:
        st = type_of(node.inputs[1]).shape
        if x.shape is not None and st is not None and len(st) == 1 and is_int(st[0]):
            # Rank is known even when the target's elements are not.
            r = max(len(x.shape), int(st[0]))
            return [TensorType(x.dtype, tuple(f"?{node.name}.{i}" for i in range(r)))]
        return [TensorType(x.dtype, None)]
    return [TensorType(x.dtype, broadcast([x.shape, tuple(target)], node))]


@_def("Tile", "primitive", 2, 2, "inputs: x, repeats")
def _tile(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
    reps = elements(node.inputs[1])
    if x.shape is None or reps is None:
        return [TensorType(x.dtype, None)]
    return [TensorType(x.dtype, tuple(dim_mul(d, r) for d, r in zip(x.shape, reps, strict=False)))]


@_def("Shape", "primitive", 1, 1, "attrs: start, end")
def _shape(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
    if x.shape is None:
        return [TensorType(DType.i64, ("?rank",))]
    sl = x.shape[slice(node.attrs.get("start", 0), node.attrs.get("end"))]
    return [TensorType(DType.i64, (len(sl),))]


@_def("Size", "primitive", 1, 1)
def _size(node: Node) -> list[TensorType]:
    return [TensorType(DType.i64, ())]


@_def("Range", "primitive", 3, 3, "inputs: start, limit, delta (scalars)")
def _range(node: Node) -> list[TensorType]:
    s, l_, d = (elements(v) for v in node.inputs)
    dt = type_of(node.inputs[0]).dtype
    if s and l_ and d and all(is_int(x) for x in s + l_ + d):
        n = max(0, -(-(int(l_[0]) - int(s[0])) // int(d[0])))  # type: ignore[arg-type]
        return [TensorType(dt, (n,))]
    if s and l_ and d and d[0] == 1:
        return [TensorType(dt, (dim_sub(l_[0], s[0]),))]
    return [TensorType(dt, (f"?{node.name}",))]


@_def("ConstantOfShape", "primitive", 1, 1, "inputs: shape; attrs: value, dtype")
def _const_of_shape(node: Node) -> list[TensorType]:
    target = elements(node.inputs[0])
    dt = DType(node.attrs.get("dtype", "f32"))
    if target is None:
        st = type_of(node.inputs[0]).shape
        if st and is_int(st[0]):
            return [TensorType(dt, tuple(f"?{i}" for i in range(int(st[0]))))]
        return [TensorType(dt, None)]
    return [TensorType(dt, tuple(target))]


@_def("Trilu", "primitive", 1, 2, "inputs: x, k?; attrs: upper")
def _trilu(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]


@_def("CumSum", "primitive", 2, 2, "inputs: x, axis; attrs: exclusive, reverse")
def _cumsum(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]
