"""Values and nodes: the elements graphs are made of.

A Value is produced by exactly one of: a graph input, a constant (weight or small literal, data
kept by reference, never copied), a state buffer owned by the compiler (the KV cache), or a node.
They live apart from Graph (graph.py) because shape inference (ops.py) works on them and Graph's
builder calls shape inference: values -> ops -> graph is the one direction between the three.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from zlc.errors import IRError

from .types import Dim, DType, TensorType


class Value:
    __slots__ = ("name", "type", "producer", "data", "kind", "sym", "quant")

    def __init__(self, name: str, type: TensorType, kind: str, producer: Node | None = None,
                 data: Any = None):
        self.name = name
        self.type = type
        self.kind = kind  # "input" | "const" | "state" | "node"
        self.producer = producer
        self.data = data  # np.ndarray / torch.Tensor for consts, else None
        # Known elements of a small integer tensor (shape arithmetic): ints and symbolic dims.
        self.sym: tuple[Dim, ...] | None = None
        # A Linear weight in a packed format (quant.QuantizedWeight): `data` is then its exact
        # dequantization, what the reference executor reads; the kernels stream the blocks.
        self.quant: Any = None

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    @property
    def shape(self) -> tuple[Dim, ...] | None:
        return self.type.shape

    @property
    def is_const(self) -> bool:
        return self.kind == "const"

    def const_array(self) -> np.ndarray | None:
        """The constant's data as numpy (shares memory where possible), else None."""
        if self.data is None:
            return None
        if isinstance(self.data, torch.Tensor):
            t = self.data.detach()
            if t.dtype == torch.bfloat16:
                t = t.float()
            return t.cpu().numpy()
        return np.asarray(self.data)

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type}"


class Node:
    __slots__ = ("op", "inputs", "outputs", "attrs", "name")

    def __init__(self, op: str, inputs: Sequence[Value | None], outputs: Sequence[Value],
                 attrs: dict[str, Any] | None = None, name: str = ""):
        self.op = op
        self.inputs: list[Value | None] = list(inputs)
        self.outputs: list[Value] = list(outputs)
        self.attrs: dict[str, Any] = dict(attrs or {})
        self.name = name

    @property
    def output(self) -> Value:
        if len(self.outputs) != 1:
            raise IRError(f"node '{self.name}' ({self.op}) has {len(self.outputs)} outputs, not 1")
        return self.outputs[0]

    def input(self, i: int) -> Value | None:
        return self.inputs[i] if i < len(self.inputs) else None

    def __repr__(self) -> str:
        ins = ", ".join("_" if v is None else f"%{v.name}" for v in self.inputs)
        outs = ", ".join(f"%{v.name}" for v in self.outputs)
        return f"{outs} = {self.op}({ins}) @{self.name}"
