"""Packed weight formats: GGUF's Q8_0, Q4_0 and Q4_1 blocks, carried by a Linear's weight constant.

A quantized weight is still an f32 [N, K] constant in the IR: its `data` is the exact dequantized
matrix (what the reference executor and every f32 consumer read), and `Value.quant` holds the
packed blocks the kernels stream. The blocks are GGUF's own ([N, K/32] blocks, row-major, each
block as ggml lays it out), so a GGUF tensor can be handed through unchanged; `gguf.quants` is the
quantizer and the bit-exact dequantization oracle (no hand-written rounding here).

    q8_0: 34 bytes per 32 K-values: f16 d, then 32 int8 q;             w = d * q
    q4_0: 18 bytes: f16 d, 16 bytes: q[j] low nibble, q[j+16] high;     w = d * (q - 8)
    q4_1: 20 bytes: f16 d, f16 m, 16 bytes as q4_0;                     w = d * q + m
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zlc.errors import IRError

BLOCK = 32  # K-values per block, every format here

# Where a packed weight may be read: op -> its inputs that are [N, K] matrices the kernels stream
# as a Linear's weights (codegen lowers each of them to a Linear task).
PACKED_INPUTS: dict[str, tuple[int, ...]] = {"Linear": (1,), "LMHead": (1,), "GatedMLP": (1, 2, 3), "MLP": (1, 3)}


@dataclass(frozen=True)
class WeightFormat:
    name: str
    code: int  # the Linear descriptor's w_format word (0: dense, in the W arena)
    block_bytes: int


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("q8_0", 1, 34),
    WeightFormat("q4_0", 2, 18),
    WeightFormat("q4_1", 3, 20),
)}


def _ggml_type(name: str):  # the gguf package's enum member of a format
    from gguf import GGMLQuantizationType

    return {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
            "q4_1": GGMLQuantizationType.Q4_1}[name]


def get_format(name: str) -> WeightFormat:
    if name not in FORMATS:
        raise IRError(f"unknown weight format '{name}' (known: {', '.join(FORMATS)})")
    return FORMATS[name]


@dataclass(frozen=True)
class QuantizedWeight:
    """The packed blocks of an [N, K] matrix: `blocks` is uint8 [N, K / 32 * block_bytes]."""

    format: WeightFormat
    blocks: np.ndarray
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return int(self.blocks.size)

    def check(self, where: str) -> None:
        """Raises IRError unless the blocks are exactly an [n, k] matrix of this format."""
        want = (self.n, self.k // BLOCK * self.format.block_bytes)
        if self.k % BLOCK:
            raise IRError(f"{where}: {self.format.name} needs K a multiple of {BLOCK}, got {self.k}")
        if self.blocks.dtype != np.uint8 or tuple(self.blocks.shape) != want:
            raise IRError(f"{where}: {self.format.name} blocks are {self.blocks.dtype}{list(self.blocks.shape)}, "
                          f"expected uint8{list(want)} for [{self.n}, {self.k}]")

    def dequantize(self) -> np.ndarray:
        """The f32 [n, k] matrix, by gguf's own dequantizer (the oracle of every kernel)."""
        from gguf import quants

        return np.ascontiguousarray(quants.dequantize(self.blocks, _ggml_type(self.format.name)), dtype=np.float32)


def quantize(w: np.ndarray, name: str) -> QuantizedWeight:
    """`w` [N, K] (K a multiple of 32) in format `name`, by gguf's quantizer."""
    from gguf import quants

    fmt = get_format(name)
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise IRError(f"{name}: needs an [N, K] matrix with K a multiple of {BLOCK}, got {list(w.shape)}")
    blocks = np.ascontiguousarray(quants.quantize(w, _ggml_type(name)), dtype=np.uint8)
    q = QuantizedWeight(fmt, blocks, int(w.shape[0]), int(w.shape[1]))
    q.check(name)
    return q
