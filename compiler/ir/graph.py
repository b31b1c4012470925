"""Values, nodes and graphs: the one graph type that holds op-level and transformer-level nodes.

A Value is produced by exactly one of: a graph input, a constant (weight or small literal, data
kept by reference, never copied), a state buffer owned by the compiler (the KV cache), or a node.
Use lists are computed on demand (`Graph.users()`) rather than maintained incrementally, which
keeps rewrites simple and correct; graphs here are thousands of nodes, not millions.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from zlc.errors import IRError

from .types import Dim, DType, TensorType

ConstData = "np.ndarray | torch.Tensor"


class Value:
    __slots__ = ("name", "type", "producer", "data", "kind", "sym")

    def __init__(self, name: str, type: TensorType, kind: str, producer: Node | None = None,
                 data: Any = None):
        self.name = name
        self.type = type
        self.kind = kind  # "input" | "const" | "state" | "node"
        self.producer = producer
        self.data = data  # np.ndarray / torch.Tensor for consts, else None
        # Known elements of a small integer tensor (shape arithmetic): ints and symbolic dims.
        self.sym: tuple[Dim, ...] | None = None

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    @property
    def shape(self) -> tuple[Dim, ...] | None:
        return self.type.shape

    @property
    def is_const(self) -> bool:
        return self.kind == "const"

    def const_array(self) -> np.ndarray | None:
        """The constant's data as numpy (shares memory where possible), else None."""
        if self.data is None:
            return None
        if isinstance(self.data, torch.Tensor):
            t = self.data.detach()
            if t.dtype == torch.bfloat16:
                t = t.float()
            return t.cpu().numpy()
        return np.asarray(self.data)

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    __slots__ = ("op", "inputs", "outputs", "attrs", "name")

    def __init__(self, op: str, inputs: Sequence[Value | None], outputs: Sequence[Value],
                 attrs: dict[str, Any] | None = None, name: str = ""):
        self.op = op
        self.inputs: list[Value | None] = list(inputs)
        self.outputs: list[Value] = list(outputs)
        self.attrs: dict[str, Any] = dict(attrs or {})
        self.name = name

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise IRError(f"node '{self.name}' ({self.op}) has {len(self.outputs)} outputs, not 1")
        return self.outputs[0]

    def input(self, i: int) -> Value | None:
        return self.inputs[i] if i < len(self.inputs) else None

    def __repr__(self) -> str:
        ins = ", ".join("_" if v is None else f"%{v.name}" for v in self.inputs)
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        return f"{outs} = {self.op}({ins}) @{self.name}"


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

    def _claim(self, name: str) -> str:
        if name in self._names:
            raise IRError(f"duplicate value name '%{name}'")
        self._names.add(name)
        return name

    # ---- construction --------------------------------------------------------------------
    def add_input(self, name: str, type: TensorType) -> Value:
        v = Value(self._claim(name), type, "input")
        self.inputs.append(v)
        return v

    def add_state(self, name: str, type: TensorType) -> Value:
        v = Value(self._claim(name), type, "state")
        self.state.append(v)
        return v

    def add_const(self, name: str | None, data: Any, *, unique: bool = False) -> Value:
        """Adds a constant. `data` (numpy array or torch tensor) is kept by reference."""
        if isinstance(data, torch.Tensor):
            ty = TensorType(DType.from_torch(data.dtype), tuple(int(d) for d in data.shape))
        else:
            data = np.asarray(data)
            ty = TensorType(DType.from_numpy(data.dtype), tuple(int(d) for d in data.shape))
        nm = self.fresh_name(name or "c") if (unique or not name) else self._claim(name)
        v = Value(nm, ty, "const", data=data)
        self.consts[nm] = v
        return v

    def const_scalar(self, value: Any, dtype: DType) -> Value:
        arr = torch.tensor(value, dtype=dtype.torch) if dtype == DType.bf16 else \
            np.array(value, dtype=_np_dtype(dtype))
        return self.add_const("c", arr, unique=True)

    def make_node(self, op: str, inputs: Sequence[Value | None], attrs: dict[str, Any] | None = None,
                  *, name: str | None = None, n_outputs: int = 1,
                  out_names: Sequence[str] | None = None,
                  out_types: Sequence[TensorType] | None = None) -> Node:
        """Creates a node (not yet placed in `nodes`) with output types from shape inference."""
        from .ops import infer_types  # local: ops imports graph

        node = Node(op, inputs, [], attrs, name=self.fresh_node_name(name or op.lower()))
        if out_types is None:
            out_types = infer_types(node, n_outputs)
        names = list(out_names) if out_names else [node.name if i == 0 else f"{node.name}_{i}"
                                                   for i in range(len(out_types))]
        node.outputs = [Value(self.fresh_name(n), t, "node", producer=node)
                        for n, t in zip(names, out_types, strict=False)]
        from .ops import infer_sym

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
            nv.sym = v.sym
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
        from .text import print_graph

        return print_graph(self)


def _np_dtype(dt: DType) -> np.dtype:
    from .types import _NUMPY

    return _NUMPY[dt]


def reinfer(g: Graph) -> None:
    """Recomputes every node's output types (and shape arithmetic) after inputs changed shape,
    e.g. when the decode graph pins the token axis to 1."""
    from .ops import infer_sym, infer_types

    for n in g.nodes:
        types = infer_types(n, len(n.outputs))
        for o, t in zip(n.outputs, types, strict=False):
            o.type = t
            o.sym = None
        infer_sym(n)
