"""`raise-blocks`: block layouts of the GPT-NeoX lineage, in the form the megakernel runs.

- A QKV projection laid out per head (GPT-NeoX's ``query_key_value``: for each head h the rows
  ``[q_h, k_h, v_h]``) or per group of heads (CodeGen's mp_num groups, ``[q_g, v_g, k_g]``) split
  after the heads: one Linear per part, its weight rows gathered head (group) by head, each split
  into heads on its own (what GPT-2's and Phi-3's fused projections already are).
- A parallel attention + MLP block's 3-way residual sum, re-associated so that each of its two Adds
  is one projection's epilogue.

GPT-J, CodeGen, GPT-NeoX, Phi-2 and Cohere compute ``x + attn_out + mlp_out`` (in some operand
order, e.g. Phi-2's ``(attn + mlp) + x``). The megakernel fuses ``Add(r, proj)`` into ``proj``'s
epilogue when ``r`` is already computed, so the sum becomes ``(x + first) + second``, ``first``
being the projection the graph computes first. Floating-point addition is not associative, so the
result may differ from the export in the last bits (the verifier's tolerance covers that).
"""

from __future__ import annotations

import numpy as np

from zlc.ir import Graph, Node, Value

from .raising import new_node
from .rewrite import Match, P, Rule

Pairs = list[tuple[Value, Value]]

_NOT_PER_HEAD = "not Split(SplitHeads(Linear)) or Split(Reshape(Linear, [B, T, G, W])) along the head features"


def _groups(heads: Node, lin: Node) -> int | None:
    """How many head groups `heads` splits the projection into: SplitHeads' heads, or G of a
    Reshape [B, T, N] -> [B, T, G, W] (CodeGen's mp_num groups)."""
    if heads.op == "SplitHeads":
        return int(heads.attrs["heads"])
    xs, rs = lin.output.shape, heads.output.shape
    if xs is None or rs is None or len(xs) != 3 or len(rs) != 4 or tuple(rs[:2]) != tuple(xs[:2]) \
            or not all(isinstance(d, int) for d in (rs[0], rs[2], rs[3])):
        return None
    return int(rs[2])  # type: ignore[arg-type]


def _check_heads_qkv(m: Match) -> str | None:
    split, heads, lin = m.root, m.node("heads"), m.node("lin")
    w = lin.inputs[1]
    if w is None or w.data is None or w.shape is None or len(w.shape) != 2:
        return "the fused projection's weight is not a constant [N, K]"
    if m.n_uses(heads.output) != 1 or m.n_uses(lin.output) != 1:
        return "the fused projection or its heads have other users"
    if split.attrs.get("axis", 0) % 4 != 3 or "split" not in split.attrs:
        return _NOT_PER_HEAD
    h, n = _groups(heads, lin), int(w.shape[0])
    sizes = [int(s) for s in split.attrs["split"]]
    if h is None or n % h or sum(sizes) != n // h:
        return _NOT_PER_HEAD
    m.note("layout", (h, n // h, sizes))
    return None


def _rw_heads_qkv(m: Match, g: Graph) -> Pairs:
    lin = m.node("lin")
    w, bias = lin.inputs[1], lin.input(2)
    assert w is not None
    h, width, sizes = m.fact("layout")
    out, lo = [], 0
    for v, size in zip(m.root.outputs, sizes, strict=True):
        rows = np.concatenate([np.arange(i * width + lo, i * width + lo + size) for i in range(h)])
        ins = [lin.inputs[0], g.add_const(f"{w.name}.heads{lo}_{lo + size}", np.asarray(w.data)[rows], unique=True)]
        if bias is not None:
            ins.append(g.add_const(f"{bias.name}.heads{lo}_{lo + size}", np.asarray(bias.data)[rows], unique=True))
        part = new_node(g, "Linear", ins, "linear")
        if m.node("heads").op == "SplitHeads":
            out.append((v, new_node(g, "SplitHeads", [part], "split_heads", heads=h)))
        else:  # the part's own [B, T, G, size] reshape, which raise-heads reads as heads
            b = int(v.shape[0])  # type: ignore[index, arg-type]
            shape = g.add_const("shape", np.array([b, -1, h, size], dtype=np.int64), unique=True)
            out.append((v, new_node(g, "Reshape", [part, shape], "reshape")))
        lo += size
    return out


HEADS_QKV = Rule(
    "heads_qkv",
    P.op("Split", P.op(("SplitHeads", "Reshape"),
                       P.op("Linear", P.any(), P.any(), rest=True, name="lin", why=_NOT_PER_HEAD),
                       rest=True, name="heads", why=_NOT_PER_HEAD), rest=True),
    _check_heads_qkv, _rw_heads_qkv, why=_NOT_PER_HEAD,
    doc="Split(SplitHeads(Linear(x)), head features) -> SplitHeads(Linear(x, rows of part i of every head))")


#: Ops whose output row a projection epilogue writes (and can add a residual row to).
PROJECTIONS = frozenset({"Linear", "MLP", "GatedMLP"})
_NOT_PARALLEL = "not a sum of two projections and a residual"


def _projection(m: Match, v: Value) -> Node | None:
    n = v.producer
    return n if n is not None and n.op in PROJECTIONS and m.n_uses(v) == 1 else None


def _check(m: Match) -> str | None:
    inner, outer = m.node("inner"), m.root
    if m.n_uses(inner.output) != 1:
        return "the inner sum has other uses"
    terms = [m["a"], m["b"], m["c"]]
    if any(t.shape is None or t.shape != outer.output.shape for t in terms):
        return "the terms do not all have the sum's shape (a broadcast)"
    order = {id(n): i for i, n in enumerate(m.graph.nodes)}
    projs = [t for t in terms if _projection(m, t) is not None]
    if len(projs) < 2:
        return _NOT_PARALLEL
    first, second = sorted(projs, key=lambda t: order[id(t.producer)])[:2]
    rest = [t for t in terms if t is not first and t is not second]
    (x,) = rest
    if inner.inputs[1] is first and inner.inputs[0] is x and outer.inputs[1] is second:
        return "already (x + first) + second"
    m.bind("x", x)
    m.bind("first", first)
    m.bind("second", second)
    return None


def _rewrite(m: Match, g: Graph) -> Pairs:
    s = new_node(g, "Add", [m["x"], m["first"]], m.node("inner").name)
    return [(m.root.output, new_node(g, "Add", [s, m["second"]], m.root.name))]


PARALLEL_RESIDUAL = Rule(
    "parallel_residual",
    P.op("Add", P.op("Add", P.var("a"), P.var("b"), name="inner", why=_NOT_PARALLEL), P.var("c")),
    _check, _rewrite, why=_NOT_PARALLEL,
    doc="a + b + c with two projections among them -> (x + first projection) + second projection")
