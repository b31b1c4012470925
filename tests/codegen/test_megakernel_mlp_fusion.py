"""MLP split-K (Tiling.fuse_mlp_down, the GPU tiling's, decode only): the gate/up (or up) tasks
multiply their columns into the down matrix and add the partials into the MLP output with float
atomics; the residual's producer (the o projection) initializes that accumulator. Checked here:
the events and the validator's rule for accumulating writes (they commute, follow the
initializing write, precede every reader) with their negative controls; the tables' structure and
the levels per layer on SmolLM2's shape; the interpreter against the reference executor on the
GPU-like tiling for a SwiGLU (llama), a gated gelu-tanh (gemma) and a plain GELU MLP with biases
(gpt2), through the specialized and the generic matrix-vector bodies and shuffled task orders
(different accumulation orders: decode then differs from prefill by rounding only); and that a
reader which does not wait for every accumulator computes wrong numbers."""

from __future__ import annotations

import copy
import importlib.util
import random
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from megakernel_checks import ATOL, PROMPT, Built, assert_matches, gpu_like, run_both, source

from zlc import bundle as fmt
from zlc.abi import LinearDesc
from zlc.codegen import program as pg
from zlc.codegen.program import Region, Task
from zlc.codegen.schedule import _assign_events, _Events, schedule, signalers, tiling_for
from zlc.codegen.shuffle import random_topological_order, write_tables
from zlc.codegen.tasks import Op
from zlc.codegen.validate import TableError, validate_program, validate_tasks
from zlc.targets import get_target

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def _levels(tasks: list[Task]) -> list[int]:
    sig = signalers(tasks)
    lv: list[int] = []
    for t in tasks:
        lv.append(1 + max([lv[j] for e, _ in t.waits for j in sig.get(e, [])] + [0]))
    return lv


def _gpu_like(max_seq: int = 64, **kw: Any) -> pg.Tiling:
    """The cpu tiling with the GPU's shape of work: 16-column Linear tasks, split-KV, every fusion."""
    return gpu_like(max_seq, **{"fuse_mlp_down": True, **kw})


# ---- events and the validator on hand-built tables -------------------------------------------------

def _t(label: str, *, waits: tuple[tuple[int, int], ...] = (), signal: int = -1, target: int = 0,
       reads: tuple[Region, ...] = (), writes: tuple[Region, ...] = ()) -> Task:
    return Task(fmt.OP_LINEAR, 0, waits=list(waits), signal=signal, signal_target=target, reads=list(reads),
                writes=list(writes), label=label)


Y, ACC = Region("y", 0, 8), Region("y", 0, 8, accumulate=True)


def _accumulating_table() -> list[Task]:
    init = _t("init", signal=0, target=1, writes=(Region("y", 0, 4), Region("y", 4, 8)))
    a = _t("acc_a", waits=((0, 1),), signal=1, target=2, writes=(ACC,))
    b = _t("acc_b", waits=((0, 1),), signal=1, target=2, writes=(ACC,))  # a and b: no order between them
    reader = _t("reader", waits=((1, 2),), reads=(Y,))
    return [init, a, b, reader]


def test_accumulators_commute_but_follow_the_init_and_precede_readers() -> None:
    validate_tasks(_accumulating_table())
    t = _accumulating_table()
    t[1].waits = []  # acc_a no longer waits for the initializing write
    with pytest.raises(TableError, match=r"task 1 \(acc_a\) accumulates into y\[0:4\] without a dependency on its "
                                         r"initializing write by task 0 \(init\)"):
        validate_tasks(t)
    t = _accumulating_table()
    t[2].signal, t[3].waits = -1, [(1, 1)]  # the reader waits for one accumulator only
    t[1].signal_target = 1
    with pytest.raises(TableError, match=r"task 3 \(reader\) reads y\[0:8\] written by task 2 \(acc_b\) without a "
                                         "dependency"):
        validate_tasks(t)
    t = _accumulating_table()  # two plain writers stay a race: only accumulating writes commute
    t[2].writes = [Y]
    with pytest.raises(TableError, match="write-write race|accumulates into"):
        validate_tasks(t)


def test_events_order_accumulators_after_the_init_only() -> None:
    """The scheduler derives the waits from declared regions: an accumulator that reads nothing
    still waits for the initializing writer (and not for the other accumulators); the reader waits
    for every accumulator (the init through them)."""
    init = Op("init", {"decode": [_t("init", writes=(Region("y", 0, 4),)), _t("init2", writes=(Region("y", 4, 8),))]})
    acc = Op("acc", {"decode": [_t(f"acc{i}", writes=(ACC,)) for i in range(3)]})
    reader = Op("reader", {"decode": [_t("reader", reads=(Y,))]})
    tasks = _assign_events([init, acc, reader], "decode", _Events())
    validate_tasks(tasks, "decode")
    sig = signalers(tasks)
    deps = [{tasks[j].label for e, _ in t.waits for j in sig[e]} for t in tasks]
    assert [deps[i] for i in (2, 3, 4)] == [{"init", "init2"}] * 3
    assert deps[5] == {"acc0", "acc1", "acc2"}


# ---- the tables -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "gemma", "gpt2"])
def test_decode_tables_fuse_the_down(lower_model: Any, name: str) -> None:
    """Decode: no down task; each gate/up (up) task accumulates into the whole MLP output, the o
    projection writes it too (the init), and the gate/up tasks of a layer do not wait on each
    other. Prefill keeps the down op. The h100 tiling has the flag, the cpu one not."""
    low = lower_model(*source(name))
    p = schedule(low.decode, tiling_for(get_target("h100"), low.max_seq), low.max_seq)
    assert p.tiling.fuse_mlp_down and not tiling_for(get_target("cpu"), 64).fuse_mlp_down
    validate_program(p)
    dec, pre = p.tables["decode"], p.tables["prefill"]
    assert not [t for t in dec if ".down[" in t.label]
    assert [t for t in pre if ".down[" in t.label]
    ups = [t for t in dec if ".gate_up[" in t.label or ".up[" in t.label]
    assert ups and all(sum(r.accumulate for r in t.writes) == 1 for t in ups)
    outs = {r.buffer for t in ups for r in t.writes if r.accumulate}
    inits = [t for t in dec if any(r.buffer in outs and not r.accumulate for r in t.writes)]
    assert inits and all(p.desc_int[t.desc][LinearDesc.copy] == 1 for t in inits)
    assert all(p.desc_int[t.desc][LinearDesc.down_rows] > 0 for t in ups)
    sig = signalers(dec)
    for t in ups:
        op = t.label.split("[")[0]
        assert not [j for e, _ in t.waits for j in sig[e] if dec[j].label.split("[")[0] == op], t.label
    assert not any(r.accumulate for t in pre for r in t.writes)


def test_moe_experts_stay_unfused(lower_model: Any) -> None:
    low = lower_model(*source("mixtral"))
    p = schedule(low.decode, tiling_for(get_target("h100"), low.max_seq), low.max_seq)
    dec = p.tables["decode"]
    assert [t for t in dec if ".down[" in t.label]  # every expert's down keeps its decode tasks
    assert not any(r.accumulate for t in dec for r in t.writes)


def test_four_levels_per_layer_on_smollm2s_shape() -> None:
    """SmolLM2-135M's layer (hidden 576, 9 heads over 3 KV heads, MLP 1536) in the bench's model,
    2 layers and a small vocabulary (levels do not depend on either), h200 tiling at 512 tokens:
    4 levels per layer (QKV; attention; o projection + init; gate/up + down) and the 3 fixed ones
    (embed, LM head, argmax); 5 per layer without the fusion."""
    import torch

    import zlc

    spec = importlib.util.spec_from_file_location("zlc_bench_device", ROOT / "bench" / "device_bench.py")
    assert spec and spec.loader
    db = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = db
    spec.loader.exec_module(db)
    cfg = replace(db.Config.named("smollm2-135m"), layers=2, vocab=256)
    torch.manual_seed(0)
    low = zlc.lower(db.Llama(cfg).eval(), example_inputs=(torch.tensor([[1, 2, 3]]),),
                    options=zlc.CompileOptions(max_seq=512))
    t = tiling_for(get_target("h200"), 512)
    got = {fuse: max(_levels(schedule(low.decode, replace(t, fuse_mlp_down=fuse), 512).tables["decode"]))
           for fuse in (True, False)}
    assert got == {True: 3 + 4 * cfg.layers, False: 3 + 5 * cfg.layers}


# ---- the interpreter against the reference executor -----------------------------------------------

SMALL = {"max_chunk": 32, "max_down_rows": 32, "prefetch_bytes": 2 * 16 * 32 * 4}  # several chunks per row, a few ahead


@pytest.mark.parametrize(("name", "body"), [("llama", "specialized"), ("gemma", "specialized"),
                                            ("gpt2", "specialized"), ("llama", "generic")])
def test_fused_mlp_matches_the_reference(built: Callable[..., Built], program_bundle: Any,
                                         tmp_path: Path, name: str, body: str) -> None:
    """Prefill + 3 decode steps within 1e-4 of the reference, equal greedy tokens. `specialized`:
    one 16-column block per task, so decode takes the unrolled bodies with the down fused (rows
    in 32-row chunks, loads continuing the gate/up stream); `generic`: two tasks per Linear of
    several blocks, the masked body's per-block down (_down_add)."""
    from zlc.codegen.gemv_plan import gemv_bodies

    b = built(name)
    t = _gpu_like() if body == "specialized" else _gpu_like(max_linear_tasks=2)
    p = schedule(b.lowered.decode, t, 64)
    validate_program(p)
    fused = [g for g in gemv_bodies([p], "fp32", t.block_n, **SMALL) if g.down]
    assert fused and all(len(g.down_chunks) == 2 for g in fused)
    path = program_bundle(b.path, tmp_path / f"{name}.zlc", p, **SMALL)
    src = (path / "kernel.py").read_text()
    assert all(g.name in src for g in fused)
    with b.session(path) as s:
        assert_matches(run_both(s, b.lowered, PROMPT, steps=3))


def test_shuffled_orders_accumulate_in_other_orders(built: Callable[..., Built], program_bundle: Any,
                                                    tmp_path: Path) -> None:
    """Random valid orders of the fused tables (the gate/up tasks of a layer, hence their atomic
    adds, in other orders each time) give the reference's numbers within the tolerance."""
    b = built("llama")
    p = schedule(b.lowered.decode, replace(_gpu_like(), block_n=32), 64)
    path = program_bundle(b.path, tmp_path / "fused.zlc", p)
    canon = [t.label for t in p.tables["decode"] if ".gate_up[" in t.label]
    for seed in (1, 2):
        rng = random.Random(seed)
        tables = {mode: random_topological_order(tasks, rng) for mode, tasks in p.tables.items()}
        validate_program(p, tables)
        assert [t.label for t in tables["decode"] if ".gate_up[" in t.label] != canon
        f = write_tables(tmp_path / f"shuffled-{seed}.safetensors", p, tables)
        with b.session(path, tables=f) as s:
            r = run_both(s, b.lowered, PROMPT, steps=2)
        assert max(r["errors"]) <= ATOL, (seed, r["errors"])
        assert r["tokens"] == r["ref_tokens"]


def test_a_reader_that_misses_an_accumulator_is_refused_and_wrong(built: Callable[..., Built],
                                                                  program_bundle: Any, tmp_path: Path) -> None:
    """The negative control: the first layer's last gate/up task stops signalling (its event's
    targets one lower, so every count still matches). The validator refuses the table (a read of
    the MLP output without a dependency on that accumulator), and run last -- what a GPU may do --
    its partial arrives after everything read the sum: wrong logits."""
    b = built("llama")
    p = schedule(b.lowered.decode, _gpu_like(), 64)
    dec = copy.deepcopy(p.tables["decode"])
    first = next(r.buffer for t in dec for r in t.writes if r.accumulate)  # layer 0's MLP output
    v = max(i for i, t in enumerate(dec) if any(r.accumulate and r.buffer == first for r in t.writes))
    e = dec[v].signal
    assert e >= 0 and dec[v].parent < 0
    dec[v].signal = -1
    for t in dec:
        if t.signal == e:
            t.signal_target -= 1
        t.waits = [(x, tg - 1 if x == e else tg) for x, tg in t.waits]
    with pytest.raises(TableError, match=rf"reads {re.escape(first)}.* written by task {v} "
                                         rf"\({re.escape(dec[v].label)}\) without a dependency"):
        validate_tasks(dec, "decode")
    tables = {"prefill": p.tables["prefill"], "decode": dec[:v] + dec[v + 1:] + [dec[v]]}  # nobody waits for it
    path = program_bundle(b.path, tmp_path / "weak.zlc", p)
    f = write_tables(tmp_path / "weak.safetensors", p, tables)
    with b.session(path, tables=f) as s:
        errs = run_both(s, b.lowered, PROMPT, steps=1)["errors"]
    assert errs[0] <= ATOL and errs[1] > 1e-3, errs


@pytest.mark.parametrize("name", ["llama", "gemma", "gpt2"])
def test_fused_mlp_gives_hugging_faces_greedy_tokens(built: Callable[..., Built], program_bundle: Any,
                                                     tmp_path: Path, name: str) -> None:
    """The family oracle on the fused decode: 8 greedy tokens through the interpreter with the
    GPU-like tiling equal Hugging Face's `generate(do_sample=False)`."""
    from zlc.testing.families import hf_greedy

    b = built(name)
    p = schedule(b.lowered.decode, replace(_gpu_like(), block_n=32), 64)
    path = program_bundle(b.path, tmp_path / f"{name}.zlc", p)
    prompt = PROMPT[:5]
    with b.session(path) as s:
        got = s.generate(prompt, 8)
    assert got == hf_greedy(name, prompt, 8)


def test_the_c_kernel_refuses_the_fusion(lower_model: Any) -> None:
    """No native table has the fusion (the native tiling keeps it off); the C codegen refuses a
    program that does, in one line."""
    from zlc.codegen.native import NativeBuildError, render

    low = lower_model(*source("llama"))
    assert not tiling_for(None, 64, native=True).fuse_mlp_down
    p = schedule(low.decode, replace(tiling_for(None, 64, native=True), fuse_mlp_down=True), 64)
    with pytest.raises(NativeBuildError, match=r"^the native C kernel does not run the MLP split-K fusion"):
        render(p, weight_dtype="fp32", version="0")
