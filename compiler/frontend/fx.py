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
"""

from __future__ import annotations

import inspect
import math
import operator
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import sympy
import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from zlc.errors import IRError, ModelFormatError, UnsupportedOpError, ZlcError
from zlc.ir import Graph, Value, verify_graph
from zlc.ir.types import Dim, DType, TensorType

SEQ = "seq"
INT64_MAX = 2**63 - 1
_PREFIX = "inner."  # FQN prefix the export wrapper adds; stripped from constant names

Args = dict[str, Any]
Result = Any  # Value | list[Value | None] | None
Lowering = Callable[["FxContext", Args], Result]

ATEN_OPS: dict[str, Lowering] = {}
# Runtime checks torch.export has already discharged at export time: lowered to nothing.
IGNORED = frozenset({
    "aten::_assert_tensor_metadata.default", "aten::_assert_scalar.default",
    "aten::sym_constrain_range_for_size.default", "aten::sym_constrain_range.default",
    "aten::_assert_async.msg", "aten::_functional_assert_async.msg",
})


def aten_op(*keys: str) -> Callable[[Lowering], Lowering]:
    """Registers a lowering for ATen overloads ("aten::add.Tensor") or Python size arithmetic
    ("operator.add")."""

    def deco(fn: Lowering) -> Lowering:
        for k in keys:
            if k in ATEN_OPS:
                raise ValueError(f"two lowerings registered for {k}")
            ATEN_OPS[k] = fn
        return fn

    return deco


def supported_ops() -> list[str]:
    return sorted(ATEN_OPS)


def op_key(target: Any) -> str:
    """The registry key of an FX call target: "aten::mm.default", "operator.getitem", ..."""
    if isinstance(target, torch._ops.OpOverload):
        return f"{target._schema.name}.{target._overloadname or 'default'}"
    mod = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", repr(target))
    return f"operator.{name}" if mod in ("_operator", "operator") else f"{mod}.{name}"


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


def resolve_overload(key: str) -> torch._ops.OpOverload | None:
    """The OpOverload a registry key names ("aten::mm.default"), or None."""
    ns, _, rest = key.partition("::")
    name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns, None), name, None) if rest else None
    op = getattr(packet, overload or "default", None) if packet is not None else None
    return op if isinstance(op, torch._ops.OpOverload) else None


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


# ---- the lowering context ------------------------------------------------------------------------

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
        return _meta_dtype(m, self.name)

    def used_outputs(self) -> set[int]:
        """Indices of a multi-output node's results that are read through getitem."""
        assert self.node is not None
        return {u.args[1] for u in self.node.users if u.target is operator.getitem
                and isinstance(u.args[1], int)}

    def unsupported(self, reason: str) -> UnsupportedAtenOpError:
        return UnsupportedAtenOpError(self.key, self.name, reason, where=_user_frame(self.node))

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
            v = _floordiv(self, self._sym_value(expr.args[0]), self._sym_value(expr.args[1]))
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


def _meta_dtype(m: Any, where: str) -> DType:
    if isinstance(m, torch.Tensor):
        return _ir_dtype(m.dtype, where)
    if isinstance(m, (torch.SymBool, bool)):
        return DType.bool
    if isinstance(m, (torch.SymInt, int)):
        return DType.i64
    if isinstance(m, (torch.SymFloat, float)):
        return DType.f32
    raise IRError(f"fx node '{where}' has no tensor or size metadata ({type(m).__name__})")


def _user_frame(node: fx.Node | None) -> str:
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
        raise UnsupportedAtenOpError(key, node.name, where=_user_frame(node), supported=supported_ops())
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
            want = TensorType(_meta_dtype(m, node.name), ())
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


# ---- lowerings: elementwise ----------------------------------------------------------------------

_UNARY = {
    "neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "reciprocal": "Reciprocal",
    "sin": "Sin", "cos": "Cos", "tanh": "Tanh", "sigmoid": "Sigmoid", "erf": "Erf", "relu": "Relu",
    "floor": "Floor", "ceil": "Ceil", "round": "Round", "sign": "Sign", "atan": "Atan", "tan": "Tan",
    "asin": "Asin", "acos": "Acos", "silu": "Silu",
}


def _unary(ir_op: str) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        return cx.emit(ir_op, cx.cast(a["self"], cx.out_dtype()))  # ints promote to float first

    return lower


for _aten, _ir in _UNARY.items():
    aten_op(f"aten::{_aten}.default")(_unary(_ir))


@aten_op("aten::rsqrt.default")
def _rsqrt(cx: FxContext, a: Args) -> Value:
    # Reciprocal(Sqrt(x)): the spelling the RMSNorm raising rule reads
    return cx.emit("Reciprocal", cx.emit("Sqrt", cx.cast(a["self"], cx.out_dtype())))


@aten_op("aten::log1p.default", "aten::expm1.default", "aten::exp2.default", "aten::log2.default",
         "aten::log10.default")
def _log_exp_variants(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    x = cx.cast(a["self"], dt)
    kind = cx.key.split("::")[1].split(".")[0]
    if kind == "log1p":
        return cx.emit("Log", cx.emit("Add", x, cx.scalar(1.0, dt)))
    if kind == "expm1":
        return cx.emit("Sub", cx.emit("Exp", x), cx.scalar(1.0, dt))
    if kind == "exp2":
        return cx.emit("Pow", cx.scalar(2.0, dt), x)
    return cx.emit("Div", cx.emit("Log", x), cx.scalar(math.log(2.0 if kind == "log2" else 10.0), dt))


@aten_op("aten::isnan.default", "aten::isinf.default")
def _isnan(cx: FxContext, a: Args) -> Value:
    return cx.emit("IsNaN" if "isnan" in cx.key else "IsInf", a["self"])


@aten_op("aten::logical_not.default", "aten::bitwise_not.default")
def _not(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    if cx.key.startswith("aten::bitwise") and x.dtype != DType.bool:
        raise cx.unsupported("bitwise ops on integers (the IR has logical ops on bool only)")
    return cx.emit("Not", cx.cast(x, DType.bool))


@aten_op("aten::gelu.default")
def _gelu(cx: FxContext, a: Args) -> Value:
    return cx.emit("Gelu", a["self"], approximate=str(a["approximate"]))


@aten_op("aten::leaky_relu.default")
def _leaky_relu(cx: FxContext, a: Args) -> Value:
    return cx.emit("LeakyRelu", a["self"], alpha=float(a["negative_slope"]))


@aten_op("aten::elu.default")
def _elu(cx: FxContext, a: Args) -> Value:
    if float(a["scale"]) != 1.0 or float(a["input_scale"]) != 1.0:
        raise cx.unsupported("elu with scale or input_scale != 1")
    return cx.emit("Elu", a["self"], alpha=float(a["alpha"]))


@aten_op("aten::softplus.default")
def _softplus(cx: FxContext, a: Args) -> Value:
    if float(a["beta"]) != 1.0 or float(a["threshold"]) != 20.0:
        raise cx.unsupported("softplus with beta != 1 or threshold != 20")
    return cx.emit("Softplus", a["self"])


def _operands(a: Args) -> list[Any]:
    return list(a.values())


def _promoted(x: Any, y: Any) -> DType:
    """torch's type promotion of two operands (0-D tensors count like scalars)."""

    def proto(v: Any) -> Any:
        if isinstance(v, Value):
            return torch.empty((1,) if v.shape is None or len(v.shape) else (), dtype=v.dtype.torch)
        return v

    px, py = proto(x), proto(y)
    if not isinstance(px, torch.Tensor) and not isinstance(py, torch.Tensor):
        px = torch.tensor(px)
    return DType.from_torch(torch.result_type(px, py))


_ARITH = {  # overloads -> IR op; operands in schema order (self, other[, alpha])
    ("add", "Tensor", "Scalar"): "Add", ("sub", "Tensor", "Scalar"): "Sub",
    ("mul", "Tensor", "Scalar"): "Mul", ("div", "Tensor", "Scalar"): "Div",
    ("pow", "Tensor_Tensor", "Tensor_Scalar", "Scalar"): "Pow", ("maximum", "default"): "Max",
    ("minimum", "default"): "Min", ("fmod", "Tensor", "Scalar"): "Mod",
}


def _arith(ir_op: str, reverse: bool = False) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        ops = _operands(a)
        x, y = (ops[1], ops[0]) if reverse else (ops[0], ops[1])
        dt = cx.out_dtype()  # e.g. int / int -> f32: cast first, then true division
        alpha = a.get("alpha", 1)
        yv = cx.tensor(y, dt)
        if alpha not in (None, 1):
            yv = cx.emit("Mul", yv, cx.scalar(alpha, dt))
        attrs = {"fmod": 1} if ir_op == "Mod" else {}  # torch.fmod: C semantics (sign of x)
        return cx.emit(ir_op, cx.tensor(x, dt), yv, **attrs)

    return lower


for (_aten, *_overloads), _ir in _ARITH.items():
    aten_op(*[f"aten::{_aten}.{o}" for o in _overloads])(_arith(_ir))
aten_op("aten::rsub.Tensor", "aten::rsub.Scalar")(_arith("Sub", reverse=True))


@aten_op("aten::remainder.Tensor", "aten::remainder.Scalar", "aten::remainder.Scalar_Tensor")
def _remainder(cx: FxContext, a: Args) -> Value:
    """Python's mod (sign of y): the IR's Mod for ints; x - floor(x / y) * y for floats."""
    dt = cx.out_dtype()
    x, y = (cx.tensor(o, dt) for o in _operands(a)[:2])
    if not dt.is_float:
        return cx.emit("Mod", x, y)
    return cx.emit("Sub", x, cx.emit("Mul", _floordiv(cx, x, y), y))


def _floordiv(cx: FxContext, x: Value, y: Value) -> Value:
    """Floor division: exact for ints (x - x mod y) / y with Python's mod; Floor(x / y) for floats."""
    if x.dtype.is_float:
        return cx.emit("Floor", cx.emit("Div", x, y))
    return cx.emit("Div", cx.emit("Sub", x, cx.emit("Mod", x, y)), y)


@aten_op("aten::div.Tensor_mode", "aten::div.Scalar_mode", "aten::floor_divide.default")
def _div_mode(cx: FxContext, a: Args) -> Value:
    ops = _operands(a)
    dt = cx.out_dtype()
    x, y = cx.tensor(ops[0], dt), cx.tensor(ops[1], dt)
    mode = a.get("rounding_mode", "floor")
    if mode is None:
        return cx.emit("Div", x, y)
    if mode == "floor":
        return _floordiv(cx, x, y)
    q = cx.emit("Div", x, y)  # integer Div truncates already
    if not dt.is_float:
        return q
    return cx.emit("Mul", cx.emit("Sign", q), cx.emit("Floor", cx.emit("Abs", q)))


_COMPARE = {"eq": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater", "ge": "GreaterOrEqual"}


def _compare(ir_op: str, negate: bool = False) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        x, y = _operands(a)[:2]
        dt = _promoted(x, y)
        out = cx.emit(ir_op, cx.tensor(x, dt), cx.tensor(y, dt))
        return cx.emit("Not", out) if negate else out

    return lower


for _aten, _ir in _COMPARE.items():
    aten_op(f"aten::{_aten}.Tensor", f"aten::{_aten}.Scalar")(_compare(_ir))
aten_op("aten::ne.Tensor", "aten::ne.Scalar")(_compare("Equal", negate=True))


def _logical(ir_op: str) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        x, y = _operands(a)[:2]
        if cx.key.startswith("aten::bitwise") and (_promoted(x, y) != DType.bool):
            raise cx.unsupported("bitwise ops on integers (the IR has logical ops on bool only)")
        return cx.emit(ir_op, cx.tensor(x, DType.bool), cx.tensor(y, DType.bool))

    return lower


for _aten, _ir in (("and", "And"), ("or", "Or"), ("xor", "Xor")):
    aten_op(f"aten::logical_{_aten}.default", f"aten::bitwise_{_aten}.Tensor",
            f"aten::bitwise_{_aten}.Scalar")(_logical(_ir))


@aten_op("aten::where.self", "aten::where.ScalarSelf", "aten::where.ScalarOther", "aten::where.Scalar")
def _where(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    return cx.emit("Where", cx.tensor(a["condition"], DType.bool), cx.tensor(a["self"], dt),
                   cx.tensor(a["other"], dt))


@aten_op("aten::masked_fill.Scalar", "aten::masked_fill.Tensor")
def _masked_fill(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    return cx.emit("Where", cx.tensor(a["mask"], DType.bool), cx.tensor(a["value"], dt), a["self"])


@aten_op("aten::clamp.default", "aten::clamp.Tensor", "aten::clamp_min.default", "aten::clamp_max.default",
         "aten::hardtanh.default")
def _clamp(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    ops = _operands(a)
    x = cx.tensor(ops[0], dt)
    lo, hi = a.get("min", a.get("min_val")), a.get("max", a.get("max_val"))
    if cx.key.startswith("aten::clamp_max"):
        lo, hi = None, ops[1]
    elif cx.key.startswith("aten::clamp_min"):
        lo, hi = ops[1], None
    if lo is not None:
        x = cx.emit("Max", x, cx.tensor(lo, dt))
    if hi is not None:
        x = cx.emit("Min", x, cx.tensor(hi, dt))
    return x


# ---- lowerings: reductions and softmax ------------------------------------------------------------

def _axes(dims: Any) -> list[int] | None:
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return None  # torch: no dims reduces everything
    return [int(d) for d in dims] if isinstance(dims, (list, tuple)) else [int(dims)]


def _reduce(ir_op: str) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        dt = cx.out_dtype()
        x = cx.cast(a["self"], DType.bool if dt == DType.bool else dt)  # sum(bool) -> i64, any(f) -> bool
        keep = int(bool(a.get("keepdim", False)))
        return cx.emit(ir_op, x, axes=_axes(a.get("dim")), keepdims=keep)

    return lower


aten_op("aten::mean.dim", "aten::mean.default")(_reduce("ReduceMean"))
aten_op("aten::sum.dim_IntList", "aten::sum.default")(_reduce("ReduceSum"))
aten_op("aten::amax.default", "aten::max.default", "aten::any.dim", "aten::any.dims",
        "aten::any.default")(_reduce("ReduceMax"))
aten_op("aten::amin.default", "aten::min.default", "aten::all.dim", "aten::all.dims",
        "aten::all.default")(_reduce("ReduceMin"))
aten_op("aten::prod.dim_int", "aten::prod.default")(_reduce("ReduceProd"))
aten_op("aten::logsumexp.default")(_reduce("ReduceLogSumExp"))


@aten_op("aten::max.dim", "aten::min.dim")
def _max_dim(cx: FxContext, a: Args) -> list[Value]:
    keep = int(bool(a["keepdim"]))
    red, arg = ("ReduceMax", "ArgMax") if cx.key.startswith("aten::max") else ("ReduceMin", "ArgMin")
    x, d = a["self"], int(a["dim"])
    return [cx.emit(red, x, axes=[d], keepdims=keep), cx.emit(arg, x, axis=d, keepdims=keep)]


@aten_op("aten::argmax.default", "aten::argmin.default")
def _argmax(cx: FxContext, a: Args) -> Value:
    op = "ArgMax" if "argmax" in cx.key else "ArgMin"
    x, d = a["self"], a["dim"]
    if d is None:
        flat = cx.emit("Reshape", x, cx.ints([-1]))
        return cx.emit(op, flat, axis=0, keepdims=0)
    return cx.emit(op, x, axis=int(d), keepdims=int(bool(a["keepdim"])))


@aten_op("aten::var.correction", "aten::var_mean.correction")
def _var(cx: FxContext, a: Args) -> Value | list[Value]:
    dt = cx.out_dtype()
    x, axes, keep = cx.cast(a["self"], dt), _axes(a["dim"]), int(bool(a["keepdim"]))
    mean = cx.emit("ReduceMean", x, axes=axes, keepdims=1)
    d = cx.emit("Sub", x, mean)
    ss = cx.emit("ReduceSum", cx.emit("Mul", d, d), axes=axes, keepdims=keep)
    n = cx.cast(cx.emit("Div", cx.emit("Size", x), cx.emit("Size", mean)), dt)  # elements reduced
    corr = a["correction"]
    denom = cx.emit("Sub", n, cx.scalar(float(1 if corr is None else corr), dt))
    var = cx.emit("Div", ss, denom)
    if "var_mean" not in cx.key:
        return var
    return [var, mean if keep else cx.emit("ReduceMean", x, axes=axes, keepdims=0)]


@aten_op("aten::_softmax.default", "aten::_log_softmax.default")
def _softmax(cx: FxContext, a: Args) -> Value:
    x = cx.cast(a["self"], cx.out_dtype())  # half_to_float: compute in the output dtype
    op = "LogSoftmax" if "log_softmax" in cx.key else "Softmax"
    return cx.emit(op, x, axis=int(a["dim"]))


@aten_op("aten::cumsum.default")
def _cumsum(cx: FxContext, a: Args) -> Value:
    return cx.emit("CumSum", cx.cast(a["self"], cx.out_dtype()), cx.scalar(int(a["dim"]), DType.i64))


# ---- lowerings: linear algebra and normalization --------------------------------------------------

@aten_op("aten::mm.default", "aten::bmm.default", "aten::matmul.default")
def _matmul(cx: FxContext, a: Args) -> Value:
    return cx.emit("MatMul", a["self"], a["mat2"] if "mat2" in a else a["other"])


@aten_op("aten::addmm.default", "aten::baddbmm.default")
def _addmm(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    y = cx.emit("MatMul", a["mat1"] if "mat1" in a else a["batch1"], a["mat2"] if "mat2" in a else a["batch2"])
    if a["alpha"] != 1:
        y = cx.emit("Mul", y, cx.scalar(a["alpha"], dt))
    bias = a["self"]
    if a["beta"] == 0:
        return y
    if a["beta"] != 1:
        bias = cx.emit("Mul", bias, cx.scalar(a["beta"], dt))
    return cx.emit("Add", y, bias)


@aten_op("aten::linear.default")
def _linear(cx: FxContext, a: Args) -> Value:
    y = cx.emit("MatMul", a["input"], _permuted(cx, a["weight"], [1, 0]))
    return y if a["bias"] is None else cx.emit("Add", y, a["bias"])


@aten_op("aten::native_layer_norm.default")
def _layer_norm(cx: FxContext, a: Args) -> list[Value | None]:
    x, shape, eps = a["input"], a["normalized_shape"], float(a["eps"])
    dt = cx.out_dtype()
    if len(shape) == 1 and cx.used_outputs() <= {0}:
        # one ATen op, one IR op: the same mapping as ONNX LayerNormalization
        w = a["weight"] if a["weight"] is not None else \
            cx.g.add_const("ones", torch.ones(int(shape[0]), dtype=dt.torch), unique=True)
        ins = [x, w] + ([a["bias"]] if a["bias"] is not None else [])
        return [cx.emit("LayerNorm", *ins, eps=eps), None, None]
    axes = list(range(-len(shape), 0))
    mean = cx.emit("ReduceMean", x, axes=axes, keepdims=1)
    d = cx.emit("Sub", x, mean)
    var = cx.emit("ReduceMean", cx.emit("Mul", d, d), axes=axes, keepdims=1)
    rstd = cx.emit("Reciprocal", cx.emit("Sqrt", cx.emit("Add", var, cx.scalar(eps, dt))))
    y = cx.emit("Mul", d, rstd)
    if a["weight"] is not None:
        y = cx.emit("Mul", y, a["weight"])
    if a["bias"] is not None:
        y = cx.emit("Add", y, a["bias"])
    return [y, mean, rstd]


# ---- lowerings: layout ------------------------------------------------------------------------------

def _shape_of(v: Value) -> tuple[Dim, ...]:
    if v.shape is None:
        raise IRError(f"%{v.name} has unknown rank")
    return v.shape


def _unchanged(cx: FxContext, x: Value) -> bool:
    """The node's result has x's dims (a no-op view or expand), symbolic dims included."""
    m = cx.meta()
    return x.shape is not None and list(x.shape) == [cx.ir_dim(d) for d in m.shape]


@aten_op("aten::view.default", "aten::_unsafe_view.default", "aten::reshape.default", "aten::view_copy.default")
def _view(cx: FxContext, a: Args) -> Value:
    x, size = a["self"], a["size"] if "size" in a else a["shape"]
    if _unchanged(cx, x):
        return x
    allowzero = int(any(isinstance(d, int) and d == 0 for d in size))
    return cx.emit("Reshape", x, cx.shape_tensor(size), allowzero=allowzero)


def _permuted(cx: FxContext, x: Value, perm: list[int]) -> Value:
    # Transpose(W) of a weight stays a node: the fold pass turns it into the constant `W.T`
    return x if perm == list(range(len(perm))) else cx.emit("Transpose", x, perm=perm)


@aten_op("aten::permute.default", "aten::permute_copy.default")
def _permute(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    r = len(_shape_of(x))
    return _permuted(cx, x, [int(d) % r for d in a["dims"]])


@aten_op("aten::t.default", "aten::transpose.int")
def _transpose(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    r = len(_shape_of(x))
    if r < 2:
        return x
    d0, d1 = (int(a["dim0"]) % r, int(a["dim1"]) % r) if "dim0" in a else (r - 2, r - 1)
    perm = list(range(r))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(cx, x, perm)


@aten_op("aten::unsqueeze.default")
def _unsqueeze(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    return cx.emit("Unsqueeze", x, axes=[int(a["dim"]) % (len(_shape_of(x)) + 1)])


@aten_op("aten::squeeze.dim", "aten::squeeze.dims", "aten::squeeze.default")
def _squeeze(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    shape = _shape_of(x)
    dims = a.get("dim")
    cand = range(len(shape)) if dims is None else ([dims] if isinstance(dims, int) else dims)
    axes = sorted({int(d) % max(len(shape), 1) for d in cand if shape and shape[int(d)] == 1})
    return cx.emit("Squeeze", x, axes=axes) if axes else x  # torch ignores non-1 dims


@aten_op("aten::expand.default", "aten::expand_copy.default")
def _expand(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    if _unchanged(cx, x):
        return x
    # -1 keeps a dim; ONNX-style Expand broadcasts a target 1 the same way
    size = [1 if isinstance(d, int) and d == -1 else d for d in a["size"]]
    return cx.emit("Expand", x, cx.shape_tensor(size))


@aten_op("aten::clone.default", "aten::alias.default", "aten::detach.default", "aten::lift_fresh_copy.default",
         "aten::contiguous.default", "aten::alias_copy.default", "aten::detach_copy.default")
def _identity(cx: FxContext, a: Args) -> Value:
    return a["self"]  # values are immutable in the IR: copies and aliases are the same value


@aten_op("aten::_to_copy.default", "aten::to.dtype")
def _to_copy(cx: FxContext, a: Args) -> Value:
    return cx.cast(a["self"], cx.out_dtype())


@aten_op("aten::slice.Tensor", "aten::slice_copy.Tensor")
def _slice(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    dim, step = int(a["dim"]), a["step"]
    start = 0 if a["start"] is None else a["start"]
    end = INT64_MAX if a["end"] is None else a["end"]
    if isinstance(start, int) and start == 0 and isinstance(end, int) and end >= INT64_MAX and step == 1:
        return x
    if isinstance(end, int):
        end = min(end, INT64_MAX)
    return cx.emit("Slice", x, cx.shape_tensor([start]), cx.shape_tensor([end]), cx.ints([dim]),
                   cx.shape_tensor([step]))


@aten_op("aten::select.int", "aten::select_copy.int")
def _select(cx: FxContext, a: Args) -> Value:
    return cx.emit("Gather", a["self"], cx.dim(a["index"]), axis=int(a["dim"]))


@aten_op("aten::cat.default", "aten::concat.default")
def _cat(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    xs = [cx.cast(t, dt) for t in a["tensors"]]
    rank = max(len(_shape_of(t)) for t in xs)
    xs = [t for t in xs if not (len(_shape_of(t)) == 1 and rank > 1 and t.shape == (0,))]  # legacy empties
    return xs[0] if len(xs) == 1 else cx.emit("Concat", *xs, axis=int(a["dim"]))


def _split_sizes(cx: FxContext, x: Value, sizes: Sequence[Any], dim: int) -> list[Value]:
    if all(isinstance(s, int) for s in sizes):
        return cx.emit_multi("Split", [x], len(sizes), axis=dim, split=[int(s) for s in sizes])
    outs, start = [], cx.scalar(0, DType.i64)
    for s in sizes:  # symbolic sizes: one Slice per piece
        end = cx.emit("Add", start, cx.dim(s))
        outs.append(cx.emit("Slice", x, cx.shape_tensor([start]), cx.shape_tensor([end]), cx.ints([dim])))
        start = end
    return outs


@aten_op("aten::split_with_sizes.default", "aten::split_with_sizes_copy.default")
def _split_with_sizes(cx: FxContext, a: Args) -> list[Value]:
    return _split_sizes(cx, a["self"], a["split_sizes"], int(a["dim"]))


@aten_op("aten::split.Tensor", "aten::split_copy.Tensor")
def _split(cx: FxContext, a: Args) -> list[Value]:
    x, dim, size = a["self"], int(a["dim"]), a["split_size"]
    total = _shape_of(x)[dim]
    if not isinstance(total, int) or not isinstance(size, int):
        raise cx.unsupported("split of a symbolic dim into equal chunks")
    return _split_sizes(cx, x, [min(size, total - i) for i in range(0, total, size)], dim)


@aten_op("aten::unbind.int", "aten::unbind_copy.int")
def _unbind(cx: FxContext, a: Args) -> list[Value]:
    x, dim = a["self"], int(a["dim"])
    n = _shape_of(x)[dim]
    if not isinstance(n, int):
        raise cx.unsupported("unbind along a symbolic dim")
    return [cx.emit("Squeeze", p, axes=[dim]) for p in _split_sizes(cx, x, [1] * n, dim)]


@aten_op("aten::repeat.default")
def _repeat(cx: FxContext, a: Args) -> Value:
    x, reps = a["self"], list(a["repeats"])
    extra = len(reps) - len(_shape_of(x))
    if extra > 0:
        x = cx.emit("Unsqueeze", x, axes=list(range(extra)))
    return cx.emit("Tile", x, cx.shape_tensor(reps))


# ---- lowerings: indexing ----------------------------------------------------------------------------

@aten_op("aten::embedding.default")
def _embedding(cx: FxContext, a: Args) -> Value:
    return cx.emit("Gather", a["weight"], a["indices"], axis=0)  # raised to Embedding by the passes


@aten_op("aten::index_select.default")
def _index_select(cx: FxContext, a: Args) -> Value:
    return cx.emit("Gather", a["self"], a["index"], axis=int(a["dim"]))


@aten_op("aten::gather.default")
def _gather(cx: FxContext, a: Args) -> Value:
    return cx.emit("GatherElements", a["self"], a["index"], axis=int(a["dim"]))


@aten_op("aten::index.Tensor")
def _index(cx: FxContext, a: Args) -> Value:
    x, idx = a["self"], list(a["indices"])
    given = [i for i, t in enumerate(idx) if t is not None]
    if any(idx[i].dtype == DType.bool for i in given):
        raise cx.unsupported("boolean-mask indexing (data-dependent shape)")
    if len(given) == 1:  # x[..., idx, ...]: one advanced index keeps its place
        return cx.emit("Gather", x, idx[given[0]], axis=given[0])
    if given != list(range(len(given))):
        raise cx.unsupported("advanced indices that are not a prefix of the dims (x[i, :, j])")
    # x[i0, i1, ...]: broadcast the indices, stack them last, GatherND
    rank = max(len(_shape_of(t)) for t in idx)
    bshape = cx.shape_tensor(list(cx.meta().shape[:rank]))
    cols = [cx.emit("Unsqueeze", cx.emit("Expand", cx.cast(t, DType.i64), bshape), axes=[rank]) for t in idx]
    return cx.emit("GatherND", x, cx.emit("Concat", *cols, axis=-1), batch_dims=0)


@aten_op("aten::triu.default", "aten::tril.default")
def _trilu(cx: FxContext, a: Args) -> Value:
    return cx.emit("Trilu", a["self"], cx.scalar(int(a["diagonal"]), DType.i64), upper=int("triu" in cx.key))


# ---- lowerings: creation -----------------------------------------------------------------------------

def _static(xs: Sequence[Any]) -> bool:
    return all(isinstance(x, (int, float, bool)) for x in xs)


@aten_op("aten::arange.start_step", "aten::arange.start", "aten::arange.default")
def _arange(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    start = a.get("start", 0) if "start" in a else 0
    end, step = a["end"], a.get("step", 1)
    if _static([start, end, step]):
        return cx.g.add_const("arange", torch.arange(start, end, step, dtype=dt.torch), unique=True)
    return cx.emit("Range", cx.tensor(start, dt), cx.tensor(end, dt), cx.tensor(step, dt))


def _filled(cx: FxContext, shape: Any, fill: Any) -> Value:
    """A tensor of the node's dtype filled with `fill`: a constant if static, else ConstantOfShape."""
    dt = cx.out_dtype()
    if isinstance(shape, Value):
        return cx.emit("ConstantOfShape", shape, value=fill, dtype=dt.value)
    if _static(shape):
        return cx.g.add_const("full", torch.full([int(s) for s in shape], fill, dtype=dt.torch), unique=True)
    return cx.emit("ConstantOfShape", cx.shape_tensor(shape), value=fill, dtype=dt.value)


@aten_op("aten::full.default")
def _full(cx: FxContext, a: Args) -> Value:
    fill = a["fill_value"]
    if not isinstance(fill, (int, float, bool)):
        raise cx.unsupported("a fill value computed at run time")
    if not a["size"]:
        return cx.scalar(fill, cx.out_dtype())
    return _filled(cx, a["size"], fill)


@aten_op("aten::full_like.default", "aten::zeros_like.default", "aten::ones_like.default")
def _full_like(cx: FxContext, a: Args) -> Value:
    x = a["self"]
    fill = a.get("fill_value", 1 if "ones" in cx.key else 0)
    if x.shape is not None and all(isinstance(d, int) for d in x.shape):
        return _filled(cx, list(x.shape), fill)
    return _filled(cx, cx.emit("Shape", x), fill)


@aten_op("aten::scalar_tensor.default")
def _scalar_tensor(cx: FxContext, a: Args) -> Value:
    s = a["s"]
    if isinstance(s, Value):
        return cx.cast(s, cx.out_dtype())
    return cx.scalar(s, cx.out_dtype())


# ---- lowerings: sizes (SymInt arithmetic) -------------------------------------------------------------

@aten_op("aten::sym_size.int")
def _sym_size(cx: FxContext, a: Args) -> Value:
    m = cx.meta()
    if isinstance(m, torch.SymInt) and m.node.expr in cx.sym_sources:
        return cx.dim(m)  # one Shape node per symbol, shared by every use
    x, d = a["self"], int(a["dim"])
    return cx.emit("Squeeze", cx.emit("Shape", x, start=d, end=d + 1 if d != -1 else None), axes=[0])


@aten_op("aten::sym_numel.default")
def _sym_numel(cx: FxContext, a: Args) -> Value:
    return cx.emit("Size", a["self"])


def _size_binary(ir_op: str) -> Lowering:
    def lower(cx: FxContext, a: Args) -> Value:
        x, y = a["arg0"], a["arg1"]
        dt = _promoted(x, y) if ir_op in _COMPARE.values() else cx.out_dtype()
        return cx.emit(ir_op, cx.tensor(x, dt), cx.tensor(y, dt))

    return lower


for _py, _ir in (("add", "Add"), ("sub", "Sub"), ("mul", "Mul"), ("truediv", "Div"), ("mod", "Mod"),
                 ("eq", "Equal"), ("lt", "Less"), ("le", "LessOrEqual"), ("gt", "Greater"),
                 ("ge", "GreaterOrEqual")):
    aten_op(f"operator.{_py}")(_size_binary(_ir))
aten_op("torch.sym_max")(_size_binary("Max"))
aten_op("torch.sym_min")(_size_binary("Min"))


@aten_op("operator.floordiv")
def _size_floordiv(cx: FxContext, a: Args) -> Value:
    dt = cx.out_dtype()
    return _floordiv(cx, cx.tensor(a["arg0"], dt), cx.tensor(a["arg1"], dt))


@aten_op("operator.neg")
def _size_neg(cx: FxContext, a: Args) -> Value:
    return cx.emit("Neg", cx.tensor(a["arg0"], cx.out_dtype()))


@aten_op("operator.getitem")
def _getitem(cx: FxContext, a: Args) -> Value:
    seq, i = a["arg0"], int(a["arg1"])
    if not isinstance(seq, (list, tuple)) or seq[i] is None:
        raise cx.unsupported(f"result {i} of a multi-output op that has no lowering")
    return seq[i]
