"""Driving the megakernel from the host, whatever runs it (Triton interpreter now, CUDA driver).

A backend does one thing: `launch(mode, ids, past, all_logits)` writes the control block, runs one
kernel launch, and returns the kernel's greedy token (and logits when asked). This module adds
what every backend shares: prompts longer than one prefill chunk run as several launches (the
cache position is in the control block, so chunks continue each other), bounds on the cache and
the vocabulary, and generation (greedy in the kernel; temperature/top-p on the host from logits).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np

from zlc.errors import ZlcError


class Backend(Protocol):
    def launch(self, mode: int, ids: list[int], past: int, all_logits: bool,
               want_logits: bool) -> tuple[int, np.ndarray | None]: ...

    def close(self) -> None: ...


class MegakernelSession:
    """Prefill + decode over one backend with one KV cache (positions 0..max_seq-1)."""

    def __init__(self, backend: Backend, *, chunk: int, max_seq: int, vocab: int):
        self.backend, self.chunk, self.max_seq, self.vocab = backend, chunk, max_seq, vocab
        self.length = 0
        self.launches = 0

    def close(self) -> None:
        self.backend.close()

    def __enter__(self) -> MegakernelSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reset(self) -> None:
        self.length = 0  # cache rows past `length` are rewritten before they are read

    def _check(self, ids: list[int]) -> None:
        if not ids:
            raise ZlcError("empty prompt")
        bad = [i for i in ids if not 0 <= int(i) < self.vocab]
        if bad:
            raise ZlcError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")
        if self.length + len(ids) > self.max_seq:
            raise ZlcError(f"{self.length + len(ids)} tokens exceed the bundle's max_seq={self.max_seq}; "
                           "recompile with a larger --max-seq or use a shorter prompt")

    def prefill(self, ids: list[int], *, all_logits: bool = False,
                want_logits: bool = False) -> tuple[int, np.ndarray | None]:
        """Runs the prompt (continuing the cache). Returns the greedy next token and, if asked,
        logits: [len(ids), vocab] with all_logits, else [1, vocab] for the last position."""
        ids = [int(i) for i in ids]
        self._check(ids)
        parts: list[np.ndarray] = []
        tok = -1
        for s in range(0, len(ids), self.chunk):
            piece = ids[s:s + self.chunk]
            last = s + self.chunk >= len(ids)
            tok, lg = self.backend.launch(0, piece, self.length, all_logits,
                                          want_logits and (all_logits or last))
            self.launches += 1
            self.length += len(piece)
            if lg is not None:
                parts.append(lg)
        return tok, (np.concatenate(parts) if parts else None)

    def step(self, token: int, *, want_logits: bool = False) -> tuple[int, np.ndarray | None]:
        """One decode step; returns the greedy next token (and [1, vocab] logits if asked)."""
        self._check([int(token)])
        out = self.backend.launch(1, [int(token)], self.length, False, want_logits)
        self.launches += 1
        self.length += 1
        return out

    def stream(self, prompt_ids: list[int], max_new_tokens: int, *, eos: int | list[int] | None = None,
               temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> Iterator[int]:
        """Yields new tokens as they are produced; greedy unless temperature > 0."""
        if max_new_tokens < 1:
            return
        stops = set([eos] if isinstance(eos, int) else (eos or []))
        if len(prompt_ids) + max_new_tokens - 1 > self.max_seq:
            raise ZlcError(f"prompt ({len(prompt_ids)}) + max-new-tokens ({max_new_tokens}) exceed the "
                           f"bundle's max_seq={self.max_seq}; recompile with a larger --max-seq")
        self.reset()
        sampled = temperature > 0.0
        gen = None
        if sampled:
            from zlc.reference.sampling import generator, sample  # numpy only

            gen = generator(seed)
        tok, lg = self.prefill(list(prompt_ids), want_logits=sampled)
        for i in range(max_new_tokens):
            if sampled:
                assert lg is not None and gen is not None
                tok = sample(lg[-1], temperature, top_p, gen)
            yield tok
            if tok in stops or i == max_new_tokens - 1:
                return
            tok, lg = self.step(tok, want_logits=sampled)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, **kw: Any) -> list[int]:
        return list(self.stream(prompt_ids, max_new_tokens, **kw))
