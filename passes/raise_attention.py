"""Raising rules for rotary embeddings and attention (causal mask, GQA, scale).

Both lean on semantic probing (probe.py): rotary cos/sin tensors and attention masks are computed
from positions only, so evaluating them tells exactly what they are, whatever the exporter wrote.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from zlc.ir import Graph, Node, Value

from . import probe
from .match import Users, prod, scalar, strip
from .raising import Match, RaiseRule, new_node

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


def rotary_tables(g: Graph, cos: Value, sin: Value, half: int) -> tuple[torch.Tensor, torch.Tensor] | str:
    """Evaluates cos/sin at every position up to max_seq, checks they are one table indexed by
    position (consistent across probes), and returns the [P, half] tables."""
    key = ("rope", id(cos), id(sin), half)
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
        if t.shape[-1] == 2 * half:
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
            row = t.reshape(-1, pr.seq, t.shape[-1])[0][:, :half]
            if not torch.allclose(row, tab[pr.past:pr.past + pr.seq], atol=1e-6):
                memo[key] = f"rotary values at past={pr.past} are not the table rows (not position-indexed)"
                return memo[key]  # type: ignore[no-any-return]
    memo[key] = (tabs[0], tabs[1])
    return memo[key]  # type: ignore[no-any-return]


def _table_consts(g: Graph, cos: Value, sin: Value, tabs: tuple[torch.Tensor, torch.Tensor]) -> tuple[Value, Value]:
    key = ("rope_consts", id(cos), id(sin))
    memo = _cache(g)
    if key not in memo:
        memo[key] = (g.add_const("rope.cos", tabs[0], unique=True), g.add_const("rope.sin", tabs[1], unique=True))
    return memo[key]  # type: ignore[no-any-return]


# ---- RoPE (rotate-half form) ------------------------------------------------------------------------

def _slice_bounds(n: Node) -> tuple[int, int, int] | None:
    """(start, end, axis) of a unit-step single-axis Slice with constant bounds."""
    if n.op != "Slice":
        return None
    vals = []
    for i in (1, 2, 3):
        v = n.input(i)
        if v is None:
            return None
        a = v.const_array() if v.data is not None else (
            None if v.sym is None or not all(isinstance(x, int) for x in v.sym) else v.sym)
        if a is None or len(list(a if not hasattr(a, "reshape") else a.reshape(-1))) != 1:  # type: ignore[arg-type]
            return None
        vals.append(int(list(a if not hasattr(a, "reshape") else a.reshape(-1))[0]))  # type: ignore[arg-type]
    step = n.input(4)
    if step is not None and scalar(step) not in (1.0, None):
        return None
    return vals[0], vals[1], vals[2]


def _rotate_half_of(v: Value) -> Value | None:
    """x when v = Concat(-x[..., h:], x[..., :h], axis=-1)."""
    cat = prod(v, "Concat")
    if cat is None or len(cat.inputs) != 2:
        return None
    neg = prod(cat.inputs[0], "Neg")
    if neg is None:
        return None
    s2, s1 = prod(neg.inputs[0], "Slice"), prod(cat.inputs[1], "Slice")
    if s1 is None or s2 is None or s1.inputs[0] is not s2.inputs[0]:
        return None
    x = s1.inputs[0]
    assert x is not None
    if x.shape is None or not isinstance(x.shape[-1], int):
        return None
    d = x.shape[-1]
    b1, b2 = _slice_bounds(s1), _slice_bounds(s2)
    if b1 is None or b2 is None or b1[2] % len(x.shape) != len(x.shape) - 1 or b2[2] % len(x.shape) != len(x.shape) - 1:
        return None
    if b1[0] != 0 or b1[1] != d // 2 or b2[0] != d // 2 or b2[1] < d:
        return None
    return x


def _match_rope(g: Graph, n: Node, u: Users) -> Match | str:
    a, b = (prod(v, "Mul") for v in n.inputs)
    if a is None or b is None:
        return "not a sum of two products"
    for m_cos, m_sin in ((a, b), (b, a)):
        for xc, cos in ((m_cos.inputs[0], m_cos.inputs[1]), (m_cos.inputs[1], m_cos.inputs[0])):
            for rs, sin in ((m_sin.inputs[0], m_sin.inputs[1]), (m_sin.inputs[1], m_sin.inputs[0])):
                x = _rotate_half_of(rs)  # type: ignore[arg-type]
                if x is None or x is not xc:
                    continue
                if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[-1], int):
                    return "rotated tensor is not [B, H, T, D]"
                tabs = rotary_tables(g, cos, sin, x.shape[-1] // 2)  # type: ignore[arg-type]
                if isinstance(tabs, str):
                    return tabs
                pos = positions_value(g, cos)  # type: ignore[arg-type]
                if isinstance(pos, str):
                    return pos
                return {"x": x, "cos": cos, "sin": sin, "tabs": tabs, "pos": pos, "out": n.output,
                        "_nodes": [n, a, b]}
    return "no x*cos + rotate_half(x)*sin form"


def _rw_rope(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    c, s = _table_consts(g, m["cos"], m["sin"], m["tabs"])
    return [(m["out"], new_node(g, "RoPE", [m["x"], c, s, m["pos"]], "rope", interleaved=0))]


ROPE = RaiseRule("rope", "Add", _match_rope, _rw_rope,
                 "x*cos + rotate_half(x)*sin with position-only cos/sin -> RoPE(x, tables, positions)")


def _match_rope_tables(g: Graph, n: Node, u: Users) -> Match | str:
    """RoPE with per-token cos/sin (opset-23 RotaryEmbedding, genai) -> position-indexed tables."""
    if n.input(3) is not None:
        return "already indexed by positions"
    x, cos, sin = n.inputs[0], n.inputs[1], n.inputs[2]
    assert x is not None and cos is not None and sin is not None
    if cos.shape is None or not isinstance(cos.shape[-1], int):
        return "cos has no static last dim"
    tabs = rotary_tables(g, cos, sin, int(cos.shape[-1]))
    if isinstance(tabs, str):
        return tabs
    pos = positions_value(g, cos)
    if isinstance(pos, str):
        return pos
    return {"x": x, "cos": cos, "sin": sin, "tabs": tabs, "pos": pos, "out": n.output,
            "interleaved": n.attrs.get("interleaved", 0), "_nodes": [n]}


def _rw_rope_tables(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    c, s = _table_consts(g, m["cos"], m["sin"], m["tabs"])
    return [(m["out"], new_node(g, "RoPE", [m["x"], c, s, m["pos"]], "rope", interleaved=m["interleaved"]))]


ROPE_TABLES = RaiseRule("rope_tables", "RoPE", _match_rope_tables, _rw_rope_tables,
                        "RoPE with per-token cos/sin -> RoPE with [P, R/2] tables and positions")


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


def _unrepeat_kv(v: Value) -> Value:
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


def _match_attention(g: Graph, n: Node, u: Users) -> Match | str:
    rank = n.output.type.rank
    if rank != 4 or n.attrs.get("axis", -1) % 4 != 3:
        return "softmax is not over the last axis of a rank-4 tensor"
    p = n.output
    cast = u.only(p, "Cast")
    if cast is not None:
        p = cast.output
    pv = u.only(p, "MatMul")
    if pv is None or pv.inputs[0] is not p:
        return "softmax output is not multiplied by V"
    s = strip(n.inputs[0])  # type: ignore[arg-type]
    mask, additive = None, True
    sp = s.producer
    if sp is not None and sp.op == "Add":
        lhs, rhs = (strip(x) for x in sp.inputs)  # type: ignore[arg-type]
        lcore, rcore = _peel_scale(lhs)[0], _peel_scale(rhs)[0]
        a0, a1 = sp.inputs[0], sp.inputs[1]
        assert a0 is not None and a1 is not None
        if prod(lcore, "MatMul") is not None and lcore.data is None:
            s, mask = a0, a1
        elif prod(rcore, "MatMul") is not None:
            s, mask = a1, a0
        else:
            return "softmax input is not scores + mask"
    elif sp is not None and sp.op == "Where":
        fill = scalar(sp.inputs[2]) if scalar(sp.inputs[2]) is not None else scalar(sp.inputs[1])
        if fill is None or fill > -1e4:
            return "Where-masked scores without a large negative fill"
        if scalar(sp.inputs[2]) is not None and sp.inputs[1] is not None:
            s, mask, additive = sp.inputs[1], sp.inputs[0], False
        else:
            return "inverted Where mask (fill on the true branch) is not supported"
    core, scale = _peel_scale(s)  # type: ignore[arg-type]
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
    v = pv.inputs[1]
    assert v is not None
    if q.shape is None or len(q.shape) != 4:
        return "Q is not [B, H, T, D]"
    if mask is not None:
        key = ("mask", id(mask), additive)
        memo = _cache(g)
        if key not in memo:
            memo[key] = probe.classify_mask(g, mask, additive)
        if memo[key] is not None:
            return f"mask: {memo[key]}"
    k0 = k if new_k_transpose else _unrepeat_kv(k)
    v0 = _unrepeat_kv(v)
    return {"q": q, "k": k0, "v": v0, "k_from_bshd": bool(new_k_transpose), "scale": scale,
            "causal": mask is not None, "out": pv.output, "_nodes": [n, pv, qk]}


def _rw_attention(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    k = m["k"]
    if m["k_from_bshd"]:
        k = _unrepeat_kv(new_node(g, "Transpose", [k], "k_bhsd", perm=[0, 2, 1, 3]))
    out = new_node(g, "Attention", [m["q"], k, m["v"]], "attention", scale=float(m["scale"]),
                   causal=int(m["causal"]))
    return [(m["out"], out)]


ATTENTION = RaiseRule("attention", "Softmax", _match_attention, _rw_attention,
                      "softmax(q k^T * scale + causal mask) v, GQA repeats stripped -> Attention")


# ---- head split / merge ------------------------------------------------------------------------

def _match_split_heads(g: Graph, n: Node, u: Users) -> Match | str:
    """Transpose(Reshape(x[B,T,H*D] -> [B,T,H,D]), [0,2,1,3]) -> SplitHeads(x, heads=H)."""
    if n.attrs.get("perm") != [0, 2, 1, 3]:
        return "not a [0, 2, 1, 3] transpose"
    r = prod(n.inputs[0], "Reshape")
    if r is None:
        return "input is not a reshape"
    x = r.inputs[0]
    assert x is not None
    xs, rs = x.shape, r.output.shape
    if xs is None or rs is None or len(xs) != 3 or len(rs) != 4:
        return "not [B, T, H*D] -> [B, T, H, D]"
    if tuple(rs[:2]) != tuple(xs[:2]) or not all(isinstance(d, int) for d in (rs[2], rs[3], xs[2])) \
            or rs[2] * rs[3] != xs[2] or any(isinstance(d, str) and "?" in d for d in xs[:2]):  # type: ignore[operator]
        return "reshape does not split the feature axis into heads"
    return {"x": x, "heads": int(rs[2]), "out": n.output, "_nodes": [n, r]}


SPLIT_HEADS = RaiseRule(
    "split_heads", "Transpose", _match_split_heads,
    lambda g, m: [(m["out"], new_node(g, "SplitHeads", [m["x"]], "split_heads", heads=m["heads"]))],
    "[B,T,H*D] -> reshape [B,T,H,D] -> transpose -> SplitHeads")


def _match_merge_heads(g: Graph, n: Node, u: Users) -> Match | str:
    """Reshape(Transpose(a[B,H,T,D], [0,2,1,3]) -> [B,T,H*D]) -> MergeHeads(a)."""
    t = prod(n.inputs[0], "Transpose")
    if t is None or t.attrs.get("perm") != [0, 2, 1, 3]:
        return "input is not a [0, 2, 1, 3] transpose"
    a = t.inputs[0]
    assert a is not None
    s_a, s_o = a.shape, n.output.shape
    if s_a is None or s_o is None or len(s_a) != 4 or len(s_o) not in (2, 3):
        return "not [B, H, T, D] -> [B, T, H*D]"
    if not (isinstance(s_a[1], int) and isinstance(s_a[3], int) and s_o[-1] == s_a[1] * s_a[3]):
        return "reshape does not merge the heads"
    if len(s_o) == 3 and (s_o[0] != s_a[0] or s_o[1] != s_a[2]):
        return "reshape does not keep [B, T]"
    if len(s_o) == 2 and (s_a[0] != 1 or s_o[0] != s_a[2]):  # GPT-2 flattens tokens for its Linear
        return "reshape to 2-D is not [T, H*D] of a batch of 1"
    return {"a": a, "out": n.output, "shape": n.inputs[1] if len(s_o) == 2 else None, "_nodes": [n, t]}


def _rw_merge_heads(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    out = new_node(g, "MergeHeads", [m["a"]], "merge_heads")
    if m["shape"] is not None:  # keep the flattening; the next Linear sweep folds it away
        out = new_node(g, "Reshape", [out, m["shape"]], "flatten_tokens")
    return [(m["out"], out)]


MERGE_HEADS = RaiseRule("merge_heads", "Reshape", _match_merge_heads, _rw_merge_heads,
                        "[B,H,T,D] -> transpose -> reshape [B,T,H*D] -> MergeHeads")


# ---- position-only selects ------------------------------------------------------------------------

def _match_static_select(g: Graph, n: Node, u: Users) -> Match | str:
    """Where(cond, a, b) whose cond depends on positions only and is constant on every probe:
    e.g. "zero fully-masked rows" after attention, which a causal mask never triggers."""
    cond = n.inputs[0]
    assert cond is not None
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
    pick = n.inputs[1] if seen.pop() else n.inputs[2]
    assert pick is not None
    if pick.type != n.output.type:
        return "the selected branch alone has another shape (broadcast)"
    return {"out": n.output, "pick": pick, "_nodes": [n]}


STATIC_SELECT = RaiseRule("static_select", "Where", _match_static_select,
                          lambda g, m: [(m["out"], m["pick"])],
                          "Where with a position-only condition that is constant on all probes -> that branch")


def _match_heads_roundtrip(g: Graph, n: Node, u: Users) -> Match | str:
    """SplitHeads(MergeHeads(x)) with the same head count -> x (frontends that reshape around a
    3-D op, e.g. contrib RotaryEmbedding, leave these pairs behind)."""
    m = prod(n.inputs[0], "MergeHeads")
    if m is None:
        return "input is not MergeHeads"
    x = m.inputs[0]
    assert x is not None
    if x.shape is None or x.shape[1] != n.attrs["heads"]:
        return "head counts differ"
    return {"out": n.output, "x": x, "_nodes": [n]}


HEADS_ROUNDTRIP = RaiseRule("heads_roundtrip", "SplitHeads", _match_heads_roundtrip,
                            lambda g, m: [(m["out"], m["x"])], "SplitHeads(MergeHeads(x)) -> x")


def _match_attention_gqa(g: Graph, n: Node, u: Users) -> Match | str:
    """Attention fed explicitly repeated K/V (genai's MHA graphs repeat KV heads before the op)
    -> Attention on the KV heads themselves (GQA)."""
    if n.input(3) is not None:
        return "attention already reads a cache"
    k, v = n.inputs[1], n.inputs[2]
    assert k is not None and v is not None
    k0, v0 = _unrepeat_kv(k), _unrepeat_kv(v)
    if k0 is k or v0 is v:
        return "K/V are not repeated heads"
    return {"node": n, "k": k0, "v": v0, "out": n.output, "_nodes": [n]}


def _rw_attention_gqa(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    n: Node = m["node"]
    out = g.add_node("Attention", [n.inputs[0], m["k"], m["v"]], dict(n.attrs), name="attention").output
    return [(m["out"], out)]


ATTENTION_GQA = RaiseRule("attention_gqa", "Attention", _match_attention_gqa, _rw_attention_gqa,
                          "Attention(q, repeat(k), repeat(v)) -> Attention(q, k, v) with fewer KV heads")
