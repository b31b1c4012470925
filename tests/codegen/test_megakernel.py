"""The megakernel in the Triton interpreter against the reference executor: every architecture
switch, chunked prefill, split-KV, shuffled task orders; and the controls that show the tests can
fail (a dropped wait gives wrong numbers; an unreachable wait times out in a debug build).

The interpreter runs a launch's programs one after another, so a table runs in table order:
shuffling the order is how these tests exercise the dependencies a GPU relies on. Each bundle is
compiled once per module; every backend is a spawned worker (~3 s to start)."""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megakernel_cases import guarded_read
from megakernel_checks import MODELS, PROMPT, Built, assert_matches, gpu_like, run_both

from zlc import bundle as fmt
from zlc.codegen.schedule import signalers, tiling_for
from zlc.codegen.shuffle import adversarial_order, drop_wait, random_topological_order, write_tables
from zlc.codegen.validate import TableError, validate_program, validate_tasks
from zlc.errors import ZlcError
from zlc.targets import get_target

pytest.importorskip("triton")

TIED = {"llama": False, "gpt2": True, "gemma": True, "phi3-genai": False, "qwen2-optimum": False, "bloom": True}


@pytest.fixture
def work(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("tables")  # not tmp_path: Hypothesis tests reuse one fixture value


# ---- every architecture switch -----------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_megakernel_matches_reference(built: Callable[..., Built], name: str) -> None:
    b = built(name)
    g = b.lowered.decode
    emb = next(n for n in g.nodes if n.op == "Embedding")
    lm = next(n for n in g.nodes if n.op == "LMHead")
    e, w = emb.inputs[0].const_array(), lm.inputs[1].const_array()
    assert (e.shape == w.shape and np.array_equal(e, w)) == TIED[name]  # the configs cover both
    with b.session() as s:
        r = run_both(s, b.lowered, PROMPT, steps=4)
        assert s.launches == 5
    assert_matches(r)


def test_prompt_longer_than_a_chunk(built: Callable[..., Built]) -> None:
    b = built("llama", 128)
    assert b.chunk == 64
    prompt = [(7 * i + 3) % b.vocab for i in range(b.chunk + 6)]
    with b.session() as s:
        r = run_both(s, b.lowered, prompt, steps=2)
        assert s.launches == 2 + 2  # the prompt in two launches, then the steps
    assert_matches(r)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fused"), [("llama", False), ("llama", True), ("bloom", True)],
                         ids=["ops", "fused", "bloom-fused"])
def test_split_kv_in_the_interpreter(built: Callable[..., Built], program_bundle: Any, work: Path,
                                     name: str, fused: bool) -> None:
    """The cpu tiling never splits KV; a custom tiling with 4 splits of 16 keys (and 16-column
    Linear tasks, so many tasks) runs through a bundle rewritten for it. Decode at positions
    37..40 uses three splits and leaves the fourth empty. `fused`: the GPU tiling's fusions --
    decode attention reads the step's k/v from the projections and its owner appends them to the
    cache (no cache_append op in decode), the output projection merges the partials as it loads
    (no combine op). BLOOM: ALiBi at the keys' absolute positions, in every split and for the
    step's own key."""
    b = built(name)
    t = replace(tiling_for(get_target("cpu"), 64), kv_splits=4, block_kv=16, block_n=16, max_linear_tasks=0,
                fuse_kv_append=fused, fuse_combine=fused)
    p = b.program(t)
    validate_program(p)
    combines = sum(x.op == fmt.OP_ATTN_COMBINE for x in p.tables["decode"])
    appends = sum(x.op == fmt.OP_CACHE_APPEND for m in p.tables.values() for x in m)
    # combines: layers x heads (decode); appends: layers x kv heads, per mode (fused: prefill only)
    kv = int(next(n for n in b.lowered.decode.nodes if n.op == "Attention").inputs[1].shape[1])
    assert (combines, appends) == ((0, 2 * kv) if fused else (2 * 4, 2 * kv * 2))
    path = program_bundle(b.path, work / f"split-{fused}.zlc", p)
    prompt = [(11 * i + 5) % b.vocab for i in range(37)]
    with b.session(path) as s:
        r = run_both(s, b.lowered, prompt, steps=3)
    assert_matches(r)


@pytest.mark.parametrize("name", ["llama", "gpt2", "gemma"])
def test_unrolled_matrix_vector_bodies(built: Callable[..., Built], program_bundle: Any, work: Path,
                                       name: str) -> None:
    """The decode matrix-vector bodies specialized per row length (gemv_plan.GemvBody: weights and norm
    gains requested before the wait, chunks prefetched ahead, RMSNorm folded into the product,
    LayerNorm statistics merged chunk by chunk, split-KV partials merged as the o projection loads
    its row) on the GPU tiling's shape of work: one block of columns per task, and rows unrolled
    into 32-column chunks so every body runs several chunks with loads in flight ahead (llama:
    RMSNorm + gate; gpt2: LayerNorm with bias; gemma: gelu-tanh gate); the LM head's wider tasks
    in the rolled body (its loop, then its last chunk)."""
    from zlc.codegen.gemv_plan import gemv_bodies

    b = built(name)
    t = gpu_like()
    p = b.program(t)
    small = {"max_chunk": 32, "max_down_rows": 32, "prefetch_bytes": 2 * t.block_n * 32 * 4}  # two fp32 chunks in flight
    bodies = gemv_bodies([p], "fp32", t.block_n, **small)
    assert bodies and all(len(g.chunks) >= 2 for g in bodies)
    assert any(g.depth < len(g.chunks) for g in bodies), "some body must prefetch ahead, not all at once"
    assert [g.wide for g in bodies if g.wide] == [64]  # the LM head's rolled body, over 64-column tasks
    # the norm kinds: RMS (or Layer), none (the MLP down projection), merged (the o projection)
    assert {g.norm for g in bodies} >= ({1, 0, 3} if name != "gpt2" else {2, 0, 3})
    path = program_bundle(b.path, work / f"{name}-gemv.zlc", p, **small)
    assert all(g.name in (path / "kernel.py").read_text() for g in bodies)
    with b.session(path) as s:
        assert_matches(run_both(s, b.lowered, PROMPT, steps=3))


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_fused_append_across_prefill_chunks(built: Callable[..., Built], program_bundle: Any, work: Path,
                                            name: str) -> None:
    """The fused attention's cache append under prefill chunking: a prompt of two launches (the
    second attends to the first's keys through the cache the first wrote) and decode steps after
    it, on a tiling with the GPU's fusions."""
    b = built(name, 128)
    t = replace(tiling_for(get_target("cpu"), 128), fuse_kv_append=True, fuse_combine=True, kv_splits=2,
                block_kv=32)
    p = b.program(t)
    validate_program(p)
    path = program_bundle(b.path, work / f"{name}-fused.zlc", p)
    prompt = [(7 * i + 3) % b.vocab for i in range(b.chunk + 6)]
    with b.session(path) as s:
        r = run_both(s, b.lowered, prompt, steps=3)
        assert s.launches == 2 + 3
    assert_matches(r)


# ---- task orders ---------------------------------------------------------------------------------

@pytest.mark.slow
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_shuffled_task_orders(built: Callable[..., Built], work: Path, seed: int) -> None:
    """Any order the waits allow computes the same numbers (a GPU runs tasks in such orders)."""
    b = built("llama")
    p = b.program()
    rng = random.Random(seed)
    tables = {mode: random_topological_order(tasks, rng) for mode, tasks in p.tables.items()}
    validate_program(p, tables)
    assert any(x is not y for m in tables for x, y in zip(tables[m], p.tables[m], strict=True))
    f = write_tables(work / f"shuffled-{seed}.safetensors", p, tables)
    with b.session(tables=f) as s:
        assert_matches(run_both(s, b.lowered, PROMPT, steps=2))


def test_dropped_wait_gives_wrong_numbers(built: Callable[..., Built], work: Path) -> None:
    """The negative control: the tests above would catch a missing dependency. Without the wait,
    the validator refuses the table, and the order that runs the reader first (what a GPU may
    do) computes with a stale q."""
    b = built("llama")
    p = b.program()
    tables = {}
    for mode, tasks in p.tables.items():
        i, w = guarded_read(tasks)
        weakened = drop_wait(tasks, i, w)
        with pytest.raises(TableError, match=rf"task {i} \({re.escape(tasks[i].label)}\) reads .* without a dependency"):
            validate_tasks(weakened, mode)
        tables[mode] = adversarial_order(weakened, i)
        producers = {tasks[j].label for j in signalers(tasks)[tasks[i].waits[w][0]]}
        labels = [t.label for t in tables[mode]]
        assert all(labels.index(x) > labels.index(tasks[i].label) for x in producers)
    f = write_tables(work / "adversarial.safetensors", p, tables)  # the validator is bypassed here
    with b.session(tables=f) as s:
        r = run_both(s, b.lowered, PROMPT, steps=1)
    assert min(r["errors"]) > 1e-3, r["errors"]


def test_debug_build_reports_a_wait_timeout(built: Callable[..., Built], work: Path) -> None:
    """A wait whose target is never reached hangs a release build; a debug build gives up after
    DEBUG_WAIT_TIMEOUT_NS (2 s), finishes the launch, and raises the error flag."""
    b = built("llama")
    p = b.program()
    pre = copy.deepcopy(p.tables["prefill"])
    t = next(t for t in pre if t.op == fmt.OP_ARGMAX)
    e, target = t.waits[0]
    t.waits[0] = (e, target + 1)
    with pytest.raises(TableError, match="argmax"):
        validate_tasks(pre, "prefill")
    f = write_tables(work / "unreachable.safetensors", p, {"prefill": pre})
    with b.session(tables=f, debug=True) as s, pytest.raises(ZlcError, match="wait timed out"):
        s.prefill(PROMPT)
