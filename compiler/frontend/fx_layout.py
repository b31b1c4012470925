"""ATen lowerings that move and create data: views and reshapes, permutes, squeezes, expands,
copies and casts, slices, concatenation and splits, indexing and gathers, and the creation ops
(arange, full, *_like). Views lower to IR values directly where torch's result has the input's
dims; fx_math.py lowers the ops that compute."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from zlc.errors import IRError
from zlc.ir import Value
from zlc.ir.types import Dim, DType

from .fx_context import FxContext
from .fx_registry import Args, aten_op

INT64_MAX = 2**63 - 1


# ---- layout -----------------------------------------------------------------------------------------

def _shape_of(v: Value) -> tuple[Dim, ...]:
    if v.shape is None:
        raise IRError(f"%{v.name} has unknown rank")
    return v.shape


def _unchanged(cx: FxContext, x: Value) -> bool:
    """The node's result has x's dims (a no-op view or expand), symbolic dims included."""
    m = cx.meta()
    return x.shape is not None and list(x.shape) == [cx.ir_dim(d) for d in m.shape]


@aten_op("aten::view.default", "aten::_unsafe_view.default", "aten::reshape.default", "aten::view_copy.default")
def _view(cx: FxContext, a: Args) -> Value:
    x, size = a["self"], a["size"] if "size" in a else a["shape"]
    if _unchanged(cx, x):
        return x
    allowzero = int(any(isinstance(d, int) and d == 0 for d in size))
    return cx.emit("Reshape", x, cx.shape_tensor(size), allowzero=allowzero)


@aten_op("aten::permute.default", "aten::permute_copy.default")
def _permute(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    r = len(_shape_of(x))
    return cx.permute(x, [int(d) % r for d in a["dims"]])


@aten_op("aten::t.default", "aten::transpose.int")
def _transpose(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    r = len(_shape_of(x))
    if r < 2:
        return x
    d0, d1 = (int(a["dim0"]) % r, int(a["dim1"]) % r) if "dim0" in a else (r - 2, r - 1)
    perm = list(range(r))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return cx.permute(x, perm)


@aten_op("aten::unsqueeze.default")
def _unsqueeze(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    return cx.emit("Unsqueeze", x, axes=[int(a["dim"]) % (len(_shape_of(x)) + 1)])


@aten_op("aten::squeeze.dim", "aten::squeeze.dims", "aten::squeeze.default")
def _squeeze(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    shape = _shape_of(x)
    dims = a.get("dim")
    cand = range(len(shape)) if dims is None else ([dims] if isinstance(dims, int) else dims)
    axes = sorted({int(d) % max(len(shape), 1) for d in cand if shape and shape[int(d)] == 1})
    return cx.emit("Squeeze", x, axes=axes) if axes else x  # torch ignores non-1 dims


@aten_op("aten::expand.default", "aten::expand_copy.default")
def _expand(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    if _unchanged(cx, x):
        return x
    # -1 keeps a dim; ONNX-style Expand broadcasts a target 1 the same way
    size = [1 if isinstance(d, int) and d == -1 else d for d in a["size"]]
    return cx.emit("Expand", x, cx.shape_tensor(size))


@aten_op("aten::clone.default", "aten::alias.default", "aten::detach.default", "aten::lift_fresh_copy.default",
         "aten::contiguous.default", "aten::alias_copy.default", "aten::detach_copy.default")
def _identity(cx: FxContext, a: Args) -> Value:
    return a["self"]  # values are immutable in the IR: copies and aliases are the same value


@aten_op("aten::_to_copy.default", "aten::to.dtype")
def _to_copy(cx: FxContext, a: Args) -> Value:
    return cx.cast(a["self"], cx.out_dtype())


@aten_op("aten::slice.Tensor", "aten::slice_copy.Tensor")
def _slice(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    dim, step = int(a["dim"]), a["step"]
    start = 0 if a["start"] is None else a["start"]
    end = INT64_MAX if a["end"] is None else a["end"]
    if isinstance(start, int) and start == 0 and isinstance(end, int) and end >= INT64_MAX and step == 1:
        return x
    if isinstance(end, int):
        end = min(end, INT64_MAX)
    return cx.emit("Slice", x, cx.shape_tensor([start]), cx.shape_tensor([end]), cx.ints([dim]),
                   cx.shape_tensor([step]))


@aten_op("aten::select.int", "aten::select_copy.int")
def _select(cx: FxContext, a: Args) -> Value:
    return cx.emit("Gather", a["self"], cx.dim(a["index"]), axis=int(a["dim"]))


@aten_op("aten::cat.default", "aten::concat.default")
def _cat(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    xs = [cx.cast(t, dt) for t in a["tensors"]]
    rank = max(len(_shape_of(t)) for t in xs)
    xs = [t for t in xs if not (len(_shape_of(t)) == 1 and rank > 1 and t.shape == (0,))]  # legacy empties
    return xs[0] if len(xs) == 1 else cx.emit("Concat", *xs, axis=int(a["dim"]))


def _split_sizes(cx: FxContext, x: Value, sizes: Sequence[Any], dim: int) -> list[Value]:
    if all(isinstance(s, int) for s in sizes):
        return cx.emit_multi("Split", [x], len(sizes), axis=dim, split=[int(s) for s in sizes])
    outs, start = [], cx.scalar(0, DType.i64)
    for s in sizes:  # symbolic sizes: one Slice per piece
        end = cx.emit("Add", start, cx.dim(s))
        outs.append(cx.emit("Slice", x, cx.shape_tensor([start]), cx.shape_tensor([end]), cx.ints([dim])))
        start = end
    return outs


@aten_op("aten::split_with_sizes.default", "aten::split_with_sizes_copy.default")
def _split_with_sizes(cx: FxContext, a: Args) -> list[Value]:
    return _split_sizes(cx, a["self"], a["split_sizes"], int(a["dim"]))


@aten_op("aten::split.Tensor", "aten::split_copy.Tensor")
def _split(cx: FxContext, a: Args) -> list[Value]:
    x, dim, size = a["self"], int(a["dim"]), a["split_size"]
    total = _shape_of(x)[dim]
    if not isinstance(total, int) or not isinstance(size, int):
        raise cx.unsupported("split of a symbolic dim into equal chunks")
    return _split_sizes(cx, x, [min(size, total - i) for i in range(0, total, size)], dim)


@aten_op("aten::unbind.int", "aten::unbind_copy.int")
def _unbind(cx: FxContext, a: Args) -> list[Value]:
    x, dim = a["self"], int(a["dim"])
    n = _shape_of(x)[dim]
    if not isinstance(n, int):
        raise cx.unsupported("unbind along a symbolic dim")
    return [cx.emit("Squeeze", p, axes=[dim]) for p in _split_sizes(cx, x, [1] * n, dim)]


@aten_op("aten::repeat.default")
def _repeat(cx: FxContext, a: Args) -> Value:
    x, reps = a["self"], list(a["repeats"])
    extra = len(reps) - len(_shape_of(x))
    if extra > 0:
        x = cx.emit("Unsqueeze", x, axes=list(range(extra)))
    return cx.emit("Tile", x, cx.shape_tensor(reps))


# ---- indexing ---------------------------------------------------------------------------------------

@aten_op("aten::embedding.default")
def _embedding(cx: FxContext, a: Args) -> Value:
    return cx.emit("Gather", a["weight"], a["indices"], axis=0)  # raised to Embedding by the passes


@aten_op("aten::index_select.default")
def _index_select(cx: FxContext, a: Args) -> Value:
    return cx.emit("Gather", a["self"], a["index"], axis=int(a["dim"]))


@aten_op("aten::gather.default")
def _gather(cx: FxContext, a: Args) -> Value:
    return cx.emit("GatherElements", a["self"], a["index"], axis=int(a["dim"]))


@aten_op("aten::index.Tensor")
def _index(cx: FxContext, a: Args) -> Value:
    x, idx = a["self"], list(a["indices"])
    given = [i for i, t in enumerate(idx) if t is not None]
    if any(idx[i].dtype == DType.bool for i in given):
        raise cx.unsupported("boolean-mask indexing (data-dependent shape)")
    if len(given) == 1:  # x[..., idx, ...]: one advanced index keeps its place
        return cx.emit("Gather", x, idx[given[0]], axis=given[0])
    if given != list(range(len(given))):
        raise cx.unsupported("advanced indices that are not a prefix of the dims (x[i, :, j])")
    # x[i0, i1, ...]: broadcast the indices, stack them last, GatherND
    rank = max(len(_shape_of(t)) for t in idx)
    bshape = cx.shape_tensor(list(cx.meta().shape[:rank]))
    cols = [cx.emit("Unsqueeze", cx.emit("Expand", cx.cast(t, DType.i64), bshape), axes=[rank]) for t in idx]
    return cx.emit("GatherND", x, cx.emit("Concat", *cols, axis=-1), batch_dims=0)


@aten_op("aten::triu.default", "aten::tril.default")
def _trilu(cx: FxContext, a: Args) -> Value:
    return cx.emit("Trilu", a["self"], cx.scalar(int(a["diagonal"]), DType.i64), upper=int("triu" in cx.key))


# ---- creation ----------------------------------------------------------------------------------------

def _static(xs: Sequence[Any]) -> bool:
    return all(isinstance(x, (int, float, bool)) for x in xs)


@aten_op("aten::arange.start_step", "aten::arange.start", "aten::arange.default")
def _arange(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    start = a.get("start", 0) if "start" in a else 0
    end, step = a["end"], a.get("step", 1)
    if _static([start, end, step]):
        return cx.g.add_const("arange", torch.arange(start, end, step, dtype=dt.torch), unique=True)
    return cx.emit("Range", cx.tensor(start, dt), cx.tensor(end, dt), cx.tensor(step, dt))


def _filled(cx: FxContext, shape: Any, fill: Any) -> Value:
    """A tensor of the node's dtype filled with `fill`: a constant if static, else ConstantOfShape."""
    dt = cx.out_dtype()
    if isinstance(shape, Value):
        return cx.emit("ConstantOfShape", shape, value=fill, dtype=dt.value)
    if _static(shape):
        return cx.g.add_const("full", torch.full([int(s) for s in shape], fill, dtype=dt.torch), unique=True)
    return cx.emit("ConstantOfShape", cx.shape_tensor(shape), value=fill, dtype=dt.value)


@aten_op("aten::full.default")
def _full(cx: FxContext, a: Args) -> Value:
    fill = a["fill_value"]
    if not isinstance(fill, (int, float, bool)):
        raise cx.unsupported("a fill value computed at run time")
    if not a["size"]:
        return cx.scalar(fill, cx.out_dtype())
    return _filled(cx, a["size"], fill)


@aten_op("aten::full_like.default", "aten::zeros_like.default", "aten::ones_like.default")
def _full_like(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    fill = a.get("fill_value", 1 if "ones" in cx.key else 0)
    if x.shape is not None and all(isinstance(d, int) for d in x.shape):
        return _filled(cx, list(x.shape), fill)
    return _filled(cx, cx.emit("Shape", x), fill)


@aten_op("aten::scalar_tensor.default")
def _scalar_tensor(cx: FxContext, a: Args) -> Value:
    s = a["s"]
    if isinstance(s, Value):
        return cx.cast(s, cx.out_dtype())
    return cx.scalar(s, cx.out_dtype())
