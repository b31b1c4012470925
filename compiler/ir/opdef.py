"""What an op definition is, and the shape arithmetic the definitions share.

The op table is written by family (ops_primitive.py: the ONNX-like op level; ops_transformer.py:
what raising produces) and assembled in ops.py; this module is what both families build on:
`OpDef`, `define` (the decorator a family fills its table with), symbolic dim arithmetic
(dims are ints or symbols such as "seq"), broadcasting, and the known elements of small integer
tensors that shape arithmetic (Shape -> Gather -> Concat -> Reshape) carries in `Value.sym`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zlc.errors import ShapeError

from .types import Dim, TensorType
from .values import Node, Value

Infer = Callable[[Node], list[TensorType]]


@dataclass(frozen=True)
class OpDef:
    name: str
    level: str  # "primitive" | "transformer"
    infer: Infer
    min_inputs: int
    max_inputs: int  # -1: variadic
    doc: str = ""
    optional: tuple[int, ...] = ()  # inputs below min_inputs that may still be absent (None)


def define(table: dict[str, OpDef], name: str, level: str, min_in: int, max_in: int, doc: str = "",
           optional: tuple[int, ...] = ()) -> Callable[[Infer], Infer]:
    """Decorator: adds the op `name`, whose output types the decorated function infers, to `table`."""
    def deco(fn: Infer) -> Infer:
        table[name] = OpDef(name, level, fn, min_in, max_in, doc, optional)
        return fn

    return deco


# ---- symbolic dim arithmetic -------------------------------------------------------------------

def is_int(d: Any) -> bool:
    """A static extent (Python or numpy int, not bool); anything else is a symbolic dim."""
    return isinstance(d, (int, np.integer)) and not isinstance(d, bool)


def dim_add(a: Dim, b: Dim) -> Dim:
    if is_int(a) and is_int(b):
        return int(a) + int(b)
    if is_int(b) and int(b) == 0:
        return a
    if is_int(a) and int(a) == 0:
        return b
    if is_int(b) and int(b) < 0:
        return f"{a}-{-int(b)}"
    return f"{a}+{b}"


def dim_sub(a: Dim, b: Dim) -> Dim:
    if is_int(a) and is_int(b):
        return int(a) - int(b)
    if is_int(b) and int(b) == 0:
        return a
    if isinstance(a, str) and isinstance(b, str) and a.endswith("+" + b):
        return a[: -len(b) - 1]
    if a == b:
        return 0
    return f"{a}-{b}"


def dim_mul(a: Dim, b: Dim) -> Dim:
    if is_int(a) and is_int(b):
        return int(a) * int(b)
    if is_int(a) and int(a) == 1:
        return b
    if is_int(b) and int(b) == 1:
        return a
    return f"{a}*{b}"


def broadcast(shapes: Sequence[tuple[Dim, ...] | None], node: Node | None = None) -> tuple[Dim, ...] | None:
    """Numpy broadcasting over static and symbolic dims (None: a rank is unknown)."""
    if any(s is None for s in shapes):
        return None
    rank = max(len(s) for s in shapes if s is not None)
    out: list[Dim] = []
    for i in range(rank):
        dims = [s[len(s) - rank + i] for s in shapes if s is not None and len(s) - rank + i >= 0]
        d: Dim = 1
        for x in dims:
            if x == 1 or x == d:
                continue
            if d == 1:
                d = x
            elif is_int(d) and is_int(x):
                where = f" at node '{node.name}' ({node.op})" if node else ""
                raise ShapeError(f"cannot broadcast shapes {list(map(list, shapes))}{where}")  # type: ignore[arg-type]
            elif isinstance(d, str) and is_int(x):
                d = x  # a static extent pins the symbol
        out.append(d)
    return tuple(out)


def norm_axis(axis: int, rank: int, node: Node) -> int:
    """A possibly negative axis as an index into the shape; ShapeError naming the node if out of range."""
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < max(rank, 1) and not (rank == 0 and a == 0):
        raise ShapeError(f"axis {axis} out of range for rank {rank} at node '{node.name}' ({node.op})")
    return a


def type_of(v: Value | None) -> TensorType:
    """The type of an input the op's arity guarantees is present."""
    assert v is not None
    return v.type


def elements(v: Value | None) -> list[Dim] | None:
    """Known elements of a small 0-D/1-D integer tensor (constant data or symbolic)."""
    if v is None:
        return None
    if v.sym is not None:
        return list(v.sym)
    if v.data is not None:
        a = v.const_array()
        if a is not None and a.ndim <= 1 and a.size <= 64 and a.dtype.kind in "iub":
            return [int(x) for x in a.reshape(-1)]
    return None
