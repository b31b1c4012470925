"""Raising rule for mixture-of-experts blocks (Mixtral, Qwen3-MoE): the router Linear, Softmax,
TopK (and the renormalisation), the selected experts' gated MLPs and the weighted sum over the k
slots -> one MoE node.

The form matched is what transformers' "batched_mm" experts implementation exports (the one
torch.onnx and torch.export can trace; see zlc.testing.export): every token repeated k times, each
copy multiplied by its expert's stacked weights gathered by index (GatherND or Gather on axis 0),
then ``sum over k of weight_k * expert_k(x)``. The structural walk below only finds the parts; a
probe then evaluates the matched subgraph on random tokens against the MoE reference kernel, so a
look-alike that computes something else is refused with the reason.
"""

from __future__ import annotations

import torch

from zlc.ir import Graph, Node, Value
from zlc.reference.evaluate import evaluate
from zlc.reference.kernels import KERNELS, const_tensor

from .match import elementwise_activation, prod
from .raise_layers import half_slice
from .raising import new_node
from .rewrite import Match, P, Rule

Pairs = list[tuple[Value, Value]]

_VIEWS = ("Reshape", "Unsqueeze", "Squeeze", "Expand", "Cast", "Identity")


def _up(v: Value | None, ops: tuple[str, ...] = _VIEWS) -> Value | None:
    """Follows view-like producers (reshapes, unsqueezes, expands, casts) upward."""
    while v is not None and v.producer is not None and v.producer.op in ops:
        v = v.producer.inputs[0]
    return v


def _topk_output(v: Value | None) -> tuple[Node, int] | None:
    v = _up(v)
    n = prod(v, "TopK")
    if n is None or v is None or not n.attrs.get("largest", 1):  # a router takes the k largest
        return None
    return n, n.outputs.index(v)


def _gathered(v: Value | None) -> tuple[Value, Node] | None:
    """(stacked constant weight [E, ...], TopK) when v is weight[topk indices] (GatherND / Gather axis 0)."""
    n = prod(_up(v))
    if n is None or n.op not in ("GatherND", "Gather") or n.inputs[0] is None or n.inputs[0].data is None:
        return None
    if n.op == "Gather" and n.attrs.get("axis", 0) != 0 or n.op == "GatherND" and n.attrs.get("batch_dims", 0):
        return None
    src = _topk_output(n.inputs[1])
    if src is None or src[1] != 1:
        return None
    return n.inputs[0], src[0]


def _expert_matmul(v: Value | None) -> tuple[Value, Node, Value] | None:
    """(stacked weight, TopK, per-copy input) of W[idx] @ x[..., None] (a batched matrix-vector)."""
    mm = prod(_up(v, ("Squeeze", "Reshape")), "MatMul")
    if mm is None:
        return None
    g = _gathered(mm.inputs[0])
    if g is None:
        return None
    x = _up(mm.inputs[1], ("Unsqueeze", "Reshape"))
    return None if x is None else (g[0], g[1], x)


def _routing(v: Value | None) -> tuple[Node, int] | None:
    """(TopK, normalize) when v is the top-k values, or those divided by their sum."""
    v = _up(v)
    n = prod(v)
    if n is not None and n.op == "Div":
        num, den = _topk_output(n.inputs[0]), prod(_up(n.inputs[1]), "ReduceSum")
        if num is not None and num[1] == 0 and den is not None and _topk_output(den.inputs[0]) == num:
            return num[0], 1
        return None
    src = _topk_output(v)
    return None if src is None or src[1] != 0 else (src[0], 0)


def _check_moe(m: Match) -> str | None:
    mul = prod(_up(m["y"]), "Mul")
    if mul is None:
        return "the summed value is not a product of routing weights and expert outputs"
    for w_side, e_side in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        route, down = _routing(w_side), _expert_matmul(e_side)
        if route is not None and down is not None:
            break
    else:
        return "no (top-k weight, expert down projection) product"
    topk, normalize = route
    wd, topk_d, hidden = down
    if topk_d is not topk:
        return "the down projection's experts are not the routed ones"
    act_mul = prod(hidden, "Mul")
    if act_mul is None:
        return "expert hidden state is not an activation product"
    for gate_side, up_side in ((act_mul.inputs[0], act_mul.inputs[1]), (act_mul.inputs[1], act_mul.inputs[0])):
        assert gate_side is not None and up_side is not None
        half = half_slice(up_side)
        if half is None or half[1] != 1:
            continue
        up = _expert_matmul(half[0])
        gate_src = next((o for n in m.graph.nodes if n.op in ("Slice", "Split") and n.inputs[0] is half[0]
                         for o in n.outputs if half_slice(o) == (half[0], 0)), None)
        if up is None or gate_src is None:
            continue
        try:
            act = elementwise_activation(m.graph, gate_src, gate_side)
        except ValueError:
            continue
        break
    else:
        return "expert hidden state is not act(gate) * up of a fused gate_up projection"
    wgu, topk_u, xrep = up
    if topk_u is not topk:
        return "the gate_up projection's experts are not the routed ones"
    sm = prod(_up(topk.inputs[0], ("Cast", "Identity")), "Softmax")
    lin = prod(_up(sm.inputs[0], ("Cast", "Identity")), "Linear") if sm is not None else None
    if sm is None or lin is None or lin.input(2) is not None:
        return "top-k is not over softmax(router Linear without bias)"
    x = lin.inputs[0]
    if _up(xrep) is not _up(x):
        return "experts do not read the router's input"
    if topk.attrs.get("axis", -1) % 2 != 1 or sm.attrs.get("axis", -1) % 2 != 1:
        return "top-k / softmax not over the experts axis"
    wr, f = lin.inputs[1], int(wgu.shape[1]) // 2  # type: ignore[index]
    assert x is not None and wr is not None and wr.shape is not None and wgu.shape is not None
    if wd.shape is None or len(wgu.shape) != 3 or len(wd.shape) != 3 or not wgu.shape[0] == wd.shape[0] == wr.shape[0]:
        return "stacked expert weights do not match the router's experts"
    m.note("parts", (x, wr, wgu, wd, f))
    m.note("attrs", dict(top_k=int(topk.attrs["k"]), normalize=normalize, activation=act))
    return _probe(m, x, m.root.output)


def _probe(m: Match, x: Value, out: Value) -> str | None:
    """Evaluates the matched subgraph on random tokens against the MoE reference kernel."""
    order: list[Node] = []
    seen: set[int] = set()

    inputs: list[Value] = []

    def visit(v: Value | None) -> None:
        if v is None or v is x or v.data is not None or id(v) in seen:
            return
        seen.add(id(v))
        if v.producer is None:  # a graph input: torch.export's reshapes read the token count off it
            inputs.append(v)
            return
        for i in v.producer.inputs:
            visit(i)
        order.append(v.producer)

    try:
        visit(out)
    except ValueError as e:
        return str(e)
    order = list(dict.fromkeys(order))
    _, wr, wgu, wd, f = m.fact("parts")
    tokens = 5
    if x.shape is None or len(x.shape) != 2:
        return "router input is not [tokens, hidden]"
    xt = torch.randn((tokens, int(wr.shape[1])), generator=torch.Generator().manual_seed(0)).to(x.dtype.torch)
    env0 = {id(x): xt}
    for v in inputs:  # only their shapes may matter: the token axis at the probe's length, zeros
        dims = [tokens if d == x.shape[0] else d for d in v.shape or ()]
        if v.shape is None or not all(isinstance(d, int) for d in dims):
            return f"'{v.name}' is not computed from the router's input"
        env0[id(v)] = torch.zeros([int(d) for d in dims], dtype=v.dtype.torch)
    try:
        env = evaluate(order, env0)
    except Exception as e:  # noqa: BLE001 -- any failure to evaluate is a refusal, with its reason
        return f"matched subgraph does not evaluate on {tokens} tokens: {e}"
    got = env.get(id(out))
    node = Node("MoE", [], [], m.fact("attrs"), "probe")
    gu = const_tensor(wgu)
    ref = KERNELS["MoE"](node, [xt, const_tensor(wr), gu[:, :f], gu[:, f:], const_tensor(wd)])[0]
    if got is None or got.shape != ref.shape or not torch.allclose(got.float(), ref.float(), atol=1e-4, rtol=1e-3):
        return "the matched subgraph does not compute the MoE it looks like"
    return None


def _elements(v: Value | None) -> list[int | str] | None:
    """A shape operand's elements: a constant's, or the symbolic ones shape arithmetic carries."""
    if v is None:
        return None
    arr = v.const_array() if v.data is not None else None
    if arr is not None:
        return [int(t) for t in arr.reshape(-1).tolist()]
    return None if v.sym is None else [t if isinstance(t, str) else int(t) for t in v.sym]


def _restores(m: Match, x: Value) -> tuple[Value, list[Node]] | None:
    """(x3, reshapes) when x is [1, T, H] x3 flattened to [T, H] and every use of the block's output
    is a reshape back to x3's shape: the MoE then runs on x3, as the other row-wise ops do."""
    flat = prod(x, "Reshape")
    x3 = flat.inputs[0] if flat is not None else None
    if x3 is None or x3.shape is None or len(x3.shape) != 3 or x3.shape[0] != 1 or m.is_output(m.root.output):
        return None
    users = m.users(m.root.output)
    for u in users:
        tgt = _elements(u.inputs[1]) if u.op == "Reshape" else None
        if tgt is None or len(tgt) != 3 or u.attrs.get("allowzero", 0) and 0 in tgt:
            return None
        if not all(t == -1 or t == d for t, d in zip(tgt, x3.shape, strict=True)):
            return None
    return (x3, users) if users else None


def _rw_moe(m: Match, g: Graph) -> Pairs:
    x, wr, wgu, wd, f = m.fact("parts")
    wg = g.add_const(wgu.name + ".gate", wgu.data[:, :f], unique=True)  # views: no copy
    wu = g.add_const(wgu.name + ".up", wgu.data[:, f:], unique=True)
    rows = _restores(m, x)
    if rows is None:
        return [(m.root.output, new_node(g, "MoE", [x, wr, wg, wu, wd], "moe", **m.fact("attrs")))]
    out = new_node(g, "MoE", [rows[0], wr, wg, wu, wd], "moe", **m.fact("attrs"))
    return [(u.output, out) for u in rows[1]]


MOE = Rule(
    "moe",
    P.op("ReduceSum", P.var("y"), rest=True, attrs={"keepdims": 0}, why="not a sum over the top-k slots"),
    _check_moe, _rw_moe,
    doc="sum_k topk(softmax(router(x)))_k * down[e_k](act(gate[e_k] x) * up[e_k] x) -> MoE (Mixtral, Qwen3-MoE)")
