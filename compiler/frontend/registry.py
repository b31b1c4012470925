"""A versioned op registry, keyed by (domain, op) and the opset version a converter applies from.

ONNX ops change meaning across opsets (Reshape's allowzero, ReduceMean's axes moving from an
attribute to an input, Split's sizes likewise). A converter registered `since=13` is used for every
model whose opset resolves (through `onnx.defs.get_schema`) to a schema version >= 13, until a
later converter takes over: the same scheme onnx2torch and TVM use.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx.defs

Converter = Callable[..., Any]


@dataclass
class OpRegistry:
    table: dict[tuple[str, str], list[tuple[int, Converter]]] = field(default_factory=dict)

    def register(self, op: str, since: int = 1, domain: str = "") -> Callable[[Converter], Converter]:
        def deco(fn: Converter) -> Converter:
            entries = self.table.setdefault((domain, op), [])
            bisect.insort(entries, (since, fn), key=lambda e: e[0])
            return fn

        return deco

    def resolve(self, domain: str, op: str, opset: int) -> Converter | None:
        entries = self.table.get((domain, op))
        if not entries:
            return None
        version = opset
        # ONNX Runtime registers a few ops of its own in the default domain (SimplifiedLayerNormalization);
        # onnx.defs does not know them, so their converters are keyed by the opset itself.
        if domain in ("", "ai.onnx") and onnx.defs.has(op, ""):
            try:
                version = onnx.defs.get_schema(op, max_inclusive_version=opset, domain="").since_version
            except onnx.defs.SchemaError:
                return None  # the op does not exist yet at this opset
        best = None
        for since, fn in entries:
            if since <= version:
                best = fn
        return best

    def supported(self, domain: str) -> list[str]:
        return sorted(op for (d, op) in self.table if d == domain)

    def domains(self) -> list[str]:
        return sorted({d for d, _ in self.table})


ONNX_OPS = OpRegistry()
onnx_op = ONNX_OPS.register
