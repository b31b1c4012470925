"""`raise-blocks`: block layouts of the GPT-NeoX lineage, in the form the megakernel runs.

- A QKV projection laid out per head (GPT-NeoX's ``query_key_value``: for each head h the rows
  ``[q_h, k_h, v_h]``) or per group of heads (CodeGen's mp_num groups, ``[q_g, v_g, k_g]``) split
  after the heads: one Linear per part, its weight rows gathered head (group) by head, each split
  into heads on its own (what GPT-2's and Phi-3's fused projections already are).
- Heads picked out of a fused projection by data movement (Falcon's ``query_key_value``: a Reshape
  to [B, T, G, D], then Slice / GatherND / Expand / Transpose per part, or since transformers 5.25
  one Split of the heads axis; K and V possibly broadcast to every query head): the rows each head
  reads are found by probing the movement chain with column indices (`heads_gather`), and become
  one Linear per part, split into heads; heads that repeat a KV group become the explicit repeat
  that attention's GQA rule strips.
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
import torch

from zlc.errors import ZlcError
from zlc.ir import Graph, Node, Value
from zlc.reference.evaluate import evaluate as run_nodes
from zlc.reference.kernels import const_tensor

from . import probe
from .base import weight_rows
from .raise_attention import unrepeat_kv
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
    if heads.op == "Reshape":
        m.note("regroup", [_regroup(m, v, h, size) for v, size in zip(split.outputs, sizes, strict=True)])
    return None


def _regroup(m: Match, v: Value, groups: int, size: int) -> Node | None:
    """The sole user of a group's part [B, T, G, size] when it is a Reshape to [B, T, G * k, size / k]
    (CodeGen with more heads than mp_num groups: each group's part is k consecutive heads); covered
    by the match, so that the part's Linear is reshaped to the heads at once."""
    user = m.sole_user(v, "Reshape")
    if user is None:
        return None
    r, xs = user.output.shape, v.shape
    if r is None or xs is None or len(r) != 4 or tuple(r[:2]) != tuple(xs[:2]) \
            or not all(isinstance(d, int) for d in (r[2], r[3])):
        return None
    heads, dim = int(r[2]), int(r[3])  # type: ignore[arg-type]
    if heads % groups or heads * dim != groups * size or heads == groups:
        return None
    m.cover(user)
    return user


def _rw_heads_qkv(m: Match, g: Graph) -> Pairs:
    lin = m.node("lin")
    w, bias = lin.inputs[1], lin.input(2)
    assert w is not None
    h, width, sizes = m.fact("layout")
    out, lo = [], 0
    regroup = m.fact("regroup") if m.node("heads").op == "Reshape" else None
    for i, (v, size) in enumerate(zip(m.root.outputs, sizes, strict=True)):
        rows = np.concatenate([np.arange(j * width + lo, j * width + lo + size) for j in range(h)])
        ins = [lin.inputs[0], weight_rows(g, f"{w.name}.heads{lo}_{lo + size}", w, rows)]
        if bias is not None:
            ins.append(g.add_const(f"{bias.name}.heads{lo}_{lo + size}", np.asarray(bias.data)[rows], unique=True))
        part = new_node(g, "Linear", ins, "linear")
        if m.node("heads").op == "SplitHeads":
            out.append((v, new_node(g, "SplitHeads", [part], "split_heads", heads=h)))
        else:  # the part's own [B, T, G, size] reshape, which raise-heads reads as heads
            b = int(v.shape[0])  # type: ignore[index, arg-type]
            shape = g.add_const("shape", np.array([b, -1, h, size], dtype=np.int64), unique=True)
            out.append((v, new_node(g, "Reshape", [part, shape], "reshape")))
            user = regroup[i] if regroup is not None else None
            if user is not None:  # G groups of k heads each: straight to [B, T, G * k, size / k]
                heads, dim = user.output.shape[2:]
                shape = g.add_const("shape", np.array([b, -1, heads, dim], dtype=np.int64), unique=True)
                out.append((user.output, new_node(g, "Reshape", [part, shape], "reshape")))
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


# ---- heads gathered from a fused projection -------------------------------------------------------

_MOVES = frozenset({"Reshape", "Slice", "Split", "Transpose", "GatherND", "Gather", "Expand", "Squeeze", "Unsqueeze"})
_NOT_GATHER = "not heads moved out of a Linear by Reshape/Slice/Split/GatherND/Expand/Transpose"
_PROBE_T = 3


def _moved_from(g: Graph, v: Value) -> tuple[Node, bool] | None:
    """The Linear whose output the data movement ending in `v` reads (shapes and indices computed
    from positions only), and whether the chain does more than Reshape + Transpose (what
    split_heads already covers)."""
    more, n = False, v.producer
    while n is not None and n.op in _MOVES:
        args = [x for x in n.inputs[1:] if x is not None and x.data is None]
        if args and probe.is_position_only(g, args):
            return None
        more = more or n.op not in ("Reshape", "Transpose")
        src = n.inputs[0]
        n = src.producer if src is not None else None
    if n is None or n.op != "Linear" or not more:
        return None
    return n, more


def _columns(g: Graph, lin: Node, out: Value) -> torch.Tensor | str:
    """[H, D] projection columns of the heads `out` [1, H, T, D] holds, by running the movement chain
    on column indices (t * N + n at token t, column n); or why not."""
    y = lin.output
    n_cols = int(y.shape[-1])  # type: ignore[index, arg-type]
    nodes = probe.closure(g, [out])
    by_value, by_shape = probe.value_inputs(g, [out])
    env: dict[int, torch.Tensor] = {}
    feeds = probe.probe_feeds(g, by_value | by_shape, probe.Probe(0, _PROBE_T))
    for v in g.inputs:
        if v.name in feeds:
            env[id(v)] = feeds[v.name]
    ids = (torch.arange(_PROBE_T)[:, None] * n_cols + torch.arange(n_cols)[None, :]).float()[None]
    try:
        for n in nodes:
            if n is lin:
                env[id(y)] = ids
            else:
                run_nodes([n], env, fetch=const_tensor)
    except (ZlcError, ValueError, RuntimeError, IndexError, KeyError) as e:
        return f"probe failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    got = env[id(out)]
    if got.dim() != 4 or got.shape[0] != 1 or got.shape[2] != _PROBE_T:
        return f"moved heads have shape {tuple(got.shape)}, not [1, H, T, D]"
    tok = torch.arange(_PROBE_T, dtype=got.dtype)[None, None, :, None] * n_cols
    cols = got - tok
    if not torch.equal(cols, cols[:, :, :1].expand_as(cols)):
        return "the moved heads mix tokens"
    return cols[0, :, 0].long()


def _check_heads_gather(m: Match) -> str | None:
    out, g = m.root.output, m.graph
    if out.shape is None or len(out.shape) != 4 or not all(isinstance(d, int) for d in (out.shape[1], out.shape[3])):
        return _NOT_GATHER
    found = _moved_from(g, out)
    if found is None:
        return _NOT_GATHER
    lin = found[0]
    w = lin.inputs[1]
    if w is None or w.data is None or lin.output.shape is None or len(lin.output.shape) != 3 \
            or not isinstance(lin.output.shape[-1], int):
        return "the fused projection's weight is not a constant [N, K]"
    cols = _columns(g, lin, out)
    if isinstance(cols, str):
        return cols
    heads = int(cols.shape[0])
    uniq = [i for i in range(heads) if not any(torch.equal(cols[i], cols[j]) for j in range(i))]
    n_rep = heads // len(uniq)
    if len(uniq) * n_rep != heads or any(not torch.equal(cols[h], cols[uniq[h // n_rep]]) for h in range(heads)):
        return "repeated heads are not consecutive copies of KV groups"
    m.note("lin", lin)
    m.note("cols", cols[uniq])
    m.note("rep", n_rep)
    return None


def repeat_kv(g: Graph, k0: Value, rep: int) -> Value:
    """k0 [B, Hkv, T, D] with each head repeated `rep` times, as the repeat attention_gqa strips:
    Reshape(Expand(Unsqueeze(k0, [2]), [B, Hkv, rep, T, D]), [B, Hkv * rep, T, D])."""
    b, hkv, _, d = (int(x) if isinstance(x, int) else -1 for x in k0.shape)  # type: ignore[union-attr]
    un = new_node(g, "Unsqueeze", [k0], "unsqueeze", axes=[2])
    t = new_node(g, "Shape", [k0], "shape", start=2, end=3)
    lead = g.add_const("shape", np.array([b, hkv, rep], dtype=np.int64), unique=True)
    tail = g.add_const("shape", np.array([d], dtype=np.int64), unique=True)
    ex = new_node(g, "Expand", [un, new_node(g, "Concat", [lead, t, tail], "concat", axis=0)], "expand")
    shape = g.add_const("shape", np.array([b, hkv * rep, -1, d], dtype=np.int64), unique=True)
    return new_node(g, "Reshape", [ex, shape], "repeat_kv")


def _check_rope_of_repeat(m: Match) -> str | None:
    x = m["x"]
    k0 = unrepeat_kv(x)
    if k0 is x or k0.shape is None or x.shape is None:
        return "not RoPE of repeated KV heads"
    m.bind("k0", k0)
    m.note("rep", int(x.shape[1]) // int(k0.shape[1]))  # type: ignore[arg-type]
    return None


def _rw_rope_of_repeat(m: Match, g: Graph) -> Pairs:
    n = m.root
    r = g.add_node("RoPE", [m["k0"], *n.inputs[1:]], dict(n.attrs), name="rope").output
    return [(n.output, repeat_kv(g, r, m.fact("rep")))]


# RoPE(repeat(k0)) -> repeat(RoPE(k0)): rotating every copy is rotating the KV heads once
ROPE_OF_REPEAT = Rule(
    "rope_of_repeat", P.op("RoPE", P.var("x"), rest=True), _check_rope_of_repeat, _rw_rope_of_repeat,
    doc="RoPE of repeated KV heads -> repeated RoPE of the KV heads (attention_gqa strips the repeat)")


def _rw_heads_gather(m: Match, g: Graph) -> Pairs:
    lin, cols, rep = m.fact("lin"), m.fact("cols"), m.fact("rep")
    w, bias = lin.inputs[1], lin.input(2)
    rows = cols.reshape(-1).numpy()
    tag = f"rows{int(rows[0])}_{len(rows)}"
    ins = [lin.inputs[0], weight_rows(g, f"{w.name}.{tag}", w, rows)]
    if bias is not None:
        ins.append(g.add_const(f"{bias.name}.{tag}", np.asarray(bias.data)[rows], unique=True))
    hkv = int(cols.shape[0])
    out = new_node(g, "SplitHeads", [new_node(g, "Linear", ins, "linear")], "split_heads", heads=hkv)
    if rep > 1:
        out = repeat_kv(g, out, rep)
    return [(m.root.output, out)]


HEADS_GATHER = Rule(
    "heads_gather", P.op("Transpose", P.any(), rest=True), _check_heads_gather, _rw_heads_gather, why=_NOT_GATHER,
    doc="[B, H, T, D] heads moved out of Linear(x) by Slice/Split/GatherND/Expand -> SplitHeads(Linear(x, their rows))")
