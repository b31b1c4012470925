"""The IR's op set: one table of op definitions with shape/dtype inference.

Op-level ops follow ONNX semantics (broadcasting, negative axes) with attributes normalized by the
frontends (e.g. reduce axes and squeeze axes are always attributes, Gemm is lowered to MatMul/Add).
Transformer-level ops are what raising produces and what codegen tiles. Both live in one graph.
Besides static shapes, inference propagates the *symbolic elements* of small integer tensors
(`Value.sym`) so that shape arithmetic (Shape -> Gather -> Concat -> Reshape) yields exact shapes.

The definitions are written by family (ops_primitive.py, ops_transformer.py, on opdef.py's
vocabulary); this module assembles the table and holds the inference entry points that Graph's
builder (graph.py) calls. They work on Node/Value (values.py), so the direction is one-way:
values -> ops -> graph -> text.
"""

from __future__ import annotations

from zlc.errors import ShapeError

from . import ops_primitive, ops_transformer
from .opdef import OpDef, dim_add, dim_mul, dim_sub, elements, is_int, type_of
from .types import Dim, DType, TensorType
from .values import Node

__all__ = ["OPS", "TRANSFORMER_OPS", "OpDef", "infer_sym", "infer_types", "is_transformer_op"]

OPS: dict[str, OpDef] = {**ops_primitive.DEFS, **ops_transformer.DEFS}
assert len(OPS) == len(ops_primitive.DEFS) + len(ops_transformer.DEFS), "an op defined at both levels"

TRANSFORMER_OPS = frozenset(k for k, v in OPS.items() if v.level == "transformer")


# ---- inference entry points -----------------------------------------------------------------

def infer_types(node: Node, n_outputs: int = 1) -> list[TensorType]:
    """The output types of `node` by its op's definition; ShapeError for an unknown op, a wrong
    number of inputs or a missing required one, and shapes that do not fit."""
    d = OPS.get(node.op)
    if d is None:
        raise ShapeError(f"unknown IR op '{node.op}' at node '{node.name}'")
    n = len(node.inputs)
    if n < d.min_inputs or (d.max_inputs >= 0 and n > d.max_inputs):
        raise ShapeError(f"{node.op} '{node.name}' takes {d.min_inputs}..{d.max_inputs} inputs, got {n}")
    for i, v in enumerate(node.inputs):
        if v is None and i < d.min_inputs and i not in d.optional:
            raise ShapeError(f"{node.op} '{node.name}': required input {i} is missing")
    return d.infer(node)


def _sym_binary(op: str, a: Dim, b: Dim) -> Dim | None:
    if op == "Add":
        return dim_add(a, b)
    if op == "Sub":
        return dim_sub(a, b)
    if op == "Mul":
        return dim_mul(a, b)
    if op == "Div" and is_int(a) and is_int(b) and int(b) != 0:
        return int(a) // int(b)
    if op == "Div" and is_int(b) and int(b) == 1:
        return a
    if op in ("Max", "Min") and is_int(a) and is_int(b):
        return max(int(a), int(b)) if op == "Max" else min(int(a), int(b))
    return None


def _sym_equal(a: Dim, b: Dim) -> int | None:
    """1/0 when the equality of two dims is decidable: ints, the same symbol, or a symbol (a
    non-negative extent) against a negative int; None otherwise."""
    if is_int(a) and is_int(b):
        return int(int(a) == int(b))
    if a == b:
        return 1
    if (is_int(a) and int(a) < 0) or (is_int(b) and int(b) < 0):
        return 0
    return None


def infer_sym(node: Node) -> None:
    """Propagates known elements of small integer tensors (shape arithmetic)."""
    if not node.outputs:
        return
    if node.op == "Equal" and node.outputs[0].dtype == DType.bool:
        a, b = elements(node.inputs[0]), elements(node.inputs[1])
        if a is not None and b is not None and len(a) == len(b):
            eq = [_sym_equal(x, y) for x, y in zip(a, b, strict=False)]
            if all(e is not None for e in eq):
                node.outputs[0].sym = tuple(eq)  # type: ignore[arg-type]
        return
    if node.op == "Where" and node.outputs[0].dtype in (DType.i64, DType.i32):
        c, a, b = (elements(v) for v in node.inputs)
        if c is not None and a is not None and b is not None and len(c) == len(a) == len(b):
            node.outputs[0].sym = tuple(x if k else y for k, x, y in zip(c, a, b, strict=False))
        return
    if node.outputs[0].dtype not in (DType.i64, DType.i32):
        return
    out = node.outputs[0]
    op = node.op
    ins = node.inputs
    res: list[Dim] | None = None
    if op == "Shape":
        x = type_of(ins[0])
        if x.shape is not None:
            res = list(x.shape[slice(node.attrs.get("start", 0), node.attrs.get("end"))])
    elif op == "Size":
        x = type_of(ins[0])
        if x.shape is not None:
            n: Dim = 1
            for d in x.shape:
                n = dim_mul(n, d)
            res = [n]
    elif op in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape"):
        e = elements(ins[0])
        if e is not None and out.shape is not None and len(out.shape) <= 1:
            res = e
    elif op == "Concat":
        parts = [elements(v) for v in ins]
        if all(p is not None for p in parts):
            res = [x for p in parts for x in p]  # type: ignore[union-attr]
    elif op == "Gather":
        e, idx = elements(ins[0]), elements(ins[1])
        if e is not None and idx is not None and all(is_int(i) for i in idx):
            try:
                res = [e[int(i)] for i in idx]  # type: ignore[arg-type]
            except IndexError:
                res = None
    elif op == "Slice":
        e = elements(ins[0])
        s, en = elements(node.input(1)), elements(node.input(2))
        st = elements(node.input(4)) if node.input(4) is not None else [1]
        if e is not None and s and en and st and all(is_int(x) for x in s + en + st):
            res = e[int(s[0]):int(min(int(en[0]), 2**62)):int(st[0])]  # type: ignore[arg-type]
    elif op in ("Add", "Sub", "Mul", "Div", "Max", "Min"):
        a, b = elements(ins[0]), elements(ins[1])
        if a is not None and b is not None and (len(a) == len(b) or len(a) == 1 or len(b) == 1):
            m = max(len(a), len(b))
            a2 = a * m if len(a) == 1 else a
            b2 = b * m if len(b) == 1 else b
            vals = [_sym_binary(op, x, y) for x, y in zip(a2, b2, strict=False)]
            if all(v is not None for v in vals):
                res = vals  # type: ignore[assignment]
    elif op == "ConstantOfShape":
        tgt = elements(ins[0])
        if tgt is not None and len(tgt) <= 1 and all(is_int(x) for x in tgt):
            val = node.attrs.get("value", 0)
            if float(val).is_integer():
                res = [int(val)] * (int(tgt[0]) if tgt else 1)  # type: ignore[arg-type]
    elif op == "Range":
        r_s, r_lim, r_d = (elements(v) for v in ins)
        if r_s and r_lim and r_d and all(is_int(x) for x in r_s + r_lim + r_d):
            start, limit, delta = int(r_s[0]), int(r_lim[0]), int(r_d[0])
            if delta and abs((limit - start) // abs(delta)) <= 64:
                res = list(range(start, limit, delta))
    if res is not None:
        if out.shape is not None and len(out.shape) == 0 and len(res) != 1:
            return
        out.sym = tuple(int(x) if is_int(x) else x for x in res)


def is_transformer_op(op: str) -> bool:
    return op in TRANSFORMER_OPS
