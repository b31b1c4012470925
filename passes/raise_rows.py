"""Raising rules that put raised layers in the form the megakernel runs: constant scales folded into
the projection before them, and token rows the export flattened put back into [1, T, H].

- `linear_scale` / `linear_divide`: `P(x) * c` or `P(x) / c` (c a one-element constant, the
  projection's only use), for P a Linear, MLP or GatedMLP, becomes P with c times the weights and
  bias its output is linear in (the down projection's for an MLP). OPT scales q by head_dim^-0.5
  after its projection (and attends with scale 1); Granite multiplies the attention and MLP outputs
  by residual_multiplier. On the logits the LM head's weights may be a tied embedding table, so
  the scale goes into the gain and bias of the norm before the head instead (exact: the head is
  linear); Granite divides its logits by logits_scaling, Cohere multiplies them by logit_scale.
- `centred_rmsnorm`: `RMSNorm(x - mean(x), w)` becomes `LayerNorm(x, w)` without bias (Cohere).
- `heads_norm`: `Transpose(RMSNorm(Reshape(x[B,T,H*D] -> [B,T,H,D]), w[D]), [0,2,1,3])` becomes
  `RMSNorm(SplitHeads(x), w)`: Qwen3's per-head q/k norm, written before the heads' transpose (Gemma
  3 writes it after, which is already that form); a norm over the last axis commutes with it.
- `unflatten_rows`: `Reshape([1, T, H] -> [T, H])`, row-wise raised ops (norms, projections, MLPs,
  elementwise ops), `Reshape(-> [1, T, H])` becomes the same ops on [1, T, H] (OPT flattens the
  residual stream around its feed-forward block). Row-wise: each token's row of the output depends
  only on that token's row of the inputs, so the batch-1 reshape changes nothing but the rank.
"""

from __future__ import annotations

from collections.abc import Callable

from zlc.ir import Graph, Node, Value

from .match import ELEMENTWISE, last_axis
from .pattern import OpPattern
from .raising import new_node
from .rewrite import Match, P, Rule

Pairs = list[tuple[Value, Value]]


# ---- constant scale after a projection -------------------------------------------------------------

# The inputs of each projection op that its output is linear in: scaling them scales the output.
_SCALED_INPUTS = {"Linear": (1, 2), "MLP": (3, 4), "GatedMLP": (3,)}  # W, b / W_down, b_down
_NORMS = ("RMSNorm", "LayerNorm")  # gain (and bias): a scale before a bias-free head is one after it


def _head_norm(m: Match) -> Node | None:
    """For a scale on the logits: the norm whose only use is the projection (the LM head's input)."""
    lin = m["lin"].producer
    assert lin is not None
    x = lin.inputs[0]
    if lin.op != "Linear" or x is None or x.producer is None or x.producer.op not in _NORMS or m.n_uses(x) != 1:
        return None
    return x.producer


def _check_scale(m: Match) -> str | None:
    lin = m["lin"].producer
    assert lin is not None
    users = m.users(m.root.output)
    if len(users) == 1 and users[0].op == "Tanh":  # c * tanh(x / c): lm_head_softcap takes it whole
        return "the inside of a soft-cap (tanh)"
    if any(lin.inputs[i] is not None and lin.inputs[i].data is None  # type: ignore[union-attr]
           for i in _SCALED_INPUTS[lin.op] if i < len(lin.inputs)):
        return "projection weights are not constants"
    if m.is_output(m.root.output):
        # The LM head's weights may be a tied embedding table: scale the norm before it instead.
        norm = _head_norm(m)
        if norm is None or any(v is not None and v.data is None for v in norm.inputs[1:]):
            return "scales the logits, and no norm of the head's input alone can take the scale"
        m.cover(norm)
    return None


def _scaled(g: Graph, n: Node, which: tuple[int, ...], c: float) -> list[Value | None]:
    return [g.add_const(f"{v.name}.scaled", v.data * c, unique=True)  # type: ignore[operator]
            if i in which and v is not None else v for i, v in enumerate(n.inputs)]


def _rw_scale(c_of: Callable[[float], float]) -> Callable[[Match, Graph], Pairs]:
    def rewrite(m: Match, g: Graph) -> Pairs:
        lin = m["lin"].producer
        assert lin is not None
        c = c_of(m.scalar("c"))
        if m.is_output(m.root.output):
            norm = _head_norm(m)
            assert norm is not None
            normed = new_node(g, norm.op, _scaled(g, norm, (1, 2), c), norm.name, **norm.attrs)
            ins = _scaled(g, lin, (2,), c)
            ins[0] = normed
        else:
            ins = _scaled(g, lin, _SCALED_INPUTS[lin.op], c)
        return [(m.root.output, new_node(g, lin.op, ins, lin.name, **lin.attrs))]
    return rewrite


def _projection() -> OpPattern:
    return P.op(tuple(_SCALED_INPUTS), P.var("x"), rest=True, single_use=True, out="lin",
                why="not the only use of a projection's output")


LINEAR_SCALE = Rule(
    "linear_scale",
    P.op("Mul", _projection(), P.scalar("c", why="not a one-element constant")),
    _check_scale, _rw_scale(lambda c: c),
    doc="Linear / MLP / GatedMLP output * c -> the same op with c times its (down) weights and bias; "
        "on the logits, c times the gain and bias of the norm before the head")

LINEAR_DIVIDE = Rule(
    "linear_divide",
    P.op("Div", _projection(), P.scalar("c", why="not divided by a one-element constant"), commutative=False),
    lambda m: "divides by zero" if m.scalar("c") == 0 else _check_scale(m), _rw_scale(lambda c: 1.0 / c),
    doc="the same for a division by a constant (Granite's logits_scaling)")


# ---- mean-centred RMSNorm: LayerNorm without bias ------------------------------------------------

def _check_centred(m: Match) -> str | None:
    mean = m.node("mean")
    if not last_axis(mean, m["x"].type.rank) or not mean.attrs.get("keepdims", 1):
        return "not centred by the keepdims mean over the last axis"
    return None


def _rw_centred(m: Match, g: Graph) -> Pairs:
    n = m.root
    return [(n.output, new_node(g, "LayerNorm", [m["x"], m["w"]], "layer_norm", eps=n.attrs.get("eps", 1e-5)))]


# (x - mean(x)) / rms(x - mean(x)) * w is (x - mean) / sqrt(var + eps) * w: LayerNorm without bias
# (Cohere, OLMo 2's exports spell it so once RMSNorm is raised).
CENTRED_RMSNORM = Rule(
    "centred_rmsnorm",
    P.op("RMSNorm", P.op("Sub", P.var("x"), P.op("ReduceMean", P.var("x"), rest=True, name="mean", single_use=True),
                         single_use=True, commutative=False, why="input is not x - mean(x)"),
         P.const("w")),
    _check_centred, _rw_centred,
    doc="RMSNorm(x - mean(x), w) -> LayerNorm(x, w) without bias")


# ---- flattened token rows --------------------------------------------------------------------------

# Ops whose output row t depends only on input row t (normalizations and activations over the last
# axis, projections); elementwise ones also need their other operands inside the region or a
# constant that broadcasts along the last axis.
_ROW_OPS = {"LayerNorm", "RMSNorm", "Linear", "MLP", "GatedMLP", "MoE"}
_FLAT = "not a [1, T, H] -> [T, H] reshape"


def _region(m: Match) -> tuple[list[Node], list[Node]] | str:
    """The row-wise nodes downstream of the flattening reshape, and the reshapes that restore
    [1, T, H]; or why the region does not qualify."""
    x, flat = m["x"], m.root.output
    inside = {id(flat)}
    nodes: list[Node] = []
    restores: list[Node] = []
    frontier = [flat]
    seen: set[int] = set()
    while frontier:
        v = frontier.pop()
        if m.is_output(v):
            return "a flattened value is a graph output"
        for u in m.users(v):
            if id(u) in seen:
                continue
            seen.add(id(u))
            if u.op == "Reshape" and u.output.shape is not None and tuple(u.output.shape) == tuple(x.shape or ()):
                restores.append(u)
                continue
            if u.op not in _ROW_OPS and u.op not in ELEMENTWISE:
                return f"{u.op} '{u.name}' on the flattened rows is not row-wise"
            nodes.append(u)
            for o in u.outputs:
                inside.add(id(o))
                frontier.append(o)
    for u in nodes:
        if u.op in _ROW_OPS:  # the rows in, constant weights, gains and biases
            first = u.inputs[0]
            if first is None or id(first) not in inside or any(w is not None and w.data is None for w in u.inputs[1:]):
                return f"{u.op} '{u.name}' takes the flattened rows other than as its input, or non-constant weights"
            continue
        for w in u.inputs:
            if w is not None and id(w) not in inside and not (w.data is not None and len(w.shape or ()) <= 1):
                return f"{u.op} '{u.name}' mixes the flattened rows with a value from outside"
    if not restores:
        return "no reshape restores [1, T, H]"
    return nodes, restores


def _check_unflatten(m: Match) -> str | None:
    xs, ys = m["x"].shape, m.root.output.shape
    if xs is None or ys is None or len(xs) != 3 or xs[0] != 1 or tuple(ys) != tuple(xs[1:]):
        return _FLAT
    got = _region(m)
    if isinstance(got, str):
        return got
    nodes, restores = got
    m.cover(*nodes, *restores)
    m.note("region", got)
    return None


def _rw_unflatten(m: Match, g: Graph) -> Pairs:
    nodes, restores = m.fact("region")
    new: dict[int, Value] = {id(m.root.output): m["x"]}
    region = {id(n) for n in nodes}
    for n in [n for n in g.nodes if id(n) in region]:  # graph order is topological
        ins = [new.get(id(v), v) if v is not None else None for v in n.inputs]
        made = g.add_node(n.op, ins, dict(n.attrs), name=n.name, n_outputs=len(n.outputs))
        for o, o2 in zip(n.outputs, made.outputs, strict=True):
            new[id(o)] = o2
    return [(r.output, new[id(r.inputs[0])]) for r in restores]


def _check_heads_norm(m: Match) -> str | None:
    xs, rs, w = m["x"].shape, m.node("r").output.shape, m["w"]
    if xs is None or rs is None or len(xs) != 3 or len(rs) != 4 or tuple(rs[:2]) != tuple(xs[:2]) \
            or not all(isinstance(d, int) for d in (rs[2], rs[3], xs[2])) or rs[2] * rs[3] != xs[2]:  # type: ignore[operator]
        return "reshape does not split [B, T, H*D] into heads"
    if w.shape is None or [int(d) for d in w.shape if d != 1] not in ([rs[3]], []):  # type: ignore[arg-type]
        return "norm weight is not one gain per head feature"
    return None


def _rw_heads_norm(m: Match, g: Graph) -> Pairs:
    heads = new_node(g, "SplitHeads", [m["x"]], "split_heads", heads=int(m.node("r").output.shape[2]))  # type: ignore[index, arg-type]
    return [(m.root.output, new_node(g, "RMSNorm", [heads, m["w"]], "rmsnorm", **dict(m.node("norm").attrs)))]


HEADS_NORM = Rule(
    "heads_norm",
    P.op("Transpose", P.op("RMSNorm", P.op("Reshape", P.var("x"), P.any(), name="r", single_use=True,
                                           why="norm input is not a reshape"), P.var("w"), name="norm",
                           single_use=True, why="input is not an RMSNorm"),
         attrs={"perm": lambda p: list(p) == [0, 2, 1, 3]}, why="not a [0, 2, 1, 3] transpose"),
    _check_heads_norm, _rw_heads_norm,
    doc="[B,T,H*D] -> reshape [B,T,H,D] -> RMSNorm over D -> transpose -> RMSNorm(SplitHeads)")


UNFLATTEN_ROWS = Rule(
    "unflatten_rows",
    P.op("Reshape", P.var("x"), P.any()),
    _check_unflatten, _rw_unflatten,
    doc="Reshape([1,T,H] -> [T,H]), row-wise ops, Reshape(-> [1,T,H]) -> the ops on [1,T,H]")
