"""The reference kernels: one PyTorch function per IR op (`KERNELS`), each the plainest correct
expression of the op's semantics, not a fast one. They are the oracle for everything downstream:
the executor runs graphs with them, constant folding and semantic probing evaluate nodes with them
(`evaluate.py`), and the scheduler reads constants through `const_tensor`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from zlc.errors import IRError, ZlcError
from zlc.ir import DType, Node, Value

from .numerics import linear
from .numerics import wide as _wide

Kernel = Callable[[Node, list[Any]], list[torch.Tensor]]
KERNELS: dict[str, Kernel] = {}


def kernel(*names: str) -> Callable[[Kernel], Kernel]:
    def deco(fn: Kernel) -> Kernel:
        for n in names:
            KERNELS[n] = fn
        return fn

    return deco


def _one(fn: Callable[..., torch.Tensor]) -> Kernel:
    return lambda node, xs: [fn(*xs)]


_UNARY: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Neg": torch.neg, "Abs": torch.abs, "Exp": torch.exp, "Log": torch.log, "Sqrt": torch.sqrt,
    "Reciprocal": torch.reciprocal, "Sin": torch.sin, "Cos": torch.cos, "Tanh": torch.tanh,
    "Sigmoid": torch.sigmoid, "Erf": torch.erf, "Relu": torch.relu, "Floor": torch.floor,
    "Ceil": torch.ceil, "Round": torch.round, "Identity": lambda x: x, "Softplus": F.softplus,
    "Sign": torch.sign, "Not": torch.logical_not, "Silu": F.silu, "IsNaN": torch.isnan,
    "IsInf": torch.isinf, "Atan": torch.atan, "Tan": torch.tan, "Asin": torch.asin, "Acos": torch.acos,
}
for _name, _fn in _UNARY.items():
    KERNELS[_name] = (lambda f: (lambda node, xs: [f(xs[0])]))(_fn)


@kernel("Gelu")
def _gelu(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [F.gelu(xs[0], approximate=node.attrs.get("approximate", "none"))]


@kernel("LeakyRelu")
def _leaky(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [F.leaky_relu(xs[0], node.attrs.get("alpha", 0.01))]


@kernel("Elu")
def _elu(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [F.elu(xs[0], node.attrs.get("alpha", 1.0))]


@kernel("HardSigmoid")
def _hsig(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    a, b = node.attrs.get("alpha", 0.2), node.attrs.get("beta", 0.5)
    return [torch.clamp(a * xs[0] + b, 0, 1)]


def _int_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.dtype.is_floating_point:
        return a / b
    return torch.div(a, b, rounding_mode="trunc")  # ONNX integer Div truncates


def _pow(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    r = torch.pow(a, b.to(a.dtype) if a.dtype.is_floating_point else b)
    return r.to(a.dtype)


@kernel("Mod")
def _mod(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    a, b = xs
    if node.attrs.get("fmod", 0):
        return [torch.fmod(a, b)]  # C fmod: the result takes the dividend's sign
    return [torch.remainder(a, b)]  # Python mod: the result takes the divisor's sign


_BINARY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _int_div, "Pow": _pow,
    "Max": torch.maximum, "Min": torch.minimum, "Equal": torch.eq, "Less": torch.lt,
    "LessOrEqual": torch.le, "Greater": torch.gt, "GreaterOrEqual": torch.ge,
    "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
}
for _name, _bfn in _BINARY.items():
    KERNELS[_name] = (lambda f: (lambda node, xs: [f(xs[0], xs[1])]))(_bfn)


@kernel("Where")
def _where(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [torch.where(xs[0].bool(), xs[1], xs[2])]


@kernel("Cast")
def _cast(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    dt = DType(node.attrs["to"]).torch
    x = xs[0]
    if x.dtype.is_floating_point and not dt.is_floating_point and dt != torch.bool:
        x = torch.trunc(x)
    return [x.to(dt)]


@kernel("MatMul")
def _matmul(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    a, b = xs
    if not a.dtype.is_floating_point:  # torch has no integer matmul on CPU for all dtypes
        return [torch.matmul(a.double(), b.double()).round().to(a.dtype)]
    return [torch.matmul(a, b)]


def _axes(node: Node, x: torch.Tensor) -> list[int]:
    ax = node.attrs.get("axes")
    return list(range(x.dim())) if ax is None else [a % max(x.dim(), 1) for a in ax]


def _reduce(fn: Callable[..., torch.Tensor]) -> Kernel:
    def k(node: Node, xs: list[Any]) -> list[torch.Tensor]:
        x = xs[0]
        axes = _axes(node, x)
        keep = bool(node.attrs.get("keepdims", 1))
        if x.dim() == 0 or not axes:
            return [x.clone()]
        return [fn(x, axes, keep)]

    return k


def _empty_reduce(x: torch.Tensor, axes: list[int], keep: bool, fill: float | bool) -> torch.Tensor:
    """Reducing over an empty set yields the op's identity element (ONNX: -inf for max, ...)."""
    shape = [1 if i in axes else d for i, d in enumerate(x.shape) if keep or i not in axes]
    if x.dtype == torch.bool:
        return torch.full(shape, bool(fill), dtype=torch.bool)
    if not x.dtype.is_floating_point and abs(fill) == float("inf"):
        info = torch.iinfo(x.dtype)
        fill = info.min if fill < 0 else info.max
    return torch.full(shape, fill, dtype=x.dtype)


def _amax(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    if any(x.shape[a] == 0 for a in axes):
        return _empty_reduce(x, axes, keep, False if x.dtype == torch.bool else float("-inf"))
    if x.dtype == torch.bool:
        return torch.amax(x.to(torch.uint8), dim=axes, keepdim=keep).bool()
    return torch.amax(x, dim=axes, keepdim=keep)


def _amin(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    if any(x.shape[a] == 0 for a in axes):
        return _empty_reduce(x, axes, keep, True if x.dtype == torch.bool else float("inf"))
    if x.dtype == torch.bool:
        return torch.amin(x.to(torch.uint8), dim=axes, keepdim=keep).bool()
    return torch.amin(x, dim=axes, keepdim=keep)


def _prod(x: torch.Tensor, axes: list[int], keep: bool) -> torch.Tensor:
    r = x
    for a in sorted(axes, reverse=True):
        r = torch.prod(r, dim=a, keepdim=keep)
    return r


KERNELS["ReduceMean"] = _reduce(lambda x, a, k: torch.mean(x, dim=a, keepdim=k))
KERNELS["ReduceSum"] = _reduce(lambda x, a, k: torch.sum(x, dim=a, keepdim=k, dtype=x.dtype))
KERNELS["ReduceMax"] = _reduce(_amax)
KERNELS["ReduceMin"] = _reduce(_amin)
KERNELS["ReduceProd"] = _reduce(_prod)
KERNELS["ReduceL2"] = _reduce(lambda x, a, k: torch.sqrt(torch.sum(x * x, dim=a, keepdim=k)))
KERNELS["ReduceSumSquare"] = _reduce(lambda x, a, k: torch.sum(x * x, dim=a, keepdim=k))
KERNELS["ReduceLogSumExp"] = _reduce(lambda x, a, k: torch.logsumexp(x, dim=a, keepdim=k))


@kernel("ArgMax", "ArgMin")
def _argmax(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x = xs[0]
    axis = node.attrs.get("axis", 0) % max(x.dim(), 1)
    keep = bool(node.attrs.get("keepdims", 1))
    y = x if node.op == "ArgMax" else -x if x.dtype != torch.bool else ~x
    if node.attrs.get("select_last_index", 0):
        y = torch.flip(y, [axis])
        idx = torch.argmax(y, dim=axis, keepdim=keep)
        return [(x.shape[axis] - 1 - idx).long()]
    return [torch.argmax(y, dim=axis, keepdim=keep).long()]


@kernel("TopK")
def _topk(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x = xs[0]
    axis, k = node.attrs.get("axis", -1) % max(x.dim(), 1), int(node.attrs["k"])
    # a stable sort (descending for the k largest, ascending for the k smallest): equal values keep
    # their order, so ties go to the lower index (ONNX)
    vals, idx = torch.sort(x, dim=axis, descending=bool(node.attrs.get("largest", 1)), stable=True)
    return [vals.narrow(axis, 0, k).contiguous(), idx.narrow(axis, 0, k).contiguous()]


@kernel("Softmax")
def _softmax(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [torch.softmax(xs[0], dim=node.attrs.get("axis", -1))]


@kernel("LogSoftmax")
def _log_softmax(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [torch.log_softmax(xs[0], dim=node.attrs.get("axis", -1))]


@kernel("Reshape")
def _reshape(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, shape = xs
    tgt = [int(s) for s in shape.tolist()]
    if not node.attrs.get("allowzero", 0):
        tgt = [x.shape[i] if s == 0 else s for i, s in enumerate(tgt)]
    return [x.reshape(tgt)]


@kernel("Transpose")
def _transpose(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    perm = node.attrs.get("perm") or list(reversed(range(xs[0].dim())))
    return [xs[0].permute(*perm)]


@kernel("Concat")
def _concat(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [torch.cat(xs, dim=node.attrs["axis"])]


@kernel("Split")
def _split(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return list(torch.split(xs[0], list(node.attrs["split"]), dim=node.attrs.get("axis", 0)))


@kernel("Slice")
def _slice(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x = xs[0]
    starts, ends = xs[1].tolist(), xs[2].tolist()
    axes = xs[3].tolist() if len(xs) > 3 and xs[3] is not None else list(range(len(starts)))
    steps = xs[4].tolist() if len(xs) > 4 and xs[4] is not None else [1] * len(starts)
    for s, e, a, st in zip(starts, ends, axes, steps, strict=False):
        a = a % x.dim()
        n = x.shape[a]
        start, stop, step = slice(int(s), int(e), int(st)).indices(n)
        if step > 0:
            x = x.narrow(a, start, max(0, len(range(start, stop, step)))) if step == 1 else \
                x.index_select(a, torch.arange(start, stop, step))
        else:
            idx = torch.arange(start, stop, step)
            x = x.index_select(a, idx) if len(idx) else x.narrow(a, 0, 0)
    return [x]


@kernel("Gather")
def _gather(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, idx = xs
    axis = node.attrs.get("axis", 0) % x.dim()
    idx = idx.long()
    idx = torch.where(idx < 0, idx + x.shape[axis], idx)
    out = torch.index_select(x, axis, idx.reshape(-1))
    shape = list(x.shape[:axis]) + list(idx.shape) + list(x.shape[axis + 1:])
    return [out.reshape(shape)]


@kernel("GatherElements")
def _gather_el(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, idx = xs
    axis = node.attrs.get("axis", 0) % x.dim()
    idx = idx.long()
    idx = torch.where(idx < 0, idx + x.shape[axis], idx)
    return [torch.gather(x, axis, idx)]


@kernel("GatherND")
def _gather_nd(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, idx = xs
    b = node.attrs.get("batch_dims", 0)
    idx = idx.long()
    k = idx.shape[-1]
    bshape = x.shape[:b]
    nb = int(np.prod(bshape)) if b else 1
    xf = x.reshape((nb,) + tuple(x.shape[b:]))
    idf = idx.reshape(nb, -1, k)
    outs = []
    for i in range(nb):
        ii = idf[i]
        dims = [x.shape[b + j] for j in range(k)]
        ii = torch.stack([torch.where(ii[:, j] < 0, ii[:, j] + dims[j], ii[:, j]) for j in range(k)], 1) \
            if k else ii
        outs.append(xf[i][tuple(ii[:, j] for j in range(k))])
    out = torch.stack(outs)
    return [out.reshape(tuple(idx.shape[:-1]) + tuple(x.shape[b + k:]))]


@kernel("ScatterND")
def _scatter_nd(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, idx, upd = xs
    out = x.clone()
    k = idx.shape[-1]
    idf = idx.long().reshape(-1, k)
    uf = upd.reshape((idf.shape[0],) + tuple(x.shape[k:]))
    red = node.attrs.get("reduction", "none")
    for i in range(idf.shape[0]):
        key = tuple(int(t) for t in idf[i])
        if red == "add":
            out[key] += uf[i]
        elif red == "mul":
            out[key] *= uf[i]
        elif red == "max":
            out[key] = torch.maximum(out[key], uf[i])
        elif red == "min":
            out[key] = torch.minimum(out[key], uf[i])
        else:
            out[key] = uf[i]
    return [out]


@kernel("ScatterElements")
def _scatter_el(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, idx, upd = xs
    axis = node.attrs.get("axis", 0) % x.dim()
    idx = idx.long()
    idx = torch.where(idx < 0, idx + x.shape[axis], idx)
    red = node.attrs.get("reduction", "none")
    if red == "none":
        return [x.scatter(axis, idx, upd)]
    mode = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}[red]
    return [x.scatter_reduce(axis, idx, upd, mode, include_self=True)]


@kernel("Unsqueeze")
def _unsqueeze(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x = xs[0]
    r = x.dim() + len(node.attrs["axes"])
    for a in sorted(a % r for a in node.attrs["axes"]):
        x = x.unsqueeze(a)
    return [x]


@kernel("Squeeze")
def _squeeze(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x = xs[0]
    axes = node.attrs.get("axes")
    if axes is None:
        return [x.squeeze()] if x.dim() else [x]
    for a in sorted((a % x.dim() for a in axes), reverse=True):
        x = x.squeeze(a)
    return [x]


@kernel("Expand")
def _expand(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, shape = xs
    tgt = [int(s) for s in shape.tolist()]
    out_shape = torch.broadcast_shapes(tuple(x.shape), tuple(tgt))
    return [x.expand(out_shape)]


@kernel("Tile")
def _tile(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [xs[0].repeat(*[int(r) for r in xs[1].tolist()])]


@kernel("Shape")
def _shape(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    s = list(xs[0].shape)[slice(node.attrs.get("start", 0), node.attrs.get("end"))]
    return [torch.tensor(s, dtype=torch.int64)]


@kernel("Size")
def _size(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    return [torch.tensor(xs[0].numel(), dtype=torch.int64)]


@kernel("Range")
def _range(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    s, lim, d = (x.item() for x in xs)
    return [torch.arange(s, lim, d, dtype=xs[0].dtype)]


@kernel("ConstantOfShape")
def _const_of_shape(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    dt = DType(node.attrs.get("dtype", "f32")).torch
    return [torch.full([int(s) for s in xs[0].tolist()], node.attrs.get("value", 0), dtype=dt)]


@kernel("Trilu")
def _trilu(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x = xs[0]
    k = int(xs[1].item()) if len(xs) > 1 and xs[1] is not None else 0
    return [torch.triu(x, k) if node.attrs.get("upper", 1) else torch.tril(x, k)]


@kernel("CumSum")
def _cumsum(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, axis = xs[0], int(xs[1].item())
    if node.attrs.get("reverse", 0):
        x = torch.flip(x, [axis])
    y = torch.cumsum(x, dim=axis, dtype=x.dtype)
    if node.attrs.get("exclusive", 0):
        y = y - x
    if node.attrs.get("reverse", 0):
        y = torch.flip(y, [axis])
    return [y]


# ---- transformer-level kernels ----------------------------------------------------------------

@kernel("Embedding")
def _embedding(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    w, ids = xs
    return [F.embedding(ids.long(), w)]


@kernel("RMSNorm")
def _rmsnorm(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, w = xs
    xf = _wide(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + node.attrs.get("eps", 1e-6))
    return [(y * _wide(w)).to(x.dtype)]


@kernel("LayerNorm")
def _layernorm(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    return [F.layer_norm(x, (x.shape[-1],), w, b, node.attrs.get("eps", 1e-5))]


@kernel("Linear", "LMHead")
def _linear(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, w = xs[0], xs[1]
    b = xs[2] if len(xs) > 2 else None
    y = linear(node.inputs[1], x, w, b)
    cap = float(node.attrs.get("softcap", 0.0) or 0.0)
    return [torch.tanh(y / cap) * cap if cap > 0 else y]


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu(x)
    raise IRError(f"unknown activation '{name}'")


@kernel("GatedMLP")
def _gated_mlp(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, wg, wu, wd = xs
    g, u, d = node.inputs[1:4]
    return [linear(d, _act(node.attrs.get("activation", "silu"), linear(g, x, wg)) * linear(u, x, wu), wd)]


def moe_routing(node: Node, x: torch.Tensor, w_router: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE's router: (weights [..., k] in f32, expert indices [..., k]) per token."""
    probs = torch.softmax(_wide(F.linear(x, w_router)), dim=-1)
    # a stable descending sort: ties go to the lower expert (ONNX TopK; torch.topk's order on ties
    # is unspecified)
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    k = int(node.attrs["top_k"])
    vals, idx = vals[..., :k], idx[..., :k]
    if node.attrs.get("normalize", 1):
        vals = vals / vals.sum(dim=-1, keepdim=True)
    return vals, idx


@kernel("MoE")
def _moe(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, wr, wg, wu, wd = xs
    vals, idx = moe_routing(node, x, wr)
    act = node.attrs.get("activation", "silu")
    flat, fv, fi = x.reshape(-1, x.shape[-1]), vals.reshape(-1, vals.shape[-1]), idx.reshape(-1, idx.shape[-1])
    out = torch.zeros(flat.shape, dtype=_wide(x).dtype)
    g, u, d = (node.inputs + [None] * 5)[2:5]  # (raising's probe runs a MoE node without its inputs)
    for t in range(flat.shape[0]):  # per token, only its selected experts, in top-k order
        for j in range(fi.shape[1]):
            e = int(fi[t, j])
            y = linear(d, _act(act, linear(g, flat[t], wg[e])) * linear(u, flat[t], wu[e]), wd[e])
            out[t] += fv[t, j] * _wide(y)
    return [out.to(x.dtype).reshape(x.shape)]


@kernel("MLP")
def _mlp(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, wu, bu, wd, bd = xs
    return [linear(node.inputs[3], _act(node.attrs.get("activation", "gelu"), linear(node.inputs[1], x, wu, bu)), wd, bd)]


@kernel("SplitHeads")
def _split_heads(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    b, t, hd = xs[0].shape
    h = node.attrs["heads"]
    return [xs[0].reshape(b, t, h, hd // h).transpose(1, 2)]


@kernel("MergeHeads")
def _merge_heads(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    b, h, t, d = xs[0].shape
    return [xs[0].transpose(1, 2).reshape(b, t, h * d)]


@kernel("Positions")
def _positions(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    past = int(xs[1].reshape(-1)[0]) if len(xs) > 1 and xs[1] is not None else 0
    t = xs[0].shape[int(node.attrs.get("axis", 1))]
    return [torch.arange(past, past + t, dtype=torch.int64).unsqueeze(0)]


@kernel("RoPE")
def _rope(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    x, cos_t, sin_t = xs[0], xs[1], xs[2]
    pos = xs[3] if len(xs) > 3 else None
    half = cos_t.shape[-1]
    rot = 2 * half
    if pos is not None:
        pos = pos.long()
        if pos.numel() and int(pos.max()) >= cos_t.shape[0]:
            raise ZlcError(f"RoPE '{node.name}': position {int(pos.max())} beyond the rotary table "
                           f"({cos_t.shape[0]} positions); raise --max-seq or shorten the prompt")
        cos_t, sin_t = cos_t[pos], sin_t[pos]  # [B|1, T, half]
    cos = cos_t.unsqueeze(1).to(x.dtype)  # [B|1, 1, T, half]
    sin = sin_t.unsqueeze(1).to(x.dtype)
    xr, xp = x[..., :rot], x[..., rot:]
    if node.attrs.get("interleaved", 0):
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.stack([o1, o2], -1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
    return [torch.cat([out, xp], -1) if xp.shape[-1] else out]


@kernel("Attention")
def _attention(node: Node, xs: list[Any]) -> list[torch.Tensor]:
    q, k, v = xs[0], xs[1], xs[2]
    past = int(xs[3].item()) if len(xs) > 3 and xs[3] is not None else 0
    if len(xs) > 5 and xs[4] is not None:
        kc, vc = xs[4], xs[5]
        t = k.shape[2]
        if past + t > kc.shape[2]:
            raise ZlcError(f"Attention '{node.name}': {past + t} tokens exceed the KV cache "
                           f"({kc.shape[2]} positions); raise --max-seq or shorten the prompt")
        kc[:, :, past:past + t] = k
        vc[:, :, past:past + t] = v
        k, v = kc[:, :, :past + t], vc[:, :, :past + t]
    hq, hkv = q.shape[1], k.shape[1]
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    scale = node.attrs.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    s = torch.matmul(_wide(q), _wide(k).transpose(-1, -2)) * scale
    cap = node.attrs.get("softcap", 0.0)
    if cap:
        s = torch.tanh(s / cap) * cap
    slopes = node.attrs.get("alibi")
    if slopes:  # ALiBi: slope_h * absolute key position
        s = s + torch.tensor(slopes, dtype=s.dtype)[:, None, None] * torch.arange(k.shape[2], dtype=s.dtype)
    if node.attrs.get("causal", 1):
        t, total = q.shape[2], k.shape[2]
        mask = torch.ones(t, total, dtype=torch.bool).tril(total - t)
        window = int(node.attrs.get("window", 0) or 0)
        if window > 0:  # query i (position total - t + i) keeps keys total - t + i - window < j
            mask = mask.triu(total - t - window + 1)
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1)
    return [torch.matmul(p, _wide(v)).to(q.dtype)]


# ---- constants -------------------------------------------------------------------------------

def const_tensor(v: Value) -> torch.Tensor:
    """A constant's data as a tensor sharing its memory: weights are never copied.

    Memory-mapped weights are read-only numpy arrays; torch wraps them with a warning about
    writability that does not apply here (kernels never write constants, only state)."""
    d = v.data
    if isinstance(d, torch.Tensor):
        return d
    if d is None:
        raise IRError(f"'%{v.name}' is not a constant")
    arr = np.asarray(d)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)
