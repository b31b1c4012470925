"""Evaluating IR nodes with the reference kernels: the one loop behind the executor, constant
folding, semantic probing and activation naming, so every caller runs a node the same way and a
kernel that fails on what it was given is reported the same way (the node, its op, its input shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from zlc.errors import IRError, ShapeError, ZlcError
from zlc.ir import DType, Node, Value
from zlc.ir.quant import Dequantized

from .kernels import KERNELS, const_tensor

Env = dict[int, torch.Tensor]  # id(value) -> its tensor
_HALF = (torch.float16, torch.bfloat16)
# a constant whose graph dtype is wider than its data (executor.in_f32 / in_f64 share the weights):
# widened, exactly, where a node reads it
_NARROWER = {DType.f32: _HALF, DType.f64: (*_HALF, torch.float32)}
CHUNK_BYTES = 16 << 20  # f32 bytes of a packed matrix's rows a Linear dequantizes at once (run_packed)


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


def run_packed(node: Node, args: list[torch.Tensor | None], packed: list[int]) -> list[torch.Tensor]:
    """A node reading packed matrices (ir.quant.Dequantized): each dequantized for this node only,
    never kept, so a run holds one matrix in f32 at a time, not the model. An Embedding dequantizes
    the rows its ids gather; a Linear or LM head on a matrix over CHUNK_BYTES in f32 (a vocabulary's
    table) runs on CHUNK_BYTES of its rows at a time, the outputs' columns concatenated."""
    ws = {i: node.inputs[i].data for i in packed}  # type: ignore[union-attr]
    if node.op == "Embedding" and packed == [0] and args[1] is not None:
        q, ids = ws[0].q, args[1]
        if ids.numel() and 0 <= int(ids.min()) and int(ids.max()) < q.n:  # else the kernel's own error
            uniq, inv = torch.unique(ids.long(), return_inverse=True)
            rows = torch.from_numpy(q.rows(uniq.numpy()).dequantize().reshape(-1, q.k))
            return run_node(node, [rows, inv.reshape(ids.shape)])
    if node.op in ("Linear", "LMHead") and packed == [1] and ws[1].nbytes > CHUNK_BYTES:
        q = ws[1].q
        step = max(1, CHUNK_BYTES // (4 * q.k))
        outs = []
        for lo in range(0, q.n, step):
            part = list(args)
            part[1] = torch.from_numpy(q.rows(slice(lo, lo + step)).dequantize().reshape(-1, q.k))
            if len(part) > 2 and part[2] is not None:
                part[2] = part[2][lo:lo + step]
            outs.append(run_node(node, part)[0])
        return [torch.cat(outs, dim=-1)]
    full = list(args)
    for i, d in ws.items():
        full[i] = torch.from_numpy(np.asarray(d))
    return run_node(node, full)


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
        packed: list[int] = []  # inputs whose data is a packed matrix, dequantized where read (ir.quant)
        for i, v in enumerate(node.inputs):
            if v is None:
                args.append(None)
                continue
            t = env.get(id(v))
            if t is None and fetch is constant and isinstance(v.data, Dequantized):
                packed.append(i)
                args.append(None)
                continue
            if t is None:
                t = env[id(v)] = fetch(v)
            if v.is_const and t.dtype in _NARROWER.get(v.dtype, ()):  # executor.in_f32/in_f64's shared weights
                t = t.to(v.dtype.torch)
            args.append(t)
        outs = run_packed(node, args, packed) if packed else run_node(node, args)
        for o, t in zip(node.outputs, outs, strict=True):
            env[id(o)] = t
            if named is not None:
                named[o.name] = t
    return env
