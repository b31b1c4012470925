"""What an ATen lowering builds with: `FxContext` (the graph being built, the FX node, helpers for
constants, casts and symbolic sizes) and the error an unsupported overload raises. The registry
(fx_registry.py), the lowerings (fx_math.py, fx_layout.py) and the driver (fx.py) build on this
module; it imports none of them."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
import sympy
import torch
import torch.fx as fx

from zlc.errors import IRError, ModelFormatError, UnsupportedOpError, ZlcError
from zlc.ir import Graph, Value
from zlc.ir.types import Dim, DType, TensorType


class UnsupportedAtenOpError(UnsupportedOpError):
    """An ATen overload (or a use of one) the fx frontend cannot lower."""

    def __init__(self, op: str, node: str, reason: str = "", supported: Sequence[str] | None = None,
                 where: str = ""):
        self.op, self.domain, self.opset, self.node = op, "aten", 0, node
        self.reason = reason
        msg = f"unsupported ATen op {op} at FX node '{node}'"
        if where:
            msg += f" ({where})"
        if reason:
            msg += f": {reason}"
        if supported:
            msg += f"; supported: {', '.join(supported)}"
        ZlcError.__init__(self, msg)


def _ir_dtype(dt: torch.dtype, where: str) -> DType:
    try:
        return DType.from_torch(dt)
    except ValueError:
        raise ModelFormatError(f"unsupported element type {dt} at {where}") from None


class FxContext:
    """What a lowering sees: the graph being built, the FX node, and helpers for constants, casts
    and symbolic sizes."""

    def __init__(self, g: Graph):
        self.g = g
        self.env: dict[fx.Node, Any] = {}
        self.node: fx.Node | None = None
        self.key = ""
        self.sym_names: dict[sympy.Symbol, str] = {}
        self.sym_sources: dict[sympy.Symbol, tuple[Value, int]] = {}
        self._dims: dict[sympy.Expr, Value] = {}
        self._consts: dict[tuple[Any, ...], Value] = {}

    # ---- the current node ---------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.node.name if self.node is not None else "fx"

    def meta(self) -> Any:
        assert self.node is not None
        return self.node.meta.get("val")

    def out_dtype(self, i: int = 0) -> DType:
        m = self.meta()
        if isinstance(m, (tuple, list)):
            m = m[i]
        return meta_dtype(m, self.name)

    def used_outputs(self) -> set[int]:
        """Indices of a multi-output node's results that are read through getitem."""
        assert self.node is not None
        return {u.args[1] for u in self.node.users if u.target is operator.getitem
                and isinstance(u.args[1], int)}

    def unsupported(self, reason: str) -> UnsupportedAtenOpError:
        return UnsupportedAtenOpError(self.key, self.name, reason, where=user_frame(self.node))

    # ---- building -------------------------------------------------------------------------------
    def emit(self, op: str, *inputs: Value | None, **attrs: Any) -> Value:
        return self.g.add_node(op, list(inputs), attrs, name=self.name).output

    def emit_multi(self, op: str, inputs: Sequence[Value | None], n: int, **attrs: Any) -> list[Value]:
        return self.g.add_node(op, list(inputs), attrs, name=self.name, n_outputs=n).outputs

    def aux(self, op: str, *inputs: Value | None, **attrs: Any) -> Value:
        """A helper node (cast, shape piece): named apart so the result keeps the FX node's name."""
        return self.g.add_node(op, list(inputs), attrs, name=f"{self.name}.{op.lower()}").output

    def scalar(self, x: bool | int | float, dtype: DType) -> Value:
        """A 0-D constant (shared between nodes: literals repeat a lot)."""
        key = ("s", type(x).__name__, repr(x), dtype)
        if key not in self._consts:
            self._consts[key] = self.g.const_scalar(x, dtype)
        return self._consts[key]

    def ints(self, xs: Sequence[int]) -> Value:
        key = ("i", tuple(int(x) for x in xs))
        if key not in self._consts:
            self._consts[key] = self.g.add_const("c", np.array(list(key[1]), dtype=np.int64), unique=True)
        return self._consts[key]

    def cast(self, v: Value, dtype: DType) -> Value:
        return v if v.dtype == dtype else self.aux("Cast", v, to=dtype.value)

    def tensor(self, x: Any, dtype: DType) -> Value:
        """An operand as a Value of `dtype`: casts Values, makes constants of Python scalars."""
        if isinstance(x, Value):
            return self.cast(x, dtype)
        if isinstance(x, (bool, int, float)):
            return self.scalar(x, dtype)
        raise self.unsupported(f"operand of type {type(x).__name__}")

    def floordiv(self, x: Value, y: Value) -> Value:
        """Floor division: exact for ints (x - x mod y) / y with Python's mod; Floor(x / y) for floats."""
        if x.dtype.is_float:
            return self.emit("Floor", self.emit("Div", x, y))
        return self.emit("Div", self.emit("Sub", x, self.emit("Mod", x, y)), y)

    def permute(self, x: Value, perm: list[int]) -> Value:
        """x with its dims permuted: a Transpose unless `perm` is the identity."""
        # Transpose(W) of a weight stays a node: the fold pass turns it into the constant `W.T`
        return x if perm == list(range(len(perm))) else self.emit("Transpose", x, perm=perm)

    # ---- symbolic sizes -------------------------------------------------------------------------
    def ir_dim(self, d: Any) -> Dim:
        """A torch size (int or SymInt) as an IR dim: "seq" for the sequence symbol."""
        if isinstance(d, int):
            return d
        expr = d.node.expr if isinstance(d, torch.SymInt) else d
        if getattr(expr, "is_Integer", False):
            return int(expr)
        if expr in self.sym_names:
            return self.sym_names[expr]
        names = {s: sympy.Symbol(n) for s, n in self.sym_names.items()}
        return str(expr.xreplace(names)).replace(" ", "")

    def ir_type(self, t: torch.Tensor, where: str) -> TensorType:
        return TensorType(_ir_dtype(t.dtype, where), tuple(self.ir_dim(d) for d in t.shape))

    def dim(self, d: Any) -> Value:
        """A size (int, SymInt or 0-D Value) as a 0-D i64 Value."""
        if isinstance(d, Value):
            return self.cast(d, DType.i64)
        if isinstance(d, int):
            return self.scalar(d, DType.i64)
        if isinstance(d, torch.SymInt):
            return self._sym_value(d.node.expr)
        raise self.unsupported(f"size of type {type(d).__name__}")

    def shape_tensor(self, dims: Sequence[Any]) -> Value:
        """A 1-D i64 shape from ints and symbolic sizes (runs of ints become one constant)."""
        parts: list[Value] = []
        run: list[int] = []
        for d in dims:
            if isinstance(d, int):
                run.append(d)
                continue
            if run:
                parts.append(self.ints(run))
                run = []
            v = self.dim(d)
            if ("u", id(v)) not in self._consts:
                self._consts[("u", id(v))] = self.aux("Unsqueeze", v, axes=[0])
            parts.append(self._consts[("u", id(v))])
        if run or not parts:
            parts.append(self.ints(run))
        if len(parts) == 1:
            return parts[0]
        key = ("shape",) + tuple(id(p) for p in parts)  # layers repeat the same shapes
        if key not in self._consts:
            self._consts[key] = self.aux("Concat", *parts, axis=0)
        return self._consts[key]

    def _sym_value(self, expr: sympy.Expr) -> Value:
        """Materializes a sympy size expression over the input symbols as IR shape arithmetic."""
        if expr in self._dims:
            return self._dims[expr]
        v: Value
        if expr.is_Integer:
            v = self.scalar(int(expr), DType.i64)
        elif expr in self.sym_sources:
            src, axis = self.sym_sources[expr]
            shp = self.g.add_node("Shape", [src], {"start": axis, "end": axis + 1},
                                  name=f"{self.sym_names[expr]}_size").output
            v = self.g.add_node("Squeeze", [shp], {"axes": [0]}, name=self.sym_names[expr]).output
        elif isinstance(expr, (sympy.Add, sympy.Mul)):
            op = "Add" if isinstance(expr, sympy.Add) else "Mul"
            terms = [self._sym_value(a) for a in expr.args]
            v = terms[0]
            for t in terms[1:]:
                v = self.emit(op, v, t)
        elif type(expr).__name__ == "FloorDiv":
            v = self.floordiv(self._sym_value(expr.args[0]), self._sym_value(expr.args[1]))
        elif isinstance(expr, (sympy.Max, sympy.Min)):
            op = "Max" if isinstance(expr, sympy.Max) else "Min"
            terms = [self._sym_value(a) for a in expr.args]
            v = terms[0]
            for t in terms[1:]:
                v = self.emit(op, v, t)
        else:
            raise self.unsupported(f"symbolic size expression {expr}")
        if v.sym is None:
            v.sym = (self.ir_dim(expr),)
        self._dims[expr] = v
        return v


def meta_dtype(m: Any, where: str) -> DType:
    """The IR dtype of an FX node's metadata value: a tensor's dtype, or that of a Python/Sym scalar."""
    if isinstance(m, torch.Tensor):
        return _ir_dtype(m.dtype, where)
    if isinstance(m, (torch.SymBool, bool)):
        return DType.bool
    if isinstance(m, (torch.SymInt, int)):
        return DType.i64
    if isinstance(m, (torch.SymFloat, float)):
        return DType.f32
    raise IRError(f"fx node '{where}' has no tensor or size metadata ({type(m).__name__})")


def user_frame(node: fx.Node | None) -> str:
    """'file.py:123 in forward' of the user code that produced the node, from export's stack trace."""
    if node is None:
        return ""
    st = node.meta.get("stack_trace") or ""
    frames = [ln.strip() for ln in st.splitlines() if ln.strip().startswith("File ")]
    if not frames:
        return ""
    parts = frames[-1].split(", ")
    if len(parts) < 3:
        return frames[-1]
    file = parts[0][len('File "'):].rstrip('"').rsplit("/", 1)[-1]
    return f"{file}:{parts[1].replace('line ', '')} {parts[2]}"
