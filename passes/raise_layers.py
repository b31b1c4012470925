"""Raising rules for embeddings, linear layers, norms and MLPs."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zlc.ir import Graph, Node, Value

from . import probe
from .base import weight_rows
from .match import ELEMENTWISE, const2d, elementwise_activation, last_axis, other, prod, slice_bounds, strip
from .pattern import OpPattern
from .raise_attention import positions_value
from .raising import new_node
from .rewrite import Match, P, Rule

Pairs = list[tuple[Value, Value]]


def _transpose_view(data: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """A [K, N] weight seen as [N, K] without copying (a strided view)."""
    return data.T


# ---- Embedding ----------------------------------------------------------------------------------

def _check_embedding(m: Match) -> str | None:
    if const2d(m["w"]) is None:
        return "table is not a constant matrix"
    if m["ids"].dtype.is_float:
        return "indices are not integers"
    return None


def _rw_embedding(m: Match, g: Graph) -> Pairs:
    ids = m["ids"]
    if ids.kind != "input" and _is_arange(g, ids):
        # Learned absolute positions (GPT-2's wpe): index by Positions, which KV-cache synthesis
        # shifts by past_len; arange(T) would restart at 0 on every decode step.
        pos = positions_value(g, ids)
        if not isinstance(pos, str):
            ids = pos
    return [(m.root.output, new_node(g, "Embedding", [m["w"], ids], "embedding"))]


def _is_arange(g: Graph, v: Value) -> bool:
    """v depends on positions only and evaluates to [0..T) (possibly with leading 1-dims)."""
    if probe.is_position_only(g, [v], allowed=()) is not None:
        return False
    for pr in (probe.Probe(0, 1), probe.Probe(0, 6)):
        got = probe.try_evaluate(g, [v], pr)
        if isinstance(got, str) or got[0].numel() != pr.seq:
            return False
        if not torch.equal(got[0].reshape(-1).long(), torch.arange(pr.seq)):
            return False
    return True


EMBEDDING = Rule(
    "embedding",
    P.op("Gather", P.const("w", why="table is not a constant matrix"), P.var("ids"),
         attrs={"axis": lambda a: (0 if a is None else a) == 0}, why="gather axis is not 0"),
    _check_embedding, _rw_embedding, doc="Gather(W[V,H], ids) -> Embedding")


# ---- Linear -------------------------------------------------------------------------------------

def _check_linear(m: Match) -> str | None:
    n = m.root
    w = n.inputs[1]
    assert w is not None
    w_nk = m.get("w_nk")  # the weight already in [out, in] layout: MatMul(x, Transpose(W[N,K]))
    if const2d(w_nk if w_nk is not None else w) is None:
        return "right operand is not a constant matrix"
    if m["x"].dtype != w.dtype:
        return "activation and weight dtypes differ"
    m.bind("out", n.output)
    add = m.sole_user(n.output, "Add")
    if add is not None:  # a bias folds in when it is a vector over the output features
        b = other(add, n.output)
        if b is not None and b.data is not None and b.shape is not None and len(b.shape) == 1 \
                and w.shape is not None and b.shape[0] == w.shape[1]:
            m.bind("bias", b)
            m.bind("out", add.output)
            m.cover(add)
    return None


def _rw_linear(m: Match, g: Graph) -> Pairs:
    w = m.root.inputs[1]
    assert w is not None
    w_nk = m.get("w_nk")
    wt = w_nk if w_nk is not None else g.add_const(w.name + ".T", _transpose_view(w.data), unique=True)
    bias = m.get("bias")
    ins = [m["x"], wt] + ([bias] if bias is not None else [])
    return [(m["out"], new_node(g, "Linear", ins, "linear"))]


LINEAR = Rule(
    "linear",
    # Tied LM heads read the embedding table transposed; too large to fold, free to view.
    P.op("MatMul", P.var("x"),
         P.or_(P.op("Transpose", P.const("w_nk"), attrs={"perm": lambda p: p == [1, 0]}, keep=True), P.const(),
               why="right operand is not a constant matrix")),
    _check_linear, _rw_linear,
    doc="MatMul(x, W[K,N]) (+ b) -> Linear(x, W^T[N,K], b); weights become [out, in] views")


_FLATTENED = "not wrapped in flattening reshapes"


def _check_linear_reshape(m: Match) -> str | None:
    xs, ys = m["x"].shape, m["y2"].shape
    if xs is None or ys is None or len(xs) != len(ys) or len(xs) < 3:
        return "reshapes do not restore the token dims"
    if tuple(xs[:-1]) != tuple(ys[:-1]) or any(isinstance(d, str) and "?" in d for d in xs):
        return "outer reshape does not restore the input's leading dims"
    return None


# Reshape(Linear(Reshape(x[..., K] -> [M, K]), W) -> [..., N]) -> Linear(x, W) (GPT-2's Conv1D /
# addmm exports flatten the tokens first).
LINEAR_RESHAPE = Rule(
    "linear_reshape",
    P.op("Linear", P.op("Reshape", P.var("x"), P.any(), why=_FLATTENED), rest=True, out="y",
         then=P.op("Reshape", P.var("y"), P.any(), out="y2", why=_FLATTENED)),
    _check_linear_reshape,
    lambda m, g: [(m["y2"], new_node(g, "Linear", [m["x"]] + m.root.inputs[1:], "linear"))],
    doc="flatten -> Linear -> unflatten collapses into one Linear on [..., K]")


def _check_lm_head(m: Match) -> str | None:
    out = m.root.output
    if not any(out is o for o in m.graph.outputs):
        return "not a graph output"
    if out.dtype.is_float is False:
        return "not float logits"
    return None


def _rw_lm_head(m: Match, g: Graph) -> Pairs:
    return [(m.root.output, _lm_head(g, m.root, {}))]


def _lm_head(g: Graph, n: Node, attrs: dict[str, Any]) -> Value:
    """LMHead on Linear `n`'s input and weights (tied to the embedding when it reads its storage)."""
    w = n.inputs[1]
    assert w is not None
    # Tied embeddings: reuse the embedding table's value when the head reads the same storage.
    for e in g.nodes:
        if e.op == "Embedding" and e.inputs[0] is not None and _same_storage(e.inputs[0], w):
            w = e.inputs[0]
            g.metadata["tied_embeddings"] = True
            break
    return g.add_node("LMHead", [n.inputs[0], w] + n.inputs[2:], attrs, name="lm_head").output


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


LM_HEAD = Rule("lm_head", P.op("Linear", P.var("x"), rest=True), _check_lm_head, _rw_lm_head,
               doc="the Linear producing the logits -> LMHead (tied to the embedding when shared)")


def _check_lm_head_softcap(m: Match) -> str | None:
    """c * tanh(Linear(x) / c) on the logits (Gemma 2's final-logit soft-capping); the division may
    be written as a product by 1 / c."""
    if not m.is_output(m.root.output):
        return "not a graph output"
    c, k = m.scalar("c"), m.scalar("k")
    inner = k if m.node("div").op == "Mul" else 1.0 / k if k else 0.0
    if c <= 0 or abs(inner * c - 1.0) > 1e-6:
        return f"not c * tanh(x / c) (cap {c}, inner factor {inner})"
    if m.n_uses(m["y"]) != 1:
        return "the logits before the cap have other uses"
    return None


# c * tanh(Linear(x) / c) as the graph output -> LMHead(softcap=c)
LM_HEAD_SOFTCAP = Rule(
    "lm_head_softcap",
    P.op("Mul", P.op("Tanh", P.op(("Div", "Mul"), P.op("Linear", P.var("x"), rest=True, out="y"),
                                  P.scalar("k", why="not scaled by a one-element constant"), name="div",
                                  commutative=False, why="tanh input is not the logits scaled"),
                     why="not a product with a tanh"),
         P.scalar("c", why="not times a one-element constant")),
    _check_lm_head_softcap,
    lambda m, g: [(m.root.output, _lm_head(g, m["y"].producer, {"softcap": m.scalar("c")}))],  # type: ignore[arg-type]
    doc="c * tanh(Linear(x) / c) producing the logits -> LMHead(softcap=c) (Gemma 2)")


# ---- RMSNorm --------------------------------------------------------------------------------------

_NOT_TIMES_X = "1/sqrt(...) is not multiplied by x"


def _times_x(inv: str) -> OpPattern:
    return P.op("Mul", P.var(inv), P.var("x", why=_NOT_TIMES_X), out="y", why=_NOT_TIMES_X)


def _mean_over_last_axis(m: Match) -> str | None:
    n = m.root
    if not last_axis(n, m["x"].type.rank) or not n.attrs.get("keepdims", 1):
        return "not a keepdims mean over the last axis"
    return None


def _check_rmsnorm(m: Match) -> str | None:
    """The tail after x * 1/sqrt(...): an optional cast back, then an optional 1-D weight."""
    x, y = m["x"], m["y"]
    cast_back = m.sole_user(y, "Cast")
    if cast_back is not None:
        m.cover(cast_back)
        y = cast_back.output
    x0 = strip(x) if cast_back is not None else x
    m.bind("src", x0)
    wmul = m.sole_user(y, "Mul")
    w = other(wmul, y) if wmul is not None else None
    if wmul is None or w is None or w.data is None or w.shape is None or len(w.shape) != 1:
        # No weight (or an all-ones weight that canonicalization folded away): unit weight.
        if x0.shape is None or not isinstance(x0.shape[-1], int):
            return "unweighted norm over a non-static feature dim"
        m.bind("out", y)
        return None
    m.cover(wmul)
    if x0.dtype != w.dtype:
        return "weight dtype differs from the input"
    m.bind("w", w)
    m.bind("out", wmul.output)
    return None


def _rw_rmsnorm(m: Match, g: Graph) -> Pairs:
    x, w = m["src"], m.get("w")
    if w is None:
        w = g.add_const("rmsnorm.ones", torch.ones(int(x.shape[-1]), dtype=x.dtype.torch), unique=True)  # type: ignore[index]
    return [(m["out"], new_node(g, "RMSNorm", [x, w], "rmsnorm", eps=m.scalar("eps")))]


RMSNORM = Rule(
    "rmsnorm",
    P.op("ReduceMean",
         P.or_(P.op("Pow", P.var("x"), P.scalar(value=2.0)), P.op("Mul", P.var("x"), P.var("x")),
               why="ReduceMean input is not x**2"),
         rest=True, out="mean", where=_mean_over_last_axis,
         then=P.op("Add", P.var("mean"), P.scalar("eps", why="mean is not followed by + eps"), out="mean_eps",
                   why="mean is not followed by + eps",
                   then=P.op("Sqrt", P.var("mean_eps"), out="rms", why="no Sqrt after + eps",
                             then=P.or_(P.op("Reciprocal", P.var("rms"), out="inv", then=_times_x("inv")),
                                        P.op("Div", P.scalar(value=1.0), P.var("rms"), out="inv",
                                             then=_times_x("inv")),
                                        P.op("Div", P.var("x"), P.var("rms"), out="y"),
                                        why="x is not divided by sqrt(...)")))),
    _check_rmsnorm, _rw_rmsnorm,
    doc="x * 1/sqrt(mean(x^2) + eps) * w (and x / sqrt(...), casts) -> RMSNorm")


def _check_rmsnorm_casts(m: Match) -> str | None:
    x, up = m["x"], m.node("up")
    if up.attrs.get("to") != "f32" or not x.dtype.is_float or x.dtype.value == "f32":
        return "not a half input upcast to f32"
    if m.root.attrs.get("to") != x.dtype.value:
        return "not cast back to the input's dtype"
    return None


RMSNORM_CASTS = Rule(
    "rmsnorm_casts",
    P.op("Cast", P.op("RMSNorm", P.op("Cast", P.var("x"), name="up", why="input is not a Cast"), P.var("w"),
                      name="norm", single_use=True, why="not a cast of an RMSNorm"),
         why="not a cast of an RMSNorm"),
    _check_rmsnorm_casts,
    lambda m, g: [(m.root.output, new_node(g, "RMSNorm", [m["x"], m["w"]], "rmsnorm",
                                           eps=m.node("norm").attrs.get("eps", 1e-6)))],
    why="not a cast of an RMSNorm",
    doc="Cast(RMSNorm(Cast(x, f32), w), x.dtype) -> RMSNorm(x, w): a half model's norm computed in "
        "f32 with its weight applied before the cast back (Gemma's (1 + w)); RMSNorm computes in f32")


# ---- MLPs ---------------------------------------------------------------------------------------

_BIAS = "down projection has a bias"
_NOT_PRODUCT = "down projection input is not a product"


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


def one_format(g: Graph, wg: Value, wu: Value) -> tuple[Value, Value]:
    """A gated pair's matrices stream under one descriptor format word: where gate and up are
    stored differently (two packed formats, or one dense: an ONNX model's MatMulNBits with per-node
    block sizes), both are read dense (their data is already the exact dequantization) and the
    graph's metadata["packed_dense"] says why (the compile report lists it)."""
    fg, fu = (None if w.quant is None else w.quant.format.name for w in (wg, wu))
    if fg != fu:
        why = f"a gated pair's gate is {fg or 'dense'} and its up {fu or 'dense'} (one format word holds both)"
        for w in (wg, wu):
            if w.quant is not None:
                w.quant = None
                g.metadata.setdefault("packed_dense", {})[w.name] = why
    return wg, wu


def _check_gated(m: Match) -> str | None:
    """The gate: another bias-free Linear of the same x whose output the activation chain reads."""
    up, x, gate = m.node("up"), m["x"], m["gate"]
    for cand in [c for c in linear_sources(gate) if c.inputs[0] is x and c is not up and c.input(2) is None]:
        try:
            act = elementwise_activation(m.graph, cand.output, gate)
        except ValueError:
            continue
        m.bind("wg", cand.inputs[1])  # type: ignore[arg-type]
        m.note("act", act)
        m.cover(cand)
        return None
    return "no gate/up Linear pair feeding an activation product"


GATED_MLP = Rule(
    "gated_mlp",
    P.op("Linear", P.op("Mul", P.var("gate"), P.op("Linear", P.var("x"), P.var("wu"), name="up"),
                        single_use=True, why=_NOT_PRODUCT),
         P.var("wd"), why=_BIAS),
    _check_gated,
    lambda m, g: [(m.root.output, new_node(g, "GatedMLP", [m["x"], *one_format(g, m["wg"], m["wu"]), m["wd"]],
                                           "gated_mlp", activation=m.fact("act")))],
    why="no gate/up Linear pair feeding an activation product",
    doc="down(act(gate(x)) * up(x)) -> GatedMLP (SwiGLU, GeGLU)")


def _check_mlp(m: Match) -> str | None:
    """Linear_down(act(Linear_up(x))): the up projection is found through the activation chain."""
    a = m["a"]
    for up in linear_sources(a):
        if up is m.root:
            continue
        try:
            act = elementwise_activation(m.graph, up.output, a)
        except ValueError:
            continue
        if act == "relu" and a is up.output:
            continue
        m.note("up", up)
        m.note("act", act)
        m.cover(up)
        return None
    return "input is not an activation of another Linear"


def _rw_mlp(m: Match, g: Graph) -> Pairs:
    up, n = m.fact("up"), m.root
    ins = [up.inputs[0], up.inputs[1], up.input(2), n.inputs[1], n.input(2)]
    return [(n.output, new_node(g, "MLP", ins, "mlp", activation=m.fact("act")))]


MLP = Rule("mlp", P.op("Linear", P.var("a"), P.var("wd"), rest=True), _check_mlp, _rw_mlp,
           doc="down(act(up(x))) -> MLP (GELU MLP)")


def half_slice(v: Value) -> tuple[Value, int] | None:
    """(h, 0|1) when v is the first or second half of h along the last axis (Slice or Split)."""
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
    b = slice_bounds(n) if n.op == "Slice" else None
    if b is None or b[2] % len(h.shape) != len(h.shape) - 1:
        return None
    if b[0] == 0 and b[1] == f2 // 2:
        return h, 0
    if b[0] == f2 // 2 and b[1] >= f2:
        return h, 1
    return None


def _slice_users(g: Graph, h: Value) -> list[Value]:
    return [o for nd in g.nodes if nd.op in ("Slice", "Split") and nd.inputs[0] is h for o in nd.outputs]


def _check_gated_fused(m: Match) -> str | None:
    """Which side of the product is the up half of a fused projection h = Linear(x, W_gate_up), and
    whether the other side is an activation of its gate half (its first reason ends the search)."""
    mul, g = m.node("mul"), m.graph
    for gate_side, up_side in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        assert gate_side is not None and up_side is not None
        up = half_slice(up_side)
        if up is None or up[1] != 1:
            continue
        h = up[0]
        lin = prod(h, "Linear")
        if lin is None or lin.input(2) is not None:
            continue
        gate_src = next((o for o in _slice_users(g, h) if half_slice(o) == (h, 0)), None)
        if gate_src is None:
            continue
        try:
            act = elementwise_activation(g, gate_src, gate_side)
        except ValueError as e:
            return str(e)
        m.note("lin", lin)
        m.note("act", act)
        m.cover(lin)
        return None
    return "no fused gate/up projection"


def _rw_gated_fused(m: Match, g: Graph) -> Pairs:
    lin: Node = m.fact("lin")
    w = lin.inputs[1]
    assert w is not None and w.shape is not None
    f = int(w.shape[0]) // 2
    wg, wu = weight_rows(g, w.name + ".gate", w, slice(0, f)), weight_rows(g, w.name + ".up", w, slice(f, None))
    out = new_node(g, "GatedMLP", [lin.inputs[0], wg, wu, m["wd"]], "gated_mlp", activation=m.fact("act"))
    return [(m.root.output, out)]


GATED_MLP_FUSED = Rule(
    "gated_mlp_fused",
    P.op("Linear", P.op("Mul", P.any(), P.any(), name="mul", commutative=False, why=_NOT_PRODUCT),
         P.var("wd"), why=_BIAS),
    _check_gated_fused, _rw_gated_fused,
    doc="down(act(gate_up(x)[:F]) * gate_up(x)[F:]) -> GatedMLP (Phi-3)")


# ---- fused projections (GPT-2 c_attn, Phi-3 qkv_proj) ---------------------------------------------

def _check_split_linear(m: Match) -> str | None:
    """Split/Slice of a Linear's output along features -> one Linear per part (weight row views)."""
    n, lin = m.root, m.node("lin")
    w = lin.inputs[1]
    assert w is not None and w.shape is not None
    rank = lin.output.type.rank
    # Shape/Size users read only metadata (genai's GQA derives lengths from the packed QKV); the
    # fused Linear stays for them and dies once KV-cache synthesis drops those length computations.
    if any(x.op not in ("Split", "Slice", "Shape", "Size", "Positions") for x in m.users(lin.output)) \
            or m.is_output(lin.output):
        return "the Linear has users other than splits"
    if n.op == "Split":
        if rank is None or n.attrs.get("axis", 0) % rank != rank - 1:
            return "split is not along the feature axis"
        bounds, start = [], 0
        for size in n.attrs["split"]:
            bounds.append((start, start + int(size)))
            start += int(size)
        m.note("parts", list(zip(n.outputs, bounds, strict=False)))
        return None
    b = slice_bounds(n)
    if b is None or rank is None or b[2] % rank != rank - 1:
        return "slice is not a constant range along the feature axis"
    m.note("parts", [(n.output, (b[0], min(b[1], int(w.shape[0]))))])
    return None


def _rw_split_linear(m: Match, g: Graph) -> Pairs:
    lin = m.node("lin")
    w, bias = lin.inputs[1], lin.input(2)
    assert w is not None
    out = []
    for v, (lo, hi) in m.fact("parts"):
        wv = weight_rows(g, f"{w.name}.rows{lo}_{hi}", w, slice(lo, hi))
        ins = [lin.inputs[0], wv]
        if bias is not None:
            ins.append(g.add_const(f"{bias.name}.rows{lo}_{hi}", bias.data[lo:hi], unique=True))
        out.append((v, new_node(g, "Linear", ins, "linear")))
    return out


def _split_of_linear(op: str) -> OpPattern:
    # the Linear is context: each of its splits is its own match in the same sweep
    return P.op(op, P.op("Linear", P.any(), P.any(), rest=True, name="lin", keep=True,
                         why="input is not a Linear"), rest=True)


SPLIT_LINEAR = Rule("split_linear", _split_of_linear("Split"), _check_split_linear, _rw_split_linear,
                    doc="Split(Linear(x, W)) -> Linear(x, W[rows]) per part (fused QKV)")
SLICE_LINEAR = Rule("slice_linear", _split_of_linear("Slice"), _check_split_linear, _rw_split_linear,
                    doc="Slice(Linear(x, W), a:b) -> Linear(x, W[a:b]) (fused QKV)")
