"""The trace build and its analysis (zlc.runtime.trace): time per op kind, idle per SM and the
critical path of a hand-made launch whose numbers are worked out below; the stuck-launch and
timed-out-wait reports; and the real kernel's TRACE and DEBUG code on the tiny model through the
Triton interpreter (where %globaltimer and %smid are emulated by a logical clock and the program id)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zlc
from zlc import bundle as fmt
from zlc.runtime import trace as tr
from zlc.runtime.trace_terms import format_terms, levels, split, summarize

# ---- a hand-made table and trace -------------------------------------------------------------------
#
#   0 embed                              signal e0
#   1 linear    waits e0=1               signal e1 (group of 2, parent e3)
#   2 linear    waits e0=1               signal e1 (group of 2, parent e3)
#   3 linear    waits e0=1               signal e2 (group of 1, parent e3)
#   4 attention waits e3=2 (both groups) signal e4
#   5 argmax    waits e4=1
ROWS = [  # op, waits, signal, signal_target, parent
    (fmt.OP_EMBED, [], 0, 1, -1),
    (fmt.OP_LINEAR, [(0, 1)], 1, 2, 3),
    (fmt.OP_LINEAR, [(0, 1)], 1, 2, 3),
    (fmt.OP_LINEAR, [(0, 1)], 2, 1, 3),
    (fmt.OP_ATTENTION, [(3, 2)], 4, 1, -1),
    (fmt.OP_ARGMAX, [(4, 1)], -1, 0, -1),
]
# task: sm/program, start, end (ns); programs: entry, exit
TIMES = [(0, 100, 200), (1, 150, 400), (0, 210, 350), (1, 420, 500), (0, 360, 700), (1, 510, 800)]
PROGRAMS = [(0, 0, 710), (1, 10, 810)]


def make_tasks(rows: list[tuple[Any, ...]], n_events: int = 5) -> np.ndarray:
    """A raw task table with these rows as its decode table (no prefill rows)."""
    t = np.zeros(fmt.HEADER_WORDS + fmt.TASK_WORDS * len(rows), dtype=np.int32)
    t[2], t[3], t[4] = len(rows), 0, n_events
    for i, (op, waits, sig, target, parent) in enumerate(rows):
        r = t[fmt.HEADER_WORDS + fmt.TASK_WORDS * i:][:fmt.TASK_WORDS]
        r[0], r[1], r[2], r[5] = op, i, i, len(waits)
        r[6:12] = [-1, 0] * fmt.MAX_WAITS
        for k, (ev, tg) in enumerate(waits):
            r[6 + 2 * k], r[7 + 2 * k] = ev, tg
        r[12], r[13], r[14] = sig, target, parent
    return t


def encode(tasks: np.ndarray, times: list[tuple[int, int, int]], programs: list[tuple[int, int, int]],
           cycles_per_ns: int = 2) -> np.ndarray:
    """The trace region a trace build would leave for these times."""
    region = np.zeros(tr.trace_words(tasks, len(programs)), dtype=np.int32).reshape(-1, fmt.TRACE_WORDS)
    n_max = max(int(tasks[0]), int(tasks[2]))

    def rec(sm: int, t0: int, t1: int, n: int) -> list[int]:
        return [sm, sm, t0 & 0xFFFFFFFF, t0 >> 32, t1 & 0xFFFFFFFF, t1 >> 32, cycles_per_ns * (t1 - t0), n]

    base = 1 << 40  # globaltimer values have high words
    for i, (sm, s, e) in enumerate(times):
        region[1 + i] = np.array(rec(sm, base + s, base + e, 1), dtype=np.int64).astype(np.uint32).view(np.int32)
    for p, (sm, s, e) in enumerate(programs):
        n = sum(1 for x in times if x[0] == sm)
        region[1 + n_max + p] = np.array(rec(sm, base + s, base + e, n), dtype=np.int64).astype(np.uint32).view(np.int32)
    return region.reshape(-1)


def tasks_ops(tasks: np.ndarray, mode: int) -> np.ndarray:
    return np.array([t.op for t in tr.table_tasks(tasks, mode)])


@pytest.fixture
def synthetic() -> tuple[list[tr.TableTask], tr.Trace, np.ndarray]:
    tasks = make_tasks(ROWS)
    trace = tr.read_trace(encode(tasks, TIMES, PROGRAMS), tasks, fmt.MODE_DECODE, 2)
    return tr.table_tasks(tasks, fmt.MODE_DECODE), trace, tasks


def test_table_and_producers() -> None:
    table = tr.table_tasks(make_tasks(ROWS), fmt.MODE_DECODE)
    assert [t.kind for t in table] == ["embed", "linear", "linear", "linear", "attention", "argmax"]
    assert table[4].waits == ((3, 2),) and table[1].parent == 3 and table[5].signal == -1
    assert tr.producers(table) == {0: [0], 1: [1, 2], 2: [3], 3: [1, 2, 3], 4: [4]}
    assert tr.signals_expected(table) == {0: 1, 1: 2, 2: 1, 3: 2, 4: 1}
    assert tr.trace_offset(5) == 24 and tr.trace_offset(0) == 24 and tr.trace_offset(16) == 32
    # the records, then 4 stamps a task rounded up to whole records
    assert tr.trace_words(make_tasks(ROWS), 2) == 8 * (1 + 6 + 2) + 24


def test_terms_split_each_task_between_its_stamps() -> None:
    """claim, descriptor, wait, body and signal cover start -> end; an unstamped wait ends when the
    last producer had signalled (not before the row's words, not after the body)."""
    tasks = make_tasks(ROWS)
    region = encode(tasks, TIMES, PROGRAMS)
    n_rec = fmt.TRACE_WORDS * (1 + 6 + 2)
    st = region[n_rec:n_rec + 4 * 6].reshape(6, 4)
    st[:] = [[5, 12, 20, 60]] * 6
    st[4] = [5, 12, -1, 300]  # the attention task waits inside its body: for event 3 (tasks 1, 2, 3)
    trace = tr.read_trace(region, tasks, fmt.MODE_DECODE, 2)
    table = tr.table_tasks(tasks, fmt.MODE_DECODE)
    terms, stamped = split(table, trace)
    assert stamped.tolist() == [True, True, True, True, False, True]
    assert np.allclose(terms.sum(axis=1), [e - s for _, s, e in TIMES]) and (terms >= 0).all()
    assert terms[0].tolist() == [5, 7, 8, 40, 40]  # embed: 100 -> 200
    # attention starts at 360; its producers end at 400 (task 1), 350, 500 (task 3): waited 500 - 360
    assert terms[4].tolist() == [5, 7, 140 - 12, 300 - 140, 340 - 300]
    assert levels(table) == [1, 2, 2, 2, 3, 4]
    kinds, lvls = summarize(table, trace)
    assert [k.key for k in kinds] == ["embed", "linear", "attention", "argmax"] and kinds[1].tasks == 3
    assert [g.key for g in lvls] == [f"level {i}" for i in range(1, 5)]
    assert "claim" in format_terms(table, trace)


def test_read_trace(synthetic: tuple[list[tr.TableTask], tr.Trace, np.ndarray]) -> None:
    _, trace, _ = synthetic
    base = 1 << 40
    assert trace.start.tolist() == [base + s for _, s, _ in TIMES] and trace.end.tolist() == [base + e for *_, e in TIMES]
    assert trace.sm.tolist() == [0, 1, 0, 1, 0, 1] and trace.recorded.all()
    assert trace.cycles.tolist() == [2 * (e - s) for _, s, e in TIMES]
    assert trace.prog_entry.tolist() == [base, base + 10] and trace.prog_tasks.tolist() == [3, 3]
    with pytest.raises(ValueError, match="needs 96"):
        tr.read_trace(np.zeros(10, dtype=np.int32), make_tasks(ROWS), fmt.MODE_DECODE, 2)


def test_analysis_of_the_hand_made_launch(synthetic: tuple[list[tr.TableTask], tr.Trace, np.ndarray]) -> None:
    table, trace, _ = synthetic
    labels = ["embed", "q", "k", "v", "attn h0", "argmax"]
    a = tr.analyze(table, trace, labels)
    assert a.span == 810 and a.tasks == 6 and a.missing == 0
    # busy = end - max(start, last dependency's end); waiting = the rest of start -> end
    ops = {k: (o.tasks, o.busy, o.waiting, o.max_busy) for k, o in a.ops.items()}
    assert ops == {"embed": (1, 100, 0, 100), "linear": (3, 420, 50, 200), "attention": (1, 200, 140, 200),
                   "argmax": (1, 100, 190, 100)}
    assert a.ops["linear"].cycles == 2 * (250 + 140 + 80)
    sms = {x.sm: (x.tasks, x.busy, x.waiting, x.between, x.head, x.tail, x.idle) for x in a.sms}
    assert sms == {0: (3, 440, 140, 130, 0, 100, 370), 1: (3, 380, 240, 180, 10, 0, 430)}
    # from the last task back: argmax waited on attention, which waited on v; v started when its
    # program finished q (its input was ready long before), q waited on embed
    assert [(p.task, p.after) for p in a.path] == [(0, "start"), (1, "dependency"), (3, "program"),
                                                   (4, "dependency"), (5, "dependency")]
    assert [p.label for p in a.path] == ["embed", "q", "v", "attn h0", "argmax"]
    assert [(p.busy, p.waited, p.start) for p in a.path] == [(100, 0, 100), (200, 50, 150), (80, 0, 420),
                                                               (200, 140, 360), (100, 190, 510)]
    assert a.path_ops == {"embed": 100, "linear": 280, "attention": 200, "argmax": 100}
    assert a.timer_step == 10 and a.clock_ghz == pytest.approx(2.0)
    text = tr.format_report(a)
    assert text.splitlines()[0] == "trace of one decode launch: 6 tasks on 2 SMs, span 0.81 µs"
    assert "SM clock 2.00 GHz" in text and "%globaltimer resolution <= 10 ns" in text
    assert "critical path: 5 tasks, 3 dependency steps, busy 0.68 of the span 0.81 µs" in text
    assert "linear 0.28, attention 0.20" in text
    # per op: tasks, busy, waiting, busy/task, max busy (µs), %clock64 cycles per task (start to end)
    assert ["linear", "3", "0.42", "0.05", "0.14", "0.20", "313"] in [ln.split() for ln in text.splitlines()]
    assert "the timer is coarse" not in text
    a.timer_step = 1000
    assert "the timer is coarse next to a task: read durations from the cycles column" in tr.format_report(a)


def test_analysis_tolerates_missing_records(synthetic: tuple[list[tr.TableTask], tr.Trace, np.ndarray]) -> None:
    table, trace, _ = synthetic
    trace.recorded[2] = False
    a = tr.analyze(table, trace)
    assert a.missing == 1 and a.ops["linear"].tasks == 2
    assert "1 tasks without a record" in tr.format_report(a)


def test_stuck_launch_diagnosis() -> None:
    tasks = make_tasks(ROWS)
    cnt = np.zeros(fmt.CNT_EVENTS + 5, dtype=np.int32)
    cnt[fmt.CNT_QUEUE], cnt[fmt.CNT_EXIT] = 5, 0  # tasks 0-3 ran, 4 claimed; task 2's signal was lost
    cnt[fmt.CNT_EVENTS:fmt.CNT_EVENTS + 4] = [1, 1, 1, 1]
    labels, events = ["embed", "q", "k", "v", "attn h0", "argmax"], ["e0", "qk", "v", "qkv", "attn"]
    msg = tr.diagnose_stuck(tasks, fmt.MODE_DECODE, cnt, grid=2, labels=labels, event_labels=events)
    assert msg == ("5 of 6 tasks claimed, 0 of 2 programs exited; task 4 (attention attn h0) waits for "
                   "event 3 (qkv) at 1 of 2")
    cnt[fmt.CNT_EVENTS] = 2
    msg = tr.diagnose_stuck(tasks, fmt.MODE_DECODE, cnt, grid=2)
    assert "task 1 (linear) waits for event 0 at 2 of 1" in msg and "events counted past their signals: event 0" in msg


def test_timed_out_wait_words() -> None:
    tasks = make_tasks(ROWS)
    address = 0x7F12_FFFF_F000  # the table straddles a 4 GiB boundary: only the low 32 bits are kept
    row = address + 4 * (fmt.HEADER_WORDS + fmt.TASK_WORDS * 4)
    ctrl = np.zeros(fmt.CTRL_TOKENS, dtype=np.int32)
    assert tr.describe_timeout(ctrl, tasks, fmt.MODE_DECODE, address) is None
    ctrl[fmt.CTRL_ERR_EVENT], ctrl[fmt.CTRL_ERR_TARGET], ctrl[fmt.CTRL_ERR_SEEN] = 4, 2, 1
    ctrl[fmt.CTRL_ERR_ROW] = np.uint32(row & 0xFFFFFFFF).view(np.int32)
    assert tr.describe_timeout(ctrl, tasks, fmt.MODE_DECODE, address, labels=["a", "b", "c", "d", "attn h0", "f"],
                               event_labels={3: "qkv"}) == (
        "task 4 (attention attn h0) waited for event 3 (qkv) to reach 2 and saw 1")


# ---- the real kernel under the interpreter ------------------------------------------------------------

# Runs in a fresh interpreter process (TRITON_INTERPRET must be set before Triton is imported):
# prefill, the same decode step untraced, traced (TRACE=2) and in a debug build with one wait made
# unreachable; prints what the parent checks.
INTERPRETED = r'''
import importlib.util, json, sys
import torch
from safetensors.torch import load_file
from zlc import bundle as fmt
from zlc.runtime import trace as tr

root = sys.argv[1]
man = json.load(open(f"{root}/manifest.json"))
spec = importlib.util.spec_from_file_location("zlc_traced_kernel", f"{root}/{man['kernel']['source']}")
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
fn = getattr(mod, man["kernel"]["entry"])
til = man["tilings"]["cpu"]
lay, grid = til["layout"], int(til["grid"])
w = load_file(f"{root}/{man['weights']['file']}")
W, P = w["W"].float(), w["P"]
Q = torch.zeros(64, dtype=torch.uint8)  # the packed weights' arena: the tiny model has none
t = load_file(f"{root}/{til['tables']}")
TASKS, DI, DF = t["tasks"], t["desc_int"], t["desc_float"]
off = tr.trace_offset(int(TASKS[4]))
A = torch.zeros(lay["a_size"])
CTRL = torch.zeros(lay["ctrl_size"], dtype=torch.int32)
CNT = torch.zeros(off + tr.trace_words(TASKS.numpy(), grid), dtype=torch.int32)

def launch(mode, ids, past, trace=0, debug=0, tasks=TASKS):
    CTRL[:] = 0
    CTRL[fmt.CTRL_MODE], CTRL[fmt.CTRL_T], CTRL[fmt.CTRL_PAST] = mode, len(ids), past
    CTRL[fmt.CTRL_TOKENS:fmt.CTRL_TOKENS + len(ids)] = torch.tensor(ids, dtype=torch.int32)
    CNT[off:] = 0
    fn[(grid,)](tasks, DI, DF, CTRL, CNT, W, Q, P, A, **dict(til["constexprs"], DEBUG=debug), STEP=mode, TRACE=trace)
    lg = man["tilings"]["cpu"]["layout"]["logits"]
    return int(CTRL[fmt.CTRL_OUT_TOKEN]), A[lg["offset"]:lg["offset"] + lg["cols"]].clone()

out = {}
tok, _ = launch(fmt.MODE_PREFILL, [3, 1, 4, 1, 5], 0, trace=2)
out["prefill_region"] = CNT[off:].tolist()
out["counters_after_trace"] = int(CNT[:off].abs().sum())
plain, lg0 = launch(fmt.MODE_DECODE, [tok], 5)
traced, lg1 = launch(fmt.MODE_DECODE, [tok], 5, trace=2)
out.update(plain=plain, traced=traced, same_logits=bool(torch.equal(lg0, lg1)), region=CNT[off:].tolist(),
           tasks=TASKS.tolist())
# a debug build with task K's first wait one signal short of reachable: it times out (2 s)
K = int(sys.argv[2])
bad = TASKS.clone()
row = fmt.HEADER_WORDS + int(TASKS[3]) + fmt.TASK_WORDS * K
bad[row + 7] += 1
launch(fmt.MODE_DECODE, [tok], 5, debug=1, tasks=bad)
out.update(ctrl=CTRL[:fmt.CTRL_TOKENS].tolist(), bad_tasks=bad.tolist(), bad_address=int(bad.data_ptr()))
print("@@" + json.dumps(out))
'''


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("trace") / "tiny.zlc"
    zlc.compile(tiny_onnx, targets=["cpu"], out=out, max_seq=64, verify=False)
    readable = json.loads((out / "tables" / "cpu.json").read_text())
    k = next(i for i, t in enumerate(readable["tables"]["decode"]) if t["op"] == fmt.OP_ATTENTION and t["waits"])
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", INTERPRETED, str(out), str(k)], capture_output=True, text=True,
                          env=env, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("@@")), None)
    assert line is not None, proc.stderr[-3000:]
    res = json.loads(line[2:])
    res["k"] = k
    return res, out


def test_interpreted_trace_of_the_tiny_model(interpreted: tuple[dict[str, Any], Path]) -> None:
    res, bundle = interpreted
    tasks = np.array(res["tasks"], dtype=np.int32)
    readable = json.loads((bundle / "tables" / "cpu.json").read_text())
    grid = json.loads((bundle / "manifest.json").read_text())["tilings"]["cpu"]["grid"]
    # tracing changes nothing the kernel computes, and leaves the counters zero
    assert res["traced"] == res["plain"] and res["same_logits"] and res["counters_after_trace"] == 0
    for mode, key in ((fmt.MODE_DECODE, "region"), (fmt.MODE_PREFILL, "prefill_region")):
        trace = tr.read_trace(np.array(res[key], dtype=np.int32), tasks, mode, grid, unit="ticks")
        n = int(tasks[2 * mode])
        assert trace.recorded.all() and trace.start.size == n
        # the interpreter runs programs one after another: program 0 takes every task, and the
        # logical clock ticks once per reading (its entry, then each task's start and end)
        assert trace.program.tolist() == [0] * n and trace.sm.tolist() == [0] * n
        # its start, the claim's and the row's stamps, the wait's where the dispatch waits, the
        # body's end, its end: 5 or 6 readings a task
        st = trace.stamps
        assert st is not None
        waited = st[:, 2] >= 0
        assert st[:, 0].tolist() == [1] * n and st[:, 1].tolist() == [2] * n
        assert (st[waited, 2] == 3).all() and (st[~waited, 2] == -1).all()
        assert (st[:, 3] == 3 + waited).all() and ((trace.end - trace.start) == 4 + waited).all()
        assert trace.start[0] == 1 and (trace.start[1:] == trace.end[:-1] + 1).all()
        if mode == fmt.MODE_PREFILL:  # Linear bodies wait themselves (after their first weights); the rest at the dispatch
            assert (waited == (tasks_ops(tasks, mode) != fmt.OP_LINEAR)).all()
        assert trace.prog_tasks.tolist() == [n] + [0] * (grid - 1)
        assert trace.prog_entry.tolist()[0] == 0 and trace.prog_exit.tolist()[0] == trace.end[-1] + 1
        table = tr.table_tasks(tasks, mode)
        terms, stamped = split(table, trace)
        assert (stamped == waited).all() and (terms >= 0).all()
        assert np.allclose(terms.sum(axis=1), trace.end - trace.start)
        assert (terms[:, 0] == 1).all() and (terms[:, 1] == 1).all() and (terms[:, 4] == 1).all()
        assert "per dependency level" in format_terms(table, trace)
        labels, _ = tr.readable_labels(readable, mode)
        a = tr.analyze(tr.table_tasks(tasks, mode), trace, labels)
        kinds = {t["op"] for t in readable["tables"]["decode" if mode else "prefill"]}
        assert {k for k in a.ops} == {fmt.OP_NAMES[k] for k in kinds}
        assert sum(o.tasks for o in a.ops.values()) == n and all(o.waiting == 0 for o in a.ops.values())
        assert [p.task for p in a.path] == list(range(n))  # one program: the path is the table
        assert a.path[0].after == "start" and {p.after for p in a.path[1:]} == {"program"}
        assert "interpreter: a logical clock" in tr.format_report(a)


def test_interpreted_debug_build_names_the_timed_out_wait(interpreted: tuple[dict[str, Any], Path]) -> None:
    res, bundle = interpreted
    k = res["k"]
    ctrl = np.array(res["ctrl"], dtype=np.int32)
    bad = np.array(res["bad_tasks"], dtype=np.int32)
    readable = json.loads((bundle / "tables" / "cpu.json").read_text())
    task = readable["tables"]["decode"][k]
    ev, target = task["waits"][0]
    assert ctrl[fmt.CTRL_ERROR] == fmt.ERROR_WAIT_TIMEOUT
    labels, events = tr.readable_labels(readable, fmt.MODE_DECODE)
    assert tr.describe_timeout(ctrl, bad, fmt.MODE_DECODE, res["bad_address"], labels=labels, event_labels=events) == (
        f"task {k} (attention {task['label']}) waited for event {ev} ({events[ev]}) to reach {target + 1} "
        f"and saw {target}")
