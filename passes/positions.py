"""Position arithmetic outside `Positions`: rebase it on the cache's past length, or name it.

A stateless graph (input_ids -> logits) computes positions from the extent of the token axis:
`Range(0, T)`, `CumSum` of an all-ones mask, a learned table gathered at either. That is the
absolute position only while the cache is empty; in a decode step (T = 1) it is 0 again. Raising
absorbs the common forms into ops that take `Positions` (RoPE, the Embedding of a learned table),
which KV-cache synthesis binds to `past_len + arange(T)`. What raising left (GPT-J's sin/cos rows
gathered at `Range(0, T)` while its rotary stays op-level, OPT's `CumSum(mask) - 1 + 2`, Cohere's
frequencies times `Range(0, T)`) is found here by evaluating the shape-only part of the graph on
probes, and rewritten:

- `rebase_positions`: every shape-only value that evaluates to `offset + arange(T)` along the token
  axis (and only feeds more shape-only computation: a table lookup, frequencies) becomes
  `Positions(ids, past_len) + offset`, cast and reshaped like the value it replaces;
- `fold_table_offsets`: `Embedding(W, Positions + c)` becomes `Embedding(W[c:], Positions)` (OPT's
  learned positions start at row 2), the form the megakernel's embedding task reads;
- `unabsorbed_positions`: what is still position-dependent in a decode graph without going through
  `Positions` (for the error of the decode-vs-prefill check, kv_check.py).

A value is "shape-only" when it depends on the graph inputs only through their shapes (and on an
attention mask assumed all ones): exactly what a probe can evaluate without real tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zlc.ir import DType, Graph, Node, Value

from . import probe

# Two prompt lengths that no model dimension is likely to equal, so the token axis is the one whose
# extent follows them; a probe with a past tells absolute positions from ones that restart at 0.
_STATELESS_PROBES = (probe.Probe(0, 5), probe.Probe(0, 9))
_CACHED_PROBES = (*_STATELESS_PROBES, probe.Probe(4, 1))


def shape_only_nodes(g: Graph) -> list[Node]:
    """Nodes (in graph order, which must be topological) whose outputs depend on the graph's inputs
    only through their shapes, or on an attention-mask input (assumed all ones), and on no state.
    `Positions` without a past length reads only the extent of its input, so it is one too."""
    roles = probe.classify_inputs(g)
    ok: set[int] = {id(v) for v in g.consts.values()}
    ok |= {id(v) for v in g.inputs if roles.get(v.name) == probe.MASK}
    out: list[Node] = []
    for n in g.nodes:
        ins = [v for v in n.inputs if v is not None]
        if any(v.kind == "state" for v in ins):
            continue
        if n.op in ("Shape", "Size"):
            good = True
        elif n.op == "Positions":
            good = all(id(v) in ok for v in ins[1:])
        else:
            good = all(id(v) in ok for v in ins)
        if good:
            ok.update(id(o) for o in n.outputs)
            out.append(n)
    return out


def _numeric(v: Value) -> bool:
    return v.dtype != DType.bool


def _evaluate_all(g: Graph, targets: Sequence[Value], p: probe.Probe) -> list[torch.Tensor] | None:
    got = probe.try_evaluate(g, list(targets), p)
    return None if isinstance(got, str) else got


def _evaluate_each(g: Graph, targets: Sequence[Value], p: probe.Probe) -> list[tuple[Value, torch.Tensor]]:
    """(value, tensor) for the targets that evaluate on probe p: all at once, else one at a time (a
    shape-only node that cannot run on this probe, e.g. a mask that only exists for prefill, must
    not hide the positions beside it)."""
    got = _evaluate_all(g, targets, p)
    if got is not None:
        return list(zip(targets, got, strict=True))
    out = []
    for v in targets:
        one = _evaluate_all(g, [v], p)
        if one is not None:
            out.append((v, one[0]))
    return out


@dataclass(frozen=True)
class Arange:
    """A value that is `offset + arange(T)` along its token axis (every other extent 1)."""

    value: Value
    offset: int
    rank: int
    axis: int


def _arange_offset(t: torch.Tensor, p: probe.Probe, absolute: bool) -> int | None:
    """offset when t is offset (+ past, if absolute) + arange(seq), else None."""
    if t.numel() != p.seq or t.dtype == torch.bool:
        return None
    flat = t.reshape(-1).double()
    if not torch.equal(flat, flat.round()):
        return None
    d = flat - torch.arange(p.seq, dtype=torch.float64)
    if not torch.all(d == d[0]):
        return None
    return int(d[0]) - (p.past if absolute else 0)


def find_aranges(g: Graph, nodes: Sequence[Node]) -> list[Arange]:
    """The shape-only values that evaluate to `offset + arange(T)` on every probe. In graphs that
    carry a cache (past, mask or position inputs), only those that count from the past length:
    a local index that restarts at 0 is what that graph computes, not a stateless assumption."""
    roles = set(probe.classify_inputs(g).values())
    cached = bool(roles & {probe.PAST_KEY, probe.PAST_VALUE, probe.MASK, probe.POSITIONS})
    probes = _CACHED_PROBES if cached else _STATELESS_PROBES
    targets = [o for n in nodes for o in n.outputs if _numeric(o) and o.kind != "const"]
    if not targets:
        return []
    offsets: dict[int, list[int | None]] = {}  # per probe it evaluated on
    first: dict[int, torch.Tensor] = {}
    for p in probes:
        for v, t in _evaluate_each(g, targets, p):
            offsets.setdefault(id(v), []).append(_arange_offset(t, p, cached))
            first.setdefault(id(v), t)
    out = []
    for v in targets:
        offs = offsets.get(id(v), [])
        if len(offs) != len(probes) or offs[0] is None or any(o != offs[0] for o in offs):
            continue
        off, t = offs[0], first[id(v)]
        axes = [i for i, d in enumerate(t.shape) if d == probes[0].seq]
        if len(axes) == 1:
            out.append(Arange(v, off, t.dim(), axes[0]))
    return out


def rebase_positions(g: Graph, ids: Value, past_len: Value,
                     positions: Value | None) -> tuple[list[str], Value | None]:
    """Rewrites every maximal arange (one whose users are not aranges themselves) that only feeds
    shape-only computation onto `positions` (`Positions(ids, past_len)`, made if None). Returns
    the names of the rebased nodes and the positions value. An arange that meets the activations
    directly (an index into the token axis of a hidden state) is left alone: it is not a position."""
    g.toposort()
    nodes = shape_only_nodes(g)
    shape_only = {id(n) for n in nodes}
    aranges = find_aranges(g, nodes)
    is_arange = {id(a.value) for a in aranges}
    users = g.users()
    rebased: list[str] = []
    for a in aranges:
        us = users.get(a.value, [])
        outer = [u for u in us if not any(id(o) in is_arange for o in u.outputs)]
        if not outer or not all(id(u) in shape_only for u in outer):
            continue
        if positions is None:
            pn = g.make_node("Positions", [ids, past_len], name="positions")
            g.nodes.insert(0, pn)
            positions = pn.output
        g.replace_uses(a.value, _positions_like(g, positions, a))
        rebased.append(a.value.producer.name if a.value.producer is not None else a.value.name)
    if rebased:
        g.toposort()
    return rebased, positions


def _positions_like(g: Graph, positions: Value, a: Arange) -> Value:
    """`positions + offset` ([1, T] i64) in the dtype and rank of the arange it replaces."""
    x = positions
    if a.offset:
        x = g.op("Add", x, g.const_scalar(a.offset, DType.i64))
    if a.value.dtype != DType.i64:
        x = g.op("Cast", x, to=a.value.dtype.value)
    if (a.rank, a.axis) != (2, 1):
        shape = [1] * a.rank
        shape[a.axis] = -1
        x = g.op("Reshape", x, g.add_const("positions.shape", np.array(shape, dtype=np.int64), unique=True))
    return x


def fold_table_offsets(g: Graph) -> int:
    """`Embedding(W, Positions + c)` -> `Embedding(W[c:], Positions)` for a constant 0 < c < rows
    (OPT's learned positions start at row 2). Returns how many were folded."""
    folded = 0
    for n in g.nodes:
        if n.op != "Embedding" or n.inputs[0] is None or n.inputs[0].data is None:
            continue
        add = n.inputs[1].producer if n.inputs[1] is not None else None
        if add is None or add.op != "Add" or len(add.inputs) != 2:
            continue
        pos = next((v for v in add.inputs if v is not None and v.producer is not None
                    and v.producer.op == "Positions"), None)
        c = next((v for v in add.inputs if v is not None and v is not pos), None)
        arr = c.const_array() if c is not None else None
        if pos is None or arr is None or arr.size != 1 or arr.dtype.kind not in "iu":
            continue
        off, w = int(arr.reshape(-1)[0]), n.inputs[0]
        if not 0 < off < int(w.shape[0]):  # type: ignore[index]
            continue
        n.inputs = [g.add_const(f"{w.name}.from{off}", w.data[off:], unique=True), pos]
        folded += 1
    return folded


# ---- what is left: for the decode-vs-prefill error -------------------------------------------------

def unabsorbed_positions(prefill: Graph, decode: Graph, seq: int = 6) -> list[str]:
    """Position-dependent nodes of `decode` that do not go through the cache's past length: a
    shape-only value whose decode-step value (one token at position seq-1) differs from row seq-1
    of the same value in a prefill of seq tokens. Returns the first such nodes of each chain
    ("Range 'node_arange' (reaches GatherND 'node_GatherND_131')"), in graph order."""
    nodes = shape_only_nodes(decode)
    by_name = {o.name: o for n in prefill.nodes for o in n.outputs}
    pairs = [(o, by_name[o.name]) for n in nodes for o in n.outputs if _numeric(o) and o.name in by_name]
    if not pairs:
        return []
    got_d = _evaluate_all(decode, [d for d, _ in pairs], probe.Probe(seq - 1, 1))
    got_p = _evaluate_all(prefill, [p for _, p in pairs], probe.Probe(0, seq))
    if got_d is None or got_p is None:
        return []
    flagged: set[int] = set()
    for (d, _), td, tp in zip(pairs, got_d, got_p, strict=True):
        if td.dim() != tp.dim() or td.shape == tp.shape:
            continue
        axes = [i for i in range(td.dim()) if tp.shape[i] == seq and td.shape[i] == 1]
        if not axes or any(tp.shape[i] != td.shape[i] for i in range(td.dim()) if i not in axes):
            continue
        row = tp[tuple(slice(seq - 1, seq) if i in axes else slice(None) for i in range(tp.dim()))]
        if not torch.allclose(row.double(), td.double(), atol=1e-6, equal_nan=True):
            flagged.add(id(d))
    users = decode.users()
    shape_only = {id(n) for n in nodes}
    out = []
    for n in nodes:
        if not any(id(o) in flagged for o in n.outputs):
            continue
        if any(v is not None and id(v) in flagged for v in n.inputs):
            continue  # downstream of a flagged root
        out.append(f"{n.op} '{n.name}'" + _entry(n, users, shape_only))
    return out


def _entry(root: Node, users: dict[Value, list[Node]], shape_only: set[int]) -> str:
    """Where a root's values first meet the activations (breadth-first), as " (reaches OP 'name')"."""
    seen, frontier = {id(root)}, [root]
    while frontier:
        nxt = []
        for n in frontier:
            for o in n.outputs:
                for u in users.get(o, []):
                    if id(u) not in shape_only:
                        return f" (reaches {u.op} '{u.name}')"
                    if id(u) not in seen:
                        seen.add(id(u))
                        nxt.append(u)
        frontier = nxt
    return ""
