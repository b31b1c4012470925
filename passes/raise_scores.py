"""Attention scores beyond q k^T: the ALiBi bias (its slopes read off by probing) and the [B*H]
batched products BLOOM's baddbmm / bmm export (lifted to [1, H, T, *] heads so attention raises).
raise_attention.py's attention rule reads both."""

from __future__ import annotations

from typing import Any

import torch

from zlc.ir import Graph, Value

from . import probe
from .match import prod, strip
from .raising import new_node
from .rewrite import Match, P, Rule

Pairs = list[tuple[Value, Value]]


def unbatch(v: Value) -> Value:
    """Strips what unbatch_matmul leaves around a [1, H, T, S] product: Squeeze(axes [0]) to
    [H, T, S] and a Reshape back to [1, H, T, S] (BLOOM's [B*H] batched scores)."""
    while True:
        v = strip(v)
        n = v.producer
        x = n.inputs[0] if n is not None else None
        xs, vs = (x.shape if x is not None else None), v.shape
        if n is None or x is None or xs is None or vs is None:
            return v
        if n.op == "Squeeze" and n.attrs.get("axes") == [0] and len(xs) == 4 and xs[0] == 1:
            v = x
        elif n.op == "Reshape" and len(xs) == 3 and len(vs) == 4 and vs[0] == 1 and tuple(vs[1:]) == tuple(xs):
            v = x
        else:
            return v


def alibi_slopes(g: Graph, bias: Value, scale: float, memo: dict[Any, Any]) -> list[float] | str:
    """Per-head slopes when `bias` (times `scale`) is ALiBi: on every probe, within each head and
    query row, slope_h * key position plus a constant (softmax ignores the constant: BLOOM's
    slope * k and MPT's slope * (k - T + 1) are the same); or why not."""
    key = ("alibi", id(bias), scale)
    if key in memo:
        return memo[key]  # type: ignore[no-any-return]
    why = probe.is_position_only(g, [bias])
    slopes: torch.Tensor | None = None
    for pr in (probe.Probe(0, 5), probe.Probe(0, 12)):
        if why:
            break
        got = probe.try_evaluate(g, [bias], pr)
        if isinstance(got, str):
            why = got
            break
        b = got[0].double() * scale
        if b.dim() < 3 or b.shape[-1] != pr.seq or b.shape[-2] not in (1, pr.seq):
            why = f"bias shape {tuple(b.shape)} does not fit {pr.seq} queries x {pr.seq} keys"
            break
        b = b.reshape(-1, b.shape[-2], b.shape[-1]).expand(-1, pr.seq, pr.seq)
        rel = b - b[:, :, :1]  # each row from its first key; only keys a causal query sees count
        sl = rel[:, -1, 1]
        want = (sl[:, None, None] * torch.arange(pr.seq, dtype=b.dtype)[None, None, :]).expand_as(rel)
        keep = torch.ones(pr.seq, pr.seq, dtype=torch.bool).tril()
        if not torch.allclose(rel[:, keep], want[:, keep], atol=1e-5, rtol=1e-5):
            why = "not a linear bias in the key position per head (ALiBi)"
            break
        if slopes is not None and not torch.allclose(sl, slopes, atol=1e-6):
            why = "ALiBi slopes differ between probes"
            break
        slopes = sl
    memo[key] = why if why or slopes is None else [float(x) for x in slopes.float()]
    return memo[key]  # type: ignore[no-any-return]


# ---- [B*H]-batched products (BLOOM's baddbmm / bmm) ------------------------------------------------

_NOT_BATCHED = "not a product of [1, H, T, D] tensors reshaped to [H, T, D]"


def _heads_3d(v: Value | None) -> tuple[Value, bool] | None:
    """x4 [1, H, T, D] when v = Reshape(x4) [H, T, D], or Transpose(Reshape(x4), [0, 2, 1]) (then
    True: the product reads it transposed)."""
    if v is None:
        return None
    transposed = False
    t = prod(v, "Transpose")
    if t is not None and t.attrs.get("perm") == [0, 2, 1]:
        v, transposed = t.inputs[0], True
    r = prod(v, "Reshape") if v is not None else None
    x = r.inputs[0] if r is not None else None
    if x is None or x.shape is None or v is None or v.shape is None or len(x.shape) != 4 or len(v.shape) != 3 \
            or x.shape[0] != 1 or tuple(x.shape[1:]) != tuple(v.shape):
        return None
    return x, transposed


def _check_unbatch(m: Match) -> str | None:
    a, b = _heads_3d(m.root.inputs[0]), _heads_3d(m.root.inputs[1])
    if a is None or b is None or a[1]:
        return _NOT_BATCHED
    m.bind("a4", a[0])
    m.bind("b4", b[0])
    m.note("b_t", b[1])
    return None


def _rw_unbatch(m: Match, g: Graph) -> Pairs:
    b = m["b4"]
    if m.fact("b_t"):
        b = new_node(g, "Transpose", [b], "transpose", perm=[0, 1, 3, 2])
    mm = new_node(g, "MatMul", [m["a4"], b], "matmul")
    return [(m.root.output, new_node(g, "Squeeze", [mm], "squeeze", axes=[0]))]


UNBATCH_MATMUL = Rule(
    "unbatch_matmul", P.op("MatMul", P.any(), P.any()), _check_unbatch, _rw_unbatch, why=_NOT_BATCHED,
    doc="MatMul of [1,H,T,D] heads reshaped to [H,T,D] (bmm) -> Squeeze(MatMul of the heads, [0])")


def _check_squeeze_roundtrip(m: Match) -> str | None:
    x = m["x"]
    if m.node("sq").attrs.get("axes") != [0] or x.type != m.root.output.type:
        return "not Reshape(Squeeze(x, [0])) back to x's type"
    return None


SQUEEZE_ROUNDTRIP = Rule(
    "squeeze_roundtrip", P.op("Reshape", P.op("Squeeze", P.var("x"), name="sq", why="input is not a Squeeze"),
                              P.any()),
    _check_squeeze_roundtrip, lambda m, g: [(m.root.output, m["x"])],
    doc="Reshape(Squeeze(x, [0])) with x's own type -> x")
