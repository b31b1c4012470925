"""Raising rules for rotary embeddings and attention (causal or sliding-window mask, GQA, scale).

Both lean on semantic probing (probe.py): rotary cos/sin tensors and attention masks are computed
from positions only, so evaluating them tells exactly what they are, whatever the exporter wrote.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from zlc.ir import Graph, Node, Value

from . import probe
from .match import prod, slice_bounds, strip
from .pattern import OpPattern, scalar
from .raise_scores import alibi_slopes, unbatch
from .raising import new_node
from .rewrite import Match, P, Rule

Pairs = list[tuple[Value, Value]]

DEFAULT_MAX_SEQ = 2048
_memo: weakref.WeakKeyDictionary[Graph, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _cache(g: Graph) -> dict[Any, Any]:
    return _memo.setdefault(g, {})


def _max_seq(g: Graph) -> int:
    return int(g.metadata.get("max_seq", DEFAULT_MAX_SEQ))


def _ids_input(g: Graph) -> Value | None:
    roles = probe.classify_inputs(g)
    for v in g.inputs:
        if roles.get(v.name) == probe.IDS:
            return v
    return None


def positions_value(g: Graph, cos: Value) -> Value | str:
    """The positions a rotary table is indexed by: the graph's position_ids input when the tables
    read it, else Positions(input_ids) (0..T-1, shifted by past_len after KV-cache synthesis)."""
    roles = probe.classify_inputs(g)
    by_value, _ = probe.value_inputs(g, [cos])
    for name in by_value:
        if roles.get(name) == probe.POSITIONS:
            v = g.value(name)
            if v.shape is None or len(v.shape) != 2:
                return f"position_ids '{name}' is not [B, T]"
            return v
    memo = _cache(g)
    if "positions" not in memo:
        ids = _ids_input(g)
        if ids is None or ids.shape is None or len(ids.shape) != 2:
            return "no [B, T] token-id input to derive positions from"
        memo["positions"] = new_node(g, "Positions", [ids], "positions")
    return memo["positions"]


def rotary_tables(g: Graph, cos: Value, sin: Value, half: int, interleaved: bool = False,
                  tokens_first: bool = False) -> tuple[torch.Tensor, torch.Tensor] | str:
    """Evaluates cos/sin at every position up to max_seq, checks they are one table indexed by
    position (consistent across probes), and returns the [P, half] tables. A full-width table
    repeats each frequency: in halves (rotate-half layout) or, `interleaved`, pairwise.
    `tokens_first`: cos/sin are [.., T, 1, R] (rotating [B, T, H, D] before the heads' transpose)."""
    key = ("rope", id(cos), id(sin), half, interleaved, tokens_first)
    memo = _cache(g)
    if key in memo:
        return memo[key]  # type: ignore[no-any-return]
    why = probe.is_position_only(g, [cos, sin])
    if why:
        memo[key] = f"rotary tables {why}"
        return memo[key]  # type: ignore[no-any-return]
    p_max = _max_seq(g)
    full = probe.try_evaluate(g, [cos, sin], probe.Probe(0, p_max))
    if isinstance(full, str):
        memo[key] = full
        return full
    if tokens_first:
        full = [t.transpose(-2, -3) for t in full]
    tabs = []
    for t in full:
        if t.shape[-2] != p_max or t.shape[-1] not in (half, 2 * half):
            memo[key] = f"rotary table shape {tuple(t.shape)} does not fit {p_max} positions x {half}"
            return memo[key]  # type: ignore[no-any-return]
        rows = t.reshape(-1, p_max, t.shape[-1])
        if not torch.equal(rows, rows[:1].expand_as(rows)):
            memo[key] = "rotary table differs across batch/head rows"
            return memo[key]  # type: ignore[no-any-return]
        tab = rows[0]
        if t.shape[-1] == 2 * half and interleaved:
            if not torch.equal(tab[:, 0::2], tab[:, 1::2]):
                memo[key] = "rotary table pairs differ (not the interleaved layout)"
                return memo[key]  # type: ignore[no-any-return]
            tab = tab[:, 0::2]
        elif t.shape[-1] == 2 * half:
            if not torch.equal(tab[:, :half], tab[:, half:]):
                memo[key] = "rotary table halves differ (not the rotate-half layout)"
                return memo[key]  # type: ignore[no-any-return]
            tab = tab[:, :half]
        tabs.append(tab.contiguous())
    for pr in (probe.Probe(0, 5), probe.Probe(3, 4)):
        if pr.past and not (set(probe.classify_inputs(g).values()) & {probe.POSITIONS, probe.PAST_KEY}):
            continue
        got = probe.try_evaluate(g, [cos, sin], pr)
        if isinstance(got, str):
            memo[key] = got
            return got
        for t, tab in zip(got, tabs, strict=False):
            row = (t.transpose(-2, -3) if tokens_first else t).reshape(-1, pr.seq, t.shape[-1])[0]
            row = row[:, 0::2] if interleaved and row.shape[-1] == 2 * half else row[:, :half]
            if not torch.allclose(row, tab[pr.past:pr.past + pr.seq], atol=1e-6):
                memo[key] = f"rotary values at past={pr.past} are not the table rows (not position-indexed)"
                return memo[key]  # type: ignore[no-any-return]
    memo[key] = (tabs[0], tabs[1])
    return memo[key]  # type: ignore[no-any-return]


def table_consts(g: Graph, cos: Value, sin: Value, tabs: tuple[torch.Tensor, torch.Tensor]) -> tuple[Value, Value]:
    """The [P, R/2] tables as constants, one pair per (cos, sin) however many rules read them."""
    key = ("rope_consts", id(cos), id(sin))
    memo = _cache(g)
    if key not in memo:
        memo[key] = (g.add_const("rope.cos", tabs[0], unique=True), g.add_const("rope.sin", tabs[1], unique=True))
    return memo[key]  # type: ignore[no-any-return]


# ---- RoPE (rotate-half form) ------------------------------------------------------------------------

def _is_rotate_half(x: Value, lo: Node, hi: Node) -> bool:
    """Concat(-x[..., d/2:], x[..., :d/2]) on the last axis: `lo` is the first half, `hi` the second."""
    if x.shape is None or not isinstance(x.shape[-1], int):
        return False
    d, last = x.shape[-1], len(x.shape) - 1
    b1, b2 = slice_bounds(lo), slice_bounds(hi)
    if b1 is None or b2 is None or b1[2] % len(x.shape) != last or b2[2] % len(x.shape) != last:
        return False
    return b1[0] == 0 and b1[1] == d // 2 and b2[0] == d // 2 and b2[1] >= d


_NO_ROPE = "no x*cos + rotate_half(x)*sin form"


def _check_rope(m: Match) -> str | None:
    x, g = m["x"], m.graph
    if not _is_rotate_half(x, m.node("lo"), m.node("hi")):
        return _NO_ROPE
    if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[-1], int):
        return "rotated tensor is not [B, H, T, D]"
    return bind_rotary(m, g, rotary_tables(g, m["cos"], m["sin"], x.shape[-1] // 2))


def bind_rotary(m: Match, g: Graph, tabs: Any) -> str | None:
    """A RoPE match's tables (`rotary_tables`' result) and the positions they are indexed by, kept
    on the match for the rewrite; or why not."""
    if isinstance(tabs, str):
        return tabs
    pos = positions_value(g, m["cos"])
    if isinstance(pos, str):
        return pos
    m.note("tabs", tabs)
    m.bind("pos", pos)
    return None


def _rw_rope(m: Match, g: Graph) -> Pairs:
    c, s = table_consts(g, m["cos"], m["sin"], m.fact("tabs"))
    return [(m.root.output, new_node(g, "RoPE", [m["x"], c, s, m["pos"]], "rope", interleaved=0))]


_TWO_PRODUCTS = "not a sum of two products"


def rope_sum(rotated: OpPattern) -> OpPattern:
    """x*cos + rotated*sin: the shape of every RoPE form; `rotated` reads x (rotate-half, pairs)."""
    return P.op("Add", P.op("Mul", P.var("x"), P.var("cos"), why=_TWO_PRODUCTS),
                P.op("Mul", rotated, P.var("sin"), why=_TWO_PRODUCTS))


# x when v = Concat(-x[..., h:], x[..., :h]) (bounds: _is_rotate_half); read, not replaced
_ROTATE_HALF = P.op("Concat", P.op("Neg", P.op("Slice", P.var("x"), rest=True, name="hi")),
                    P.op("Slice", P.var("x"), rest=True, name="lo"), keep=True)

ROPE = Rule(
    "rope",
    rope_sum(_ROTATE_HALF),
    _check_rope, _rw_rope, why=_NO_ROPE,
    doc="x*cos + rotate_half(x)*sin with position-only cos/sin -> RoPE(x, tables, positions)")


def _check_rope_tables(m: Match) -> str | None:
    cos, g = m["cos"], m.graph
    if cos.shape is None or not isinstance(cos.shape[-1], int):
        return "cos has no static last dim"
    tabs = rotary_tables(g, cos, m["sin"], int(cos.shape[-1]))
    if isinstance(tabs, str):
        return tabs
    pos = positions_value(g, cos)
    if isinstance(pos, str):
        return pos
    m.note("tabs", tabs)
    m.bind("pos", pos)
    return None


def _rw_rope_tables(m: Match, g: Graph) -> Pairs:
    c, s = table_consts(g, m["cos"], m["sin"], m.fact("tabs"))
    interleaved = m.root.attrs.get("interleaved", 0)
    return [(m.root.output, new_node(g, "RoPE", [m["x"], c, s, m["pos"]], "rope", interleaved=interleaved))]


# RoPE with per-token cos/sin (opset-23 RotaryEmbedding, genai) -> position-indexed tables.
ROPE_TABLES = Rule(
    "rope_tables",
    P.op("RoPE", P.var("x"), P.var("cos"), P.var("sin"), why="already indexed by positions"),
    _check_rope_tables, _rw_rope_tables,
    doc="RoPE with per-token cos/sin -> RoPE with [P, R/2] tables and positions")


# ---- Attention ----------------------------------------------------------------------------------

def _peel_scale(v: Value) -> tuple[Value, float]:
    """Strips scalar Mul/Div (and casts) from v; returns the core value and the factor."""
    f = 1.0
    while True:
        v = strip(v)
        n = v.producer
        if n is None:
            return v, f
        if n.op == "Mul":
            c = scalar(n.inputs[1]) if scalar(n.inputs[1]) is not None else scalar(n.inputs[0])
            if c is None:
                return v, f
            f *= c
            v = n.inputs[0] if scalar(n.inputs[1]) is not None else n.inputs[1]  # type: ignore[assignment]
        elif n.op == "Div" and scalar(n.inputs[1]) is not None:
            f /= scalar(n.inputs[1])  # type: ignore[operator]
            v = n.inputs[0]  # type: ignore[assignment]
        else:
            return v, f


def _peel(v: Value) -> tuple[Value, float]:
    """_peel_scale and _unbatch, alternately, until neither strips anything."""
    f = 1.0
    while True:
        v, g = _peel_scale(v)
        f *= g
        u = unbatch(v)
        if u is v:
            return v, f
        v = u


def _is_scores(v: Value) -> bool:
    """q k^T (scaled), or q k^T plus a bias: the scores side of `scores + mask`."""
    core = _uncapped(_peel(v)[0])
    if core.data is not None:
        return False
    if prod(core, "MatMul") is not None:
        return True
    add = prod(core, "Add")
    return add is not None and any(x is not None and prod(_peel(x)[0], "MatMul") is not None for x in add.inputs)


def unrepeat_kv(v: Value) -> Value:
    """k0 when v = Reshape(Expand(Unsqueeze(k0, [2]), [B, Hkv, n, S, D]), [B, Hkv*n, S, D])."""
    r = prod(v, "Reshape")
    e = prod(r.inputs[0], "Expand") if r is not None else None
    un = prod(e.inputs[0], "Unsqueeze") if e is not None else None
    if un is None or un.attrs.get("axes") != [2]:
        return v
    k0 = un.inputs[0]
    assert k0 is not None
    if k0.shape is None or len(k0.shape) != 4 or v.shape is None or len(v.shape) != 4:
        return v
    return k0


def _uncapped(v: Value) -> Value:
    """x's scale-stripped core when v = tanh([scale *] x) (a soft-cap's inside), else v."""
    n = v.producer
    return _peel_scale(n.inputs[0])[0] if n is not None and n.op == "Tanh" and n.inputs[0] is not None else v


def _softmax_last_axis(m: Match) -> str | None:
    n = m.root
    if n.output.type.rank != 4 or n.attrs.get("axis", -1) % 4 != 3:
        return "softmax is not over the last axis of a rank-4 tensor"
    return None


def _check_attention(m: Match) -> str | None:
    """The scores: [scale *] q k^T [* scale] [+ mask | masked by Where], read upward through casts
    and any number of scalar factors (which the pattern language cannot repeat)."""
    g = m.graph
    s = strip(m["s"])
    mask, additive, inverted = None, True, False
    sp = s.producer
    if sp is not None and sp.op == "Add":
        lhs, rhs = (strip(x) for x in sp.inputs)  # type: ignore[arg-type]
        lcore, rcore = _uncapped(_peel_scale(lhs)[0]), _uncapped(_peel_scale(rhs)[0])
        a0, a1 = sp.inputs[0], sp.inputs[1]
        assert a0 is not None and a1 is not None
        if _is_scores(lhs):
            s, mask = a0, a1
        elif _is_scores(rhs):
            s, mask = a1, a0
        else:
            for c in (lcore, rcore):
                r = prod(c, "Reshape")
                x = r.inputs[0] if r is not None else None
                if x is not None and x.type.rank == 3 and prod(strip(x), "Add") is not None:
                    return (f"attention bias at '{strip(x).producer.name}': scores batched as [B*H, T, S] "  # type: ignore[union-attr]
                            "plus a bias, not liftable to [B, H, T, S] (unbatch_matmul), are not supported")
            return "softmax input is not scores + mask"
    elif sp is not None and sp.op == "Where":
        fill = scalar(sp.inputs[2]) if scalar(sp.inputs[2]) is not None else scalar(sp.inputs[1])
        if fill is None or fill > -1e4:
            return "Where-masked scores without a large negative fill"
        if scalar(sp.inputs[2]) is not None and sp.inputs[1] is not None:
            s, mask, additive = sp.inputs[1], sp.inputs[0], False
        elif sp.inputs[2] is not None:  # masked_fill(drop, fill): the fill on the true branch
            s, mask, additive, inverted = sp.inputs[2], sp.inputs[0], False, True
        else:
            return "Where-masked scores without a scores branch"
    if m.get("p_3d") is not None:  # softmax -> Reshape [B*H, T, S] -> bmm: only said why, not raised
        return "attention probabilities reshaped to [B*H, T, S] before the PV product are not supported"
    core, scale = _peel(s)
    softcap = 0.0
    tanh = core.producer
    if tanh is not None and tanh.op == "Tanh" and tanh.inputs[0] is not None:
        # soft-capping (Gemma 2): c * tanh(a * q k^T) is Attention(scale=a * c, softcap=c)
        if scale <= 0:
            return "soft-capped scores with a non-positive cap"
        core, inner = _peel(tanh.inputs[0])
        softcap, scale = scale, inner * scale
    slopes: list[float] | None = None
    bp = strip(core).producer
    if bp is not None and bp.op == "Add":  # scores + an additive bias: ALiBi or refused
        if softcap:
            return "soft-capped scores plus an additive bias are not supported"
        sides = [x for x in bp.inputs if x is not None]
        qk_side = [x for x in sides if prod(_peel(x)[0], "MatMul") is not None and x.data is None]
        if len(sides) != 2 or not qk_side:
            return "softmax input is not scores + bias"
        bias = sides[1] if sides[0] is qk_side[0] else sides[0]
        got = alibi_slopes(g, bias, scale, _cache(g))
        if isinstance(got, str):
            return f"attention bias at '{bp.name}': {got}"
        slopes = got
        core, s2 = _peel(qk_side[0])
        scale *= s2
    qk = prod(core, "MatMul")
    if qk is None:
        return "scores are not a MatMul"
    q, s_q = _peel_scale(qk.inputs[0])  # type: ignore[arg-type]
    kt, s_k = _peel_scale(qk.inputs[1])  # type: ignore[arg-type]
    scale *= s_q * s_k
    if q.data is not None or kt.data is not None:
        return "Q or K is a constant"
    tr = prod(kt, "Transpose")
    new_k_transpose = None
    if tr is not None and tr.attrs.get("perm") == [0, 1, 3, 2]:
        k = tr.inputs[0]
    elif tr is not None and tr.attrs.get("perm") == [0, 2, 3, 1]:
        k, new_k_transpose = tr.inputs[0], True
    else:
        return "K is not transposed for the QK^T product"
    assert k is not None
    if q.shape is None or len(q.shape) != 4:
        return "Q is not [B, H, T, D]"
    window = 0
    if mask is not None:
        key = ("mask", id(mask), additive, inverted)
        memo = _cache(g)
        if key not in memo:
            memo[key] = probe.mask_window(g, mask, additive, _max_seq(g), inverted)
        if isinstance(memo[key], str):
            return f"mask: {memo[key]}"
        window = int(memo[key])
    m.bind("q", q)
    m.bind("k", k if new_k_transpose else unrepeat_kv(k))
    m.bind("v0", unrepeat_kv(m["v"]))
    m.note("k_from_bshd", bool(new_k_transpose))
    m.note("scale", scale)
    m.note("causal", mask is not None)
    m.note("window", window)
    m.note("softcap", softcap)
    if slopes is not None and len(slopes) != q.shape[1]:
        return f"{len(slopes)} ALiBi slopes for {q.shape[1]} query heads"
    m.note("alibi", slopes)
    m.cover(qk)
    return None


def _rw_attention(m: Match, g: Graph) -> Pairs:
    k = m["k"]
    if m.fact("k_from_bshd"):
        k = unrepeat_kv(new_node(g, "Transpose", [k], "k_bhsd", perm=[0, 2, 1, 3]))
    attrs: dict[str, Any] = {"scale": float(m.fact("scale")), "causal": int(m.fact("causal"))}
    if m.fact("window"):
        attrs["window"] = int(m.fact("window"))
    if m.fact("softcap"):
        attrs["softcap"] = float(m.fact("softcap"))
    if m.fact("alibi") is not None:
        attrs["alibi"] = m.fact("alibi")
    out = new_node(g, "Attention", [m["q"], k, m["v0"]], "attention", **attrs)
    return [(m.node("pv").output, out)]


_NOT_PV = "softmax output is not multiplied by V"


def _times_v(p: str) -> OpPattern:
    return P.op("MatMul", P.var(p, why=_NOT_PV), P.var("v"), name="pv", why=_NOT_PV)


ATTENTION = Rule(
    "attention",
    P.op("Softmax", P.var("s"), out="p", where=_softmax_last_axis,
         then=P.or_(P.op("Cast", P.var("p"), out="p_cast", keep=True, then=_times_v("p_cast")), _times_v("p"),
                    P.op("Reshape", P.var("p"), P.any(), out="p_3d", keep=True, then=_times_v("p_3d")),
                    why=_NOT_PV)),
    _check_attention, _rw_attention,
    doc="softmax([c * tanh](q k^T * scale [/ c]) + causal [sliding-window] mask) v, GQA repeats stripped -> "
        "Attention")


# ---- head split / merge ------------------------------------------------------------------------

def _bhtd_swap(p: object) -> bool:
    return p == [0, 2, 1, 3]


def _check_split_heads(m: Match) -> str | None:
    x, rs = m["x"], m.node("r").output.shape
    xs = x.shape
    if xs is None or rs is None or len(xs) != 3 or len(rs) != 4:
        return "not [B, T, H*D] -> [B, T, H, D]"
    if tuple(rs[:2]) != tuple(xs[:2]) or not all(isinstance(d, int) for d in (rs[2], rs[3], xs[2])) \
            or rs[2] * rs[3] != xs[2] or any(isinstance(d, str) and "?" in d for d in xs[:2]):  # type: ignore[operator]
        return "reshape does not split the feature axis into heads"
    m.note("heads", int(rs[2]))
    return None


# Transpose(Reshape(x[B,T,H*D] -> [B,T,H,D]), [0,2,1,3]) -> SplitHeads(x, heads=H)
SPLIT_HEADS = Rule(
    "split_heads",
    P.op("Transpose", P.op("Reshape", P.var("x"), P.any(), name="r", why="input is not a reshape"),
         attrs={"perm": _bhtd_swap}, why="not a [0, 2, 1, 3] transpose"),
    _check_split_heads,
    lambda m, g: [(m.root.output, new_node(g, "SplitHeads", [m["x"]], "split_heads", heads=m.fact("heads")))],
    doc="[B,T,H*D] -> reshape [B,T,H,D] -> transpose -> SplitHeads")


def _check_merge_heads(m: Match) -> str | None:
    s_a, s_o = m["a"].shape, m.root.output.shape
    if s_a is None or s_o is None or len(s_a) != 4 or len(s_o) not in (2, 3):
        return "not [B, H, T, D] -> [B, T, H*D]"
    if not (isinstance(s_a[1], int) and isinstance(s_a[3], int) and s_o[-1] == s_a[1] * s_a[3]):
        return "reshape does not merge the heads"
    if len(s_o) == 3 and (s_o[0] != s_a[0] or s_o[1] != s_a[2]):
        return "reshape does not keep [B, T]"
    if len(s_o) == 2 and (s_a[0] != 1 or s_o[0] != s_a[2]):  # GPT-2 flattens tokens for its Linear
        return "reshape to 2-D is not [T, H*D] of a batch of 1"
    return None


def _rw_merge_heads(m: Match, g: Graph) -> Pairs:
    out = new_node(g, "MergeHeads", [m["a"]], "merge_heads")
    if len(m.root.output.shape or ()) == 2:  # keep the flattening; the next Linear sweep folds it away
        out = new_node(g, "Reshape", [out, m["shape"]], "flatten_tokens")
    return [(m.root.output, out)]


# Reshape(Transpose(a[B,H,T,D], [0,2,1,3]) -> [B,T,H*D]) -> MergeHeads(a)
MERGE_HEADS = Rule(
    "merge_heads",
    P.op("Reshape", P.op("Transpose", P.var("a"), attrs={"perm": _bhtd_swap},
                         why="input is not a [0, 2, 1, 3] transpose"), P.var("shape")),
    _check_merge_heads, _rw_merge_heads, doc="[B,H,T,D] -> transpose -> reshape [B,T,H*D] -> MergeHeads")


# ---- position-only selects ------------------------------------------------------------------------

def _check_static_select(m: Match) -> str | None:
    """Where(cond, a, b) whose cond depends on positions only and is constant on every probe:
    e.g. "zero fully-masked rows" after attention, which a causal mask never triggers."""
    n, g, cond = m.root, m.graph, m["cond"]
    if cond.data is not None:
        return "condition is a constant (folding's job)"
    why = probe.is_position_only(g, [cond])
    if why:
        return f"condition {why}"
    seen: set[bool] = set()
    for pr in probe.PROBES:
        got = probe.try_evaluate(g, [cond], pr)
        if isinstance(got, str):
            if probe.optional_probe(pr):
                continue
            return got
        t = got[0].bool()
        if bool(t.all()):
            seen.add(True)
        elif not bool(t.any()):
            seen.add(False)
        else:
            return "condition is mixed"
    if len(seen) != 1:
        return "condition differs across probes"
    pick = m["a"] if seen.pop() else m["b"]
    if pick.type != n.output.type:
        return "the selected branch alone has another shape (broadcast)"
    m.bind("pick", pick)
    return None


STATIC_SELECT = Rule(
    "static_select", P.op("Where", P.var("cond"), P.var("a"), P.var("b")), _check_static_select,
    lambda m, g: [(m.root.output, m["pick"])],
    doc="Where with a position-only condition that is constant on all probes -> that branch")


def _check_heads_roundtrip(m: Match) -> str | None:
    x = m["x"]
    if x.shape is None or x.shape[1] != m.root.attrs["heads"]:
        return "head counts differ"
    return None


# SplitHeads(MergeHeads(x)) with the same head count -> x (frontends that reshape around a 3-D op,
# e.g. contrib RotaryEmbedding, leave these pairs behind).
HEADS_ROUNDTRIP = Rule(
    "heads_roundtrip",
    P.op("SplitHeads", P.op("MergeHeads", P.var("x"), keep=True, why="input is not MergeHeads")),
    _check_heads_roundtrip, lambda m, g: [(m.root.output, m["x"])], doc="SplitHeads(MergeHeads(x)) -> x")


def _check_attention_gqa(m: Match) -> str | None:
    if m.root.input(3) is not None:
        return "attention already reads a cache"
    k0, v0 = unrepeat_kv(m["k"]), unrepeat_kv(m["v"])
    if k0 is m["k"] or v0 is m["v"]:
        return "K/V are not repeated heads"
    m.bind("k0", k0)
    m.bind("v0", v0)
    return None


def _rw_attention_gqa(m: Match, g: Graph) -> Pairs:
    n = m.root
    out = g.add_node("Attention", [m["q"], m["k0"], m["v0"]], dict(n.attrs), name="attention").output
    return [(n.output, out)]


# Attention fed explicitly repeated K/V (genai's MHA graphs repeat KV heads before the op) ->
# Attention on the KV heads themselves (GQA).
ATTENTION_GQA = Rule(
    "attention_gqa", P.op("Attention", P.var("q"), P.var("k"), P.var("v"), rest=True),
    _check_attention_gqa, _rw_attention_gqa,
    doc="Attention(q, repeat(k), repeat(v)) -> Attention(q, k, v) with fewer KV heads")
