"""ONNX frontend: reads a model with onnx-ir (external weights are memory-mapped, never copied)
and lowers every node through the versioned registry in onnx_ops/onnx_contrib into zlc's IR."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir
import torch

from ..errors import IRError, ModelFormatError, ShapeError, UnsupportedOpError, ZlcError
from ..ir import Graph, Value, verify_graph
from ..ir.types import Dim, DType, TensorType
from . import onnx_ops  # noqa: F401  (registers the default-domain converters)
from .registry import ONNX_OPS

try:  # the contrib-op converters live in their own module
    from . import onnx_contrib  # noqa: F401
except ImportError:  # pragma: no cover - only while the module is being written
    pass

_DTYPES: dict[onnx_ir.DataType, DType] = {
    onnx_ir.DataType.FLOAT: DType.f32, onnx_ir.DataType.FLOAT16: DType.f16,
    onnx_ir.DataType.BFLOAT16: DType.bf16, onnx_ir.DataType.DOUBLE: DType.f64,
    onnx_ir.DataType.INT64: DType.i64, onnx_ir.DataType.INT32: DType.i32,
    onnx_ir.DataType.INT16: DType.i16, onnx_ir.DataType.INT8: DType.i8,
    onnx_ir.DataType.UINT8: DType.u8, onnx_ir.DataType.BOOL: DType.bool,
}
_ONNX_INT_DTYPES = {int(k): v for k, v in _DTYPES.items()}


def dtype_from_onnx(code: int | onnx_ir.DataType, where: str = "") -> DType:
    try:
        return _ONNX_INT_DTYPES[int(code)]
    except KeyError:
        name = onnx_ir.DataType(int(code)).name if int(code) in onnx_ir.DataType._value2member_map_ else code
        raise ModelFormatError(f"unsupported element type {name}{where}") from None


def sanitize(name: str) -> str:
    """IR value names: ONNX allows any string; the text form needs no spaces, commas or parens."""
    out = "".join(c if (c.isalnum() or c in "_.") else "_" for c in name)
    return out or "v"


def array_to_ir(arr: np.ndarray) -> Any:
    """numpy array as IR constant data, without a copy (bf16 arrays become torch views)."""
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(arr).view(np.int16)).view(torch.bfloat16)
    if arr.dtype.kind not in "biuf":
        raise ModelFormatError(f"unsupported constant element type {arr.dtype}")
    return arr


class OnnxContext:
    """What a converter sees: the node, its inputs as IR values, attributes, the opset."""

    def __init__(self, g: Graph, node: onnx_ir.Node, inputs: list[Value | None], opset: int):
        self.g = g
        self.node = node
        self.inputs = inputs
        self.opset = opset
        self.name = sanitize(node.name or f"{node.op_type}_{id(node)}")

    # inputs -------------------------------------------------------------------------------
    def inp(self, i: int) -> Value | None:
        return self.inputs[i] if i < len(self.inputs) else None

    def req(self, i: int) -> Value:
        v = self.inp(i)
        if v is None:
            raise ModelFormatError(f"node '{self.node.name}' ({self.node.op_type}): required input {i} missing")
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

    # attributes ---------------------------------------------------------------------------
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

    # building -----------------------------------------------------------------------------
    def emit(self, op: str, *ins: Value | None, n_outputs: int = 1, **attrs: Any) -> Any:
        node = self.g.add_node(op, list(ins), attrs, name=self.name, n_outputs=n_outputs)
        return node.output if n_outputs == 1 else node.outputs

    def const_value(self, data: Any) -> Value:
        return self.g.add_const(self.name + "_c", data, unique=True)

    def unsupported(self, why: str) -> ZlcError:
        n = self.node
        dom = n.domain or "ai.onnx"
        return ModelFormatError(f"{dom}::{n.op_type} (opset {self.opset}) at node '{n.name}': {why}")


def _value_type(v: onnx_ir.Value, where: str) -> TensorType:
    if v.dtype is None:
        raise ModelFormatError(f"{where} '{v.name}' has no element type")
    dt = dtype_from_onnx(v.dtype, f" for {where} '{v.name}'")
    if v.shape is None:
        return TensorType(dt, None)
    dims: list[Dim] = []
    for i, d in enumerate(v.shape):
        if isinstance(d, int):
            dims.append(d)
        else:
            name = getattr(d, "value", None)
            dims.append(sanitize(str(name)) if name else f"{sanitize(v.name)}_{i}")
    return TensorType(dt, tuple(dims))


def load_onnx(path: str | os.PathLike[str]) -> onnx_ir.Model:
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelFormatError(f"{p} is a directory, not an ONNX file")
    try:
        return onnx_ir.load(str(p))
    except ZlcError:
        raise
    except Exception as e:  # protobuf decode errors have many types; all mean "not a model"
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFormatError(f"cannot read ONNX model {p}: {msg} (truncated or not an ONNX file?)") from None


def import_onnx(model: str | os.PathLike[str] | onnx.ModelProto | onnx_ir.Model, *, name: str | None = None) -> Graph:
    """Lowers an ONNX model (path, ModelProto or onnx-ir Model) into a zlc IR graph."""
    try:
        if isinstance(model, onnx.ModelProto):
            m = onnx_ir.serde.deserialize_model(model)
        elif isinstance(model, onnx_ir.Model):
            m = model
        else:
            m = load_onnx(model)
            name = name or Path(model).stem
        return _convert(m, name or (m.graph.name or "model"))
    except ZlcError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError) as e:
        # onnx-ir's lazy deserialization and malformed attributes surface here
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelFormatError(f"malformed ONNX model: {type(e).__name__}: {msg}") from None


def _topo_nodes(nodes: Sequence[onnx_ir.Node], known: set[str]) -> list[onnx_ir.Node]:
    """ONNX requires topological order but writers get it wrong; sort, and name a cycle."""
    order: list[onnx_ir.Node] = []
    pending = list(nodes)
    avail = set(known)
    while pending:
        rest = []
        for n in pending:
            if all(i is None or i.name in avail or i.name == "" for i in n.inputs):
                order.append(n)
                avail.update(o.name for o in n.outputs)
            else:
                rest.append(n)
        if len(rest) == len(pending):
            n = rest[0]
            missing = [i.name for i in n.inputs if i is not None and i.name and i.name not in avail]
            produced = {o.name for r in rest for o in r.outputs}
            if all(mv in produced for mv in missing):
                raise ModelFormatError(f"graph has a cycle through node '{n.name}' ({n.op_type})")
            raise ModelFormatError(f"node '{n.name}' ({n.op_type}) uses undefined value(s) {missing}")
        pending = rest
    return order


def _convert(m: onnx_ir.Model, name: str) -> Graph:
    g = Graph(name)
    og = m.graph
    opsets = dict(m.opset_imports)
    if "" not in opsets and "ai.onnx" in opsets:
        opsets[""] = opsets["ai.onnx"]
    g.metadata["onnx_opset"] = opsets.get("", 0)
    env: dict[str, Value] = {}

    for v in og.inputs:
        if v.name in og.initializers:
            continue
        env[v.name] = g.add_input(sanitize(v.name), _value_type(v, "graph input"))
    for iname, iv in og.initializers.items():
        if iv.const_value is None:
            raise ModelFormatError(f"initializer '{iname}' has no data")
        try:
            arr = iv.const_value.numpy()
        except Exception as e:
            raise ModelFormatError(f"cannot read weight '{iname}': {str(e).splitlines()[0] if str(e) else type(e).__name__}"
                                   " (missing or truncated external data file?)") from None
        env[iname] = g.add_const(sanitize(iname), array_to_ir(arr))
    nodes = _topo_nodes(list(og), set(env) | {""})
    for node in nodes:
        if any(a.type in (onnx_ir.AttributeType.GRAPH, onnx_ir.AttributeType.GRAPHS)
               for a in node.attributes.values()):
            raise UnsupportedOpError(node.op_type, node.domain, opsets.get(node.domain, 0), node.name or "?",
                                     None)
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        opset = opsets.get(domain, opsets.get("", 1) if domain == "" else 1)
        conv = ONNX_OPS.resolve(domain, node.op_type, opset)
        if conv is None:
            raise UnsupportedOpError(node.op_type, domain, opset, node.name or "?", ONNX_OPS.supported(domain))
        ins = [None if (i is None or i.name == "") else env.get(i.name) for i in node.inputs]
        cx = OnnxContext(g, node, ins, opset)
        try:
            outs = conv(cx)
        except (ShapeError, IRError) as e:
            raise ShapeError(f"{domain or 'ai.onnx'}::{node.op_type} node '{node.name}': {e}") from None
        if isinstance(outs, Value):
            outs = [outs]
        for o, ov in zip(node.outputs, outs):
            if ov is not None and o.name:
                env[o.name] = ov
    for v in og.outputs:
        if v.name not in env:
            raise ModelFormatError(f"graph output '{v.name}' is not produced by any node")
        val = env[v.name]
        target = sanitize(v.name)
        if val.kind == "node" and val.name != target and target not in g._names:
            g._names.discard(val.name)  # keep the model's output names (logits, present.0.key, ...)
            val.name = g._claim(target)
        g.outputs.append(val)
    verify_graph(g, check_types=False)
    return g
