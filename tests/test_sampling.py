"""The one sampling function (zlc.reference.sampling, numpy only) and the serving engine's top_k cut,
against torch as the oracle: the same nucleus (top_p) and top_k sets as torch's sort / topk, draws
that follow the softmax, argmax at temperature 0, and the same tokens for the same seed."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from zlc.reference.sampling import generator, sample
from zlc.runtime.serve.engine.sampling import top_k_cut

# small integer-valued logits: ties are common, which is where the orders could differ
rows = arrays(np.float32, st.integers(2, 40), elements=st.integers(-4, 4).map(float))


def nucleus_torch(logits: np.ndarray, temperature: float, top_p: float) -> set[int]:
    """The tokens torch's sort + cumsum keep (the cut the sampler used to make with torch)."""
    probs = torch.softmax(torch.from_numpy(logits).double() / temperature, -1)
    sp, idx = torch.sort(probs, descending=True, stable=True)
    keep = torch.cumsum(sp, 0) - sp < top_p
    keep[0] = True
    return set(idx[keep].tolist())


@settings(max_examples=60, deadline=None)
@given(logits=rows, temperature=st.sampled_from([0.3, 1.0, 2.0]), top_p=st.sampled_from([0.2, 0.5, 0.9, 1.0]),
       seed=st.integers(-2**63, 2**63 - 1))
def test_draws_stay_in_torch_nucleus(logits: np.ndarray, temperature: float, top_p: float, seed: int) -> None:
    allowed = nucleus_torch(logits, temperature, top_p)
    gen = generator(seed)
    draws = [sample(logits, temperature, top_p, gen) for _ in range(30)]
    assert set(draws) <= allowed
    again = generator(seed)
    assert draws == [sample(logits, temperature, top_p, again) for _ in range(30)]


@given(logits=rows)
def test_temperature_zero_is_argmax(logits: np.ndarray) -> None:
    assert sample(logits, 0.0, 1.0, generator(0)) == int(torch.argmax(torch.from_numpy(logits)))


def test_draws_follow_the_softmax() -> None:
    logits = np.array([2.0, 1.0, 0.5, -np.inf, 0.0], dtype=np.float32)
    p = torch.softmax(torch.from_numpy(logits).double() / 0.8, -1).numpy()
    n = 20000
    gen = generator(5)
    counts = np.bincount([sample(logits, 0.8, 1.0, gen) for _ in range(n)], minlength=5)
    assert counts[3] == 0  # -inf (a top_k cut) is never drawn
    # within 5 standard deviations of the binomial count for every token (fixed seed: deterministic)
    assert np.all(np.abs(counts - n * p) <= 5 * np.sqrt(n * p * (1 - p)) + 1)


@settings(max_examples=80, deadline=None)
@given(logits=rows, k=st.integers(1, 40))
def test_top_k_cut_keeps_torch_topk_set(logits: np.ndarray, k: int) -> None:
    k = min(k, logits.shape[0])
    cut = top_k_cut(logits, k)
    kept = np.flatnonzero(np.isfinite(cut))
    # torch.topk's set on a stable descending sort: the k largest, the lowest ids on ties
    want = sorted(torch.sort(torch.from_numpy(logits), descending=True, stable=True).indices[:k].tolist())
    assert kept.tolist() == want
    assert np.array_equal(cut[kept], logits[kept])


def test_sampling_imports_no_torch() -> None:
    """The serving engine samples through these modules: a runtime-only install has no torch."""
    code = ("import sys, zlc.reference.sampling, zlc.runtime.serve.engine.sampling, zlc.runtime.serve.engine.scheduler; "
            "print(sorted(m for m in ('torch', 'triton', 'onnx', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
