"""Raising rules for embeddings, linear layers, norms and MLPs."""

from __future__ import annotations

import numpy as np
import torch

from zlc.ir import Graph, Node, Value

from .match import (
    ELEMENTWISE,
    Users,
    const2d,
    elementwise_activation,
    last_axis,
    other,
    prod,
    scalar,
    strip,
)
from .raising import Match, RaiseRule, new_node


def _transpose_view(data: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """A [K, N] weight seen as [N, K] without copying (a strided view)."""
    return data.T


# ---- Embedding ----------------------------------------------------------------------------------

def _match_embedding(g: Graph, n: Node, u: Users) -> Match | str:
    w, ids = n.inputs[0], n.inputs[1]
    if n.attrs.get("axis", 0) != 0:
        return "gather axis is not 0"
    if const2d(w) is None:
        return "table is not a constant matrix"
    assert ids is not None
    if ids.dtype.is_float:
        return "indices are not integers"
    return {"w": w, "ids": ids, "out": n.output, "_nodes": [n]}


def _rw_embedding(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    ids = m["ids"]
    if ids.kind != "input" and _is_arange(g, ids):
        # Learned absolute positions (GPT-2's wpe): index by Positions, which KV-cache synthesis
        # shifts by past_len; arange(T) would restart at 0 on every decode step.
        from .raise_attention import positions_value

        pos = positions_value(g, ids)
        if not isinstance(pos, str):
            ids = pos
    return [(m["out"], new_node(g, "Embedding", [m["w"], ids], "embedding"))]


def _is_arange(g: Graph, v: Value) -> bool:
    """v depends on positions only and evaluates to [0..T) (possibly with leading 1-dims)."""
    from . import probe

    if probe.is_position_only(g, [v], allowed=()) is not None:
        return False
    for pr in (probe.Probe(0, 1), probe.Probe(0, 6)):
        got = probe.try_evaluate(g, [v], pr)
        if isinstance(got, str) or got[0].numel() != pr.seq:
            return False
        if not torch.equal(got[0].reshape(-1).long(), torch.arange(pr.seq)):
            return False
    return True


EMBEDDING = RaiseRule("embedding", "Gather", _match_embedding, _rw_embedding,
                      "Gather(W[V,H], ids) -> Embedding")


# ---- Linear -------------------------------------------------------------------------------------

def _match_linear(g: Graph, n: Node, u: Users) -> Match | str:
    x, w = n.inputs[0], n.inputs[1]
    assert x is not None and w is not None
    tr = prod(w, "Transpose")
    w_nk = None  # the weight already in [out, in] layout: MatMul(x, Transpose(W[N,K]))
    if tr is not None and tr.attrs.get("perm") == [1, 0] and const2d(tr.inputs[0]) is not None:
        # Tied LM heads read the embedding table transposed; too large to fold, free to view.
        w_nk = tr.inputs[0]
    elif const2d(w) is None:
        return "right operand is not a constant matrix"
    if x.dtype != w.dtype:
        return "activation and weight dtypes differ"
    m: Match = {"x": x, "w": w, "w_nk": w_nk, "out": n.output, "bias": None, "_nodes": [n]}
    add = u.only(n.output, "Add")
    if add is not None:
        b = other(add, n.output)
        if b is not None and b.data is not None and b.shape is not None and len(b.shape) == 1 \
                and w.shape is not None and b.shape[0] == w.shape[1]:
            m.update(bias=b, out=add.output)
            m["_nodes"].append(add)
    return m


def _rw_linear(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    w: Value = m["w"]
    wt = m["w_nk"] if m["w_nk"] is not None else g.add_const(w.name + ".T", _transpose_view(w.data), unique=True)
    ins = [m["x"], wt] + ([m["bias"]] if m["bias"] is not None else [])
    return [(m["out"], new_node(g, "Linear", ins, "linear"))]


LINEAR = RaiseRule("linear", "MatMul", _match_linear, _rw_linear,
                   "MatMul(x, W[K,N]) (+ b) -> Linear(x, W^T[N,K], b); weights become [out, in] views")


def _match_lm_head(g: Graph, n: Node, u: Users) -> Match | str:
    if not any(n.output is o for o in g.outputs):
        return "not a graph output"
    if n.output.dtype.is_float is False:
        return "not float logits"
    return {"node": n, "_nodes": [n]}


def _rw_lm_head(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    n: Node = m["node"]
    w = n.inputs[1]
    assert w is not None
    # Tied embeddings: reuse the embedding table's value when the head reads the same storage.
    for e in g.nodes:
        if e.op == "Embedding" and e.inputs[0] is not None and _same_storage(e.inputs[0], w):
            w = e.inputs[0]
            g.metadata["tied_embeddings"] = True
            break
    out = g.add_node("LMHead", [n.inputs[0], w] + n.inputs[2:], {}, name="lm_head").output
    return [(n.output, out)]


def _same_storage(a: Value, b: Value) -> bool:
    if a is b:
        return True
    da, db = a.data, b.data
    if da is None or db is None or a.shape != b.shape:
        return False
    if isinstance(da, np.ndarray) and isinstance(db, np.ndarray):
        return np.shares_memory(da, db) or (da.ctypes.data == db.ctypes.data)
    if isinstance(da, torch.Tensor) and isinstance(db, torch.Tensor):
        return da.data_ptr() == db.data_ptr()
    return False


def _match_linear_reshape(g: Graph, n: Node, u: Users) -> Match | str:
    """Reshape(Linear(Reshape(x[..., K] -> [M, K]), W) -> [..., N]) -> Linear(x, W) (GPT-2's
    Conv1D / addmm exports flatten the tokens first)."""
    inner = prod(n.inputs[0], "Reshape")
    outer = u.only(n.output, "Reshape")
    if inner is None or outer is None:
        return "not wrapped in flattening reshapes"
    x = inner.inputs[0]
    assert x is not None
    xs, ys = x.shape, outer.output.shape
    if xs is None or ys is None or len(xs) != len(ys) or len(xs) < 3:
        return "reshapes do not restore the token dims"
    if tuple(xs[:-1]) != tuple(ys[:-1]) or any(isinstance(d, str) and "?" in d for d in xs):
        return "outer reshape does not restore the input's leading dims"
    return {"x": x, "node": n, "out": outer.output, "_nodes": [n, inner, outer]}


def _rw_linear_reshape(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    n: Node = m["node"]
    return [(m["out"], new_node(g, "Linear", [m["x"]] + n.inputs[1:], "linear"))]


LINEAR_RESHAPE = RaiseRule("linear_reshape", "Linear", _match_linear_reshape, _rw_linear_reshape,
                           "flatten -> Linear -> unflatten collapses into one Linear on [..., K]")


LM_HEAD = RaiseRule("lm_head", "Linear", _match_lm_head, _rw_lm_head,
                    "the Linear producing the logits -> LMHead (tied to the embedding when shared)")


# ---- RMSNorm / LayerNorm --------------------------------------------------------------------------

def _square_of(v: Value) -> Value | None:
    """x for Pow(x, 2) or Mul(x, x)."""
    n = prod(v)
    if n is None:
        return None
    if n.op == "Pow" and scalar(n.inputs[1]) == 2.0:
        return n.inputs[0]
    if n.op == "Mul" and n.inputs[0] is n.inputs[1]:
        return n.inputs[0]
    return None


def _match_rmsnorm(g: Graph, n: Node, u: Users) -> Match | str:
    x = _square_of(n.inputs[0])  # type: ignore[arg-type]
    if x is None:
        return "ReduceMean input is not x**2"
    if not last_axis(n, x.type.rank) or not n.attrs.get("keepdims", 1):
        return "not a keepdims mean over the last axis"
    nodes = [n, n.inputs[0].producer]  # type: ignore[union-attr]
    add = u.only(n.output, "Add")
    if add is None or scalar(other(add, n.output)) is None:
        return "mean is not followed by + eps"
    eps = scalar(other(add, n.output))
    sq = u.only(add.output, "Sqrt")
    if sq is None:
        return "no Sqrt after + eps"
    nodes += [add, sq]
    rec = u.only(sq.output, "Reciprocal")
    if rec is not None:
        mul = u.only(rec.output, "Mul")
        if mul is None or other(mul, rec.output) is not x:
            return "1/sqrt(...) is not multiplied by x"
        nodes += [rec, mul]
    else:
        mul = u.only(sq.output, "Div")
        if mul is not None and scalar(mul.inputs[0]) == 1.0:  # 1 / sqrt(...), then x * that
            inv = mul
            mul = u.only(inv.output, "Mul")
            if mul is None or other(mul, inv.output) is not x:
                return "1/sqrt(...) is not multiplied by x"
            nodes += [inv, mul]
        elif mul is None or mul.inputs[0] is not x:
            return "x is not divided by sqrt(...)"
        else:
            nodes.append(mul)
    y = mul.output
    cast_back = u.only(y, "Cast")
    if cast_back is not None:
        nodes.append(cast_back)
        y = cast_back.output
    x0 = strip(x) if cast_back is not None else x
    wmul = u.only(y, "Mul")
    w = other(wmul, y) if wmul is not None else None
    if wmul is None or w is None or w.data is None or w.shape is None or len(w.shape) != 1:
        # No weight (or an all-ones weight that canonicalization folded away): unit weight.
        if x0.shape is None or not isinstance(x0.shape[-1], int):
            return "unweighted norm over a non-static feature dim"
        return {"x": x0, "w": None, "eps": eps, "out": y, "_nodes": nodes}
    nodes.append(wmul)
    if x0.dtype != w.dtype:
        return "weight dtype differs from the input"
    return {"x": x0, "w": w, "eps": eps, "out": wmul.output, "_nodes": nodes}


def _rw_rmsnorm(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    w = m["w"]
    if w is None:
        x = m["x"]
        w = g.add_const("rmsnorm.ones", torch.ones(int(x.shape[-1]), dtype=x.dtype.torch), unique=True)
    return [(m["out"], new_node(g, "RMSNorm", [m["x"], w], "rmsnorm", eps=float(m["eps"])))]


RMSNORM = RaiseRule("rmsnorm", "ReduceMean", _match_rmsnorm, _rw_rmsnorm,
                    "x * 1/sqrt(mean(x^2) + eps) * w (and x / sqrt(...), casts) -> RMSNorm")


# ---- MLPs ---------------------------------------------------------------------------------------

def linear_sources(v: Value, limit: int = 24) -> list[Node]:
    """Linear nodes reached from v upward through elementwise nodes (activation candidates)."""
    out: list[Node] = []
    seen: set[int] = set()
    stack = [v]
    while stack and len(seen) < limit:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        p = x.producer
        if p is None:
            continue
        if p.op == "Linear":
            out.append(p)
        elif p.op in ELEMENTWISE:
            stack.extend(i for i in p.inputs if i is not None and i.data is None)
    return out


def _match_gated(g: Graph, n: Node, u: Users) -> Match | str:
    """Linear_down(act(Linear_gate(x)) * Linear_up(x)) -> GatedMLP."""
    if n.input(2) is not None:
        return "down projection has a bias"
    mul = prod(n.inputs[0], "Mul")
    if mul is None or u.only(mul.output) is not n:
        return "down projection input is not a product"
    for gate_side, up_side in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        up = prod(up_side, "Linear")
        if up is None or up.input(2) is not None:
            continue
        x = up.inputs[0]
        for cand in [c for c in linear_sources(gate_side) if c.inputs[0] is x and c is not up  # type: ignore[arg-type]
                     and c.input(2) is None]:
            try:
                act = elementwise_activation(g, cand.output, gate_side)  # type: ignore[arg-type]
            except ValueError:
                continue
            return {"x": x, "wg": cand.inputs[1], "wu": up.inputs[1], "wd": n.inputs[1], "act": act,
                    "out": n.output, "_nodes": [n, mul, up, cand]}
    return "no gate/up Linear pair feeding an activation product"


def _rw_gated(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    out = new_node(g, "GatedMLP", [m["x"], m["wg"], m["wu"], m["wd"]], "gated_mlp", activation=m["act"])
    return [(m["out"], out)]


GATED_MLP = RaiseRule("gated_mlp", "Linear", _match_gated, _rw_gated,
                      "down(act(gate(x)) * up(x)) -> GatedMLP (SwiGLU, GeGLU)")


def _match_mlp(g: Graph, n: Node, u: Users) -> Match | str:
    """Linear_down(act(Linear_up(x))) -> MLP (GPT-2, Phi-2 style)."""
    a = n.inputs[0]
    assert a is not None
    for up in linear_sources(a):
        if up is n:
            continue
        try:
            act = elementwise_activation(g, up.output, a)
        except ValueError:
            continue
        if act == "relu" and a is up.output:
            continue
        return {"x": up.inputs[0], "wu": up.inputs[1], "bu": up.input(2), "wd": n.inputs[1],
                "bd": n.input(2), "act": act, "out": n.output, "_nodes": [n, up]}
    return "input is not an activation of another Linear"


def _rw_mlp(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    out = new_node(g, "MLP", [m["x"], m["wu"], m["bu"], m["wd"], m["bd"]], "mlp", activation=m["act"])
    return [(m["out"], out)]


MLP = RaiseRule("mlp", "Linear", _match_mlp, _rw_mlp, "down(act(up(x))) -> MLP (GELU MLP)")


def _half_slice(v: Value) -> tuple[Value, int] | None:
    """(h, 0|1) when v is the first or second half of h along the last axis (Slice or Split)."""
    from .raise_attention import _slice_bounds

    n = v.producer
    if n is None:
        return None
    h = n.inputs[0]
    if h is None or not h.shape or not isinstance(h.shape[-1], int):
        return None
    f2 = h.shape[-1]
    if n.op == "Split" and len(n.outputs) == 2 and n.attrs.get("split") == [f2 // 2, f2 // 2] \
            and n.attrs.get("axis", 0) % len(h.shape) == len(h.shape) - 1:
        return h, n.outputs.index(v)
    b = _slice_bounds(n) if n.op == "Slice" else None
    if b is None or b[2] % len(h.shape) != len(h.shape) - 1:
        return None
    if b[0] == 0 and b[1] == f2 // 2:
        return h, 0
    if b[0] == f2 // 2 and b[1] >= f2:
        return h, 1
    return None


def _match_gated_fused(g: Graph, n: Node, u: Users) -> Match | str:
    """down(act(h[..., :F]) * h[..., F:]) with h = Linear(x, W_gate_up) -> GatedMLP (Phi-3)."""
    if n.input(2) is not None:
        return "down projection has a bias"
    mul = prod(n.inputs[0], "Mul")
    if mul is None:
        return "down projection input is not a product"
    for gate_side, up_side in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        up = _half_slice(up_side)  # type: ignore[arg-type]
        if up is None or up[1] != 1:
            continue
        h = up[0]
        lin = prod(h, "Linear")
        if lin is None or lin.input(2) is not None:
            continue
        gate_src = next((o for o in _slice_users(g, h) if _half_slice(o) == (h, 0)), None)
        if gate_src is None:
            continue
        try:
            act = elementwise_activation(g, gate_src, gate_side)  # type: ignore[arg-type]
        except ValueError as e:
            return str(e)
        w = lin.inputs[1]
        assert w is not None and w.shape is not None
        f = int(w.shape[0]) // 2
        return {"x": lin.inputs[0], "w": w, "f": f, "act": act, "wd": n.inputs[1], "out": n.output,
                "_nodes": [n, mul, lin]}
    return "no fused gate/up projection"


def _slice_users(g: Graph, h: Value) -> list[Value]:
    return [o for nd in g.nodes if nd.op in ("Slice", "Split") and nd.inputs[0] is h for o in nd.outputs]


def _rw_gated_fused(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    w: Value = m["w"]
    f = m["f"]
    wg = g.add_const(w.name + ".gate", w.data[:f], unique=True)  # views: no copy
    wu = g.add_const(w.name + ".up", w.data[f:], unique=True)
    out = new_node(g, "GatedMLP", [m["x"], wg, wu, m["wd"]], "gated_mlp", activation=m["act"])
    return [(m["out"], out)]


GATED_MLP_FUSED = RaiseRule("gated_mlp_fused", "Linear", _match_gated_fused, _rw_gated_fused,
                            "down(act(gate_up(x)[:F]) * gate_up(x)[F:]) -> GatedMLP (Phi-3)")


# ---- fused projections (GPT-2 c_attn, Phi-3 qkv_proj) ---------------------------------------------

def _match_split_linear(g: Graph, n: Node, u: Users) -> Match | str:
    """Split/Slice of a Linear's output along features -> one Linear per part (weight row views)."""
    lin = prod(n.inputs[0], "Linear")
    if lin is None:
        return "input is not a Linear"
    w = lin.inputs[1]
    assert w is not None and w.shape is not None
    rank = n.inputs[0].type.rank  # type: ignore[union-attr]
    users = u.of(lin.output)
    # Shape/Size users read only metadata (genai's GQA derives lengths from the packed QKV); the
    # fused Linear stays for them and dies once KV-cache synthesis drops those length computations.
    if any(x.op not in ("Split", "Slice", "Shape", "Size", "Positions") for x in users) or id(lin.output) in u.outputs:
        return "the Linear has users other than splits"
    if n.op == "Split":
        if rank is None or n.attrs.get("axis", 0) % rank != rank - 1:
            return "split is not along the feature axis"
        bounds, start = [], 0
        for size in n.attrs["split"]:
            bounds.append((start, start + int(size)))
            start += int(size)
        return {"lin": lin, "parts": list(zip(n.outputs, bounds, strict=False)), "_nodes": [n]}
    from .raise_attention import _slice_bounds

    b = _slice_bounds(n)
    if b is None or rank is None or b[2] % rank != rank - 1:
        return "slice is not a constant range along the feature axis"
    n_out = int(w.shape[0])
    return {"lin": lin, "parts": [(n.output, (b[0], min(b[1], n_out)))], "_nodes": [n]}


def _rw_split_linear(g: Graph, m: Match) -> list[tuple[Value, Value]]:
    lin: Node = m["lin"]
    w, bias = lin.inputs[1], lin.input(2)
    assert w is not None
    out = []
    for v, (lo, hi) in m["parts"]:
        wv = g.add_const(f"{w.name}.rows{lo}_{hi}", w.data[lo:hi], unique=True)  # a view, no copy
        ins = [lin.inputs[0], wv]
        if bias is not None:
            ins.append(g.add_const(f"{bias.name}.rows{lo}_{hi}", bias.data[lo:hi], unique=True))
        out.append((v, new_node(g, "Linear", ins, "linear")))
    return out


SPLIT_LINEAR = RaiseRule("split_linear", "Split", _match_split_linear, _rw_split_linear,
                         "Split(Linear(x, W)) -> Linear(x, W[rows]) per part (fused QKV)")
SLICE_LINEAR = RaiseRule("slice_linear", "Slice", _match_split_linear, _rw_split_linear,
                         "Slice(Linear(x, W), a:b) -> Linear(x, W[a:b]) (fused QKV)")
