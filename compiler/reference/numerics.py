"""The `fast` numerics of the CPU kernel, emulated: the oracle of its integer dot products.

Under `fast` (zlc.bundle.NUMERICS) the native kernel rounds the input row of every Linear whose
weights are packed in one of `CPU_FAST_FORMATS` as llama.cpp's x86 quantize_row_q8_0 does, per
block of 32 values: amax = max |x|, q = round-half-even(x * (127 / amax)) (0 where amax is 0),
d = amax / 127 stored as f16; the row the dot product sees is q * d. Its integer sums against the
blocks' quants, times the blocks' and the row's scales, are that row times the dequantized matrix
up to f32 summation order, which is what the reference computes here: the Linear kernels of
kernels.py round such inputs with `q8_round` while `fast_formats` names their weights' format.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from zlc.bundle import CPU_FAST_FORMATS, check_numerics

QK = 32  # values per activation block (llama.cpp's QK8_0)

#: the packed formats whose Linears round their inputs in the evaluation under way (empty: exact)
_FAST: ContextVar[frozenset[str]] = ContextVar("zlc_fast_formats", default=frozenset())


def wide(t: torch.Tensor) -> torch.Tensor:
    """`t` in at least f32: half inputs are computed in f32 (what the kernels do); an f64 graph
    (executor.in_f64, the oracle of the kernels' f32 summation order) stays f64."""
    return t if t.dtype == torch.float64 else t.float()


def q8_round(x: torch.Tensor) -> torch.Tensor:
    """`x` ([..., K], K a multiple of 32) with each block of 32 of its last axis rounded to Q8_0 and
    dequantized, in x's dtype. Every step is one f32 operation, as the kernel's C does them."""
    b = x.float().reshape(-1, QK)
    amax = b.abs().amax(-1, keepdim=True)
    # a tensor division, not 127 / amax (torch computes a scalar's quotient as a reciprocal times it)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    q = torch.round(b * inv)  # half to even, as vroundps / rintf
    d = (amax / 127.0).half().float()
    return (q * d).reshape(x.shape).to(x.dtype)


def rounds(w: Any) -> bool:
    """Whether a Linear input multiplied with the graph value `w` is rounded now."""
    q = getattr(w, "quant", None)
    fast = _FAST.get()
    return bool(fast) and q is not None and q.format.name in fast


def linear_input(w: Any, x: torch.Tensor) -> torch.Tensor:
    """x as the kernel feeds it to the Linear whose weight is the graph value `w`."""
    return q8_round(x) if rounds(w) else x


def linear(w: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear of x as the kernel feeds it (linear_input) with the tensor of the graph value `w`."""
    return F.linear(linear_input(w, x), weight, bias)


@contextlib.contextmanager
def numerics(name: str) -> Iterator[None]:
    """Evaluations inside compute with `name`'s (zlc.bundle.NUMERICS) CPU roundings."""
    token = _FAST.set(frozenset(CPU_FAST_FORMATS) if check_numerics(name) == "fast" else frozenset())
    try:
        yield
    finally:
        _FAST.reset(token)
