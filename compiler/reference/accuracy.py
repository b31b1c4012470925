"""The accuracy cost of a change to a model's weights (`zlc compile --quantize`), measured by the
reference executor: the same probe prompts through the model before and after, teacher-forced
with the unchanged model's greedy tokens, so every position compares the same context.

The probes are fixed pseudo-random token ids (seeded; no tokenizer needed, so any model has them):
PROBES prompts of PROMPT_LEN tokens, then STEPS decode steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .session import ReferenceSession

PROBES, PROMPT_LEN, STEPS = 3, 8, 8


def probe_logits(lowered: Any, forced: list[np.ndarray] | None = None, seed: int = 0) -> list[np.ndarray]:
    """Per probe: logits [PROMPT_LEN + steps, vocab] (prefill rows, then one row per decode step).
    Each decode step is fed the argmax of the previous row, or, with `forced` (the result of this
    call on the unchanged model), the unchanged model's argmax: both then see the same contexts."""
    s = ReferenceSession.from_lowered(lowered)
    vocab = int(lowered.prefill.outputs[0].shape[-1])
    steps = max(0, min(STEPS, lowered.max_seq - PROMPT_LEN))
    plen = min(PROMPT_LEN, lowered.max_seq)
    rng = np.random.default_rng(seed)
    out = []
    for p in range(PROBES):
        s.reset()
        ids = [int(t) for t in rng.integers(0, vocab, size=plen)]
        rows = [s.prefill(ids).float().numpy()]
        for i in range(steps):
            src = rows[-1][-1] if forced is None else forced[p][plen - 1 + i]
            rows.append(s.step(int(src.argmax())).float().numpy().reshape(1, -1))
        out.append(np.concatenate(rows))
    return out


def accuracy(before: list[np.ndarray], after: list[np.ndarray]) -> dict[str, Any]:
    """Max / mean abs logit delta and greedy-token agreement (share of positions whose argmax is
    the same), after (teacher-forced with before's tokens) vs before."""
    deltas = [np.abs(a - b) for a, b in zip(after, before, strict=True)]
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(after, before, strict=True))
    n = sum(b.shape[0] for b in before)
    mx = float(max(d.max() for d in deltas))
    mean = float(np.mean([d.mean() for d in deltas]))
    spread = float(np.mean([b.std() for b in before]))
    return {"probes": len(before), "positions": n, "max_abs_logit_delta": round(mx, 5),
            "mean_abs_logit_delta": round(mean, 5), "logit_std": round(spread, 5),
            "greedy_agreement": round(agree / max(n, 1), 4),
            "summary": f"logit delta max {mx:.4f} mean {mean:.4f} (logit std {spread:.3f}), "
                       f"greedy tokens agree at {agree}/{n} positions"}
