"""The decode-vs-prefill invariant: every lowered model with a KV cache is checked at lowering time.

KV-cache synthesis derives the decode graph from a graph that saw whole sequences; anything it
did not rebase on the cache's past length (position arithmetic raising left op-level, a table
gathered at `Range(0, T)`) is exact in prefill and wrong in every decode step. So, on the reference
executor and without ONNX Runtime (this guards `zlc run model.onnx`, `zlc.lower(module)` and
`zlc.compile(module)` as much as `zlc verify`): the logits of decode step t must equal the logits
of a prefill of the whole sequence at position t. The probe: a prompt of 3 tokens, a decode step,
a chunk of 2 tokens prefilled on top of the cache (the prefill graph with a past), a decode step
past that chunk's boundary; then one prefill of all 7. Five forward passes of a few tokens, on a
cache of 7 positions rather than max_seq (allocating SmolLM2's 94 MB cache twice cost more than the
passes): ~5 ms for the zoo's tiny models, ~0.4 s for SmolLM2-135M (weights already in memory).

A mismatch raises `DecodeMismatchError` (a VerificationError: exit code 3), naming the first
divergent step and the position-dependent nodes left in the decode graph (positions.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from zlc.errors import VerificationError
from zlc.ir import Graph
from zlc.reference.executor import ReferenceExecutor

from .kv_cache import CachedModel
from .positions import unabsorbed_positions

PROMPT, CHUNK = 3, 2
RTOL = 1e-3  # of the row's largest |logit|; a 1-row and an n-row pass differ by ~1e-6 of it in f32
HALF_ULPS = 8  # f16/bf16 logits: the tolerance is at least 8 of their ulps at the row's scale (bf16: 6%)


class DecodeMismatchError(VerificationError):
    """Decode disagrees with prefill of the same tokens: the decode graph would generate wrong tokens."""


@dataclass
class DecodeCheck:
    """What the check compared: positions, worst logit error (absolute and of the row's scale), time."""

    positions: int
    max_abs: float
    max_rel: float
    seconds: float

    def stats(self) -> dict[str, Any]:
        return {"decode_checked": self.positions, "decode_max_abs": float(f"{self.max_abs:.3g}"),
                "decode_check_ms": round(self.seconds * 1e3, 1)}


def probe_ids(n: int, vocab: int) -> list[int]:
    """n deterministic, varied token ids in [0, vocab) (no special meaning)."""
    return [(7 + 37 * i * (i + 3)) % vocab for i in range(n)]


def check_decode_matches_prefill(cm: CachedModel, *, prompt: int = PROMPT,
                                 chunk: int = CHUNK) -> DecodeCheck | None:
    """Runs the invariant on `cm`: prefill `prompt` tokens, one decode step, a `chunk` prefilled on
    top of the cache, one more decode step (past the chunk's boundary); each against one prefill of
    the whole sequence (5 forward passes). Raises DecodeMismatchError on the first that differs.
    Returns None when the vocabulary or a cache extent is symbolic, or max_seq cannot hold a
    prompt and a step."""
    vocab = (cm.prefill.outputs[0].shape or (None,))[-1]
    if not isinstance(vocab, int) or cm.max_seq < 2:
        return None
    if any(not isinstance(d, int) for v in cm.prefill.state for d in v.shape or ()):
        return None  # a symbolic cache extent: nothing to size the probe's cache by
    prompt = min(prompt, cm.max_seq - 1)
    chunk = max(0, min(chunk, cm.max_seq - prompt - 2))
    total = prompt + 1 + (chunk + 1 if chunk else 0)
    t0 = time.perf_counter()
    ids = probe_ids(total, vocab)
    probe = _Probe(cm, total)
    threads = torch.get_num_threads()
    # One thread, for the passes and the comparison alike: as fast for passes of a few rows, and
    # when another process holds a core, torch's threads wait on each other at every op (SmolLM2:
    # 0.4 s on one thread, 1.2-1.5 s on two with the other core busy).
    torch.set_num_threads(1)
    try:
        checks, full = _run(probe, ids, prompt, chunk)
        worst_abs, worst_rel = _compare(cm, checks, full)
    finally:
        torch.set_num_threads(threads)
    return DecodeCheck(total - prompt, worst_abs, worst_rel, time.perf_counter() - t0)


def _compare(cm: CachedModel, checks: list[tuple[str, int, torch.Tensor]],
             full: torch.Tensor) -> tuple[float, float]:
    """Worst (abs, rel) error of the checks against rows of `full`; raises on the first beyond RTOL."""
    worst_abs = worst_rel = 0.0
    # A position bug is off by the logits' own size; rounding of half-precision logits is not.
    tol = max(RTOL, HALF_ULPS * torch.finfo(full.dtype).eps) if full.dtype.is_floating_point else RTOL
    for what, t, got in checks:
        want = full[t:t + got.shape[0]].double()
        err = (got.double() - want).abs()
        scale = want.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)
        rel = float((err / scale).max())
        if not rel <= tol:  # NaN fails too
            raise DecodeMismatchError(_message(cm, what, float(err.max()), rel, tol))
        worst_abs, worst_rel = max(worst_abs, float(err.max())), max(worst_rel, rel)
    return worst_abs, worst_rel


class _Probe:
    """The prefill and decode graphs on one small cache: `total` positions along the cache's sequence
    axis (axis 2 of [1, kv_heads, max_seq, head_dim], the one the reference Attention writes and
    checks the length of), instead of max_seq."""

    def __init__(self, cm: CachedModel, total: int):
        state = {v.name: torch.zeros(_small(v.shape, cm.max_seq, total), dtype=v.dtype.torch)
                 for v in cm.prefill.state}
        self.graphs = ReferenceExecutor(cm.prefill, state=state), ReferenceExecutor(cm.decode, state=state)
        self.state = state
        self.length = 0

    def run(self, ids: list[int], decode: bool = False) -> torch.Tensor:
        """Logits [T, vocab] of `ids` on top of what is cached (the decode graph for one token)."""
        ex = self.graphs[1] if decode else self.graphs[0]
        g: Graph = ex.graph
        out = ex.run({g.inputs[0].name: np.array([ids], dtype=np.int64),
                      "past_len": np.array(self.length, dtype=np.int64)})
        self.length += len(ids)
        return out[g.outputs[0].name][0]

    def reset(self) -> None:
        for t in self.state.values():
            t.zero_()
        self.length = 0


def _small(shape: Any, max_seq: int, total: int) -> list[int]:
    dims = [int(d) for d in shape or ()]
    if len(dims) == 4 and dims[2] == max_seq:
        dims[2] = total
    return dims


def _run(probe: _Probe, ids: list[int], prompt: int,
         chunk: int) -> tuple[list[tuple[str, int, torch.Tensor]], torch.Tensor]:
    """The probe's passes: (what, first position, logits) per check, and the whole-sequence prefill."""
    checks: list[tuple[str, int, torch.Tensor]] = []
    with torch.no_grad():
        probe.run(ids[:prompt])
        t = prompt
        checks.append((f"decode step at position {t} (past_len {t})", t, probe.run([ids[t]], decode=True)))
        if chunk:
            t += 1
            checks.append((f"chunked prefill of positions {t}..{t + chunk - 1} (past_len {t})", t,
                           probe.run(ids[t:t + chunk])))
            t += chunk
            checks.append((f"decode step at position {t} (past_len {t}, after the chunk)", t,
                           probe.run([ids[t]], decode=True)))
        probe.reset()
        return checks, probe.run(ids)


def _message(cm: CachedModel, what: str, err: float, rel: float, tol: float) -> str:
    left = unabsorbed_positions(cm.prefill, cm.decode)
    if left:
        shown = "; ".join(left[:4]) + (f"; and {len(left) - 4} more" if len(left) > 4 else "")
        cause = f"position-dependent nodes the KV cache does not rebase on past_len: {shown}"
    else:
        cause = "no position arithmetic outside Positions was found (a cache or attention bug?)"
    return (f"the decode graph disagrees with a prefill of the same tokens, {what}: max abs logit error "
            f"{err:.3g} ({rel:.2g} of the row's scale, tolerance {tol:.2g}); {cause}. It would generate "
            "wrong tokens (`zlc inspect MODEL --explain`; the graph before KV-cache synthesis: "
            "`zlc inspect MODEL --ir --after cleanup`)")
