"""The kernel statistics tool (`zlc inspect BUNDLE --kernel`): the SASS parser on a hand-written
snippet, golden facts of the tiny model's real sm_86 and sm_90 cubins (registers, weight-load
width, in-flight bytes, round trips, fences / L1 invalidations / atomics per task, levels), the
level computation on a hand-checkable table, and the latency model's monotonic properties."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.codegen.kernel_code import SyncCounts, simulate
from zlc.codegen.kernel_model import LoopCost, TaskCost, bundle_report, params_for, step_time, task_time
from zlc.codegen.kernel_stats import occupancy
from zlc.codegen.kernel_tables import levels_of
from zlc.codegen.sass import Cfg, find_tool, load_width, parse_sass

pytest.importorskip("triton")

TARGETS = ("a10", "h200")


@pytest.fixture(scope="module")
def bundle(tiny_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama compiled for a10 (sm_86) and h200 (sm_90): real ptxas cubins."""
    # the module's function, not `zlc.compile`: that lazy attribute would shadow the zlc.compile
    from zlc.build import compile as compile_bundle

    out = tmp_path_factory.mktemp("kstats") / "tiny.zlc"
    compile_bundle(tiny_onnx, targets=list(TARGETS), out=out, max_seq=64, verify=False)
    return out


@pytest.fixture(scope="module")
def report(bundle: Path) -> dict[str, Any]:
    return bundle_report(bundle, context=64)


def _linear(rep: dict[str, Any], target: str) -> dict[str, Any]:
    return next(b for b in rep["targets"][target]["facts"]["bodies"].values() if b["op"] == "linear")


# ---- the parser on a hand-written snippet ------------------------------------------------------

SNIPPET = '''\
//--------------------- .text.mk --------------------------
mk:
	//## File "/x/kernel.py", line 10
        /*0000*/                   LDC.64 R2, c[0x0][0x238] ;
        /*0010*/                   IMAD.WIDE R4, R0, 0x2, R2 ;
.L_x_1:
	//## File "/x/kernel.py", line 12 inlined at "/x/kernel.py", line 30
	//## File "/x/kernel.py", line 30
        /*0020*/               @P0 LDG.E.128 R8, desc[UR4][R4.64+0x10] ;
        /*0030*/                   LDG.E.U16 R12, desc[UR4][R4.64] ;
        /*0040*/                   FFMA R20, R8, R9, R20 ;
        /*0050*/                   LDG.E R13, desc[UR4][R12.64] ;
        /*0060*/                   FADD R20, R20, R13 ;
        /*0070*/                   ISETP.GE.AND P1, PT, R0, 0x40, PT ;
        /*0080*/                   IADD3 R4, P2, R4, 0x80, RZ ;
        /*0090*/              @!P1 BRA `(.L_x_1) ;
        /*00a0*/                   STG.E.64 desc[UR4][R4.64], R20 ;
        /*00b0*/               @P1 CALL.REL.NOINC `(.L_x_2) ;
.L_x_2:
        /*00c0*/                   EXIT ;
'''


def test_parser_reads_registers_predicates_widths_and_frames() -> None:
    s = parse_sass(SNIPPET)
    assert [hex(i.addr) for i in s.instrs][:3] == ["0x0", "0x10", "0x20"]
    ldc, wide, ld128, ld16 = s.instrs[:4]
    assert ldc.dests == ("R2", "R3") and ldc.consts == (0x238,)
    assert wide.dests == ("R4", "R5") and {"R0", "R2", "R3"} <= set(wide.srcs)  # the addend is a pair
    assert ld128.guard == "P0" and ld128.dests == ("R8", "R9", "R10", "R11") and ld128.width() == 16
    assert ld128.address_regs == ["R4", "R5"] and "P0" in ld128.srcs
    assert ld16.width() == 2 and ld16.opcode == "LDG.E.U16" and ld16.is_global_load
    assert [(f.line) for f in ld128.frames] == [12, 30]  # innermost first: the helper, then its call site
    setp = s.instrs[7]
    assert setp.dests == ("P1",) and "R0" in setp.srcs
    iadd = s.instrs[8]
    assert iadd.dests == ("R4", "P2")  # a carry-out predicate is written too
    stg = s.instrs[10]
    assert stg.dests == () and {"R20", "R21"} <= set(stg.srcs)
    assert load_width("LDG.E.LTC128B.128") == 16 and load_width("LDG.E.STRONG.GPU") == 4


def test_cfg_loops_and_a_call_that_is_a_branch() -> None:
    s = parse_sass(SNIPPET)
    cfg = Cfg(s)
    assert len(cfg.loops) == 1
    loop = cfg.loops[0]
    assert [hex(s.instrs[n].addr) for n in loop.instr_indices(cfg)] == [hex(a) for a in range(0x20, 0xa0, 0x10)]
    call = s.instrs[11]
    assert call.is_branch and not call.is_call and s.subroutines() == []  # CALL.REL.NOINC to a label: a jump


def test_simulate_counts_bytes_in_flight_and_dependent_round_trips() -> None:
    s = parse_sass(SNIPPET)
    body = s.instrs[2:10]
    weight = [i.opcode.startswith("LDG.E.U16") or i.opcode.startswith("LDG.E.128") for i in body]
    r = simulate(body, weight)
    # the .128 and .U16 loads are in flight together (18 bytes per thread); the third load's
    # address is the U16 load's result: a second round trip in the same iteration
    assert r["weight_in_flight_per_thread"] == 18 and r["global_in_flight_per_thread"] == 18
    assert r["round_trips_per_iteration"] == 2 and r["weight_loads"] == 2


def test_levels_on_a_hand_checkable_table() -> None:
    # 0 embed -> 1, 2 (group g0 of parent P=9) -> 3 waits on the parent; 4 waits on 3 and on 1's event
    rows = [
        {"op": 0, "waits": [], "signal": 5, "parent": -1},
        {"op": 1, "waits": [(5, 1)], "signal": 6, "parent": 9},
        {"op": 1, "waits": [(5, 1)], "signal": 7, "parent": 9},
        {"op": 1, "waits": [(9, 2)], "signal": 8, "parent": -1},
        {"op": 1, "waits": [(8, 1), (6, 1)], "signal": -1, "parent": -1},
        {"op": 5, "waits": [], "signal": -1, "parent": -1},
    ]
    assert levels_of(rows) == [1, 2, 2, 3, 4, 1]


def test_occupancy_from_registers_and_threads() -> None:
    assert occupancy(90, 205, 256, 17408)["programs_per_sm"] == 1  # 205 regs x 256 threads > 64K / 2
    assert occupancy(90, 128, 256, 17408)["programs_per_sm"] == 2
    assert occupancy(86, 64, 256, 0)["warps_per_sm"] == 32  # 64 regs: 2 KB per warp of the 64K file
    assert occupancy(86, 40, 256, 0)["warps_per_sm"] == 48  # sm_86 holds at most 48 warps


# ---- golden facts of the tiny model's real cubins --------------------------------------------

@pytest.mark.parametrize("target", TARGETS)
def test_registers_equal_cuobjdump_and_the_manifest(bundle: Path, report: dict[str, Any], target: str) -> None:
    man = json.loads((bundle / "manifest.json").read_text())
    out = subprocess.run([find_tool("cuobjdump"), "--dump-resource-usage", str(bundle / man["targets"][target]["cubin"])],
                         capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", out).group(1))  # type: ignore[union-attr]
    facts = report["targets"][target]["facts"]
    assert facts["registers"] == regs == man["targets"][target]["resources"]["registers"]
    assert facts["threads_per_program"] == 256 and facts["occupancy"]["programs_per_sm"] == 1


@pytest.mark.parametrize("target", TARGETS)
def test_weights_load_two_bytes_at_a_time_today(bundle: Path, report: dict[str, Any], target: str) -> None:
    lin = _linear(report, target)
    assert set(lin["weight_loads"]) == {"LDG.E.U16"}  # the bf16 path: one element per load
    src = (bundle / "kernel.py").read_text().split("\n")
    assert lin["weight_load_lines"] and all("tl.load(W +" in src[n - 1] for n in lin["weight_load_lines"])
    d = lin["decode"]
    assert d["weight_loads_per_iteration"] == 8 and d["weight_in_flight_per_thread"] == 16
    in_flight_per_sm = d["weight_in_flight_per_thread"] * report["targets"][target]["facts"]["threads_per_program"]
    assert in_flight_per_sm == 4096  # the 4 KB
    # claim atomic -> task row -> descriptor -> weight; then x (.cg) -> norm weight -> weight
    assert d["address_round_trips"] == 2 and d["round_trips_per_iteration"] == 3
    assert d["round_trips_in_iteration_before_weights"] == 2 and d["serial_loops_before"] == [
        f"_row_stats:{_line_of(src, 'if norm != 0:') + 1} x1"]


def _line_of(src: list[str], text: str) -> int:
    return next(i + 1 for i, ln in enumerate(src) if ln.strip() == text)


@pytest.mark.parametrize("target,fences", [("a10", 3), ("h200", 2)])
def test_fences_invalidations_and_atomics_per_task(report: dict[str, Any], target: str, fences: int) -> None:
    tl = report["targets"][target]["facts"]["task_loop"]
    one_wait = {k: tl["per_task"][k] + tl["per_wait"][k] for k in tl["per_task"]}
    # release signal and the next claim: a MEMBAR + atomic each; the acquire poll: CCTL.IVALL (and on
    # sm_86 a MEMBAR); every atomic result is broadcast with a BAR.SYNC
    assert one_wait["fences"] == fences and one_wait["l1_invalidations"] == 3 and one_wait["atomics"] == 2
    assert tl["per_group_completion"]["atomics"] == 1 and tl["per_group_completion"]["fences"] == 1


def test_tables_levels_tasks_and_weight_bytes(bundle: Path, report: dict[str, Any]) -> None:
    dec = report["tables"]["gpu"]["modes"]["decode"]
    readable = json.loads((bundle / "tables" / "gpu.json").read_text())["tables"]["decode"]
    assert dec["tasks"] == len(readable)
    assert dec["levels"] == _longest_path(readable)  # an independent longest path over the JSON tables
    assert dec["tasks_by_op"]["linear"] == sum(t["op"] == 1 for t in readable)
    man = json.loads((bundle / "manifest.json").read_text())
    place = [p for p in man["weights"]["placement"] if p["arena"] == "W"]
    embed = next(p for p in place if "embed" in p["value"])
    expected = sum(p["shape"][0] * p["shape"][1] * 2 for p in place) - (embed["shape"][0] - 1) * embed["shape"][1] * 2
    assert dec["weight_bytes"] == expected  # untied head: every matrix once, one embedding row


def _longest_path(tasks: list[dict[str, Any]]) -> int:
    sig: dict[int, list[int]] = {}
    for i, t in enumerate(tasks):
        for e in (t["signal"], t["parent"]):
            if e >= 0:
                sig.setdefault(e, []).append(i)
    depth: dict[int, int] = {}
    for i, t in enumerate(tasks):
        depth[i] = 1 + max((depth[j] for e, _ in t["waits"] for j in sig.get(e, []) if j < i), default=0)
    return max(depth.values())


@pytest.mark.parametrize("target", TARGETS)
def test_prediction_is_ordered_and_above_the_floor(report: dict[str, Any], target: str) -> None:
    p = report["targets"][target]["prediction"]
    assert p["us"]["low"] <= p["us"]["central"] <= p["us"]["high"]
    assert p["floor_us"]["low"] <= p["floor_us"]["central"] <= p["floor_us"]["high"]
    assert p["us"]["low"] > p["floor_us"]["high"]


def test_cli_kernel_report_and_json(bundle: Path) -> None:
    from zlc.cli import cli

    res = CliRunner().invoke(cli, ["inspect", str(bundle), "--kernel", "--target", "h200"])
    assert res.exit_code == 0, res.output
    assert "LDG.E.U16" in res.output and "predicted" in res.output
    res = CliRunner().invoke(cli, ["inspect", str(bundle), "--kernel", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert set(rep["targets"]) == set(TARGETS)


def test_cpu_only_bundle_gives_one_clear_line(bundle: Path, tmp_path: Path) -> None:
    from zlc.bundle import read_manifest, write_manifest
    from zlc.cli import cli

    cpu = tmp_path / "cpu.zlc"
    shutil.copytree(bundle, cpu)
    man = read_manifest(cpu)
    man["targets"] = {k: v for k, v in man["targets"].items() if "cubin" not in v}
    write_manifest(cpu, man)
    res = CliRunner().invoke(cli, ["inspect", str(cpu), "--kernel"])
    assert res.exit_code != 0
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "no GPU target" in lines[0]


# ---- the latency model's properties ----------------------------------------------------------

def _task(level: int, in_flight: float, nbytes: float, trips: int, chain: int = 2) -> TaskCost:
    loop = LoopCost(trips=trips, round_trips=3, before_weights=2, weight=True, kv=False, nbytes=nbytes,
                    in_flight=in_flight)
    return TaskCost(op=1, level=level, sync=SyncCounts(2, 3, 2, 5), chain=chain, loops=[loop], nbytes=nbytes)


tasks_st = st.lists(st.tuples(st.integers(1, 6), st.floats(256, 65536), st.floats(1024, 1 << 22), st.integers(1, 64)),
                    min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(tasks_st, st.floats(1.0, 16.0), st.sampled_from(["a10", "h200"]))
def test_more_bytes_in_flight_is_never_slower(spec: list[tuple[int, float, float, int]], factor: float,
                                             target: str) -> None:
    p = params_for(target, "central")
    slow = [_task(lv, fl, nb, tr) for lv, fl, nb, tr in spec]
    fast = [_task(lv, fl * factor, nb, tr) for lv, fl, nb, tr in spec]
    assert step_time(fast, p, p.sms)[0] <= step_time(slow, p, p.sms)[0] + 1e-9
    for a, b in zip(fast, slow, strict=True):
        assert task_time(a, p, False)[0] <= task_time(b, p, False)[0] + 1e-9


@settings(max_examples=60, deadline=None)
@given(tasks_st, st.data(), st.sampled_from(["a10", "h200"]))
def test_more_levels_is_never_faster(spec: list[tuple[int, float, float, int]], data: st.DataObject,
                                     target: str) -> None:
    p = params_for(target, "central")
    tasks = [_task(lv, fl, nb, tr) for lv, fl, nb, tr in spec]
    # split one level in two: the same tasks, one more dependency level
    lv = data.draw(st.sampled_from(sorted({t.level for t in tasks})))
    cut = data.draw(st.integers(0, sum(t.level == lv for t in tasks)))
    split, seen = [], 0
    for t in tasks:
        level = t.level * 2
        if t.level == lv:
            level += 1 if seen >= cut else 0
            seen += 1
        split.append(TaskCost(t.op, level, t.sync, t.chain, t.loops, t.nbytes))
    merged = [TaskCost(t.op, t.level * 2, t.sync, t.chain, t.loops, t.nbytes) for t in tasks]
    assert step_time(split, p, p.sms)[0] >= step_time(merged, p, p.sms)[0] - 1e-9


@settings(max_examples=40, deadline=None)
@given(tasks_st, st.sampled_from(["a10", "h200"]))
def test_slow_end_of_every_range_is_never_faster(spec: list[tuple[int, float, float, int]], target: str) -> None:
    tasks = [_task(lv, fl, nb, tr) for lv, fl, nb, tr in spec]
    times = [step_time(tasks, params_for(target, c), 72)[0] for c in ("low", "central", "high")]
    assert times == sorted(times)

