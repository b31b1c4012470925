"""The registry of ATen lowerings, keyed by overload ("aten::mm.default", "aten::view.default")
or by Python size arithmetic ("operator.add"): the role (domain, op, since_version) plays in the
ONNX frontend (registry.py). Core ATen is a closed, documented opset with stable schemas, so one
table covers whole model families. The lowerings (fx_math.py, fx_layout.py) register here; the
driver (fx.py) imports them for that and looks lowerings up here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .fx_context import FxContext

Args = dict[str, Any]
Result = Any  # Value | list[Value | None] | None
Lowering = Callable[[FxContext, Args], Result]

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


def resolve_overload(key: str) -> torch._ops.OpOverload | None:
    """The OpOverload a registry key names ("aten::mm.default"), or None."""
    ns, _, rest = key.partition("::")
    name, _, overload = rest.partition(".")
    packet = getattr(getattr(torch.ops, ns, None), name, None) if rest else None
    op = getattr(packet, overload or "default", None) if packet is not None else None
    return op if isinstance(op, torch._ops.OpOverload) else None
