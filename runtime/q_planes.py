"""The Triton kernel's layout of the Q arena (packed weights): each matrix's GGUF blocks rearranged
in place into planes, at session start.

A bundle's Q arena holds every packed matrix as GGUF blocks (zlc.abi.formats), which the native kernel
reads. In those blocks the quants sit 2 (q8_0, q4_0) or 4 (q4_1) bytes past a 34-, 18- or 20-byte
stride, so no GPU thread could load them 16 bytes at a time. The Triton kernel reads each matrix
[N, K] at the same offset and in the same number of bytes as planes instead:

    quants  [N, K/32, 32] int8 (q8_0) or [N, K/32, 16] bytes (q4_*: byte i low nibble q[i], high q[i+16])
    d       [N, K/32] f16
    m       [N, K/32] f16 (q4_1 only)

Every field is copied bit for bit, so the planes dequantize exactly as the blocks do (gguf's
dequantizer is the oracle of both). Quants rows are K/2 or K bytes (K a multiple of 32, Q offsets
64-byte aligned): 16-byte aligned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from zlc.abi.formats import FORMATS
from zlc.errors import ZlcError
from zlc.targets import TRITON_WEIGHT_FORMATS

_PLANES = ("q", "d", "m")  # the planes' order: quants, then the scales, then the mins
_MAX_BYTES = 2**31  # the kernel's offsets within a matrix are int32


def planar_formats() -> frozenset[str]:
    """The formats this layout covers: those the Triton kernel streams (zlc.targets)."""
    return TRITON_WEIGHT_FORMATS


def to_planes(blocks: np.ndarray, fmt: str) -> np.ndarray:
    """Planes of one matrix's blocks ([N, K/32 * block_bytes] uint8): the same number of bytes.
    A block's fields and their sizes are the format's (zlc.abi.formats)."""
    f = FORMATS[fmt]
    n_rows = blocks.shape[0]
    b = blocks.reshape(n_rows, -1, f.block_bytes)
    at, parts = 0, {}
    for name, n in f.fields:
        parts[name] = b[:, :, at:at + n].reshape(-1)
        at += n
    return np.concatenate([parts[p] for p in _PLANES if p in parts])


def planar_q(q: np.ndarray, placements: Iterable[Mapping[str, Any]]) -> np.ndarray:
    """The Q arena with every packed matrix of a Triton-streamed format as planes (a new array)."""
    out = np.array(q, dtype=np.uint8, copy=True).reshape(-1)
    done: set[int] = set()
    for pl in placements:
        if pl["arena"] != "Q" or pl["offset"] in done:  # tied names share one offset
            continue
        done.add(int(pl["offset"]))
        fmt = str(pl["format"])
        if fmt not in planar_formats():
            raise ZlcError(f"Q arena: '{pl['value']}' is {fmt}, which the Triton kernel does not stream "
                           "(compile the bundle with a GPU target to get it dense)")
        off, nbytes = int(pl["offset"]), int(pl["bytes"])
        n, k = (int(d) for d in pl["shape"])
        if nbytes >= _MAX_BYTES or off + nbytes > out.size or nbytes != n * k // FORMATS[fmt].block_k * FORMATS[fmt].block_bytes:
            raise ZlcError(f"Q arena: '{pl['value']}' ({fmt} [{n}, {k}]) at {off} is {nbytes} bytes, which does not "
                           f"fit the arena ({out.size} bytes) or its shape")
        out[off:off + nbytes] = to_planes(out[off:off + nbytes].reshape(n, -1), fmt)
    return out
