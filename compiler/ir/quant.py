"""Packed weight formats: GGUF's blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) and ONNX
Runtime's MatMulNBits int4 blocks (nbits4_b16 ... nbits4_b1024), carried by a Linear's weight constant.

A quantized weight is still an f32 [N, K] constant in the IR: its `data` is the exact dequantized
matrix (what the reference executor and every f32 consumer read), and `Value.quant` holds the
packed blocks the kernels stream (codes and block geometry: zlc.abi.formats). The blocks are GGUF's own ([N, K/32] blocks, row-major, each
block as ggml lays it out), so a GGUF tensor can be handed through unchanged; `gguf.quants` is the
quantizer and the bit-exact dequantization oracle (no hand-written rounding here).

    q8_0: 34 bytes per 32 K-values: f16 d, then 32 int8 q;             w = d * q
    q4_0: 18 bytes: f16 d, 16 bytes: q[j] low nibble, q[j+16] high;     w = d * (q - 8)
    q4_1: 20 bytes: f16 d, f16 m, 16 bytes as q4_0;                     w = d * q + m
    q5_0: 22 bytes: f16 d, u32 qh (bit i: 5th bit of q[i]), 16 as q4_0;  w = d * (q - 16)
    q5_1: 24 bytes: f16 d, f16 m, u32 qh, 16 as q4_0;                    w = d * q + m
    q4_k: 144 bytes per 256: f16 d, dmin; 12 bytes of 6-bit scale/min pairs (8 sub-blocks of 32);
          128 bytes: sub-block 2c in the low nibbles of bytes 32c.., 2c+1 in the high ones;
          w = (d * sc) * q - (dmin * m)
    q5_k: 176 bytes: as q4_k, with 32 bytes qh before the quants (bit s of byte e: sub-block s)
    q6_k: 210 bytes: 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16), f16 d;
          w = (d * sc) * (q - 32)

Bytes per weight (the decode floor): q8_0 1.0625, q5_1 0.75, q5_0 0.6875, q6_k 0.8203, q5_k 0.6875,
q4_1 0.625, q4_0 0.5625, q4_k 0.5625. The kernels read these bytes as they are (the native kernel
only transposes each block group at session start, codegen/templates/megakernel.c.jinja "packed
weights"): no repacking into a wider layout.

MatMulNBits int4 (com.microsoft, bits=4, block_size B a power of two in 16..1024) is one format per
B, `nbits4_b<B>` (codes 9..15: 9 + log2(B / 16)). Its blocks are zlc's own regrouping of ORT's
three tensors, one record per (row, block) so that the kernels stream a row's bytes in one run:

    nbits4_b<B>: 5 + B/2 bytes per B K-values: f32 scale s (little-endian; an f16 scale widened,
                 exactly), u8 zero point z (0..15; 8 where the model has none), then the block's B/2
                 bytes of B exactly as ORT packs them: element 2i in the low nibble of byte i, 2i+1
                 in the high one;                                         w = (q - z) * s

`(q - z) * s` in f32 is ORT's own order (its CPU kernel with accuracy_level 0/1, the f32 path,
checked bit for bit on its output; q - z is an exact small integer, so one rounding): the
dequantized matrix is exactly the weight ORT multiplies by. Bytes per weight: b16 0.8125, b32 0.656,
b64 0.578, b128 0.539 (ORT's own: 0.5 + 4.5 / B with zero points).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# the formats' codes and block geometry are the ABI's (zlc.abi.formats), re-exported for the IR's users
from zlc.abi.formats import BLOCK, FORMATS, NBITS_BLOCKS, NBITS_HEAD, WeightFormat  # noqa: F401
from zlc.errors import IRError

# Where a packed weight may be read: op -> its inputs that are [N, K] matrices the kernels stream
# as a Linear's weights (codegen lowers each of them to a Linear task).
PACKED_INPUTS: dict[str, tuple[int, ...]] = {"Linear": (1,), "LMHead": (1,), "GatedMLP": (1, 2, 3), "MLP": (1, 3)}
# Tables read row by row in a packed format: the Embedding's token table (the native kernel gathers
# each token's row of blocks and dequantizes it; the Triton kernel reads none, passes/embed_tables.py).
PACKED_TABLES: dict[str, tuple[int, ...]] = {"Embedding": (0,)}


def _ggml_type(name: str):  # the gguf package's enum member of a format
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[name.upper()]


def format_of_ggml(type_name: str) -> WeightFormat | None:
    """The packed format of a GGUF tensor type ("Q4_K"), None where the kernels stream no such blocks."""
    return FORMATS.get(type_name.lower())


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

    def rows(self, index: np.ndarray | slice) -> QuantizedWeight:
        """The blocks of rows `index` (a permutation or a slice): blocks lie along K, so a row
        permutation or split of the matrix is the same one of its block rows, bit for bit."""
        blocks = np.ascontiguousarray(self.blocks[index])
        return QuantizedWeight(self.format, blocks, int(blocks.shape[0]), self.k)

    def check(self, where: str) -> None:
        """Raises IRError unless the blocks are exactly an [n, k] matrix of this format."""
        bk = self.format.block_k
        want = (self.n, self.k // bk * self.format.block_bytes)
        if self.k % bk:
            raise IRError(f"{where}: {self.format.name} needs K a multiple of {bk}, got {self.k}")
        if self.blocks.dtype != np.uint8 or tuple(self.blocks.shape) != want:
            raise IRError(f"{where}: {self.format.name} blocks are {self.blocks.dtype}{list(self.blocks.shape)}, "
                          f"expected uint8{list(want)} for [{self.n}, {self.k}]")

    def dequantize(self) -> np.ndarray:
        """The f32 [n, k] matrix, by gguf's own dequantizer (the oracle of every kernel); the
        nbits4 formats by MatMulNBits' definition, (q - z) * s in f32."""
        if self.format.name.startswith("nbits4_"):
            return _dequantize_nbits4(self.blocks, self.n, self.k, self.format.block_k)
        from gguf import quants

        return np.ascontiguousarray(quants.dequantize(self.blocks, _ggml_type(self.format.name)), dtype=np.float32)


class Dequantized:
    """A packed constant's f32 data, dequantized each time it is read (`np.asarray(d)`) and not
    kept: what the GGUF frontend gives a matrix it keeps packed, so that a compile holds the file's
    blocks (mapped) and one matrix in f32 at a time, never an f32 copy of the model (issue 33).
    Shape and dtype are known without dequantizing; the graph's passes see a constant as usual."""

    __slots__ = ("q",)

    def __init__(self, q: QuantizedWeight) -> None:
        self.q = q

    @property
    def shape(self) -> tuple[int, int]:
        return (self.q.n, self.q.k)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.float32)

    @property
    def ndim(self) -> int:
        return 2

    @property
    def size(self) -> int:
        return self.q.n * self.q.k

    @property
    def nbytes(self) -> int:
        return 4 * self.size

    def __len__(self) -> int:
        return self.q.n

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        a = self.q.dequantize().reshape(self.q.n, self.q.k)
        return a if dtype is None else a.astype(dtype, copy=False)

    def __getitem__(self, index: Any) -> np.ndarray:
        return np.asarray(self)[index]

    def __mul__(self, other: Any) -> np.ndarray:
        return np.asarray(self) * other

    __rmul__ = __mul__

    def reshape(self, *shape: Any) -> np.ndarray:
        return np.asarray(self).reshape(*shape)

    def astype(self, dtype: Any, copy: bool = True) -> np.ndarray:
        return np.asarray(self).astype(dtype)

    @property
    def T(self) -> np.ndarray:  # noqa: N802 (numpy's name)
        return np.asarray(self).T


def quantize(w: np.ndarray, name: str) -> QuantizedWeight:
    """`w` [N, K] (K a multiple of 32) in format `name`, by gguf's quantizer."""
    from gguf import quants

    fmt = get_format(name)
    if not fmt.quantizable:
        raise IRError(f"{name}: gguf has no quantizer for it (its blocks come from llama.cpp's files)")
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise IRError(f"{name}: needs an [N, K] matrix with K a multiple of {BLOCK}, got {list(w.shape)}")
    blocks = np.ascontiguousarray(quants.quantize(w, _ggml_type(name)), dtype=np.uint8)
    q = QuantizedWeight(fmt, blocks, int(w.shape[0]), int(w.shape[1]))
    q.check(name)
    return q


# ---- MatMulNBits int4 ------------------------------------------------------------------------------

def nbits4_format(block: int) -> WeightFormat | None:
    """The format of MatMulNBits int4 blocks of `block` K-values, None where there is none."""
    return FORMATS.get(f"nbits4_b{block}")


def pack_nbits4(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *,
                n: int, k: int, block: int) -> QuantizedWeight:
    """The nbits4_b<block> blocks of a MatMulNBits int4 weight from ORT's tensors: B uint8
    [N, K/block, block/2], scales f32 or f16 [N * K/block], zero points uint8 [N, ceil(K/block / 2)]
    (4-bit, packed like B along each row's blocks) or None (8). Raises IRError (a one-line reason)
    where the weight has no such format (K not a multiple of the block, float zero points, shapes)."""
    fmt = nbits4_format(block)
    if fmt is None:
        raise IRError(f"block_size={block} has no packed format (supported: {', '.join(map(str, NBITS_BLOCKS))})")
    if k % block:
        raise IRError(f"K={k} is not a multiple of block_size={block} (ORT pads the last block)")
    kb = k // block
    b = np.asarray(b)
    if b.dtype != np.uint8 or b.size != n * kb * block // 2:
        raise IRError(f"B is {b.dtype}{list(b.shape)}, expected uint8 [{n}, {kb}, {block // 2}]")
    sc = np.asarray(scales)
    if sc.dtype not in (np.float32, np.float16) or sc.size != n * kb:
        raise IRError(f"scales are {sc.dtype}{list(sc.shape)}, expected f32/f16 [{n * kb}]")
    if zero_points is None:
        zp = np.full((n, kb), 8, np.uint8)
    else:
        zpa = np.asarray(zero_points)
        if zpa.dtype != np.uint8:
            raise IRError(f"zero points of type {zpa.dtype} (only uint8 packed 4-bit zero points are kept packed)")
        if zpa.size != n * -(-kb // 2):
            raise IRError(f"zero points are {list(zpa.shape)}, expected uint8 [{n}, {-(-kb // 2)}]")
        zpa = zpa.reshape(n, -1)
        zp = np.stack([zpa & 15, zpa >> 4], axis=-1).reshape(n, -1)[:, :kb]
    out = np.empty((n, kb, fmt.block_bytes), np.uint8)
    out[:, :, :4] = sc.astype(np.float32).reshape(n, kb, 1).view(np.uint8)  # f16 -> f32 is exact
    out[:, :, 4] = zp
    out[:, :, NBITS_HEAD:] = b.reshape(n, kb, block // 2)
    q = QuantizedWeight(fmt, out.reshape(n, kb * fmt.block_bytes), n, k)
    q.check("MatMulNBits")
    return q


def _dequantize_nbits4(blocks: np.ndarray, n: int, k: int, block: int) -> np.ndarray:
    """(q - z) * s in f32, block by block: ORT's MatMulNBits weight (module docstring)."""
    recs = blocks.reshape(n, k // block, NBITS_HEAD + block // 2)
    s = np.ascontiguousarray(recs[:, :, :4]).view(np.float32)  # [n, kb, 1]
    z = recs[:, :, 4:5].astype(np.float32)
    packed = recs[:, :, NBITS_HEAD:]
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, k // block, block).astype(np.float32)
    return np.ascontiguousarray(((q - z) * s).reshape(n, k), dtype=np.float32)
