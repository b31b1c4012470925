"""Batched launches of the Triton kernel in the interpreter (runtime/batch.py's TritonBatch: the
prefill kernel over rows of several sequences, a paged KV cache in A; docs/megakernel.md,
"Batched steps and the paged KV cache"). The oracle is the same request run alone: on the tiny
Llama through the Triton kernel's own single-sequence session, elsewhere through the reference
executor (which the interpreter's single-sequence runs already match, test_megakernel.py). Every
row's logits are within ATOL and its greedy token equal, whatever shares its launch (decode rows,
a prefill chunk of another sequence), and the page invariant holds after every step. The
interpreter runs a launch in about a second, so these keep to a few launches each."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megakernel_cases import greedy_logits
from megakernel_checks import ATOL, Built

from zlc.errors import ZlcError
from zlc.reference.session import ReferenceSession
from zlc.runtime.batch import BATCHED, OutOfPages, TritonBatch


def _assert_row(got: np.ndarray | None, want: np.ndarray, what: str) -> None:
    assert got is not None and got.shape == want.shape, what
    err = float(np.abs(got - want).max())
    assert err <= ATOL, f"{what}: max abs error {err}"
    assert int(np.argmax(got)) == int(np.argmax(want)), f"{what}: greedy token differs"


class ReferenceAlone:
    """A request run by itself on the reference executor: [vocab] logits after the prompt, then
    after each greedy token."""

    def __init__(self, b: Built):
        self.ref = ReferenceSession.from_lowered(b.lowered)

    def logits(self, prompt: list[int], steps: int) -> list[np.ndarray]:
        self.ref.reset()
        out = [self.ref.prefill(prompt).numpy()[-1]]
        for _ in range(steps):
            out.append(self.ref.step(int(np.argmax(out[-1]))).numpy())
        return out


class KernelAlone(ReferenceAlone):
    """The same through the Triton kernel's single-sequence session (prefill and decode launches)."""

    def __init__(self, b: Built):
        self.s = b.session()

    def logits(self, prompt: list[int], steps: int) -> list[np.ndarray]:
        return greedy_logits(self.s, prompt, steps)


@pytest.fixture(scope="module")
def llama(built: Callable[..., Built]) -> Iterator[tuple[Built, TritonBatch]]:
    b = built("llama")
    tb = TritonBatch(b.path, b.manifest, page_size=4, pages=12)
    yield b, tb
    tb.close_all()


def test_rows_equal_alone_mixed_decode_and_prefill_chunk(llama: tuple[Built, TritonBatch]) -> None:
    """Two prompts prefilled in one launch; then their decode rows beside the first chunk of a
    third prompt; then all three: each row equals its request alone on the Triton kernel."""
    b, tb = llama
    rng = random.Random(1)
    prompts = [[rng.randrange(b.vocab) for _ in range(n)] for n in (6, 3, 7)]
    alone = KernelAlone(b)
    try:
        want = [alone.logits(prompts[0], 2), alone.logits(prompts[1], 2), alone.logits(prompts[2], 1)]
    finally:
        alone.s.close()
    a, c = tb.open(), tb.open()
    got = tb.step([(a, prompts[0]), (c, prompts[1])], [True, True])
    _assert_row(got[0], want[0][0], "A's prompt")
    _assert_row(got[1], want[1][0], "B's prompt")
    tb.check_pages()
    e = tb.open()
    got = tb.step([(a, [int(np.argmax(want[0][0]))]), (e, prompts[2][:4]), (c, [int(np.argmax(want[1][0]))])],
                  [True, False, True])
    assert got[1] is None
    _assert_row(got[0], want[0][1], "A's first decode row beside a prefill chunk")
    _assert_row(got[2], want[1][1], "B's first decode row beside a prefill chunk")
    got = tb.step([(e, prompts[2][4:]), (a, [int(np.argmax(want[0][1]))]), (c, [int(np.argmax(want[1][1]))])],
                  [True, True, True])
    _assert_row(got[0], want[2][0], "C's prompt, its second chunk")
    _assert_row(got[1], want[0][2], "A's second decode row")
    _assert_row(got[2], want[1][2], "B's second decode row")
    assert [tb.length(s) for s in (a, c, e)] == [8, 5, 7]
    tb.check_pages()
    # pages come back at once and are reused by the next sequence
    tb.close(a)
    f = tb.open()
    got = tb.step([(f, prompts[1]), (e, [int(np.argmax(want[2][0]))])], [True, True])
    _assert_row(got[0], want[1][0], "B's prompt again, in A's old pages")
    _assert_row(got[1], want[2][1], "C's first decode row")
    tb.check_pages()
    for s in (c, e, f):
        tb.close(s)
    assert tb.pages_free() == tb.pages_total
    tb.check_pages()


def test_bad_steps_change_nothing(llama: tuple[Built, TritonBatch]) -> None:
    b, tb = llama
    s = tb.open()
    with pytest.raises(OutOfPages):
        tb.step([(s, [1] * 49)], [True])  # 13 pages of 4 > 12
    assert tb.length(s) == 0 and tb.pages_free() == tb.pages_total
    with pytest.raises(ZlcError, match="max_seq"):
        tb.step([(s, [1] * (b.max_seq + 1))], [False])
    with pytest.raises(ZlcError, match="vocabulary"):
        tb.step([(s, [b.vocab])], [False])
    tb.check_pages()


def test_batch_backend_picks_triton_for_interpret() -> None:
    assert set(BATCHED) >= {"cpu", "interpret"}


def test_gpt2_rows_equal_alone(built: Callable[..., Built]) -> None:
    """Learned positions (each row's own, in the embedding), a tied LM head, biases."""
    b = built("gpt2")
    ref = ReferenceAlone(b)
    rng = random.Random(2)
    p, q = [rng.randrange(b.vocab) for _ in range(5)], [rng.randrange(b.vocab) for _ in range(9)]
    wp, wq = ref.logits(p, 1), ref.logits(q, 0)
    with TritonBatch(b.path, b.manifest, page_size=8, pages=4) as tb:
        s, t = tb.open(), tb.open()
        got = tb.step([(s, p), (t, q[:4])], [True, False])
        _assert_row(got[0], wp[0], "gpt2 prompt")
        got = tb.step([(t, q[4:]), (s, [int(np.argmax(wp[0]))])], [True, True])
        _assert_row(got[0], wq[0], "gpt2 prompt in two chunks")
        _assert_row(got[1], wp[1], "gpt2 decode row beside a chunk")
        tb.check_pages()


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_scheduler_property(data: st.DataObject, built: Callable[..., Built]) -> None:
    """Random arrivals and prompt lengths, prompts cut into random chunks, random page sizes:
    every logits row equals its request alone (reference), and the page invariant holds."""
    b = built("llama")
    ref = ReferenceAlone(b)
    page_size = data.draw(st.sampled_from([1, 3, 16]), label="page_size")
    n_seqs = 2
    plans = [(data.draw(st.integers(1, 7), label="prompt"), data.draw(st.integers(0, 1), label="steps"),
              data.draw(st.integers(0, 1), label="arrival")) for _ in range(n_seqs)]
    rng = random.Random(data.draw(st.integers(0, 2**16), label="seed"))
    prompts = [[rng.randrange(b.vocab) for _ in range(n)] for n, _, _ in plans]
    want = [ref.logits(p, s) for p, (_, s, _) in zip(prompts, plans, strict=True)]
    with TritonBatch(b.path, b.manifest, page_size=page_size) as tb:
        seq: dict[int, int] = {}
        fed = [0] * n_seqs  # prompt tokens fed
        done = [0] * n_seqs  # logits rows checked
        step = 0
        while any(done[i] < plans[i][1] + 1 for i in range(n_seqs)):
            rows, who = [], []
            for i, (n, steps, arrival) in enumerate(plans):
                if arrival > step or done[i] == steps + 1:
                    continue
                if i not in seq:
                    seq[i] = tb.open()
                if fed[i] < n:
                    k = data.draw(st.integers(1, n - fed[i]), label="chunk")
                    rows.append((seq[i], prompts[i][fed[i]:fed[i] + k]))
                    fed[i] += k
                    who.append((i, fed[i] == n))
                else:
                    rows.append((seq[i], [int(np.argmax(want[i][done[i] - 1]))]))
                    who.append((i, True))
            step += 1
            if not rows:
                continue
            got = tb.step(rows, [w for _, w in who])
            for (i, w), g in zip(who, got, strict=True):
                if w:
                    _assert_row(g, want[i][done[i]], f"sequence {i}, logits row {done[i]}")
                    done[i] += 1
                    if done[i] == plans[i][1] + 1:
                        tb.close(seq[i])
                else:
                    assert g is None
            tb.check_pages()
        assert tb.pages_free() == tb.pages_total
