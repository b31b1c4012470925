"""torch.export frontend: nn.Module -> torch.export (dynamic "seq" axis) -> core ATen -> zlc IR.

`import_module` exports the module (only its logits), decomposes the program to the core ATen
opset (`ep.run_decompositions()`, keeping linear/matmul whole: see KEEP_COMPOSITE), and lowers
every FX node through a registry keyed by ATen overload (`aten::mm.default`, `aten::view.default`,
...): the role (domain, op, since_version) plays in the ONNX frontend. Core ATen is a closed,
documented opset with stable schemas, so one table of lowerings covers whole model families;
anything else fails with one UnsupportedOpError naming the overload, the FX node and the line of
user code that produced it.

Lowering emits op-level IR only (MatMul/Reshape/Softmax/...); the shared passes raise it. Symbolic
sizes (SymInt nodes: sym_size, +, * on sizes) become 0-D i64 IR values computed with Shape/Squeeze
arithmetic, so the sequence axis stays symbolic ("seq") in every IR type. After each node, the IR
types are checked against torch's own metadata (dtype, rank, static extents) and refined with it:
a lowering bug fails at the node that has it, not as a wrong number at the end.

This module is the export and the driver (the loop over FX nodes, argument binding, value mapping,
the type checks). The registry is fx_registry.py, what lowerings build with fx_context.py, and the
lowerings live by family in fx_math.py (ops that compute) and fx_layout.py (ops that move or create
data); they are imported here only so that they register themselves.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from zlc.errors import IRError, ModelFormatError, UnsupportedOpError, ZlcError
from zlc.ir import Graph, Value, verify_graph
from zlc.ir.types import Dim, TensorType

from . import fx_layout, fx_math  # noqa: F401  (register the lowerings)
from .fx_context import FxContext, UnsupportedAtenOpError, meta_dtype, user_frame
from .fx_registry import ATEN_OPS, IGNORED, Args, aten_op, op_key, resolve_overload, supported_ops

__all__ = ["ATEN_OPS", "IGNORED", "KEEP_COMPOSITE", "FxContext", "UnsupportedAtenOpError", "aten_op",
           "export_module", "import_module", "import_program", "op_key", "resolve_overload", "supported_ops"]

SEQ = "seq"
_PREFIX = "inner."  # FQN prefix the export wrapper adds; stripped from constant names


# ---- export ------------------------------------------------------------------------------------

class _LogitsOnly(torch.nn.Module):
    """Exports only the logits: Hugging Face models return a ModelOutput, others a tuple."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> torch.Tensor:
        out = self.inner(*args)
        if hasattr(out, "logits"):
            return out.logits
        if isinstance(out, (tuple, list)):
            return out[0]
        return out


@contextmanager
def _eval_mode(module: torch.nn.Module) -> Iterator[None]:
    """Inference graph (no dropout) without leaving the caller's module changed."""
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, t in modes.items():
            m.training = t


def _dynamic_shapes(inputs: Sequence[Any]) -> tuple[Any, ...] | None:
    """Axis 1 of the token ids (and of every [B, T, ...] integer input: mask, positions) is dynamic."""
    first = inputs[0] if inputs else None
    if not (isinstance(first, torch.Tensor) and first.dim() == 2 and not first.is_floating_point()):
        return None
    t = first.shape[1]
    if t < 2:
        raise ModelFormatError("example token ids need at least 2 positions for a dynamic 'seq' axis "
                               "(torch.export specializes sizes 0 and 1); pass dynamic_seq=False for "
                               "a static graph")
    # DYNAMIC (not a named Dim) accepts the range refinements models imply (seq <= max positions).
    seq = torch.export.Dim.DYNAMIC(min=2)
    specs = [{1: seq} if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] == t
             and not x.is_floating_point() else None for x in inputs]
    return (tuple(specs),)


# Composite ops kept whole instead of decomposed: core ATen spells matmul as expand/view/bmm/view
# and linear as view/mm/view, while the ONNX exporter keeps both as one MatMul. Keeping them gives
# the shared raising rules (attention, linear) the same IR from both frontends, and fewer nodes.
KEEP_COMPOSITE = ("aten::linear.default", "aten::matmul.default")


def _decomp_table(keep_composite: bool) -> dict[Any, Any]:
    table = torch.export.default_decompositions()
    if keep_composite:
        for key in KEEP_COMPOSITE:
            del table[resolve_overload(key)]
    return table


def export_module(module: torch.nn.Module, example_inputs: tuple[Any, ...], *, dynamic_seq: bool = True,
                  keep_composite: bool = True) -> ExportedProgram:
    """torch.export of the module's logits, decomposed to core ATen (but for KEEP_COMPOSITE)."""
    inputs = tuple(example_inputs)
    dyn = _dynamic_shapes(inputs) if dynamic_seq else None
    with _eval_mode(module):
        try:
            ep = torch.export.export(_LogitsOnly(module), inputs, dynamic_shapes=dyn, strict=False)
            return ep.run_decompositions(_decomp_table(keep_composite))
        except ZlcError:
            raise
        except Exception as e:  # torch raises many types (UserError, guard failures, tracing errors)
            msg = str(e).strip().splitlines()
            raise ModelFormatError(f"torch.export failed: {type(e).__name__}: "
                                   f"{msg[0] if msg else ''}") from e


def _input_names(module: torch.nn.Module, n: int, given: Sequence[str] | None) -> list[str]:
    if given is not None:
        if len(given) != n:
            raise ModelFormatError(f"input_names has {len(given)} names for {n} example inputs")
        return list(given)
    try:
        params = [p.name for p in inspect.signature(module.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[i] if i < len(params) else f"input_{i}" for i in range(n)]


def import_module(module: torch.nn.Module, example_inputs: tuple[Any, ...], *, dynamic_seq: bool = True,
                  input_names: Sequence[str] | None = None, keep_composite: bool = True) -> Graph:
    """Lowers `module(*example_inputs)` (its logits) into a zlc IR graph.

    With dynamic_seq and [B, T] integer token ids first, axis 1 is the symbolic dim "seq" in the
    IR. Parameters and buffers become constants named by their FQN and share the module's storage.
    keep_composite=False decomposes linear/matmul too (pure core ATen: mm, bmm, addmm).
    """
    inputs = tuple(example_inputs)
    ep = export_module(module, inputs, dynamic_seq=dynamic_seq, keep_composite=keep_composite)
    names = _input_names(module, len(inputs), input_names)
    return import_program(ep, input_names=names, name=type(module).__name__, module=module)


# ---- the driver -----------------------------------------------------------------------------------

def _lookup(module: torch.nn.Module | None, ep: ExportedProgram, fqn: str) -> torch.Tensor:
    """A parameter/buffer/constant by FQN, preferring the module's own tensor (same storage)."""
    inner = fqn[len(_PREFIX):] if fqn.startswith(_PREFIX) else fqn
    if module is not None:
        for get in (module.get_parameter, module.get_buffer):
            try:
                return get(inner)
            except (AttributeError, KeyError):
                pass
    if fqn in ep.state_dict:
        return ep.state_dict[fqn]
    if fqn in ep.constants:
        c = ep.constants[fqn]
        if isinstance(c, torch.Tensor):
            return c
    raise ModelFormatError(f"exported program has no tensor for '{fqn}'")


def _bind_inputs(cx: FxContext, ep: ExportedProgram, names: Sequence[str] | None,
                 module: torch.nn.Module | None) -> None:
    placeholders = {n.name: n for n in ep.graph.nodes if n.op == "placeholder"}
    user_i = 0
    for spec in ep.graph_signature.input_specs:
        node = placeholders[spec.arg.name]  # type: ignore[union-attr]
        val = node.meta.get("val")
        if spec.kind == InputKind.USER_INPUT:
            name = names[user_i] if names and user_i < len(names) else spec.arg.name  # type: ignore[union-attr]
            user_i += 1
            if not isinstance(val, torch.Tensor):
                cx.env[node] = val  # a specialized Python value
                continue
            _name_symbols(cx, val, name)
            cx.env[node] = v = cx.g.add_input(name, cx.ir_type(val, f"input '{name}'"))
            for axis, d in enumerate(val.shape):
                expr = d.node.expr if isinstance(d, torch.SymInt) else None
                if isinstance(expr, sympy.Symbol) and expr not in cx.sym_sources:
                    cx.sym_sources[expr] = (v, axis)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            fqn = spec.target or spec.arg.name  # type: ignore[union-attr]
            t = _lookup(module, ep, fqn).detach()  # a view: no copy
            cname = fqn[len(_PREFIX):] if fqn.startswith(_PREFIX) else fqn
            cx.env[node] = cx.g.add_const(cname, t)
        else:
            raise ModelFormatError(f"unsupported exported-program input kind {spec.kind.name} "
                                   f"('{spec.arg.name}')")  # type: ignore[union-attr]


def _name_symbols(cx: FxContext, val: torch.Tensor, input_name: str) -> None:
    """The first symbol seen (token ids' axis 1) is "seq"; any other gets '<input>_<axis>'."""
    for axis, d in enumerate(val.shape):
        if isinstance(d, torch.SymInt) and isinstance(d.node.expr, sympy.Symbol):
            s = d.node.expr
            if s not in cx.sym_names:
                cx.sym_names[s] = SEQ if SEQ not in cx.sym_names.values() else f"{input_name}_{axis}"


def import_program(ep: ExportedProgram, *, input_names: Sequence[str] | None = None, name: str = "main",
                   module: torch.nn.Module | None = None) -> Graph:
    """Lowers a (core-ATen) ExportedProgram; its first user output becomes the graph output 'logits'."""
    g = Graph(name)
    g.metadata["frontend"] = "fx"
    cx = FxContext(g)
    _bind_inputs(cx, ep, input_names, module)
    _record_seq_range(cx, ep)
    outputs: list[Any] = []
    for node in ep.graph.nodes:
        if node.op == "call_function":
            _lower_node(cx, node)
        elif node.op == "output":
            outputs = list(node.args[0]) if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
        elif node.op != "placeholder":
            raise UnsupportedAtenOpError(f"{node.op}:{node.target}", node.name,
                                         "submodules and control flow are not supported")
    if not outputs or not isinstance(outputs[0], fx.Node) or not isinstance(cx.env.get(outputs[0]), Value):
        raise ModelFormatError("the exported module returns no tensor")
    g.outputs.append(_named_output(g, cx.env[outputs[0]], "logits"))
    g.drop_unused_consts()  # e.g. a tied embedding export lists twice
    verify_graph(g)
    return g


def _record_seq_range(cx: FxContext, ep: ExportedProgram) -> None:
    for s, r in ep.range_constraints.items():
        if cx.sym_names.get(s) == SEQ:  # type: ignore[call-overload]
            hi = r.upper
            cx.g.metadata["seq_range"] = [int(r.lower), int(hi) if isinstance(hi, sympy.Integer) else None]


def _named_output(g: Graph, v: Value, name: str) -> Value:
    if v.kind == "node" and name not in {x.name for x in g.values()}:
        v.name = g.fresh_name(name)
        return v
    return g.add_node("Identity", [v], name=name, out_names=[name]).output


def _lower_node(cx: FxContext, node: fx.Node) -> None:
    key = op_key(node.target)
    if key in IGNORED:
        return
    fn = ATEN_OPS.get(key)
    if fn is None:
        raise UnsupportedAtenOpError(key, node.name, where=user_frame(node), supported=supported_ops())
    cx.node, cx.key = node, key
    args = _bind(cx, node)
    first_new = len(cx.g.nodes)
    try:
        res = fn(cx, args)
    except UnsupportedOpError:
        raise
    except ZlcError as e:
        raise type(e)(f"{key} at FX node '{node.name}': {e}") from e
    except Exception as e:  # a lowering bug: say where
        raise IRError(f"fx frontend: lowering {key} at FX node '{node.name}' failed: "
                      f"{type(e).__name__}: {e}") from e
    cx.env[node] = res
    _check_types(cx, node, res, {id(o) for n in cx.g.nodes[first_new:] for o in n.outputs})


def _bind(cx: FxContext, node: fx.Node) -> Args:
    """Arguments by schema name, defaults filled in, FX nodes replaced by their IR values."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return {f"arg{i}": _map_arg(cx, a) for i, a in enumerate(node.args)}
    out: Args = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            v = node.args[i]
        elif arg.name in node.kwargs:
            v = node.kwargs[arg.name]
        elif arg.has_default_value():
            v = arg.default_value
        else:
            v = None
        out[arg.name] = _map_arg(cx, v)
    return out


def _map_arg(cx: FxContext, a: Any) -> Any:
    if isinstance(a, fx.Node):
        if a not in cx.env:
            raise IRError(f"fx node '{a.name}' is used before it is lowered")
        return cx.env[a]
    if isinstance(a, (list, tuple)):
        return [_map_arg(cx, x) for x in a]
    if isinstance(a, torch.SymInt):
        return cx.dim(a)
    return a


def _check_types(cx: FxContext, node: fx.Node, res: Any, fresh: set[int]) -> None:
    """Checks new IR values against torch's metadata and refines their dims with it: exact
    extents where IR inference lost them (Slice with symbolic bounds), "seq" for the symbol."""
    meta = node.meta.get("val")
    pairs: list[tuple[Any, Any]] = []
    if isinstance(res, Value):
        pairs = [(res, meta)]
    elif isinstance(res, (list, tuple)) and isinstance(meta, (list, tuple)):
        pairs = list(zip(res, meta, strict=True))
    for v, m in pairs:
        if not isinstance(v, Value) or id(v) not in fresh or m is None:
            continue
        if isinstance(m, torch.Tensor):
            want = cx.ir_type(m, f"node '{node.name}'")
        else:
            want = TensorType(meta_dtype(m, node.name), ())
            if v.sym is None and isinstance(m, (torch.SymInt, int)):
                v.sym = (cx.ir_dim(m),)
        v.type = _refined(v, want, cx, node)


def _refined(v: Value, want: TensorType, cx: FxContext, node: fx.Node) -> TensorType:
    bad = f"fx frontend bug: {op_key(node.target)} at '{node.name}' gives %{v.name}: {v.type}, torch says {want}"
    if v.dtype != want.dtype:
        raise IRError(bad)
    assert want.shape is not None
    if v.shape is None:
        return want
    if len(v.shape) != len(want.shape):
        raise IRError(bad)
    dims: list[Dim] = []
    for have, w in zip(v.shape, want.shape, strict=True):
        if isinstance(have, int) and isinstance(w, int) and have != w:
            raise IRError(bad)
        exact = isinstance(w, int) or w in cx.sym_names.values()
        dims.append(w if exact or not isinstance(have, str) or have.startswith("?") else have)
    return TensorType(v.dtype, tuple(dims))
