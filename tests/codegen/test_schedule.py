"""The scheduler's task tables (structure from the model's dimensions), the table validator
(hand-built bad tables), and the reorderings the megakernel tests use. No interpreter: fast."""

from __future__ import annotations

import math
import random
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zlc import bundle as fmt
from zlc.abi import LinearDesc
from zlc.bundle import OP_NAMES
from zlc.codegen import program as pg
from zlc.codegen.program import Program, Region, Task, Tiling
from zlc.codegen.schedule import happens_before, schedule, signalers, tiling_for
from zlc.codegen.shuffle import adversarial_order, drop_wait, random_topological_order, write_tables
from zlc.codegen.validate import TableError, validate_program, validate_tasks
from zlc.targets import get_target
from zlc.testing.zoo import FAMILIES

TILINGS = ("cpu", "h100")
MODELS = {  # id -> (zoo kind, family, opset): every frontend route, MHA/GQA, LayerNorm/RMSNorm
    "llama": ("stateless", "llama", 20),
    "gpt2": ("stateless", "gpt2", 20),
    "gemma": ("stateless", "gemma", 20),
    "phi3-genai": ("genai", "phi3", None),
    "qwen2-optimum": ("optimum_kv", "qwen2", 20),
}
NORM_OPS = ("RMSNorm", "LayerNorm")
LINEAR_OPS = ("Linear", "GatedMLP", "MLP", "LMHead")


def _program(lowered: Any, target: str) -> Program:
    return schedule(lowered.decode, tiling_for(get_target(target), lowered.max_seq), lowered.max_seq)


def _hist(tasks: list[Task]) -> dict[str, int]:
    h: dict[str, int] = {}
    for t in tasks:
        h[OP_NAMES[t.op]] = h.get(OP_NAMES[t.op], 0) + 1
    return h


def _linear_tasks(n: int, t: Tiling, lm: bool = False) -> int:
    """Tasks of one Linear with n output columns: blocks of block_n (the LM head's: lm_block_n where
    set), at most max_linear_tasks."""
    blocks = math.ceil(n / (t.lm_block_n if lm and t.lm_block_n else t.block_n))
    per = 1 if not t.max_linear_tasks else math.ceil(blocks / t.max_linear_tasks)
    return math.ceil(blocks / per)


def _llama_dims() -> dict[str, int]:
    c = FAMILIES["llama"]
    return {"hidden": c["hidden_size"], "hq": c["num_attention_heads"], "hkv": c["num_key_value_heads"],
            "d": c["head_dim"], "inter": c["intermediate_size"], "vocab": c["vocab_size"],
            "layers": c["num_hidden_layers"]}


def _expected_hist(t: Tiling, mode: str) -> dict[str, int]:
    m = _llama_dims()
    lin = (_linear_tasks(m["hq"] * m["d"], t) + 2 * _linear_tasks(m["hkv"] * m["d"], t)
                           + _linear_tasks(m["hidden"], t)  # q, k, v, o (+ residual)
                           + _linear_tasks(m["inter"], t)  # gate*up
                           + (0 if mode == "decode" and t.fuse_mlp_down else _linear_tasks(m["hidden"], t)))  # down
    if mode == "prefill":
        attention = m["layers"] * m["hq"] * math.ceil(t.chunk / t.block_t)  # heads x query blocks
    else:
        attention = m["layers"] * m["hq"] * t.kv_splits
    h = {"embed": 1, "linear": m["layers"] * lin + _linear_tasks(m["vocab"], t, lm=True), "attention": attention,
         "argmax": 1}
    if mode == "prefill" or not t.fuse_kv_append:  # fused: decode attention reads the step's k/v itself
        h["cache_append"] = m["layers"] * m["hkv"]
    if mode == "decode" and t.kv_splits > 1 and not t.fuse_combine:  # fused: merged by the o projection
        h["attn_combine"] = m["layers"] * m["hq"]
    return h


# ---- structure ---------------------------------------------------------------------------------

@pytest.mark.parametrize("target", TILINGS)
def test_task_histogram_follows_model_dims(tiny_lowered: Any, target: str) -> None:
    p = _program(tiny_lowered, target)
    for mode in ("prefill", "decode"):
        assert _hist(p.tables[mode]) == _expected_hist(p.tiling, mode), mode
    assert p.summary()["tasks_by_op"]["decode"] == _hist(p.tables["decode"])
    assert p.vocab == _llama_dims()["vocab"]


@pytest.mark.parametrize("target", TILINGS)
def test_tasks_per_projection(tiny_lowered: Any, target: str) -> None:
    """Each projection is tiled into ceil(blocks / per-task blocks) tasks over its output columns
    (h100: one 32-column block per task, so the 64-column q projection is 2 tasks; the LM head's
    256-column block), and the tasks cover its columns exactly once."""
    p = _program(tiny_lowered, target)
    if target == "h100":
        assert p.tiling.max_linear_tasks == 0
    ops: list[tuple[str, int]] = []
    for n in tiny_lowered.decode.nodes:
        if n.op == "Linear":
            ops.append((n.name, int(n.inputs[1].shape[0])))
        elif n.op == "GatedMLP":
            ops += [(f"{n.name}.gate_up", int(n.inputs[1].shape[0])), (f"{n.name}.down", int(n.inputs[3].shape[0]))]
        elif n.op == "LMHead":
            ops.append(("lm_head", int(n.inputs[1].shape[0])))
    assert len(ops) == 4 * _llama_dims()["layers"] + 2 * _llama_dims()["layers"] + 1
    for mode in ("prefill", "decode"):
        for name, cols in ops:
            mine = [t for t in p.tables[mode] if t.op == fmt.OP_LINEAR and t.label.startswith(f"{name}[")]
            if mode == "decode" and p.tiling.fuse_mlp_down and name.endswith(".down"):
                assert not mine, name  # fused into the gate/up tasks (MLP split-K)
                continue
            assert len(mine) == _linear_tasks(cols, p.tiling, lm=name == "lm_head"), (mode, name)
            covered = sorted((t.a, t.b) for t in mine)
            assert covered[0][0] == 0 and covered[-1][1] == cols
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False)), (name, covered)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_norms_are_fused_into_linears(lower_model: Any, name: str) -> None:
    """No task computes a norm: every Linear that reads one recomputes its row statistics."""
    lowered = lower_model(*MODELS[name])
    g = lowered.decode
    norms = {n.name: n for n in g.nodes if n.op in NORM_OPS}
    assert norms
    # consumers: the Linear-like nodes whose input is a norm; their first descriptor is the normed one
    consumers = [u for u in g.nodes if u.op in LINEAR_OPS and u.inputs[0].producer is not None
                 and u.inputs[0].producer.op in NORM_OPS]
    assert len(consumers) == sum(len(g.users()[n.output]) for n in norms.values())
    for target in TILINGS:
        p = _program(lowered, target)
        for mode, tasks in p.tables.items():
            assert not any(t.label.split("[")[0] in norms or t.op == fmt.OP_ROW_NORM for t in tasks)
            linear_descs = sorted({t.desc for t in tasks if t.op == fmt.OP_LINEAR})
            normed = [d for d in linear_descs if p.desc_int[d][LinearDesc.norm] != pg.NORM_NONE]
            assert len(normed) == len(consumers), (target, mode)
            want = pg.NORM_LAYER if name == "gpt2" else pg.NORM_RMS
            assert all(p.desc_int[d][LinearDesc.norm] == want for d in normed)


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("target", TILINGS)
def test_every_table_validates(lower_model: Any, name: str, target: str) -> None:
    p = _program(lower_model(*MODELS[name]), target)
    validate_program(p)
    for tasks in p.tables.values():
        assert all(len(t.waits) <= fmt.MAX_WAITS for t in tasks)


def test_split_kv_for_long_contexts(lower_model: Any) -> None:
    """The GPU tiling splits decode attention over the KV cache once max_seq >= 128 (splits of >= 64
    keys). With fuse_combine (the GPU tiling's) the output projection merges a layer's partials as
    it loads its row, so each of its decode tasks depends on exactly that layer's split tasks; without
    it, one combine task per query head merges that head's splits."""
    from dataclasses import replace

    from zlc.codegen.program import NORM_COMBINE

    lowered = lower_model(*MODELS["llama"], 1024)
    m = _llama_dims()
    p = _program(lowered, "h100")
    validate_program(p)
    S = p.tiling.kv_splits
    assert S >= 2 and p.tiling.fuse_combine
    dec = p.tables["decode"]
    assert _hist(dec) == _expected_hist(p.tiling, "decode")
    hb = happens_before(dec)
    merged = [i for i, t in enumerate(dec) if t.op == fmt.OP_LINEAR and int(p.desc_int[t.desc, LinearDesc.norm]) == NORM_COMBINE]
    assert len(merged) == m["layers"] * _linear_tasks(m["hidden"], p.tiling)  # every o-projection task
    splits_of_layer: dict[str, set[int]] = {}
    for j, t in enumerate(dec):
        if t.op == fmt.OP_ATTENTION:
            splits_of_layer.setdefault(t.label.split(".attention")[0], set()).add(j)
    assert len(splits_of_layer) == m["layers"]
    assert all(len(js) == m["hq"] * S for js in splits_of_layer.values())
    for i in merged:  # ordered after every split of exactly one layer's attention
        before = {j for j in range(len(dec)) if hb[i] >> j & 1 and dec[j].op == fmt.OP_ATTENTION}
        assert any(before >= js for js in splits_of_layer.values()), dec[i].label
    prefill_merged = [t for t in p.tables["prefill"] if t.op == fmt.OP_LINEAR
                      and int(p.desc_int[t.desc, LinearDesc.norm]) == NORM_COMBINE]
    assert not prefill_merged  # prefill attention writes its output rows directly
    # the unfused structure: one combine task per query head, on exactly its splits
    u = schedule(lowered.decode, replace(p.tiling, fuse_combine=False), 1024)
    validate_program(u)
    dec = u.tables["decode"]
    combines = [i for i, t in enumerate(dec) if t.op == fmt.OP_ATTN_COMBINE]
    assert len(combines) == m["layers"] * m["hq"]
    sig = signalers(dec)
    for i in combines:
        t = dec[i]
        layer = t.label.split(".combine")[0]
        deps = {j for e, _ in t.waits for j in sig[e]}
        assert {dec[j].label for j in deps} == {f"{layer}.attention[h{t.a},s{s}]" for s in range(S)}
    assert not any(t.op == fmt.OP_ATTN_COMBINE for t in u.tables["prefill"])
    for target, seq in (("cpu", 1024), ("h100", 64)):  # no split: the interpreter, or short contexts
        q = _program(lower_model(*MODELS["llama"], seq), target)
        assert q.tiling.kv_splits == 1
        assert "attn_combine" not in _hist(q.tables["decode"])


@pytest.mark.parametrize("target,heads,max_seq,splits", [
    ("h200", 0, 512, 8),  # heads unknown: the context alone decides
    ("h200", 9, 512, 8),  # SmolLM2: 72 tasks on 132 SMs
    ("a10", 9, 512, 8),  # 72 on 72
    ("h200", 32, 512, 4),  # the Llama-3.2-1B shape: 128 on 132, not 256
    ("a10", 32, 512, 2),  # 64 on 72
    ("h200", 32, 4096, 4),
    ("h200", 128, 4096, 1),  # more heads than SMs: no split
    ("h200", 4, 128, 2),  # splits of >= 64 keys
    ("h200", 4, 64, 1),
])
def test_kv_splits_fill_the_sms_in_one_round(target: str, heads: int, max_seq: int, splits: int) -> None:
    """Split-KV doubles while the splits keep >= 64 keys and one decode attention level (heads x
    splits tasks) still fits the target's SMs in one round."""
    assert tiling_for(get_target(target), max_seq, heads=heads).kv_splits == splits


def test_the_build_sizes_splits_by_the_models_heads(tiny_lowered: Any) -> None:
    from zlc.build import _query_heads

    assert _query_heads(tiny_lowered.decode) == _llama_dims()["hq"]


# ---- the validator on hand-built tables ----------------------------------------------------------

def _task(label: str, *, waits: tuple[tuple[int, int], ...] = (), signal: int = -1, target: int = 0,
          parent: int = -1, reads: tuple[Region, ...] = (), writes: tuple[Region, ...] = ()) -> Task:
    return Task(fmt.OP_LINEAR, 0, waits=list(waits), signal=signal, signal_target=target, parent=parent,
                reads=list(reads), writes=list(writes), label=label)


X, Y = Region("x", 0, 8), Region("y", 0, 8)


def _pair() -> tuple[Task, Task]:
    producer = _task("producer", signal=0, target=1, writes=(X,))
    consumer = _task("consumer", waits=((0, 1),), reads=(X,), writes=(Y,))
    return producer, consumer


def test_validator_accepts_a_good_table() -> None:
    validate_tasks(list(_pair()))
    a = _task("a", signal=0, target=2, parent=2, writes=(Region("x", 0, 4),))  # two groups -> parent
    b = _task("b", signal=0, target=2, parent=2, writes=(Region("x", 4, 8),))
    c = _task("c", signal=1, target=1, parent=2, writes=(Region("x", 8, 12),))
    d = _task("d", waits=((2, 2),), reads=(Region("x", 0, 12),))
    validate_tasks([a, b, c, d])


def test_validator_wait_on_later_task() -> None:
    producer, consumer = _pair()
    with pytest.raises(TableError, match=r"task 0 \(consumer\).*producer.*not topological"):
        validate_tasks([consumer, producer])


def test_validator_wrong_target() -> None:
    producer, consumer = _pair()
    consumer.waits = [(0, 2)]
    with pytest.raises(TableError, match=r"\(consumer\) waits for event 0 to reach 2, but it receives 1"):
        validate_tasks([producer, consumer])


def test_validator_group_target_mismatch() -> None:
    a = _task("a", signal=0, target=3, parent=1, writes=(X,))  # says 3 members, there are 2
    b = _task("b", signal=0, target=3, parent=1, writes=(Y,))
    with pytest.raises(TableError, match="group target 3 but 2 tasks"):
        validate_tasks([a, b])


def test_validator_read_without_dependency() -> None:
    producer, consumer = _pair()
    consumer.waits = []
    with pytest.raises(TableError, match=r"task 1 \(consumer\) reads x\[0:8\] written by task 0 \(producer\) "
                                         "without a dependency"):
        validate_tasks([producer, consumer])


def test_validator_transitive_dependency_covers_a_read() -> None:
    producer = _task("producer", signal=0, target=1, writes=(X,))
    middle = _task("middle", waits=((0, 1),), signal=1, target=1, reads=(X,), writes=(Y,))
    last = _task("last", waits=((1, 1),), reads=(X, Y))  # ordered after x's writer through middle
    validate_tasks([producer, middle, last])
    middle.waits, middle.reads = [], []
    with pytest.raises(TableError, match=r"task 2 \(last\) reads x\[0:8\] written by task 0 \(producer\)"):
        validate_tasks([producer, middle, last])


def test_validator_unordered_writers() -> None:
    a = _task("writer_a", writes=(Region("x", 0, 8),))
    b = _task("writer_b", writes=(Region("x", 4, 12),))
    with pytest.raises(TableError, match=r"\(writer_a\) and 1 \(writer_b\) both write x unordered"):
        validate_tasks([a, b])
    validate_tasks([a, _task("writer_c", writes=(Region("x", 8, 12),))])  # disjoint: fine
    rows = _task("rows", writes=(Region("x", 0, 8, 16, 32),))  # other rows: fine
    validate_tasks([_task("rows0", writes=(Region("x", 0, 8, 0, 16),)), rows])


def test_validator_event_nobody_signals() -> None:
    producer, consumer = _pair()
    consumer.waits = [(7, 1)]
    with pytest.raises(TableError, match=r"\(consumer\) waits on event 7, which no task signals"):
        validate_tasks([producer, consumer], "decode")


def test_validator_too_many_waits() -> None:
    ps = [_task(f"p{i}", signal=i, target=1, writes=(Region("x", i, i + 1),)) for i in range(fmt.MAX_WAITS + 1)]
    c = _task("greedy", waits=tuple((i, 1) for i in range(fmt.MAX_WAITS + 1)), reads=(Region("x", 0, 8),))
    with pytest.raises(TableError, match=r"\(greedy\) has 4 waits"):
        validate_tasks([*ps, c])


# ---- reorderings over the real tables -------------------------------------------------------------

REAL = [(name, target) for name in MODELS for target in TILINGS]


@pytest.fixture(scope="module")
def real_tables(lower_model: Any) -> dict[tuple[str, str, str], list[Task]]:
    out = {}
    for name, target in REAL:
        p = _program(lower_model(*MODELS[name]), target)
        for mode, tasks in p.tables.items():
            out[name, target, mode] = tasks
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(key=st.sampled_from([(n, t, m) for n, t in REAL for m in ("prefill", "decode")]),
       seed=st.integers(0, 2**32 - 1))
def test_random_topological_order_validates(real_tables: Any, key: tuple[str, str, str], seed: int) -> None:
    tasks = real_tables[key]
    order = random_topological_order(tasks, random.Random(seed))
    assert sorted(map(id, order)) == sorted(map(id, tasks))
    validate_tasks(order, key[2])


def test_random_topological_order_varies(real_tables: Any) -> None:
    tasks = real_tables["llama", "h100", "decode"]
    orders = {tuple(t.label for t in random_topological_order(tasks, random.Random(s))) for s in range(5)}
    assert len(orders) == 5


@pytest.mark.parametrize("target", TILINGS)
def test_every_wait_guards_a_read(real_tables: Any, target: str) -> None:
    """Dropping any one wait of a real table leaves one of the task's reads unordered after its
    writer: the scheduler emits no redundant waits, and the validator sees every missing one."""
    for mode in ("prefill", "decode"):
        tasks = real_tables["llama", target, mode]
        n = 0
        for i, t in enumerate(tasks):
            for w in range(len(t.waits)):
                weakened = drop_wait(tasks, i, w)
                assert len(tasks[i].waits) == len(weakened[i].waits) + 1  # the input is untouched
                with pytest.raises(TableError, match=rf"task {i} \({re.escape(t.label)}\) reads .* without a "
                                                     "dependency"):
                    validate_tasks(weakened, mode)
                n += 1
        assert n >= len(tasks) - 1  # every task but the embedding waits


@settings(max_examples=20, deadline=None)
@given(key=st.sampled_from(REAL), seed=st.integers(0, 2**32 - 1))
def test_adversarial_order_runs_the_victim_before_its_dropped_producer(real_tables: Any, key: tuple[str, str],
                                                                         seed: int) -> None:
    tasks = real_tables[(*key, "decode")]
    rng = random.Random(seed)
    i = rng.choice([k for k, t in enumerate(tasks) if t.waits])
    w = rng.randrange(len(tasks[i].waits))
    dropped = {j for j in signalers(tasks)[tasks[i].waits[w][0]]}
    weakened = drop_wait(tasks, i, w)
    order = adversarial_order(weakened, i)
    pos = {id(t): k for k, t in enumerate(order)}
    assert any(pos[id(weakened[j])] > pos[id(weakened[i])] for j in dropped)
    # still topological for the weakened waits, so only the coverage check can fail
    with pytest.raises(TableError, match="without a dependency"):
        validate_tasks(order)


def test_reorder_rejects_a_cycle() -> None:
    a = _task("a", waits=((1, 1),), signal=0, target=1)
    b = _task("b", waits=((0, 1),), signal=1, target=1)
    with pytest.raises(ValueError, match="cycle"):
        random_topological_order([a, b], random.Random(0))


def test_write_tables_matches_the_program(tiny_lowered: Any, tmp_path: Any) -> None:
    from safetensors.numpy import load_file

    p = _program(tiny_lowered, "cpu")
    dec = random_topological_order(p.tables["decode"], random.Random(1))
    f = load_file(str(write_tables(tmp_path / "t.safetensors", p, {"decode": dec})))
    assert np.array_equal(f["tasks"], p.task_table({"prefill": p.tables["prefill"], "decode": dec}))
    assert f["tasks"].dtype == np.int32
    assert np.array_equal(f["desc_int"], p.desc_int) and np.array_equal(f["desc_float"], p.desc_float)


@pytest.mark.parametrize("target", ["a10", "h200", "small-l2"])
def test_the_l2_prefetch_takes_each_programs_share_of_half_the_l2(tiny_lowered: Any, target: str) -> None:
    """kernel_builds.l2_prefetch: one prefetch requests at most half the L2 over the SMs (KiB), so a round
    of them never overflows that half (the kernel's PREFETCH bytes, the model's cap); a target
    whose share is under the 32 KB a task requests itself before its wait gets none."""
    from dataclasses import replace

    from zlc.codegen.gemv_plan import PREFETCH_BYTES
    from zlc.codegen.kernel_builds import l2_prefetch

    t = replace(get_target("a10"), l2_mb=2.0) if target == "small-l2" else get_target(target)
    p = _program(tiny_lowered, "h100")
    r = l2_prefetch(p, t, "bf16")
    share = int(t.l2_mb * 1e6 / 2 / t.sms) // 1024 * 1024
    assert r["bytes"] * t.sms <= t.l2_mb * 1e6 / 2
    assert (r["on"], r["bytes"]) == ((True, share) if share >= PREFETCH_BYTES else (False, 0))
    assert {"a10": 40, "h200": 184, "small-l2": 13}[target] == share // 1024 and f"{share // 1024} KB" in r["why"]
