"""Common-subexpression elimination: merge identical constants, then identical nodes.

Small constants (up to SMALL_CONST elements) merge when dtype, shape and bytes agree; large ones
(weights) only when they are the same data object (e.g. tied embeddings loaded once), because
hashing hundreds of megabytes to find an unlikely duplicate is not worth it. Nodes merge when op,
inputs (after earlier merges) and attributes agree; for commutative ops the operand order does not
matter. Nodes that write state are never merged. A graph output keeps its name: when a duplicate
is a graph output, the surviving value takes that name, unless it is an output itself.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from zlc.ir import Graph, Node, Value

from .base import PassResult, drop_consts, has_side_effects, rename_value
from .pattern import COMMUTATIVE

SMALL_CONST = 64


def _freeze(v: Any) -> Hashable:
    """A hashable attribute key that keeps 1, 1.0 and True apart (and -0.0 from 0.0)."""
    if isinstance(v, (list, tuple)):
        return ("list", tuple(_freeze(x) for x in v))
    if isinstance(v, float):
        return ("float", v.hex())
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _freeze(x)) for k, x in v.items())))
    return (type(v).__name__, v)


def _const_key(v: Value) -> Hashable:
    n = v.type.numel()
    if n is not None and n <= SMALL_CONST:
        arr = v.const_array()
        if arr is not None:
            return ("small", v.type, arr.tobytes())
    return ("data", v.type, id(v.data))


def _node_key(n: Node) -> Hashable:
    ins = tuple(None if v is None else id(v) for v in n.inputs)
    if n.op in COMMUTATIVE and len(ins) == 2 and None not in ins:
        ins = tuple(sorted(ins, key=lambda x: x or 0))  # operand order does not matter
    attrs = tuple(sorted((k, _freeze(a)) for k, a in n.attrs.items()))
    return (n.op, ins, attrs, len(n.outputs))


def cse(graph: Graph) -> PassResult:
    outputs = {id(v) for v in graph.outputs}
    subst: dict[int, Value] = {}

    def can_merge(dup: Value, kept: Value) -> bool:
        # a graph output's name is interface: only a node value that is not an output can take it
        return id(dup) not in outputs or (id(kept) not in outputs and kept.kind == "node")

    def merge(dup: Value, kept: Value) -> None:
        if id(dup) in outputs:
            rename_value(graph, kept, dup.name)
            outputs.add(id(kept))
        subst[id(dup)] = kept

    seen_consts: dict[Hashable, Value] = {}
    dup_consts: list[Value] = []
    for c in list(graph.consts.values()):
        first = seen_consts.setdefault(_const_key(c), c)
        if first is not c and can_merge(c, first):
            merge(c, first)
            dup_consts.append(c)

    seen_nodes: dict[Hashable, Node] = {}
    keep: list[Node] = []
    nodes_merged = 0
    for n in graph.nodes:
        if subst:
            n.inputs = [None if v is None else subst.get(id(v), v) for v in n.inputs]
        if not has_side_effects(n):
            key = _node_key(n)
            first_n = seen_nodes.get(key)
            if first_n is None:
                seen_nodes[key] = n
            elif all(can_merge(o, k) for o, k in zip(n.outputs, first_n.outputs, strict=True)):
                for o, k in zip(n.outputs, first_n.outputs, strict=True):
                    merge(o, k)
                nodes_merged += 1
                continue
        keep.append(n)

    if not subst:
        return PassResult(False, {})
    graph.nodes = keep
    graph.outputs = [subst.get(id(v), v) for v in graph.outputs]
    dropped = drop_consts(graph, dup_consts)
    stats = {"nodes_merged": nodes_merged, "consts_merged": dropped}
    return PassResult(True, {k: v for k, v in stats.items() if v})


@dataclass(frozen=True)
class CommonSubexpressionElimination:
    name: str = "cse"

    def run(self, graph: Graph) -> PassResult:
        return cse(graph)
