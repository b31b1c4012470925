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
CHUNK_BYTES = 16 << 20  # wide bytes of a matrix's rows a Linear widens at once (run_wide)


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


class Wide:
    """A matrix a node reads wider than it is held, widened where read and never kept: a packed
    matrix (ir.quant.Dequantized, dequantized to f32) or a half constant of an executor.in_f32 /
    in_f64 graph (the mapped weights, widened exactly to `to`)."""

    def __init__(self, data: Dequantized | torch.Tensor, to: torch.dtype = torch.float32):
        self.data, self.to = data, to

    @property
    def nbytes(self) -> int:
        return self.data.nbytes if isinstance(self.data, Dequantized) else self.data.numel() * self.to.itemsize

    @property
    def n(self) -> int:
        return len(self.data)

    @property
    def k(self) -> int:
        return self.data.q.k if isinstance(self.data, Dequantized) else int(self.data.shape[-1])

    def matrix(self) -> bool:
        return isinstance(self.data, Dequantized) or self.data.dim() == 2

    def rows(self, sel: slice | torch.Tensor) -> torch.Tensor:
        d = self.data
        if isinstance(d, Dequantized):
            return torch.from_numpy(d.q.rows(sel if isinstance(sel, slice) else sel.numpy())
                                    .dequantize().reshape(-1, d.q.k))
        return d[sel].to(self.to)

    def whole(self) -> torch.Tensor:
        d = self.data
        return torch.from_numpy(np.asarray(d)) if isinstance(d, Dequantized) else d.to(self.to)


def chunk_rows(k: int, itemsize: int = 4) -> int:
    """Rows of a [N, k] matrix a Linear widens at once: CHUNK_BYTES of f32, in whole multiples of
    256 rows, at which the f32 GEMM's columns come out bit-identical to one call on the whole
    matrix (checked on MKL for vocabularies of 32k-152k and k of 576-3072; an unaligned split
    moved some logits by an ulp)."""
    return max(256, CHUNK_BYTES // (itemsize * k) // 256 * 256)


def run_wide(node: Node, args: list[torch.Tensor | None], wide: dict[int, Wide]) -> list[torch.Tensor]:
    """A node reading matrices held narrower than it computes (`Wide`): each widened for this node
    only, so a run holds one matrix wide at a time, not the model. An Embedding widens the rows its
    ids gather; a Linear or LM head on a matrix over CHUNK_BYTES wide (a vocabulary's table) runs
    on `chunk_rows` of its rows at a time, the outputs' columns concatenated; anything else reads
    each matrix widened whole."""
    full = list(args)
    for i, w in wide.items():  # the small ones (a bias, a norm's weights) whole
        if not ((node.op == "Embedding" and i == 0) or (node.op in ("Linear", "LMHead") and i == 1)):
            full[i] = w.whole()
    if node.op == "Embedding" and 0 in wide and args[1] is not None:
        w, ids = wide[0], args[1]
        if ids.numel() and 0 <= int(ids.min()) and int(ids.max()) < w.n:  # else the kernel's own error
            uniq, inv = torch.unique(ids.long(), return_inverse=True)
            return run_node(node, [w.rows(uniq), inv.reshape(ids.shape)])
    if node.op in ("Linear", "LMHead") and 1 in wide and wide[1].matrix() and wide[1].nbytes > CHUNK_BYTES:
        w = wide[1]
        step = chunk_rows(w.k, w.to.itemsize)
        outs = []
        for lo in range(0, w.n, step):
            part = list(full)
            part[1] = w.rows(slice(lo, lo + step))
            if len(part) > 2 and part[2] is not None:
                part[2] = part[2][lo:lo + step]
            outs.append(run_node(node, part)[0])
        return [torch.cat(outs, dim=-1)]
    for i, w in wide.items():
        if full[i] is None:
            full[i] = w.whole()
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
        wide: dict[int, Wide] = {}  # inputs held narrower than the node computes, widened where read
        for i, v in enumerate(node.inputs):
            if v is None:
                args.append(None)
                continue
            t = env.get(id(v))
            if t is None and fetch is constant and isinstance(v.data, Dequantized):  # a packed matrix (ir.quant)
                wide[i] = Wide(v.data)
                args.append(None)
                continue
            if t is None:
                t = env[id(v)] = fetch(v)
            if v.is_const and t.dtype in _NARROWER.get(v.dtype, ()):  # executor.in_f32/in_f64's shared weights
                wide[i] = Wide(t, v.dtype.torch)
                args.append(None)
                continue
            args.append(t)
        outs = run_wide(node, args, wide) if wide else run_node(node, args)
        for o, t in zip(node.outputs, outs, strict=True):
            env[id(o)] = t
            if named is not None:
                named[o.name] = t
    return env
