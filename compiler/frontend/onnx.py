"""ONNX frontend: reads a model with onnx-ir (external weights are memory-mapped, never copied)
and lowers every node through the versioned registry (registry.py) into zlc's IR.

The converters live by family in onnx_ops.py (elementwise, linear algebra, reductions, shapes),
onnx_nn.py (normalization, attention, rotary embeddings) and onnx_contrib.py (com.microsoft); they
build with onnx_context.py. This module imports them only so that they register themselves."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnx_ir

from zlc.errors import IRError, ModelFormatError, ShapeError, UnsupportedOpError, ZlcError
from zlc.ir import Graph, Value, verify_graph
from zlc.ir.types import Dim, TensorType

from . import onnx_contrib, onnx_nn, onnx_ops  # noqa: F401  (register the converters)
from .onnx_context import OnnxContext, array_to_ir, dtype_from_onnx, sanitize
from .registry import ONNX_OPS

__all__ = ["array_to_ir", "deserialize", "dtype_from_onnx", "import_onnx", "load_onnx", "sanitize"]


def _value_type(v: onnx_ir.Value, where: str) -> TensorType:
    if v.type is not None and not isinstance(v.type, onnx_ir.TensorType):
        raise ModelFormatError(f"{where} '{v.name}' has type {v.type}; zlc takes plain tensors only "
                               "(no sequences, optionals, maps or sparse tensors)")
    if v.dtype is None:
        raise ModelFormatError(f"{where} '{v.name}' has no element type")
    dt = dtype_from_onnx(v.dtype, f" for {where} '{v.name}'")
    if v.shape is None:
        return TensorType(dt, None)
    dims: list[Dim] = []
    for i, d in enumerate(v.shape):
        if isinstance(d, int):
            if d < 0:
                raise ModelFormatError(f"{where} '{v.name}' has a negative dimension ({d}) at axis {i}")
            dims.append(d)
        else:
            name = getattr(d, "value", None)
            dims.append(sanitize(str(name)) if name else f"{sanitize(v.name or 'v')}_{i}")
    return TensorType(dt, tuple(dims))


def load_onnx(path: str | os.PathLike[str]) -> onnx_ir.Model:
    """Reads a model file; external weights are resolved next to it and memory-mapped lazily."""
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"model file not found: {p}")
    if p.is_dir():
        raise ModelFormatError(f"{p} is a directory, not an ONNX file")
    try:
        proto = onnx.load(str(p), load_external_data=False)
    except Exception as e:  # protobuf decode errors have many types; all mean "not a model"
        raise ModelFormatError(f"cannot read ONNX model {p}: {_brief(e)} (truncated or not an ONNX file?)") \
            from None
    model = deserialize(proto, where=str(p))
    onnx_ir.external_data.set_base_dir(model.graph, str(p.parent))
    return model


def deserialize(proto: onnx.ModelProto, where: str = "model") -> onnx_ir.Model:
    """ModelProto -> onnx-ir Model, with the structural checks onnx-ir reports only vaguely."""
    _precheck(proto, where)
    try:
        return onnx_ir.serde.deserialize_model(proto)
    except Exception as e:
        raise ModelFormatError(f"invalid ONNX {where}: {_root_cause(e)}") from e


def _root_cause(e: BaseException) -> str:
    """onnx-ir wraps the real problem in 'Error calling _deserialize_graph with: ...' layers."""
    while e.__cause__ is not None:
        e = e.__cause__
    return _brief(e)


_VALID_DTYPES = set(onnx.TensorProto.DataType.values())


def _precheck(proto: onnx.ModelProto, where: str) -> None:
    if not proto.HasField("graph"):
        raise ModelFormatError(f"{where} has no graph (empty or not an ONNX model?)")
    g = proto.graph
    for kind, infos in (("graph input", g.input), ("graph output", g.output), ("value_info", g.value_info)):
        for vi in infos:
            t = vi.type
            if t.HasField("tensor_type") and t.tensor_type.elem_type not in _VALID_DTYPES:
                raise ModelFormatError(f"{kind} '{vi.name}' has invalid element type {t.tensor_type.elem_type}")
    for init in g.initializer:
        if init.data_type not in _VALID_DTYPES:
            raise ModelFormatError(f"initializer '{init.name}' has invalid element type {init.data_type}")
    defined = {v.name: "a graph input" for v in g.input}
    for t in g.initializer:
        defined.setdefault(t.name, "an initializer")  # old exporters also list weights as inputs
    for i, n in enumerate(g.node):
        node = f"node '{n.name or f'{n.op_type}_{i}'}' ({n.op_type})"
        for o in n.output:
            if o and o in defined:
                raise ModelFormatError(f"value '{o}' is produced twice: by {defined[o]} and by {node}")
            defined[o] = node
    for op in proto.opset_import:
        if not 1 <= op.version <= 10_000:
            raise ModelFormatError(f"the model imports opset {op.version} of domain "
                                   f"'{op.domain or 'ai.onnx'}', which does not exist")


def import_onnx(model: str | os.PathLike[str] | onnx.ModelProto | onnx_ir.Model, *, name: str | None = None) -> Graph:
    """Lowers an ONNX model (path, ModelProto or onnx-ir Model) into a zlc IR graph.

    Raises only ZlcError subclasses: ModelFormatError (unreadable or invalid model, unsupported
    feature of a node), UnsupportedOpError (no converter), ShapeError (shapes that do not fit)."""
    try:
        if isinstance(model, onnx.ModelProto):
            m = deserialize(model)
        elif isinstance(model, onnx_ir.Model):
            m = model
        else:
            m = load_onnx(model)
            name = name or Path(model).stem
        return _convert(m, name or (m.graph.name or "model"))
    except ZlcError:
        raise
    except Exception as e:
        # Last line of defense: node-level failures are attributed in _convert_node; what reaches
        # here is a model-level inconsistency that slipped past the checks above.
        raise ModelFormatError(f"malformed ONNX model: {_brief(e)}") from e


def _brief(e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


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
                avail.update(o.name for o in n.outputs if o.name)
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


def _opsets(m: onnx_ir.Model) -> dict[str, int]:
    opsets = {("" if d == "ai.onnx" else d): int(v) for d, v in m.opset_imports.items()}
    if "" not in opsets:
        opsets[""] = int(m.opset_imports.get("ai.onnx", 1))
    return opsets


def _unique(g: Graph, onnx_name: str) -> str:
    """The sanitized name, suffixed if sanitizing made two ONNX names collide ('a b' and 'a_b')."""
    name = g.fresh_name(sanitize(onnx_name))
    g.release_name(name)  # add_input/add_const claim it again
    return name


def _add_inputs(g: Graph, og: onnx_ir.Graph, env: dict[str, Value]) -> None:
    for v in og.inputs:
        name = v.name or ""
        if name in og.initializers:
            continue  # old exporters list weights as inputs too
        if name in env or not name:
            raise ModelFormatError(f"graph input '{name}' is unnamed or declared twice")
        env[name] = g.add_input(_unique(g, name), _value_type(v, "graph input"))


def _add_initializers(g: Graph, og: onnx_ir.Graph, env: dict[str, Value]) -> None:
    for iname, iv in og.initializers.items():
        if iv.const_value is None:
            raise ModelFormatError(f"initializer '{iname}' has no data")
        try:
            arr = iv.const_value.numpy()
        except Exception as e:
            hint = "missing or truncated external data file?" if isinstance(iv.const_value, onnx_ir.ExternalTensor) \
                else "its data does not match its type and dims"
            raise ModelFormatError(f"cannot read weight '{iname}': {_brief(e)} ({hint})") from e
        try:
            data = array_to_ir(arr)
        except ModelFormatError as e:
            raise ModelFormatError(f"weight '{iname}': {e}") from None
        env[iname] = g.add_const(_unique(g, iname), data)


def _node_inputs(node: onnx_ir.Node, env: dict[str, Value], display: str) -> list[Value | None]:
    ins: list[Value | None] = []
    for i in node.inputs:
        if i is None or i.name == "":
            ins.append(None)
        elif i.name in env:
            ins.append(env[i.name])
        else:  # produced by an earlier node whose converter did not produce that output
            raise ModelFormatError(f"node '{display}' ({node.op_type}) uses '{i.name}', an output "
                                   "zlc does not produce for its producer")
    return ins


def _convert_node(g: Graph, node: onnx_ir.Node, index: int, opsets: dict[str, int],
                  env: dict[str, Value]) -> None:
    display = node.name or f"{node.op_type}_{index}"
    domain = "" if node.domain in ("", "ai.onnx") else node.domain
    opset = opsets.get(domain, 1)
    if any(a.type in (onnx_ir.AttributeType.GRAPH, onnx_ir.AttributeType.GRAPHS)
           for a in node.attributes.values()):
        # control flow (If/Loop/Scan) has no place in a static megakernel
        raise UnsupportedOpError(node.op_type, domain, opset, display, None)
    conv = ONNX_OPS.resolve(domain, node.op_type, opset)
    if conv is None:
        raise UnsupportedOpError(node.op_type, domain, opset, display, ONNX_OPS.supported(domain))
    cx = OnnxContext(g, node, _node_inputs(node, env, display), opset, display)
    where = f"{domain or 'ai.onnx'}::{node.op_type} (opset {opset}) at node '{display}'"
    try:
        outs = conv(cx)
    except (ShapeError, IRError) as e:
        raise ShapeError(f"{where}: {e}") from None
    except ZlcError:
        raise
    except Exception as e:  # malformed attributes or inputs a converter did not anticipate
        raise ModelFormatError(f"{where}: malformed node ({_brief(e)})") from e
    if isinstance(outs, Value):
        outs = [outs]
    for o, ov in zip(node.outputs, outs, strict=False):  # trailing optional outputs may be absent
        if ov is not None and o.name:
            env[o.name] = ov


def _add_outputs(g: Graph, og: onnx_ir.Graph, env: dict[str, Value]) -> None:
    for v in og.outputs:
        if v.name not in env:
            raise ModelFormatError(f"graph output '{v.name}' is not produced by any node")
        val = env[v.name]
        target = sanitize(v.name)
        if val.kind == "node" and val.name != target and not g.has_name(target) and val not in g.outputs:
            g.release_name(val.name)  # keep the model's output names (logits, present.0.key, ...)
            val.name = g.claim_name(target)
        g.outputs.append(val)
    if not g.outputs:
        raise ModelFormatError("the model's graph has no outputs")


def _convert(m: onnx_ir.Model, name: str) -> Graph:
    g = Graph(name)
    og = m.graph
    opsets = _opsets(m)
    g.metadata["onnx_opset"] = opsets[""]
    env: dict[str, Value] = {}
    _add_inputs(g, og, env)
    _add_initializers(g, og, env)
    position = {id(n): i for i, n in enumerate(og)}  # unnamed nodes are named by their place in the file
    for node in _topo_nodes(list(og), set(env) | {""}):
        _convert_node(g, node, position[id(node)], opsets, env)
    _add_outputs(g, og, env)
    verify_graph(g, check_types=False)
    return g
