"""Batched steps on the native kernel (runtime/batch.py's NativeBatch): many sequences' rows in one
launch over a paged KV cache. The oracle is the same request run alone through MegakernelSession
on the same bundle: every row's logits (f32 math, ATOL) and greedy tokens equal it, whatever
else shares the launch (decode rows, prefill chunks of other sequences), and the page invariant
(no page owned twice, every page back after close) holds after every test."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from native_helpers import ATOL, Alone, Built

from zlc.codegen.native import find_compiler
from zlc.codegen.shuffle import random_topological_order, write_tables
from zlc.codegen.validate import validate_program
from zlc.errors import ZlcError
from zlc.runtime.batch import NativeBatch, OutOfPages

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def _batch(b: Built, **kw: object) -> NativeBatch:
    kw.setdefault("threads", 2)
    return NativeBatch(b.path, b.manifest, **kw)


def _assert_row(got: np.ndarray | None, want: np.ndarray, what: str) -> None:
    assert got is not None and got.shape == want.shape, what
    err = float(np.abs(got - want).max())
    assert err <= ATOL, f"{what}: max abs error {err}"
    assert int(np.argmax(got)) == int(np.argmax(want)), f"{what}: greedy token differs"


def _check_closed(nb: NativeBatch) -> None:
    nb.check_pages()
    assert nb.pages_free() == nb.pages_total


@pytest.mark.parametrize("model", ["llama", "gpt2", "bloom"])
def test_rows_equal_the_request_alone(built: Callable[..., Built], model: str) -> None:
    """Three prompts prefilled in one launch, then decoded together: each row's logits and greedy
    tokens are those of its request alone (GQA + RoPE; learned positions + tied head; ALiBi)."""
    b = built(model)
    alone = Alone(b)
    rng = random.Random(1)
    prompts = [_prompt(rng, n, b.vocab) for n in (7, 1, 20)]
    steps = 5
    with _batch(b, page_size=4) as nb:
        seqs = [nb.open() for _ in prompts]
        out = nb.step(list(zip(seqs, prompts, strict=True)), [True] * 3)
        got: list[list[np.ndarray]] = [[o] for o in out]  # type: ignore[list-item]
        for _ in range(steps):
            out = nb.step([(s, [int(np.argmax(g[-1]))]) for s, g in zip(seqs, got, strict=True)], [True] * 3)
            for g, o in zip(got, out, strict=True):
                assert o is not None
                g.append(o)
        nb.check_pages()
        for i, p in enumerate(prompts):
            want = alone.logits(p, steps)
            for k in range(steps + 1):
                _assert_row(got[i][k], want[k], f"{model} request {i} step {k}")
            assert nb.length(seqs[i]) == len(p) + steps
        for s in seqs:
            nb.close(s)
        _check_closed(nb)
    alone.close()


def test_mixed_decode_and_prefill_chunks(llama: tuple[Built, Alone]) -> None:
    """Chunked prefill: a running sequence decodes while a new one's prompt arrives in three chunks
    in the same launches; rows without logits asked give None; both match their requests alone."""
    b, alone = llama
    rng = random.Random(2)
    pa, pb = _prompt(rng, 5, b.vocab), _prompt(rng, 23, b.vocab)
    with _batch(b, page_size=8) as nb:
        a = nb.open()
        (la,) = nb.step([(a, pa)], [True])
        got_a = [la]
        s_b = nb.open()
        got_b: list[np.ndarray] = []
        for lo, hi in ((0, 9), (9, 16), (16, 23)):
            out = nb.step([(a, [int(np.argmax(got_a[-1]))]), (s_b, pb[lo:hi])], [True, hi == 23])
            assert out[0] is not None and (out[1] is None) == (hi != 23)
            got_a.append(out[0])
        got_b.append(out[1])  # type: ignore[arg-type]
        for _ in range(3):  # b's tokens first in the launch this time
            ob, oa = nb.step([(s_b, [int(np.argmax(got_b[-1]))]), (a, [int(np.argmax(got_a[-1]))])], [True, True])
            got_a.append(oa)  # type: ignore[arg-type]
            got_b.append(ob)  # type: ignore[arg-type]
        for k, w in enumerate(alone.logits(pa, len(got_a) - 1)):
            _assert_row(got_a[k], w, f"running sequence step {k}")
        for k, w in enumerate(alone.logits(pb, len(got_b) - 1)):
            _assert_row(got_b[k], w, f"chunked sequence step {k}")
        nb.close(a)
        nb.close(s_b)
        _check_closed(nb)


def test_sequences_open_and_close_between_steps(llama: tuple[Built, Alone]) -> None:
    """A closed sequence's pages go to the next one at once (the arena is just big enough for two
    live sequences), and what the old sequence left in them does not leak into the new one."""
    b, alone = llama
    rng = random.Random(3)
    prompts = [_prompt(rng, n, b.vocab) for n in (12, 9, 15, 6)]
    with _batch(b, page_size=4, pages=10) as nb:
        live: dict[int, tuple[list[int], list[np.ndarray]]] = {}
        for p in prompts:
            if len(live) == 2:  # retire the oldest: its pages are the newcomer's
                old = next(iter(live))
                had = set(nb.pages_of(old))
                got = live.pop(old)
                for k, w in enumerate(alone.logits(got[0], len(got[1]) - 1)):
                    _assert_row(got[1][k], w, f"step {k}")
                nb.close(old)
                nb.check_pages()
            else:
                had = set()
            s = nb.open()
            rows = [(s, p)] + [(q, [int(np.argmax(v[1][-1]))]) for q, v in live.items()]
            out = nb.step(rows, [True] * len(rows))
            live[s] = (p, [out[0]])  # type: ignore[list-item]
            for (q, _), o in zip(rows[1:], out[1:], strict=True):
                live[q][1].append(o)  # type: ignore[arg-type]
            assert not had or had & set(nb.pages_of(s)), "the freed pages were not reused"
            nb.check_pages()
        for s, (p, got) in live.items():
            for k, w in enumerate(alone.logits(p, len(got) - 1)):
                _assert_row(got[k], w, f"step {k}")
            nb.close(s)
        _check_closed(nb)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 30), st.integers(1, 5), st.booleans()),
                min_size=1, max_size=5),
       st.integers(2, 16), st.integers(0, 2**16))
def test_random_arrivals_and_closes(llama: tuple[Built, Alone],
                                    requests: list[tuple[int, int, int, bool]], chunk: int, seed: int) -> None:
    """Hypothesis drives a small scheduler: requests (arrival step, prompt length, new tokens,
    closed early) admitted when they arrive, prompts fed in chunks of `chunk` rows beside the
    running sequences' decode rows; every token's logits equal the request's alone; the page
    invariant holds after every step and every page is back at the end."""
    b, alone = llama
    rng = random.Random(seed)
    reqs = [(arr, _prompt(rng, n, b.vocab), new, early) for arr, n, new, early in requests]
    with _batch(b, page_size=rng.choice([1, 4, 16])) as nb:
        state: dict[int, dict] = {}  # seq -> prompt, fed, logits, wanted
        pending = sorted(range(len(reqs)), key=lambda i: reqs[i][0])
        step = 0
        while pending or state:
            while pending and reqs[pending[0]][0] <= step:
                i = pending.pop(0)
                state[nb.open()] = {"req": i, "fed": 0, "logits": []}
            rows, want, budget = [], [], nb.max_rows
            for s, v in state.items():
                arr, p, new, early = reqs[v["req"]]
                if v["fed"] < len(p):
                    n = min(chunk, len(p) - v["fed"], budget)
                    if n == 0:
                        continue
                    rows.append((s, p[v["fed"]:v["fed"] + n]))
                    want.append(v["fed"] + n == len(p))
                    v["fed"] += n
                else:
                    if budget == 0:
                        continue
                    rows.append((s, [int(np.argmax(v["logits"][-1]))]))
                    want.append(True)
                    n = 1
                budget -= n
            if rows:
                out = nb.step(rows, want)
                for (s, _), o in zip(rows, out, strict=True):
                    if o is not None:
                        state[s]["logits"].append(o)
            nb.check_pages()
            for s in list(state):
                v = state[s]
                arr, p, new, early = reqs[v["req"]]
                if len(v["logits"]) >= (max(1, new // 2) if early else new):
                    want_lg = alone.logits(p, len(v["logits"]) - 1)
                    for k, g in enumerate(v["logits"]):
                        _assert_row(g, want_lg[k], f"request {v['req']} token {k}")
                    nb.close(s)
                    del state[s]
            step += 1
        _check_closed(nb)


def test_out_of_pages_before_anything_runs(llama: tuple[Built, Alone]) -> None:
    """A step whose pages are not free raises OutOfPages and changes nothing: the sequences'
    lengths, their pages and the free count are as before, and the same sequences continue."""
    b, alone = llama
    rng = random.Random(4)
    pa, pb = _prompt(rng, 8, b.vocab), _prompt(rng, 9, b.vocab)
    with _batch(b, page_size=4, pages=4) as nb:
        a, s_b = nb.open(), nb.open()
        (la,) = nb.step([(a, pa)], [True])
        before = (nb.length(a), nb.pages_of(a), nb.pages_free())
        with pytest.raises(OutOfPages, match="needs 4 KV pages, 2 of 4 are free"):
            nb.step([(a, [int(np.argmax(la))]), (s_b, pb)], [True, True])
        assert (nb.length(a), nb.pages_of(a), nb.pages_free()) == before and nb.length(s_b) == 0
        nb.check_pages()
        (la2,) = nb.step([(a, [int(np.argmax(la))])], [True])
        for k, g in enumerate((la, la2)):
            _assert_row(g, alone.logits(pa, 1)[k], f"step {k}")
        nb.close(a)
        nb.close(s_b)
        _check_closed(nb)


def test_bad_steps_are_one_line_errors(llama: tuple[Built, Alone]) -> None:
    """A row passing max_seq names the limit; so do too many rows, a repeated or unknown sequence
    and ids outside the vocabulary. Nothing changes on any of them."""
    b, _ = llama
    with _batch(b) as nb:
        a = nb.open()
        nb.step([(a, [1] * (b.max_seq - 1))], [False])
        cases = [
            ([(a, [1, 2])], f"would hold {b.max_seq + 1} tokens, past the bundle's max_seq={b.max_seq}"),
            ([(a, [1]), (a, [2])], "appears twice"),
            ([(99, [1])], "sequence 99 is not open"),
            ([(a, [b.vocab])], "outside the vocabulary"),
        ]
        for rows, msg in cases:
            with pytest.raises(ZlcError, match=msg) as e:
                nb.step(rows, [True] * len(rows))
            assert "\n" not in str(e.value)
        s, t = nb.open(), nb.open()
        half = nb.max_rows // 2 + 1
        with pytest.raises(ZlcError, match=f"a step of {2 * half} rows exceeds max_rows={nb.max_rows}"):
            nb.step([(s, [1] * half), (t, [1] * half)], [True, True])
        assert nb.length(a) == b.max_seq - 1 and nb.length(s) == nb.length(t) == 0
        nb.step([(a, [3])], [False])  # the last position is still usable
        for q in (a, s, t):
            nb.close(q)
        _check_closed(nb)


@pytest.mark.parametrize("seed", range(2))
def test_shuffled_orders_batched(built: Callable[..., Built], tmp_path: Path, seed: int) -> None:
    """Any order the waits allow gives the batched rows the same numbers (4 workers)."""
    b = built("llama")
    p = b.program()
    rng = random.Random(seed)
    tables = {mode: random_topological_order(tasks, rng) for mode, tasks in p.tables.items()}
    validate_program(p, tables)
    f = write_tables(tmp_path / f"shuffled-{seed}.safetensors", p, tables)
    alone = Alone(b)
    prompts = [_prompt(rng, n, b.vocab) for n in (6, 17, 3)]
    with _batch(b, threads=4, tables=f, page_size=4) as nb:
        seqs = [nb.open() for _ in prompts]
        out = nb.step(list(zip(seqs, prompts, strict=True)), [True] * 3)
        out2 = nb.step([(s, [int(np.argmax(o))]) for s, o in zip(seqs, out, strict=True)], [True] * 3)  # type: ignore[arg-type]
        for i, pr in enumerate(prompts):
            want = alone.logits(pr, 1)
            _assert_row(out[i], want[0], f"request {i} prefill")
            _assert_row(out2[i], want[1], f"request {i} step")
        for s in seqs:
            nb.close(s)
        _check_closed(nb)
    alone.close()


_TSAN_CHILD = r"""
import json, os, sys
os.sched_setaffinity(0, range(os.cpu_count()))  # a race needs two workers running at once
import numpy as np
from zlc.runtime.batch import NativeBatch
bundle, lib, out, prompts, feeds = sys.argv[1:6]
prompts, feeds = json.loads(prompts), json.loads(feeds)
with NativeBatch(bundle, threads=4, library=lib, page_size=4) as nb:
    seqs = [nb.open() for _ in prompts]
    got = [nb.step(list(zip(seqs, prompts)), [True] * len(seqs))]
    for step in feeds:  # decode rows of every sequence, the first one's prompt again beside them
        extra = nb.open()
        rows = [(s, [f]) for s, f in zip(seqs, step)] + [(extra, prompts[0])]
        got.append(nb.step(rows, [True] * len(rows)))
        nb.close(extra)
    nb.check_pages()
np.savez(out, *[np.stack(g) for g in got])
import ctypes
print("child done", "tsan" if hasattr(ctypes.CDLL(None), "__tsan_init") else "no tsan")
"""


def test_tsan_clean_on_a_batched_step(built: Callable[..., Built], tsan: tuple[Path, Path], tmp_path: Path) -> None:
    """A ThreadSanitizer build (tests/native/conftest.py) runs batched steps (three prompts in one
    launch, then decode rows beside a new prompt) with 4 workers: no report, and every row equals
    its request alone."""
    import json
    import os
    import subprocess
    import sys

    lib, rt = tsan
    b = built("llama")
    alone = Alone(b)
    rng = random.Random(5)
    prompts = [_prompt(rng, n, b.vocab) for n in (6, 17, 3)]
    want = [alone.logits(p, 2) for p in prompts]
    feeds = [[int(np.argmax(w[k])) for w in want] for k in range(2)]
    env = dict(os.environ, LD_PRELOAD=str(rt), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               TSAN_OPTIONS="halt_on_error=0 exitcode=0 report_signal_unsafe=0")
    out = tmp_path / "out.npz"
    proc = subprocess.run([sys.executable, "-c", _TSAN_CHILD, str(b.path), str(lib), str(out), json.dumps(prompts),
                           json.dumps(feeds)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "child done tsan" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-6000:]
    got = np.load(out)
    for k in range(3):
        for i in range(3):
            _assert_row(got[f"arr_{k}"][i], want[i][k], f"launch {k} request {i}")
        if k:
            _assert_row(got[f"arr_{k}"][3], want[0][0], f"launch {k}: the new prompt beside the decode rows")
    alone.close()
