"""Graphs: the one graph type that holds op-level and transformer-level nodes, its builder and
its text form's printer.

Use lists are computed on demand (`Graph.users()`) rather than maintained incrementally, which
keeps rewrites simple and correct; graphs here are thousands of nodes, not millions.

Layering inside the IR (one way, no lazy imports): types -> values (Value, Node) -> ops (the op
table and shape inference, on values) -> graph (the builder, which infers the types of the nodes it
makes) -> text (the parser, which builds graphs). The printer lives here rather than in text.py so
that `str(g)` needs nothing from above; text.py re-exports it beside the parser it round-trips with.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from zlc.errors import IRError

from .ops import infer_sym, infer_types
from .quant import Dequantized
from .types import DType, TensorType
from .values import Node, Value

__all__ = ["Graph", "Node", "Value", "print_graph", "reinfer"]

INLINE_MAX = 16  # constants with at most this many elements print their data


class Graph:
    def __init__(self, name: str = "main"):
        self.name = name
        self.inputs: list[Value] = []
        self.outputs: list[Value] = []
        self.nodes: list[Node] = []
        self.consts: dict[str, Value] = {}
        self.state: list[Value] = []
        self.metadata: dict[str, Any] = {}
        self._names: set[str] = set()
        self._node_names: set[str] = set()
        self._counter = itertools.count()

    # ---- naming -------------------------------------------------------------------------
    def fresh_name(self, prefix: str = "v") -> str:
        prefix = prefix or "v"
        if prefix not in self._names:
            self._names.add(prefix)
            return prefix
        while True:
            cand = f"{prefix}_{next(self._counter)}"
            if cand not in self._names:
                self._names.add(cand)
                return cand

    def fresh_node_name(self, prefix: str) -> str:
        prefix = prefix or "n"
        cand = prefix
        while cand in self._node_names:
            cand = f"{prefix}_{next(self._counter)}"
        self._node_names.add(cand)
        return cand

    def claim_name(self, name: str) -> str:
        """Takes `name` for a new value; IRError if a value already has it."""
        if name in self._names:
            raise IRError(f"duplicate value name '%{name}'")
        self._names.add(name)
        return name

    def claim_node_name(self, name: str) -> str:
        """Takes `name` for a node built outside make_node (the parser keeps the text's names)."""
        self._node_names.add(name)
        return name

    def has_name(self, name: str) -> bool:
        """Whether a value holds (or a caller reserved) `name`."""
        return name in self._names

    def release_name(self, name: str) -> None:
        """Gives `name` back, for a value about to take it (or one that is gone)."""
        self._names.discard(name)

    def release_node_name(self, name: str) -> None:
        """Gives a node name back (the node is renamed or gone)."""
        self._node_names.discard(name)

    # ---- construction --------------------------------------------------------------------
    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(self.claim_name(name), type, "input")
        self.inputs.append(v)
        return v

    def add_state(self, name: str, type: TensorType) -> Value:
        v = Value(self.claim_name(name), type, "state")
        self.state.append(v)
        return v

    def add_const(self, name: str | None, data: Any, *, unique: bool = False) -> Value:
        """Adds a constant. `data` (numpy array or torch tensor) is kept by reference."""
        if isinstance(data, torch.Tensor):
            ty = TensorType(DType.from_torch(data.dtype), tuple(int(d) for d in data.shape))
        elif isinstance(data, Dequantized):  # a packed matrix's f32 view, dequantized where read
            ty = TensorType(DType.f32, data.shape)
        else:
            data = np.asarray(data)
            ty = TensorType(DType.from_numpy(data.dtype), tuple(int(d) for d in data.shape))
        nm = self.fresh_name(name or "c") if (unique or not name) else self.claim_name(name)
        v = Value(nm, ty, "const", data=data)
        self.consts[nm] = v
        return v

    def const_scalar(self, value: Any, dtype: DType) -> Value:
        arr = torch.tensor(value, dtype=dtype.torch) if dtype == DType.bf16 else \
            np.array(value, dtype=dtype.numpy)
        return self.add_const("c", arr, unique=True)

    def make_node(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None,
                  *, name: str | None = None, n_outputs: int = 1,
                  out_names: Sequence[str] | None = None,
                  out_types: Sequence[TensorType] | None = None) -> Node:
        """Creates a node (not yet placed in `nodes`) with output types from shape inference."""
        node = Node(op, inputs, [], attrs, name=self.fresh_node_name(name or op.lower()))
        if out_types is None:
            out_types = infer_types(node, n_outputs)
        names = list(out_names) if out_names else [node.name if i == 0 else f"{node.name}_{i}"
                                                   for i in range(len(out_types))]
        node.outputs = [Value(self.fresh_name(n), t, "node", producer=node)
                        for n, t in zip(names, out_types, strict=False)]
        infer_sym(node)
        return node

    def add_node(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None,
                 **kw: Any) -> Node:
        node = self.make_node(op, inputs, attrs, **kw)
        self.nodes.append(node)
        return node

    def op(self, op: str, *inputs: Value | None, **attrs: Any) -> Value:
        """Shorthand used by frontends and rewrites: append a single-output node, return its value."""
        return self.add_node(op, list(inputs), attrs).output

    def insert_before(self, anchor: Node, nodes: Iterable[Node]) -> None:
        i = self.nodes.index(anchor)
        self.nodes[i:i] = list(nodes)

    # ---- editing -------------------------------------------------------------------------
    def users(self) -> dict[Value, list[Node]]:
        u: dict[Value, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v is not None:
                    u.setdefault(v, []).append(n)
        return u

    def replace_uses(self, old: Value, new: Value) -> None:
        for n in self.nodes:
            n.inputs = [new if v is old else v for v in n.inputs]
        self.outputs = [new if v is old else v for v in self.outputs]

    def remove_nodes(self, dead: Iterable[Node]) -> None:
        dead_ids = {id(n) for n in dead}
        self.nodes = [n for n in self.nodes if id(n) not in dead_ids]

    def drop_unused_consts(self) -> int:
        used = {id(v) for n in self.nodes for v in n.inputs if v is not None}
        used |= {id(v) for v in self.outputs}
        dead = [k for k, v in self.consts.items() if id(v) not in used]
        for k in dead:
            del self.consts[k]
            self._names.discard(k)
        return len(dead)

    def toposort(self) -> None:
        """Reorders nodes topologically (stable); raises IRError naming a node on a cycle."""
        producer_of = {id(o): n for n in self.nodes for o in n.outputs}
        state: dict[int, int] = {}
        order: list[Node] = []
        for root in self.nodes:
            if id(root) in state:
                continue
            stack: list[tuple[Node, int]] = [(root, 0)]
            state[id(root)] = 1
            while stack:
                node, i = stack.pop()
                if i < len(node.inputs):
                    stack.append((node, i + 1))
                    v = node.inputs[i]
                    p = producer_of.get(id(v)) if v is not None else None
                    if p is None:
                        continue
                    s = state.get(id(p))
                    if s == 1:
                        raise IRError(f"graph has a cycle through node '{p.name}' ({p.op})")
                    if s is None:
                        state[id(p)] = 1
                        stack.append((p, 0))
                else:
                    state[id(node)] = 2
                    order.append(node)
        self.nodes = order

    def values(self) -> Iterable[Value]:
        yield from self.inputs
        yield from self.consts.values()
        yield from self.state
        for n in self.nodes:
            yield from n.outputs

    def value(self, name: str) -> Value:
        for v in self.values():
            if v.name == name:
                return v
        raise IRError(f"no value named '%{name}' in graph '{self.name}'")

    def op_histogram(self) -> dict[str, int]:
        h: dict[str, int] = {}
        for n in self.nodes:
            h[n.op] = h.get(n.op, 0) + 1
        return dict(sorted(h.items(), key=lambda kv: (-kv[1], kv[0])))

    def clone(self) -> Graph:
        """A structural copy; constant data is shared, not copied."""
        g = Graph(self.name)
        g.metadata = dict(self.metadata)
        m: dict[int, Value] = {}

        def cp(v: Value, producer: Node | None = None) -> Value:
            nv = Value(v.name, v.type, v.kind, producer, v.data)
            nv.sym, nv.quant = v.sym, v.quant
            g._names.add(v.name)
            m[id(v)] = nv
            return nv

        g.inputs = [cp(v) for v in self.inputs]
        g.consts = {k: cp(v) for k, v in self.consts.items()}
        g.state = [cp(v) for v in self.state]
        for n in self.nodes:
            nn = Node(n.op, [None if v is None else m[id(v)] for v in n.inputs], [], dict(n.attrs), n.name)
            g._node_names.add(n.name)
            nn.outputs = [cp(o, nn) for o in n.outputs]
            g.nodes.append(nn)
        g.outputs = [m[id(v)] for v in self.outputs]
        return g

    def __str__(self) -> str:
        return print_graph(self)


def reinfer(g: Graph) -> None:
    """Recomputes every node's output types (and shape arithmetic) after inputs changed shape,
    e.g. when the decode graph pins the token axis to 1."""
    for n in g.nodes:
        types = infer_types(n, len(n.outputs))
        for o, t in zip(n.outputs, types, strict=False):
            o.type = t
            o.sym = None
        infer_sym(n)


# ---- the text form's printer (text.py parses it) ------------------------------------------------

def _fmt_attr(v: Any) -> str:
    """An attribute value (or inline constant data) in the text form: JSON, plus NaN/Infinity."""
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt_attr(x) for x in v) + "]"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return json.dumps(v) if v == v and abs(v) != float("inf") else \
            ("NaN" if v != v else ("Infinity" if v > 0 else "-Infinity"))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, str):
        return json.dumps(v)
    if v is None:
        return "null"
    raise IRError(f"attribute value of type {type(v).__name__} has no text form")


def _inline(v: Value) -> str | None:
    n = v.type.numel()
    if isinstance(n, int) and n > INLINE_MAX:  # too large: not converted (a packed matrix dequantized,
        return None                            # a half one widened) only to be left out
    arr = v.const_array()
    if arr is None or arr.size > INLINE_MAX:
        return None
    flat = arr.reshape(-1).tolist()
    if v.dtype.is_float:
        flat = [float(x) for x in flat]
    return _fmt_attr(flat)


def print_graph(g: Graph) -> str:
    """The text form of `g` (format: text.py's docstring); parse_graph reads it back."""
    lines = [f"graph {json.dumps(g.name)} {{"]
    if g.metadata:
        lines.append(f"  meta {json.dumps(g.metadata, sort_keys=True, default=str)}")
    for v in g.inputs:
        lines.append(f"  input %{v.name}: {v.type}")
    for v in g.consts.values():
        data = _inline(v)
        fmt = f" {v.quant.format.name}" if v.quant is not None else ""  # packed blocks: kept aside
        lines.append(f"  const %{v.name}: {v.type}{fmt}" + (f" = {data}" if data is not None else ""))
    for v in g.state:
        lines.append(f"  state %{v.name}: {v.type}")
    for n in g.nodes:
        outs = ", ".join(f"%{o.name}: {o.type}" for o in n.outputs)
        ins = ", ".join("_" if v is None else f"%{v.name}" for v in n.inputs)
        attrs = ""
        if n.attrs:
            attrs = " {" + ", ".join(f"{k}={_fmt_attr(n.attrs[k])}" for k in sorted(n.attrs)) + "}"
        lines.append(f"  {outs} = {n.op}({ins}){attrs} @{n.name}")
    lines.append("  output " + ", ".join(f"%{v.name}" for v in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"
