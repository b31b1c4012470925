"""The pass protocol and the few graph-editing helpers every pass shares.

A pass is a named object with `run(graph) -> PassResult`. Passes are pure Graph -> Graph in
spirit: they may mutate the graph they are given, and a driver that needs the before-state (for
`--after` dumps or diff tests) clones first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from zlc.ir import Dim, Graph, Node, TensorType, Value, verify_graph
from zlc.ir.verify import compatible_types


@dataclass
class PassResult:
    changed: bool
    stats: dict[str, int] = field(default_factory=dict)


@runtime_checkable
class Pass(Protocol):
    @property
    def name(self) -> str: ...

    def run(self, graph: Graph) -> PassResult: ...


def run_passes(graph: Graph, passes: Sequence[Pass], *, verify: bool = False) -> list[tuple[str, PassResult]]:
    """Runs passes in order on `graph` (in place); with verify, checks the IR after each one."""
    results = []
    for p in passes:
        results.append((p.name, p.run(graph)))
        if verify:
            verify_graph(graph)
    return results


# ---- shared helpers ----------------------------------------------------------------------------

def has_side_effects(node: Node) -> bool:
    """A node that reads a state buffer writes it (Attention with a KV cache): never dead, never merged."""
    return any(v is not None and v.kind == "state" for v in node.inputs)


def known_elements(v: Value | None) -> list[Dim] | None:
    """Known elements of a small 0-D/1-D integer tensor: its symbolic elements or constant data."""
    if v is None:
        return None
    if v.sym is not None:
        return list(v.sym)
    arr = v.const_array() if v.kind == "const" else None
    if arr is not None and arr.ndim <= 1 and arr.size <= 64 and arr.dtype.kind in "iu":
        return [int(x) for x in arr.reshape(-1)]
    return None


def is_unknown_dim(d: object) -> bool:
    """Symbolic dims with '?' are placeholders (positional, not identities): never equal to anything."""
    return isinstance(d, str) and "?" in d


def same_shape(a: TensorType, b: TensorType) -> bool:
    """Provably equal shapes: same rank, same static ints, same (known) symbols."""
    if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
        return False
    return all(x == y and not is_unknown_dim(x) for x, y in zip(a.shape, b.shape, strict=True))


def compatible(a: TensorType, b: TensorType) -> bool:
    """Could be the same tensor type: dtype equal, and no two static dims disagree."""
    return compatible_types(a, b)


def precision(t: TensorType) -> int:
    """How much a type says: known rank, then static dims, then named (non-'?') symbols."""
    if t.shape is None:
        return 0
    return 1 + sum(2 if isinstance(d, int) else (0 if is_unknown_dim(d) else 1) for d in t.shape)


# Value and node names are claimed in the graph (so `fresh_name` never hands out a live name);
# passes that give a replacement its predecessor's name go through these.

def release_value_name(graph: Graph, name: str) -> None:
    graph.release_name(name)


def rename_value(graph: Graph, v: Value, name: str) -> None:
    """Gives `v` a name whose previous owner is gone (or about to be); keeps `consts` keyed by name."""
    if v.name == name:
        return
    old = v.name
    graph.release_name(old)
    graph.release_name(name)  # its previous owner is gone or about to be
    graph.claim_name(name)
    v.name = name
    if v.kind == "const" and graph.consts.get(old) is v:
        graph.consts = {(name if k == old else k): c for k, c in graph.consts.items()}


def rename_node(graph: Graph, node: Node, name: str) -> None:
    if node.name == name:
        return
    graph.release_node_name(node.name)
    graph.claim_node_name(name)
    node.name = name


def drop_consts(graph: Graph, candidates: Iterable[Value]) -> int:
    """Removes the candidate constants that no node and no graph output uses any more."""
    cand = {id(v): v for v in candidates if v.kind == "const"}
    if not cand:
        return 0
    for n in graph.nodes:
        for v in n.inputs:
            if v is not None:
                cand.pop(id(v), None)
    for v in graph.outputs:
        cand.pop(id(v), None)
    for v in cand.values():
        if graph.consts.get(v.name) is v:
            del graph.consts[v.name]
            graph.release_name(v.name)
    return len(cand)


def weight_rows(graph: Graph, name: str, w: Value, rows: Any) -> Value:
    """A new constant `name` (made unique) of rows `rows` (a slice or an index array) of the
    [N, K] matrix `w`, keeping its packed blocks where it has them: blocks lie along K, so the
    same rows of the blocks are exactly the rows' blocks (a fused QKV or gate/up split)."""
    data = w.data[rows] if isinstance(rows, slice) else np.asarray(w.data)[rows]  # a slice: a view, no copy
    v = graph.add_const(name, data, unique=True)
    if w.quant is not None:
        v.quant = w.quant.rows(rows)
    return v
