"""Dead-code elimination: drop nodes no graph output depends on, then unused constants.

Graph outputs and state writes are the roots of liveness: a node that reads a state buffer writes
it (Attention with a KV cache), so it is never dead even when nothing reads its outputs. Graph
inputs and state buffers are the graph's interface and always stay.
"""

from __future__ import annotations

from dataclasses import dataclass

from zlc.ir import Graph

from .base import PassResult, has_side_effects


def dce(graph: Graph) -> PassResult:
    live = {id(v) for v in graph.outputs}
    keep = []
    for node in reversed(graph.nodes):  # nodes are in topological order: users come later
        if has_side_effects(node) or any(id(o) in live for o in node.outputs):
            keep.append(node)
            live.update(id(v) for v in node.inputs if v is not None)
    removed = len(graph.nodes) - len(keep)
    if removed:
        keep.reverse()
        graph.nodes = keep
    consts = graph.drop_unused_consts()
    stats = {"nodes_removed": removed, "consts_removed": consts}
    return PassResult(bool(removed or consts), {k: v for k, v in stats.items() if v})


@dataclass(frozen=True)
class DeadCodeElimination:
    name: str = "dce"

    def run(self, graph: Graph) -> PassResult:
        return dce(graph)
