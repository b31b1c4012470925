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
    """A one-element constant of the activation chain as a 0-D tensor (broadcasts over the probe).
    Float constants come as f32 (a half model's constants, rounded to half, computed in f32)."""
    arr = v.const_array()
    assert arr is not None
    return torch.tensor(arr.reshape(()).item(), dtype=torch.float32 if v.dtype.is_float else v.dtype.torch)


def elementwise_activation(g: Graph, start: Value, end: Value) -> str:
    """Names the activation that the elementwise chain start -> end computes, or raises ValueError
    with the reason. Every node between must be elementwise with only constant scalar operands."""
    order: list[Node] = []  # post-order: producers before consumers, whatever g.nodes says
    consts: list[Value] = []  # the chain's scalar constants
    seen: set[int] = set()

    def visit(v: Value) -> None:
        if v is start or id(v) in seen:
            return
        seen.add(id(v))
        if v.data is not None:
            arr = v.const_array()
            if arr is not None and arr.size == 1:
                consts.append(v)
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
    # The chain runs in f32, as the kernel computes it: a Cast between float types (a half model's
    # upcast around the activation and its cast back) is the identity there, so an f16/bf16 chain
    # names the same activation as its f32 original instead of failing on half rounding.
    x = torch.linspace(-8, 8, 401, dtype=torch.float32)
    env = {id(start): x}
    for n in order:
        if n.op == "Cast" and n.output.dtype.is_float and n.inputs[0] is not None and n.inputs[0].dtype.is_float:
            env[id(n.output)] = env[id(n.inputs[0])] if id(n.inputs[0]) in env else _scalar_tensor(n.inputs[0])
        else:
            evaluate([n], env, fetch=_scalar_tensor)
    y = env.get(id(end))
    if y is None:
        raise ValueError("activation chain did not reach its end")
    # A half model's constants are rounded to half (gelu_tanh's 0.044715 and sqrt(2/pi) in bf16 are
    # off by ~1e-3): the tolerance follows the coarsest float constant, and the closest activation
    # within it wins (so gelu and gelu_tanh, ~5e-4 apart, are not told apart by the order below).
    eps = max([torch.finfo(c.dtype.torch).eps for c in consts if c.dtype.is_float] + [2e-5])
    tol = 2e-5 if eps <= 2e-5 else 4 * eps
    best: tuple[float, str] | None = None
    for name, fn in ACTIVATIONS.items():
        ref = fn(x.double()).to(y.dtype)
        if y.shape == ref.shape and torch.allclose(y, ref, atol=tol, rtol=5 * tol):
            err = float((y - ref).abs().max())
            if best is None or err < best[0]:
                best = (err, name)
    if best is not None:
        return best[1]
    raise ValueError("elementwise chain matches no known activation (silu, gelu, gelu_tanh, relu, quick_gelu)")
