"""A generation session over a lowered model: prefill once, then one decode step per token, on
the reference executor, with one compiler-owned KV cache shared by both graphs."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from zlc.errors import ZlcError
from zlc.ir import Graph

from .executor import ReferenceExecutor, in_f64
from .sampling import generator, sample


class ReferenceSession:
    def __init__(self, prefill: Graph, decode: Graph, max_seq: int):
        self.max_seq = max_seq
        self._prefill = ReferenceExecutor(prefill)
        self._decode = ReferenceExecutor(decode, state=self._prefill.state)
        self.ids_name = prefill.inputs[0].name
        self.logits_name = prefill.outputs[0].name
        self.length = 0  # tokens in the cache

    @classmethod
    def from_lowered(cls, lowered: Any, *, f64: bool = False) -> ReferenceSession:
        """`f64`: the same graphs computed in f64 (executor.in_f64: the summation-order oracle)."""
        if lowered.prefill is None or lowered.decode is None:
            raise ZlcError("the model was lowered without a KV cache; nothing to generate with")
        if f64:
            return cls(in_f64(lowered.prefill), in_f64(lowered.decode), lowered.max_seq)
        return cls(lowered.prefill, lowered.decode, lowered.max_seq)

    def reset(self) -> None:
        self._prefill.reset_state()
        self.length = 0

    def _check_room(self, n: int) -> None:
        if self.length + n > self.max_seq:
            raise ZlcError(f"{self.length + n} tokens exceed max_seq={self.max_seq}; "
                           "compile with a larger --max-seq or use a shorter prompt")

    def prefill(self, ids: list[int]) -> torch.Tensor:
        """Runs the prompt (appending to whatever is cached); returns logits [T, vocab]."""
        if not ids:
            raise ZlcError("empty prompt")
        self._check_room(len(ids))
        out = self._prefill.run({self.ids_name: np.array([ids], dtype=np.int64),
                                 "past_len": np.array(self.length, dtype=np.int64)})
        self.length += len(ids)
        return out[self.logits_name][0]

    def step(self, token: int) -> torch.Tensor:
        """One decode step; returns logits [vocab]."""
        self._check_room(1)
        out = self._decode.run({self.ids_name: np.array([[token]], dtype=np.int64),
                                "past_len": np.array(self.length, dtype=np.int64)})
        self.length += 1
        return out[self.logits_name][0, -1]

    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, eos: int | None = None,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> list[int]:
        """Greedy by default; temperature/top-p sampling with a seed otherwise."""
        self.reset()
        gen = generator(seed)
        logits = self.prefill(list(prompt_ids))[-1]
        out: list[int] = []
        for i in range(max_new_tokens):
            tok = sample(logits.double().numpy(), temperature, top_p, gen)
            out.append(tok)
            if tok == eos or i == max_new_tokens - 1:
                break
            logits = self.step(tok)
        return out
