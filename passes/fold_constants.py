"""Constant folding: evaluate nodes whose inputs are all constants with the reference kernels
(zlc.reference.evaluate), and turn values whose symbolic elements are all static ints into constants.

Folding `Transpose(W)`, `Cast(W)` or `Reshape(W)` of a weight is how weight layouts get folded, so
results derived from a weight become new constants named after it (`W.T`, `W.f16`, `W.reshape`);
other folded values keep the name of the value they replace. Constant data is never written: a
kernel result that aliases an input (views) is copied before it becomes a constant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zlc.ir import DType, Graph, Node, Value
from zlc.reference.evaluate import has_kernel, run_node
from zlc.reference.kernels import const_tensor

from .base import PassResult, drop_consts, has_side_effects, release_value_name

MAX_ELEMENTS = 2**24  # larger results (giant Expand/ConstantOfShape) stay computed at run time
WEIGHT_MIN = 65  # constants with more elements than a literal count as weights for naming


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _const_data(t: torch.Tensor, inputs: list[torch.Tensor]) -> Any:
    """A fresh, contiguous copy of the result unless it already owns its memory."""
    if any(_storage(t) == _storage(x) for x in inputs if x.numel()) or not t.is_contiguous():
        t = t.clone(memory_format=torch.contiguous_format)
    return t if t.dtype == torch.bfloat16 else t.numpy()


def _suffix(node: Node) -> str:
    if node.op == "Transpose":
        return "T"
    if node.op == "Cast":
        return str(node.attrs["to"])
    return node.op.lower()


def _static_numel(v: Value) -> int | None:
    return v.type.numel() if v.type.is_static else None


class _Folder:
    def __init__(self, graph: Graph, max_elements: int):
        self.g = graph
        self.max_elements = max_elements
        self.outputs = {id(v) for v in graph.outputs}
        self.subst: dict[int, Value] = {}
        self.stats = {"folded_nodes": 0, "sym_consts": 0, "weight_consts": 0, "skipped_large": 0,
                      "kernel_errors": 0}

    def _new_const(self, old: Value, data: Any, weight: Value | None, node: Node) -> Value:
        if weight is not None and id(old) not in self.outputs:
            self.stats["weight_consts"] += 1
            name = self.g.fresh_name(f"{weight.name}.{_suffix(node)}")
            release_value_name(self.g, name)  # fresh_name claims it; add_const claims it again
            c = self.g.add_const(name, data)
        else:
            release_value_name(self.g, old.name)  # the node output dies here; its name moves
            c = self.g.add_const(old.name, data)
        self.subst[id(old)] = c
        return c

    def try_fold(self, node: Node) -> bool:
        ins = [v for v in node.inputs if v is not None]
        if not ins or any(v.kind != "const" for v in ins) or not has_kernel(node.op) or has_side_effects(node):
            return False
        sizes = [_static_numel(o) for o in node.outputs]
        if any(s is None or s > self.max_elements for s in sizes):
            self.stats["skipped_large"] += 1
            return False
        args = [None if v is None else const_tensor(v) for v in node.inputs]
        try:
            results = run_node(node, args)
        except Exception:  # leave it to run time, where the executor names the node and shapes
            self.stats["kernel_errors"] += 1
            return False
        for o, t in zip(node.outputs, results, strict=True):
            if tuple(t.shape) != tuple(o.shape or ()):
                return False  # the kernel disagrees with inference: not ours to paper over
        weights = [v for v in ins if (v.type.numel() or 0) >= WEIGHT_MIN]
        weight = weights[0] if weights else None
        inputs = [a for a in args if a is not None]
        for o, t in zip(node.outputs, results, strict=True):
            if t.dtype != o.dtype.torch:
                t = t.to(o.dtype.torch)
            self._new_const(o, _const_data(t, inputs), weight, node)
        self.stats["folded_nodes"] += 1
        return True

    def try_sym(self, node: Node) -> bool:
        """A single-output node whose value is fully known from shape arithmetic."""
        if len(node.outputs) != 1 or has_side_effects(node):
            return False
        o = node.outputs[0]
        if o.sym is None or not all(isinstance(d, int) for d in o.sym) or o.dtype not in (DType.i64, DType.i32):
            return False
        if o.shape is None or len(o.shape) > 1 or not o.type.is_static or o.type.numel() != len(o.sym):
            return False
        shape = tuple(int(d) for d in o.shape)  # static: checked above
        arr = np.array(o.sym, dtype=np.int64 if o.dtype == DType.i64 else np.int32).reshape(shape)
        self._new_const(o, arr, None, node)
        self.stats["sym_consts"] += 1
        return True

    def run(self) -> bool:
        g = self.g
        keep: list[Node] = []
        touched: list[Value] = []
        for node in g.nodes:
            if self.subst:
                node.inputs = [None if v is None else self.subst.get(id(v), v) for v in node.inputs]
            if self.try_fold(node) or self.try_sym(node):
                touched.extend(v for v in node.inputs if v is not None)
                continue
            keep.append(node)
        if not self.subst:
            return False
        g.nodes = keep
        g.outputs = [self.subst.get(id(v), v) for v in g.outputs]
        self.stats["dropped_consts"] = drop_consts(g, touched)
        return True


def fold_constants(graph: Graph, *, max_elements: int = MAX_ELEMENTS) -> PassResult:
    f = _Folder(graph, max_elements)
    changed = f.run()
    return PassResult(changed, {k: v for k, v in f.stats.items() if v})


@dataclass(frozen=True)
class FoldConstants:
    max_elements: int = MAX_ELEMENTS
    name: str = "fold_constants"

    def run(self, graph: Graph) -> PassResult:
        return fold_constants(graph, max_elements=self.max_elements)
