"""Evaluating IR nodes with the reference kernels: the one loop behind the executor, constant
folding, semantic probing and activation naming, so every caller runs a node the same way and a
kernel that fails on what it was given is reported the same way (the node, its op, its input shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from zlc.errors import IRError, ShapeError, ZlcError
from zlc.ir import DType, Node, Value

from .kernels import KERNELS, const_tensor

Env = dict[int, torch.Tensor]  # id(value) -> its tensor
_HALF = (torch.float16, torch.bfloat16)
# a constant whose graph dtype is wider than its data (executor.in_f32 / in_f64 share the weights):
# widened, exactly, where a node reads it
_NARROWER = {DType.f32: _HALF, DType.f64: (*_HALF, torch.float32)}


def has_kernel(op: str) -> bool:
    return op in KERNELS


def run_node(node: Node, args: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Runs one node's kernel. zlc's own errors pass through; any other failure becomes a ShapeError
    naming the node and its input shapes; a missing kernel is an IRError."""
    k = KERNELS.get(node.op)
    if k is None:
        raise IRError(f"reference executor has no kernel for op '{node.op}' (node '{node.name}')")
    try:
        outs = k(node, args)
    except ZlcError:
        raise
    except Exception as e:  # a kernel failing on what it was given: report the node
        shapes = [None if a is None else tuple(a.shape) for a in args]
        first = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise ShapeError(f"node '{node.name}' ({node.op}) failed on input shapes {shapes}: {first}") from e
    if len(outs) != len(node.outputs):
        raise ShapeError(f"node '{node.name}' ({node.op}) produced {len(outs)} outputs, "
                         f"its graph node has {len(node.outputs)}")
    return outs


def constant(v: Value) -> torch.Tensor:
    """The default for a value missing from the environment: a constant's data, else an error."""
    if v.data is None:
        raise ZlcError(f"no value for '%{v.name}' ({v.kind}) to evaluate with")
    return const_tensor(v)


def evaluate(nodes: Iterable[Node], env: Env, *, fetch: Callable[[Value], torch.Tensor] = constant,
             named: dict[str, torch.Tensor] | None = None) -> Env:
    """Runs `nodes` in order (producers first), reading inputs from and writing outputs to `env`.
    A value missing from `env` comes from `fetch` (by default: constants) and is kept there; with
    `named`, every output is also recorded by value name. Returns `env`."""
    for node in nodes:
        args: list[torch.Tensor | None] = []
        for v in node.inputs:
            if v is None:
                args.append(None)
                continue
            t = env.get(id(v))
            if t is None:
                t = env[id(v)] = fetch(v)
            if v.is_const and t.dtype in _NARROWER.get(v.dtype, ()):  # executor.in_f32/in_f64's shared weights
                t = t.to(v.dtype.torch)
            args.append(t)
        for o, t in zip(node.outputs, run_node(node, args), strict=True):
            env[id(o)] = t
            if named is not None:
                named[o.name] = t
    return env
