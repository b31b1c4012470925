"""Where everything the megakernel reads lives: the arena layout and the op descriptors.

While the scheduler lowers ops (tasks.py), it asks a `Layout` for an activation buffer in A, an
offset for a constant in W (matrices, in the weight dtype) or P (f32: norm weights, biases, rotary
tables), and a descriptor row (DI ints, DF floats). The layout records every placement, so the
bundle's manifest lists each constant and `pack_arenas` fills W and P from the graph afterwards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from zlc.bundle import DESC_FLOATS, DESC_WORDS
from zlc.ir import Graph, Value
from zlc.ir.quant import Dequantized

from .program import Buffer, Program


class Layout:
    """The A/W/P arenas and the descriptor rows of one program, filled as ops are lowered."""

    def __init__(self) -> None:
        self.buffers: dict[str, Buffer] = {}
        self.a_size = 0
        self.w_size = 0
        self.p_size = 0
        self.q_size = 0  # bytes
        self.q_place: dict[Any, int] = {}
        self.w_place: dict[Any, int] = {}
        self.p_place: dict[Any, int] = {}
        self.placements: list[dict[str, Any]] = []
        self.placed_names: set[tuple[str, str]] = set()
        self.di: list[list[int]] = []
        self.df: list[list[float]] = []
        self.desc_labels: list[str] = []

    def buffer(self, name: str, cols: int, rows: int) -> Buffer:
        """A new [rows, cols] f32 buffer in A; a name already taken gets a numeric suffix."""
        name = name if name not in self.buffers else f"{name}.{len(self.buffers)}"
        buf = self.buffers[name] = Buffer(name, self.a_size, rows, cols)
        self.a_size += rows * cols
        self.a_size += (-self.a_size) % 16  # 64-byte aligned rows of the next buffer
        return buf

    def place(self, v: Value, arena: str) -> int:
        """The offset of constant `v` in arena "W" or "P" (placed on first use). A packed weight
        asked for in W goes to Q (its offset is then in bytes; `Value.quant` says which format)."""
        key = _data_key(v)
        if arena == "W" and v.quant is not None:
            arena = "Q"
        table = {"W": self.w_place, "P": self.p_place, "Q": self.q_place}[arena]
        if key in table:
            off = table[key]
        else:
            n = int(v.type.numel() or 0)
            if arena == "W":
                off, self.w_size = self.w_size, self.w_size + n + (-n) % 64
            elif arena == "Q":  # 64-byte aligned: the kernel's wide loads of each block group
                n = v.quant.nbytes
                off, self.q_size = self.q_size, self.q_size + n + (-n) % 64
            else:
                off, self.p_size = self.p_size, self.p_size + n + (-n) % 16
            table[key] = off
        # Every name is listed, tied ones (same data) at the one offset, so each constant of the
        # bundle's IR resolves (runtime/reference_backend.py rebuilds the graphs from these).
        if (arena, v.name) not in self.placed_names:
            self.placed_names.add((arena, v.name))
            pl = {"value": v.name, "arena": arena, "offset": off, "shape": [int(d) for d in v.shape or ()]}
            if arena == "Q":
                pl.update(format=v.quant.format.name, bytes=v.quant.nbytes)
            self.placements.append(pl)
        return off

    def desc(self, label: str, ints: dict[int, int], floats: dict[int, float] | None = None) -> int:
        """Appends a descriptor row (fields by index, the rest zero); returns its index."""
        row = [0] * DESC_WORDS
        for k, v in ints.items():
            row[k] = int(v)
        frow = [0.0] * DESC_FLOATS
        for k, fv in (floats or {}).items():
            frow[k] = float(fv)
        self.di.append(row)
        self.df.append(frow)
        self.desc_labels.append(label)
        return len(self.di) - 1

    def desc_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(DI [n, DESC_WORDS] int64, DF [n, DESC_FLOATS] float32), as the kernel reads them."""
        return (np.array(self.di, dtype=np.int64).reshape(-1, DESC_WORDS),
                np.array(self.df, dtype=np.float32).reshape(-1, DESC_FLOATS))


def _data_key(v: Value) -> Any:
    """Constants that share storage (a tied LM head and embedding) are placed once."""
    d = v.data
    if isinstance(d, Dequantized):  # one per packed constant (tied names share it)
        return ("dq", id(d))
    if isinstance(d, np.ndarray):
        return ("np", d.__array_interface__["data"][0], d.shape, d.strides, str(d.dtype))
    try:
        import torch

        if isinstance(d, torch.Tensor):
            return ("pt", d.data_ptr(), tuple(d.shape), tuple(d.stride()), str(d.dtype))
    except ImportError:  # pragma: no cover
        pass
    return ("id", id(v))


def pack_arenas(decode: Graph, program: Program, weight_dtype: str,
                on_packed: Callable[[int, int], None] | None = None) -> tuple[Any, Any, Any]:
    """(W, P, Q) arenas as torch tensors: every placed constant copied to its offset (Q: the
    packed blocks, bytes, empty when no weight is packed). `on_packed(done, total)` after each."""
    import torch

    from zlc.reference.kernels import const_tensor

    wdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[weight_dtype]
    W = torch.zeros(max(program.w_size, 1), dtype=wdt)
    P = torch.zeros(max(program.p_size, 1), dtype=torch.float32)
    Q = torch.zeros(program.q_size, dtype=torch.uint8)
    for pl, v in placed_constants(program, decode, on_packed):
        if pl["arena"] == "Q":
            Q[pl["offset"]:pl["offset"] + pl["bytes"]] = torch.from_numpy(v.quant.blocks.reshape(-1))
            continue
        t = const_tensor(v).reshape(-1)
        arena = W if pl["arena"] == "W" else P
        arena[pl["offset"]:pl["offset"] + t.numel()] = t.to(arena.dtype)
    return W, P, Q


def placed_constants(program: Any, decode: Any,
                     on_packed: Callable[[int, int], None] | None = None) -> Iterator[tuple[dict[str, Any], Any]]:
    """(placement, constant) for each distinct arena spot of program.weights, in order (a tied name's
    spot once); `on_packed(done, total)` before each placement and once at the end. The one walk
    both arena writers (pack_arenas here, arena_file.write_arenas streaming) take."""
    consts = {v.name: v for v in decode.consts.values()}
    done: set[tuple[str, int]] = set()
    for i, pl in enumerate(program.weights):
        if on_packed is not None:
            on_packed(i, len(program.weights))
        if (pl["arena"], pl["offset"]) in done:  # a tied name: its data is already there
            continue
        done.add((pl["arena"], pl["offset"]))
        yield pl, consts[pl["value"]]
    if on_packed is not None:
        on_packed(len(program.weights), len(program.weights))
