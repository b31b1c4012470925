"""top_k, frequency/presence penalties and logprobs in the scheduler (runtime/serve/engine/sampling.py),
driven directly over SequentialBatch on the bundle's reference executor. Oracle: the reference
executor's logits of the whole finished sequence (one prefill with every position's logits: decode
equals prefill), with OpenAI's penalty formula and top_k written out here by hand, picked by
argmax (greedy) or by zlc.reference.sampling.sample with the same seed; logprobs are the
log-softmax of those logits at the chosen tokens (1e-4)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.runtime.batch import SequentialBatch
from zlc.runtime.serve.engine.scheduler import Scheduler
from zlc.runtime.serve.protocol import RequestFlag, ResultFlag
from zlc.runtime.serve.rings import Request

MAX_NEW = 8


@pytest.fixture(scope="module")
def batch(bundle: Any) -> Any:
    made: list[Any] = []

    def make() -> Any:
        made.append(bundle.session("reference"))
        return made[-1]

    b = SequentialBatch(make, max_seq=bundle.max_seq, max_seqs=4, max_rows=20, page_size=16)
    yield b
    b.close_all()


def run(bundle: Any, b: Any, requests: list[Request], stats: list[Any] | None = None
        ) -> dict[int, list[tuple[int, int, float]]]:
    """Every request's results (token, flags, logprob), all run side by side (the scheduler's
    stats appended to `stats`)."""
    out: dict[int, list[tuple[int, int, float]]] = {}

    def emit(rid: int, tok: int, flags: int, logprob: float = 0.0) -> None:
        out.setdefault(rid, []).append((tok, flags, logprob))

    s = Scheduler(b, emit, eos=frozenset(bundle.eos_token_ids), vocab=bundle.vocab, max_batch=4, prefill_chunk=5)
    for r in requests:
        s.submit(r)
    for _ in range(2000):
        if not s.step() and s.idle:
            if stats is not None:
                stats.append(s.stats)
            return out
    raise AssertionError("the scheduler did not go idle")


def tokens(results: list[tuple[int, int, float]]) -> list[int]:
    return [t for t, f, _ in results if not f & (ResultFlag.TOP | ResultFlag.PROMPT | ResultFlag.ERROR)]


def reference_logits(session: Any, prompt: list[int], generated: list[int]) -> np.ndarray:
    """[len(generated), vocab]: the logits each generated token was picked from (one prefill of the
    whole sequence, every position's logits)."""
    session.reset()
    _, lg = session.prefill(prompt + generated[:-1], all_logits=True, want_logits=True)
    assert lg is not None
    return np.asarray(lg, dtype=np.float64)[len(prompt) - 1:]


def penalized(logits: np.ndarray, before: list[int], frequency: float, presence: float) -> np.ndarray:
    """OpenAI's formula, written out: logit[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = logits.astype(np.float32).copy()
    for j in set(before):
        c = before.count(j)
        out[j] = out[j] - np.float32(c) * np.float32(frequency) - np.float32(presence)
    return out


def prompt_of(i: int, n: int, vocab: int) -> list[int]:
    return [(i * 131 + k * 17 + 3) % vocab for k in range(n)]


@settings(max_examples=6, deadline=None)
@given(frequency=st.sampled_from([0.0, 0.5, 2.0, -1.0]), presence=st.sampled_from([0.0, 1.5, -0.5]),
       i=st.integers(0, 50))
def test_greedy_penalties_equal_the_hand_computed_reference(bundle: Any, batch: Any, session: Any,
                                                            frequency: float, presence: float, i: int) -> None:
    prompt = prompt_of(i, 6, bundle.vocab)
    plain = Request(2, prompt_of(i + 1, 9, bundle.vocab), MAX_NEW)  # a row without options beside it
    out = run(bundle, batch, [Request(1, prompt, MAX_NEW, frequency_penalty=frequency, presence_penalty=presence),
                              plain])
    got = tokens(out[1])
    lg = reference_logits(session, prompt, got)
    want = [int(np.argmax(penalized(lg[k], got[:k], frequency, presence))) for k in range(len(got))]
    assert got == want
    # the row without options gives its solo greedy tokens
    session.reset()
    assert tokens(out[2]) == list(session.stream(list(plain.tokens), MAX_NEW, eos=bundle.eos_token_ids))


def test_sampled_top_k_and_penalties_equal_the_reference_sampler(bundle: Any, batch: Any, session: Any) -> None:
    from zlc.reference.sampling import generator, sample

    prompt = prompt_of(7, 8, bundle.vocab)
    for k, freq, pres, seed in [(3, 0.0, 0.0, 11), (1, 0.0, 0.0, 5), (40, 0.7, 0.3, 2), (0, 1.0, 1.0, 9)]:
        out = run(bundle, batch, [Request(1, prompt, MAX_NEW, temperature=1.2, top_p=0.9, seed=seed, top_k=k,
                                          frequency_penalty=freq, presence_penalty=pres)])
        got = tokens(out[1])
        lg = reference_logits(session, prompt, got)
        gen = generator(seed)
        want = []
        for step in range(len(got)):
            x = penalized(lg[step], got[:step], freq, pres)
            if 0 < k < x.shape[0]:  # keep the k largest (ties: the lowest ids), the rest can never come
                keep = sorted(range(x.shape[0]), key=lambda j: (-x[j], j))[:k]
                cut = np.full_like(x, -np.inf)
                cut[keep] = x[keep]
                x = cut
            want.append(sample(x, 1.2, 0.9, gen))
            if k == 1:
                assert want[-1] == int(np.argmax(penalized(lg[step], got[:step], freq, pres)))
        assert got == want, (k, freq, pres, seed)


def test_logprobs_equal_the_log_softmax_of_the_reference_logits(bundle: Any, batch: Any, session: Any) -> None:
    prompt = prompt_of(3, 7, bundle.vocab)
    for top, temperature in [(0, 0.0), (5, 0.0), (20, 0.8)]:
        r = Request(1, prompt, MAX_NEW, temperature=temperature, seed=3, flags=RequestFlag.LOGPROBS,
                    top_logprobs=top)
        out = run(bundle, batch, [r, Request(2, prompt_of(4, 5, bundle.vocab), MAX_NEW)])
        got = tokens(out[1])
        lg = reference_logits(session, prompt, got)
        ref = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
        alts: list[tuple[int, float]] = []
        k = 0
        for tok, flags, lp in out[1]:
            if flags & ResultFlag.TOP:
                alts.append((tok, lp))
                continue
            assert lp == pytest.approx(ref[k, tok], abs=1e-4)
            assert len(alts) == top
            order = sorted(range(bundle.vocab), key=lambda j: (-ref[k, j], j))[:top]
            assert [t for t, _ in alts] == order
            assert [a for _, a in alts] == pytest.approx([ref[k, j] for j in order], abs=1e-4)
            alts, k = [], k + 1
        assert k == len(got)
        assert all(lp == 0.0 for _, _, lp in out[2])  # the plain row's results carry no logprob


def test_prompt_logprobs_under_preemption_come_once_each(bundle: Any, session: Any) -> None:
    """PROMPT_LOGPROBS (completions' echo with logprobs): one PROMPT result per prompt token after
    the first, equal to the reference log-softmax, each exactly once although a tiny page budget
    (3 pages of 16 for 4 requests of 14 + 8 tokens) preempts and recomputes sequences; the
    generated tokens are the solo greedy ones."""
    made: list[Any] = []

    def make() -> Any:
        made.append(bundle.session("reference"))
        return made[-1]

    b = SequentialBatch(make, max_seq=bundle.max_seq, max_seqs=4, max_rows=20, page_size=16, pages_total=3)
    prompts = [prompt_of(20 + i, 14, bundle.vocab) for i in range(4)]
    stats: list[Any] = []
    flags = RequestFlag.LOGPROBS | RequestFlag.PROMPT_LOGPROBS
    out = run(bundle, b, [Request(i, p, MAX_NEW, flags=flags, top_logprobs=2) for i, p in enumerate(prompts, 1)],
              stats)
    b.close_all()
    assert stats[0].preemptions > 0
    for i, p in enumerate(prompts, 1):
        got = [(t, lp) for t, f, lp in out[i] if f & ResultFlag.PROMPT]
        assert [t for t, _ in got] == p[1:], i
        session.reset()
        _, lg = session.prefill(p, all_logits=True, want_logits=True)
        x = np.asarray(lg, dtype=np.float64)
        ls = x - x.max(-1, keepdims=True)
        ls = ls - np.log(np.exp(ls).sum(-1, keepdims=True))
        assert [lp for _, lp in got] == pytest.approx([ls[k, p[k + 1]] for k in range(len(p) - 1)], abs=1e-4)
        assert len([1 for _, f, _ in out[i] if f & ResultFlag.TOP]) == 2 * (len(p) - 1 + len(tokens(out[i])))
        session.reset()
        assert tokens(out[i]) == list(session.stream(p, MAX_NEW, eos=bundle.eos_token_ids)), i
