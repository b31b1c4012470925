"""Small helpers the raising rules' checks use: producers, scalars, slice bounds, activations."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from zlc.ir import Graph, Node, Value
from zlc.reference.evaluate import evaluate

from .pattern import scalar

TRANSPARENT = ("Cast", "Identity")


def prod(v: Value | None, op: str | tuple[str, ...] | None = None) -> Node | None:
    n = v.producer if v is not None else None
    if n is None:
        return None
    if op is not None and n.op not in ((op,) if isinstance(op, str) else op):
        return None
    return n


def strip(v: Value, ops: tuple[str, ...] = TRANSPARENT) -> Value:
    """Follows Cast/Identity producers upward."""
    while v.producer is not None and v.producer.op in ops and v.producer.inputs[0] is not None:
        v = v.producer.inputs[0]
    return v


def const2d(v: Value | None) -> np.ndarray | torch.Tensor | None:
    if v is None or v.data is None or v.shape is None or len(v.shape) != 2:
        return None
    return v.data


def other(node: Node, v: Value) -> Value | None:
    """The other input of a binary node."""
    a, b = node.inputs[0], node.inputs[1]
    return b if a is v else a if b is v else None


def slice_bounds(n: Node) -> tuple[int, int, int] | None:
    """(start, end, axis) of a unit-step single-axis Slice with constant bounds."""
    if n.op != "Slice":
        return None
    vals = []
    for i in (1, 2, 3):
        v = n.input(i)
        if v is None:
            return None
        a = v.const_array() if v.data is not None else (
            None if v.sym is None or not all(isinstance(x, int) for x in v.sym) else v.sym)
        if a is None or len(list(a if not hasattr(a, "reshape") else a.reshape(-1))) != 1:  # type: ignore[arg-type]
            return None
        vals.append(int(list(a if not hasattr(a, "reshape") else a.reshape(-1))[0]))  # type: ignore[arg-type]
    step = n.input(4)
    if step is not None and scalar(step) not in (1.0, None):
        return None
    return vals[0], vals[1], vals[2]


def last_axis(node: Node, rank: int | None) -> bool:
    axes = node.attrs.get("axes")
    if rank is None or axes is None or len(axes) != 1:
        return False
    return axes[0] % rank == rank - 1


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu,
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "relu": torch.relu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
ELEMENTWISE = {"Neg", "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Tanh", "Sigmoid", "Erf", "Relu",
               "Gelu", "Silu", "Softplus", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Cast",
               "Identity"}


def _scalar_tensor(v: Value) -> torch.Tensor:
    """A one-element constant of the activation chain as a 0-D tensor (broadcasts over the probe)."""
    arr = v.const_array()
    assert arr is not None
    return torch.tensor(arr.reshape(()).item(), dtype=v.dtype.torch)


def elementwise_activation(g: Graph, start: Value, end: Value) -> str:
    """Names the activation that the elementwise chain start -> end computes, or raises ValueError
    with the reason. Every node between must be elementwise with only constant scalar operands."""
    order: list[Node] = []  # post-order: producers before consumers, whatever g.nodes says
    seen: set[int] = set()

    def visit(v: Value) -> None:
        if v is start or id(v) in seen:
            return
        seen.add(id(v))
        if v.data is not None:
            arr = v.const_array()
            if arr is not None and arr.size == 1:
                return
            raise ValueError(f"non-scalar constant '{v.name}' in the activation")
        n = v.producer
        if n is None or n.op not in ELEMENTWISE:
            raise ValueError(f"'{v.name}' is not an elementwise function of '{start.name}'")
        for x in n.inputs:
            if x is not None:
                visit(x)
        order.append(n)

    visit(end)
    x = torch.linspace(-8, 8, 401, dtype=start.dtype.torch if start.dtype.is_float else torch.float32)
    env = evaluate(order, {id(start): x}, fetch=_scalar_tensor)
    y = env.get(id(end))
    if y is None:
        raise ValueError("activation chain did not reach its end")
    for name, fn in ACTIVATIONS.items():
        ref = fn(x.double()).to(y.dtype)
        if y.shape == ref.shape and torch.allclose(y, ref, atol=2e-5, rtol=1e-4):
            return name
    raise ValueError("elementwise chain matches no known activation (silu, gelu, gelu_tanh, relu, quick_gelu)")
