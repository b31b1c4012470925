"""Per-row sampling options beyond temperature / top_p: top_k, OpenAI's frequency and presence
penalties, and logprobs with the top alternatives. The scheduler (scheduler.py) keeps a row
without any of them on its old path (argmax, or zlc.reference.sampling.sample), so those rows
give the same tokens and cost nothing more; a row with options goes through `RowSampler`.

The penalties follow OpenAI's definition (and vLLM's): over the tokens generated so far (not the
prompt), with c[j] the count of token j,

    logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty

then top_k keeps the k largest adjusted logits (ties at the k-th: the lowest ids, as
torch.topk orders them), and the row samples as before (greedy rows take the argmax, lowest id on ties).

Logprobs are the log-softmax of the model's own logits (before penalties, temperature, top_k and
top_p: what the model says of the chosen token, as OpenAI and vLLM report them), computed for the
chosen token and the alternatives only (one log-sum-exp over the row); alternatives come most
likely first, lowest id first on ties.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zlc.reference.sampling import sample

from ..protocol import MAX_TOP_LOGPROBS

__all__ = ["MAX_TOP_LOGPROBS", "RowSampler", "log_sum_exp", "top_alternatives", "top_k_cut"]


def top_k_cut(logits: np.ndarray, k: int) -> np.ndarray:
    """A copy of the [vocab] row with all but its k largest entries at -inf (ties at the k-th value:
    the lowest ids kept). O(vocab): one partition, no sort."""
    kth = np.partition(logits, logits.shape[0] - k)[logits.shape[0] - k]
    above = np.flatnonzero(logits > kth)
    keep = np.concatenate([above, np.flatnonzero(logits == kth)[:k - above.shape[0]]])
    cut = np.full_like(logits, -np.inf, dtype=np.float32)
    cut[keep] = logits[keep]
    return cut


def log_sum_exp(logits: np.ndarray) -> float:
    """log(sum(exp(logits))) of a [vocab] row; the sum in float64 (f32's would lose 1e-4 over a
    150k vocabulary). A logprob is then logits[j] - log_sum_exp: no [vocab] log-softmax array."""
    m = float(logits.max())
    return m + math.log(float(np.exp(logits - np.float32(m)).sum(dtype=np.float64)))


def top_alternatives(logits: np.ndarray, lse: float, k: int) -> list[tuple[int, float]]:
    """The k most likely (token, logprob) pairs of a row (its log_sum_exp given), most likely
    first, lowest id first on ties."""
    if k <= 0:
        return []
    k = min(k, logits.shape[0])
    idx = np.argpartition(-logits, k - 1)[:k].tolist()
    order = sorted(idx, key=lambda i: (-logits[i], i))
    return [(int(i), float(logits[i]) - lse) for i in order]


class RowSampler:
    """One request's options and the counts of what it generated (penalties need them)."""

    __slots__ = ("top_k", "frequency", "presence", "logprobs", "top_logprobs", "counts")

    def __init__(self, top_k: int, frequency_penalty: float, presence_penalty: float, logprobs: bool,
                 top_logprobs: int):
        self.top_k = top_k
        self.frequency, self.presence = frequency_penalty, presence_penalty
        self.logprobs, self.top_logprobs = logprobs, top_logprobs
        self.counts: dict[int, int] = {}

    @staticmethod
    def of(top_k: int, frequency_penalty: float, presence_penalty: float, logprobs: bool,
           top_logprobs: int) -> RowSampler | None:
        """A sampler, or None when the options change nothing (the row keeps the plain path)."""
        if top_k <= 0 and frequency_penalty == 0.0 and presence_penalty == 0.0 and not logprobs:
            return None
        return RowSampler(max(0, top_k), frequency_penalty, presence_penalty, logprobs, top_logprobs)

    def adjusted(self, logits: np.ndarray) -> np.ndarray:
        """The logits the token is picked from: penalties applied, top_k's cut at -inf (a copy when
        anything changes; `logits` itself otherwise)."""
        out = logits
        if self.counts and (self.frequency != 0.0 or self.presence != 0.0):
            out = logits.astype(np.float32, copy=True)
            ids = np.fromiter(self.counts.keys(), dtype=np.int64, count=len(self.counts))
            c = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
            out[ids] -= c * np.float32(self.frequency) + np.float32(self.presence)
        if 0 < self.top_k < out.shape[0]:
            out = top_k_cut(out, self.top_k)
        return out

    def pick(self, logits: np.ndarray, temperature: float, top_p: float, generator: Any) -> int:
        """The row's next token from its raw logits; records it for the penalties."""
        x = self.adjusted(logits)
        if generator is None:
            tok = int(np.argmax(x))  # the first maximum: the lowest id on ties, as the plain path
        else:
            tok = sample(x, temperature, top_p, generator)
        self.counts[tok] = self.counts.get(tok, 0) + 1
        return tok

    def logprobs_of(self, logits: np.ndarray, tok: int) -> tuple[float, list[tuple[int, float]]]:
        """The chosen token's logprob and the top alternatives, from the raw logits."""
        lse = log_sum_exp(logits)
        return float(logits[tok]) - lse, top_alternatives(logits, lse, self.top_logprobs)
