"""The task tables under real concurrency: the native kernel's worker threads run tasks in
whatever order the waits allow, with C11 acquire/release on the events.

- shuffled valid orders, more threads than cores, many launches: the same numbers as the oracle;
- ThreadSanitizer: the kernel's C source built with -fsanitize=thread (here, not in bundles) runs
  the tiny model clean, and reports a data race once one wait is removed from the table;
- negative control without a sanitizer: the weakened table in an order that runs the reader
  first computes wrong numbers, and the validator refuses it;
- a debug session turns an unreachable wait into an error instead of a hang."""

from __future__ import annotations

import copy
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from megakernel_cases import guarded_read
from native_helpers import ATOL, PROMPT, Built, assert_matches, run_both

from zlc import bundle as fmt
from zlc.codegen.native import find_compiler
from zlc.codegen.program import Task
from zlc.codegen.schedule import signalers
from zlc.codegen.shuffle import adversarial_order, drop_wait, random_topological_order, write_tables
from zlc.codegen.validate import TableError, validate_program, validate_tasks
from zlc.errors import ZlcError
from zlc.reference.session import ReferenceSession

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")

STEPS = 4


def _oracle(b: Built, prompt: list[int], steps: int) -> tuple[list[np.ndarray], list[int]]:
    """The reference's logits per launch (prefill rows, then each step) and its greedy feeds."""
    ref = ReferenceSession.from_lowered(b.lowered)
    out = [ref.prefill(prompt).numpy()]
    feeds = [int(out[0][-1].argmax())]
    for _ in range(steps):
        out.append(ref.step(feeds[-1]).numpy().reshape(1, -1))
        feeds.append(int(out[-1][0].argmax()))
    return out, feeds


def _weakened(b: Built) -> tuple[Any, dict[str, list[Task]], dict[str, tuple[int, set[str]]]]:
    """(program, its tables with the guarded wait dropped, per mode: (victim index, labels of
    the producers it no longer waits for)); the validator refuses every weakened table."""
    p = b.program()
    tables, victims = {}, {}
    for mode, tasks in p.tables.items():
        i, w = guarded_read(tasks)
        victims[mode] = (i, {tasks[j].label for j in signalers(tasks)[tasks[i].waits[w][0]]})
        tables[mode] = drop_wait(tasks, i, w)
        with pytest.raises(TableError, match=rf"task {i} \({re.escape(tasks[i].label)}\) reads .* without a dependency"):
            validate_tasks(tables[mode], mode)
    return p, tables, victims


# ---- valid orders ----------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
def test_shuffled_orders_with_real_threads(built: Callable[..., Built], tmp_path: Path, seed: int) -> None:
    """Any order the waits allow computes the oracle's numbers with 4 workers on this host's cores."""
    b = built("llama")
    p = b.program()
    rng = random.Random(seed)
    tables = {mode: random_topological_order(tasks, rng) for mode, tasks in p.tables.items()}
    validate_program(p, tables)
    assert any(x is not y for m in tables for x, y in zip(tables[m], p.tables[m], strict=True))
    f = write_tables(tmp_path / f"shuffled-{seed}.safetensors", p, tables)
    with b.session(tables=f, threads=4) as s:
        assert_matches(run_both(s, ReferenceSession.from_lowered(b.lowered), PROMPT, steps=STEPS))


def test_many_launches_of_one_session(built: Callable[..., Built]) -> None:
    """The pool is created once: 30 generations in one session (prefill + steps each), every
    one equal to the first; the counters return to zero after every launch (the backend checks)."""
    b = built("gpt2")
    want = ReferenceSession.from_lowered(b.lowered).generate(PROMPT, 6)
    with b.session(threads=3) as s:
        for _ in range(30):
            assert s.generate(PROMPT, 6) == want


# ---- ThreadSanitizer -------------------------------------------------------------------------------

_CHILD = r"""
import sys, json, os
os.sched_setaffinity(0, range(os.cpu_count()))  # a race needs two workers running at once
import numpy as np
from zlc.runtime.megakernel import MegakernelSession
from zlc.runtime.native import NativeBackend
bundle, lib, tables, threads, out, prompt, feeds, rounds = sys.argv[1:9]
nb = NativeBackend(bundle, threads=int(threads), library=lib, tables=tables or None)
man = json.load(open(bundle + "/manifest.json"))
s = MegakernelSession(nb, chunk=nb.chunk, max_seq=man["model"]["max_seq"], vocab=man["model"]["vocab"])
runs = []
for rep in range(int(rounds)):
    s.reset()
    _, lg = s.prefill(json.loads(prompt), all_logits=True, want_logits=True)
    got = [lg]
    for f in json.loads(feeds):
        got.append(s.step(f, want_logits=True)[1])
    runs.append(got)
np.savez(out, *runs[0], *runs[1])
s.close()
import ctypes
print("child done", "tsan" if hasattr(ctypes.CDLL(None), "__tsan_init") else "no tsan")
"""


def _run_tsan(b: Built, lib: Path, rt: Path, tables: Path | None, out: Path, feeds: list[int], rounds: int = 2) -> str:
    """Runs `rounds` x (prefill + steps) in a child under ThreadSanitizer; its stderr (the reports)."""
    env = dict(os.environ, LD_PRELOAD=str(rt), OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               TSAN_OPTIONS="halt_on_error=0 exitcode=0 report_signal_unsafe=0")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(b.path), str(lib), str(tables or ""), "4", str(out),
                           str(PROMPT), str(feeds), str(rounds)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "child done tsan" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    return proc.stderr


def test_tsan_clean_on_valid_tables(built: Callable[..., Built], tsan: tuple[Path, Path], tmp_path: Path) -> None:
    """No race on the real tables, canonical and shuffled; numbers equal the oracle's."""
    lib, rt = tsan
    b = built("llama")
    want, feeds = _oracle(b, PROMPT, STEPS)
    p = b.program()
    shuffled = write_tables(tmp_path / "shuffled.safetensors", p,
                            {m: random_topological_order(t, random.Random(7)) for m, t in p.tables.items()})
    for tables in (None, shuffled):
        err = _run_tsan(b, lib, rt, tables, tmp_path / "out.npz", feeds[:-1])
        assert "ThreadSanitizer" not in err, err[-6000:]
        got = np.load(tmp_path / "out.npz")
        for i in range(2 * len(want)):
            assert np.abs(got[f"arr_{i}"] - want[i % len(want)]).max() <= ATOL


def test_tsan_reports_the_dropped_wait(built: Callable[..., Built], tsan: tuple[Path, Path], tmp_path: Path) -> None:
    """The negative control under real threads: with attention's wait on its q projection removed,
    ThreadSanitizer reports the data race between the two."""
    lib, rt = tsan
    b = built("llama")
    _, feeds = _oracle(b, PROMPT, STEPS)
    p = b.program()
    tables = {}
    for mode, tasks in p.tables.items():  # every attention task loses its wait on the q projection
        sig = signalers(tasks)
        tables[mode] = copy.deepcopy(tasks)
        for t in tables[mode]:
            if t.op == fmt.OP_ATTENTION:
                t.waits = [(e, n) for e, n in t.waits if not all(tasks[j].op == fmt.OP_LINEAR for j in sig[e])]
        with pytest.raises(TableError, match="without a dependency"):
            validate_tasks(tables[mode], mode)
    f = write_tables(tmp_path / "weakened.safetensors", p, tables)  # the validator is bypassed here
    # A report needs the writer and a reader on different workers in some launch: 8 readers per
    # layer and mode, 8 x 5 launches per child, and a second child should a busy host have run
    # every launch on one worker (TSan judges happens-before, not timing, but needs two threads).
    # Up to 6 children: one busy-host run once had all 3 of an earlier bound's see no overlap.
    for _ in range(6):
        err = _run_tsan(b, lib, rt, f, tmp_path / "out.npz", feeds[:-1], rounds=8)
        if "WARNING: ThreadSanitizer: data race" in err:
            break
    assert "WARNING: ThreadSanitizer: data race" in err, err[-6000:]
    assert "attention" in err  # the reader's frames name the op body


# ---- without a sanitizer ---------------------------------------------------------------------------

def test_dropped_wait_gives_wrong_numbers(built: Callable[..., Built], tmp_path: Path) -> None:
    """The weakened table in the order that runs the reader before its producer: one worker runs
    the queue in order, so the reader sees q before it is written, every launch."""
    b = built("llama")
    p, weakened, victims = _weakened(b)
    tables = {}
    for mode, tasks in weakened.items():
        i, producers = victims[mode]
        tables[mode] = adversarial_order(tasks, i)
        labels = [t.label for t in tables[mode]]
        assert all(labels.index(x) > labels.index(tasks[i].label) for x in producers)
    f = write_tables(tmp_path / "adversarial.safetensors", p, tables)
    with b.session(tables=f, threads=1) as s:
        r = run_both(s, ReferenceSession.from_lowered(b.lowered), PROMPT, steps=1)
    assert min(r["errors"]) > 1e-3, r["errors"]


def test_debug_session_reports_a_wait_timeout(built: Callable[..., Built], tmp_path: Path) -> None:
    """A wait whose target is never reached would hang a release session; a debug one gives up
    after 2 s, finishes the launch and raises the error flag."""
    b = built("llama")
    p = b.program()
    pre = copy.deepcopy(p.tables["prefill"])
    t = next(t for t in pre if t.op == fmt.OP_ARGMAX)
    e, target = t.waits[0]
    t.waits[0] = (e, target + 1)
    with pytest.raises(TableError, match="argmax"):
        validate_tasks(pre, "prefill")
    f = write_tables(tmp_path / "unreachable.safetensors", p, {"prefill": pre})
    with b.session(tables=f, debug=True, threads=2) as s, pytest.raises(ZlcError, match="wait timed out"):
        s.prefill(PROMPT)
