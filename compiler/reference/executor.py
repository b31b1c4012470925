"""The reference executor: runs any IR graph (op-level or raised, stateless, prefill or decode)
on the CPU with PyTorch, one node at a time, through the kernels of `kernels.py` (evaluated by
`evaluate.py`, which reports a failing node by name, op and input shapes). It is the oracle for
everything downstream.

State values (the compiler-owned KV cache) are tensors held by the executor and updated in place
by the ops that write them (Attention with a cache), so a decode step sees what prefill wrote.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from zlc.bundle import check_numerics
from zlc.errors import ZlcError
from zlc.ir import Graph
from zlc.ir.quant import Dequantized

from .evaluate import evaluate
from .kernels import const_tensor
from .numerics import numerics as with_numerics


class ReferenceExecutor:
    """Runs a graph; holds state buffers (the KV cache) across calls. `numerics` (zlc.bundle.NUMERICS):
    "fast" computes the CPU kernel's roundings (reference/numerics.py), the oracle of a fast bundle."""

    def __init__(self, graph: Graph, state_shapes: Mapping[str, int] | None = None,
                 state: dict[str, torch.Tensor] | None = None, numerics: str = "exact"):
        self.graph = graph
        self.numerics = check_numerics(numerics)
        # packed matrices (ir.quant.Dequantized) are dequantized where a node reads them, not held here
        self.consts = {id(v): const_tensor(v) for v in graph.consts.values() if not isinstance(v.data, Dequantized)}
        self.state_dims = dict(state_shapes or {})
        # Executors of the prefill and decode graphs share one state dict (one KV cache).
        self.state: dict[str, torch.Tensor] = state if state is not None else {}
        if state is None:
            self.reset_state()

    def reset_state(self) -> None:
        for v in self.graph.state:
            shape = []
            for d in v.shape or ():
                if isinstance(d, str):
                    if d not in self.state_dims:
                        raise ZlcError(f"state '%{v.name}' has symbolic dim '{d}'; give its size")
                    d = self.state_dims[d]
                shape.append(int(d))
            self.state[v.name] = torch.zeros(shape, dtype=v.dtype.torch)

    def run(self, inputs: Mapping[str, Any], *, keep: bool = False) -> dict[str, torch.Tensor]:
        """Runs the graph. Returns outputs by name (and every intermediate value with keep=True)."""
        g = self.graph
        env: dict[int, torch.Tensor] = dict(self.consts)
        for v in g.inputs:
            if v.name not in inputs:
                raise ZlcError(f"missing input '{v.name}' ({v.type})")
            x = inputs[v.name]
            t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
            if t.dtype != v.dtype.torch:
                t = t.to(v.dtype.torch)
            env[id(v)] = t
        for v in g.state:
            env[id(v)] = self.state[v.name]
        named: dict[str, torch.Tensor] = {}
        with with_numerics(self.numerics):
            evaluate(g.nodes, env, named=named if keep else None)
        for v in g.outputs:
            named[v.name] = env[id(v)]
        return named


def run_graph(graph: Graph, inputs: Mapping[str, Any], **state_dims: int) -> dict[str, torch.Tensor]:
    """One-shot convenience: run a graph with fresh state."""
    return ReferenceExecutor(graph, state_dims).run(inputs)



HALF = ("f16", "bf16")


def in_f32(graph: Graph, *, rounding: Iterable[str] = ()) -> Graph:
    """A copy of `graph` that computes in f32 on the same weights: every f16/bf16 value (inputs,
    constants, state, node outputs) becomes f32, half constants are widened exactly where they are
    read (evaluate.py; the copy shares the weights), and casts or
    dtype attributes naming a half type name f32. A half model run this way is what the megakernel
    computes (f32 math on half-rounded weights), and the oracle where ONNX Runtime has no kernels.
    The Casts named in `rounding` still round to half (then widen back): tables the model rounds
    before it uses them, such as rotary cos/sin, which a lowered graph holds as half constants."""
    return _widened(graph, HALF, "f32", rounding)


def in_f64(graph: Graph, *, rounding: Iterable[str] = ()) -> Graph:
    """A copy of `graph` that computes in f64 on the same weights (f32 and half constants widened
    exactly; `rounding` as in_f32): the same arithmetic as the f32 graph without its rounding
    errors. The kernels' oracles measure how far an f32 computation of this model must land from
    it (the reference's own f32 distance), and bound a kernel's distance by a multiple of that:
    a tolerance derived from the model's summation lengths and magnitudes, not tuned to one CPU's
    summation order (tests/native/native_helpers.py)."""
    return _widened(graph, ("f32", *HALF), "f64", rounding)


def _widened(graph: Graph, narrow: tuple[str, ...], wide: str, rounding: Iterable[str]) -> Graph:
    from zlc.ir import DType, Node, TensorType, Value

    to = DType(wide)
    g = graph.clone()
    keep = set(rounding)
    held: set[int] = set()
    for n in list(g.nodes):
        if n.name in keep and n.op == "Cast" and n.attrs.get("to") in HALF:
            widened = Value(g.fresh_name(n.output.name + "_" + wide), TensorType(to, n.output.type.shape), "node")
            g.replace_uses(n.output, widened)
            back = Node("Cast", [n.output], [widened], {"to": wide}, g.fresh_node_name(n.name + "_" + wide))
            widened.producer = back
            g.nodes.insert(g.nodes.index(n) + 1, back)
            held.add(id(n))
    for n in g.nodes:
        if id(n) in held:
            continue
        for o in n.outputs:
            if o.dtype.value in narrow:
                o.type = TensorType(to, o.type.shape)
        for k in ("to", "dtype"):
            if n.attrs.get(k) in narrow:
                n.attrs[k] = wide
    for v in [*g.inputs, *g.consts.values(), *g.state]:
        if v.dtype.value in narrow:
            v.type = TensorType(to, v.type.shape)
            # a constant keeps its data: evaluate.py widens it where a node reads it (one matrix
            # at a time), so this copy of a model holds no wide copy of its weights
    return g
