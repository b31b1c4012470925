"""What ONNX converters build with: the context a converter sees (`OnnxContext`) and the value
conversions the import driver (onnx.py) and the converters share (element types, names, constant
data). Converters import this module and registry.py, never onnx.py, which imports them to
register them: the direction is one-way."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir
import torch

from zlc.errors import ModelFormatError, ZlcError
from zlc.ir import Graph, Value
from zlc.ir.types import DType

_DTYPES: dict[onnx_ir.DataType, DType] = {
    onnx_ir.DataType.FLOAT: DType.f32, onnx_ir.DataType.FLOAT16: DType.f16,
    onnx_ir.DataType.BFLOAT16: DType.bf16, onnx_ir.DataType.DOUBLE: DType.f64,
    onnx_ir.DataType.INT64: DType.i64, onnx_ir.DataType.INT32: DType.i32,
    onnx_ir.DataType.INT16: DType.i16, onnx_ir.DataType.INT8: DType.i8,
    onnx_ir.DataType.UINT8: DType.u8, onnx_ir.DataType.BOOL: DType.bool,
}
_ONNX_INT_DTYPES = {int(k): v for k, v in _DTYPES.items()}


def dtype_from_onnx(code: int | onnx_ir.DataType, where: str = "") -> DType:
    """The IR dtype of an ONNX element type; ModelFormatError (naming `where`) for one zlc lacks."""
    try:
        return _ONNX_INT_DTYPES[int(code)]
    except KeyError:
        name = onnx_ir.DataType(int(code)).name if int(code) in onnx_ir.DataType._value2member_map_ else code
        raise ModelFormatError(f"unsupported element type {name}{where}") from None


def sanitize(name: str | bytes | None) -> str:
    """IR value names: ONNX allows any string; the text form needs no spaces, commas or parens."""
    if isinstance(name, bytes):  # onnx-ir keeps names that are not valid UTF-8 as bytes
        name = name.decode("utf-8", errors="replace")
    out = "".join(c if (c.isascii() and c.isalnum() or c in "_.") else "_" for c in str(name))
    return out or "v"


def array_to_ir(arr: np.ndarray) -> Any:
    """numpy array as IR constant data, without a copy (bf16 arrays become torch views)."""
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    try:
        DType.from_numpy(arr.dtype)
    except ValueError:
        raise ModelFormatError(f"unsupported constant element type {arr.dtype}") from None
    return arr


class OnnxContext:
    """What a converter sees: the node, its inputs as IR values, attributes, the opset."""

    def __init__(self, g: Graph, node: onnx_ir.Node, inputs: list[Value | None], opset: int,
                 display_name: str | None = None):
        self.g = g
        self.node = node
        self.inputs = inputs
        self.opset = opset
        # unnamed nodes (common in hand-built graphs) are called <op>_<index in the graph>
        self.display_name = display_name or node.name or node.op_type
        self.name = sanitize(self.display_name)

    # inputs -------------------------------------------------------------------------------
    def inp(self, i: int) -> Value | None:
        return self.inputs[i] if i < len(self.inputs) else None

    def req(self, i: int) -> Value:
        v = self.inp(i)
        if v is None:
            raise self.unsupported(f"required input {i} is missing")
        return v

    def const(self, i: int) -> np.ndarray | None:
        """Constant data of input i: an initializer/Constant, or shape arithmetic known statically."""
        v = self.inp(i)
        if v is None:
            return None
        if v.data is not None:
            return v.const_array()
        if v.sym is not None and all(isinstance(x, int) for x in v.sym):
            arr = np.array(v.sym, dtype=np.int64)
            return arr.reshape(()) if v.shape == () else arr
        return None

    def ints(self, i: int, what: str) -> list[int]:
        c = self.const(i)
        if c is None:
            raise self.unsupported(f"{what} (input {i}) must be a constant")
        return [int(x) for x in np.asarray(c).reshape(-1)]

    # attributes and outputs ------------------------------------------------------------------
    def attr(self, name: str, default: Any = None) -> Any:
        a = self.node.attributes.get(name)
        if a is None:
            return default
        v = a.value
        if isinstance(v, onnx_ir.TensorProtocol):
            return v.numpy()
        if isinstance(v, (list, tuple)):
            return list(v)
        return v

    def onnx_dtype(self, code: int) -> DType:
        """An element-type attribute (Cast's `to`, `stash_type`, ...) as an IR dtype."""
        return dtype_from_onnx(code, f" at node '{self.node.name}'")

    def wants(self, i: int) -> bool:
        """Whether the model reads output i (optional outputs are absent or have an empty name)."""
        return len(self.node.outputs) > i and bool(self.node.outputs[i].name)

    # building -----------------------------------------------------------------------------
    def emit(self, op: str, *ins: Value | None, n_outputs: int = 1, **attrs: Any) -> Any:
        node = self.g.add_node(op, list(ins), attrs, name=self.name, n_outputs=n_outputs)
        return node.output if n_outputs == 1 else node.outputs

    def const_value(self, data: Any) -> Value:
        return self.g.add_const(self.name + "_c", data, unique=True)

    def i64(self, values: list[int]) -> Value:
        """A 1-D i64 constant (shape pieces, axes, slice bounds)."""
        return self.const_value(np.array(values, dtype=np.int64))

    def i64_scalar(self, value: int) -> Value:
        return self.const_value(np.array(value, dtype=np.int64))

    def scalar_like(self, value: float, dt: DType) -> Value:
        """A 0-D float constant of dtype `dt` (a Cast of the f32/f64 literal where needed)."""
        c = self.const_value(np.array(value, dtype=np.float64 if dt == DType.f64 else np.float32))
        return c if c.dtype == dt else self.emit("Cast", c, to=dt.value)

    def dim_of(self, x: Value, axis: int) -> Value:
        """x.shape[axis] as an i64 scalar (a constant when static, shape arithmetic otherwise)."""
        if x.shape is not None and isinstance(x.shape[axis], int):
            return self.i64_scalar(int(x.shape[axis]))
        return self.emit("Gather", self.emit("Shape", x), self.i64_scalar(axis), axis=0)

    def unsupported(self, why: str) -> ZlcError:
        n = self.node
        dom = n.domain or "ai.onnx"
        return ModelFormatError(f"{dom}::{n.op_type} (opset {self.opset}) at node '{self.display_name}': {why}")
