"""Picking the next token from logits: greedy, or temperature / top-p with a seeded generator.
Every executor (the reference session, the megakernel's host loop, the serving engine) samples
through this one function, so the same seed gives the same tokens on every device.

numpy only (no torch): the serving path samples here, and a runtime-only install has no torch."""

from __future__ import annotations

import numpy as np

SEED_MASK = (1 << 64) - 1  # the API's seeds are int64, negative ones included: taken mod 2**64


def generator(seed: int | None) -> np.random.Generator:
    """The seeded generator `sample` draws from (seed None: 0)."""
    return np.random.default_rng((seed or 0) & SEED_MASK)


def sample(logits: np.ndarray, temperature: float, top_p: float, gen: np.random.Generator) -> int:
    """The next token from a [vocab] row: its argmax (the lowest id on ties) when temperature <= 0,
    else a draw from softmax(logits / temperature) in float64, cut to the smallest most-likely set
    whose mass reaches top_p (always at least the most likely token)."""
    x = np.asarray(logits)
    if temperature <= 0.0:
        return int(np.argmax(x))
    z = x.astype(np.float64) / temperature
    p = np.exp(z - z.max())  # -inf (top_k's cut) gives 0
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")  # ties: the lowest id first
        sp = p[order]
        keep = np.cumsum(sp) - sp < top_p
        keep[0] = True
        p = np.zeros_like(p)
        p[order[keep]] = sp[keep]
    c = np.cumsum(p)
    # the first token whose cumulative mass exceeds u: a zero-probability token is never picked
    return int(min(np.searchsorted(c, gen.random() * c[-1], side="right"), c.shape[0] - 1))
