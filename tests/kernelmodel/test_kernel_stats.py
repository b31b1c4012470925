"""The kernel statistics tool (`zlc inspect BUNDLE --kernel`): the SASS parser on a hand-written
snippet and against cuobjdump's own numbers, golden facts of the tiny model's real v2 sm_86 and
sm_90 cubins (both kernels: registers, 128-bit weight loads, weights requested before the wait,
bytes in flight, fences / L1 invalidations per task, levels, bytes), a masked-fallback model (odd
K) reported as such, the level computation on a hand-checkable table, and the event simulation's
monotonic properties."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.codegen.toolchain import find_tool
from zlc.kernelmodel.event_sim import SimParams, TaskShape
from zlc.kernelmodel.event_sim import simulate as simulate_step
from zlc.kernelmodel.latency import CASES, params_for, sim_params
from zlc.kernelmodel.report import bundle_report
from zlc.kernelmodel.sass import Cfg, load_width, parse_sass
from zlc.kernelmodel.sass_map import simulate
from zlc.kernelmodel.static_facts import occupancy
from zlc.kernelmodel.task_tables import levels_of

pytest.importorskip("triton")

TARGETS = ("a10", "h200")
WIDE = "LDG.E.128"


@pytest.fixture(scope="module")
def bundle(tiny_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama (hidden 64, mlp 128: every K specialized) compiled for a10 (sm_86) and h200
    (sm_90): real ptxas cubins, a decode and a prefill kernel each."""
    # the module's function, not `zlc.compile`: that lazy attribute would shadow the zlc.compile
    from zlc.build import compile as compile_bundle

    out = tmp_path_factory.mktemp("kstats") / "tiny.zlc"
    compile_bundle(tiny_onnx, targets=list(TARGETS), out=out, max_seq=64, verify=False)
    return out


@pytest.fixture(scope="module")
def report(bundle: Path) -> dict[str, Any]:
    return bundle_report(bundle, context=64)


def _matvec(rep: dict[str, Any], target: str) -> list[dict[str, Any]]:
    return [c for c in rep["targets"][target]["prediction"]["classes"] if c["op"] == "linear"]


def _check(rep: dict[str, Any], target: str, prefix: str) -> dict[str, Any]:
    return next(c for c in rep["targets"][target]["checks"] if c["target"].startswith(prefix))


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


def test_cfg_loops_post_dominators_and_a_call_that_is_a_branch() -> None:
    s = parse_sass(SNIPPET)
    cfg = Cfg(s)
    assert len(cfg.loops) == 1
    loop = cfg.loops[0]
    assert [hex(s.instrs[n].addr) for n in loop.instr_indices(cfg)] == [hex(a) for a in range(0x20, 0xa0, 0x10)]
    call = s.instrs[11]
    assert call.is_branch and not call.is_call and s.subroutines() == []  # CALL.REL.NOINC to a label: a jump
    # the loop's exit block post-dominates the loop head; the last block leads to the exit only
    ipdom = cfg.ipdom()
    head = cfg.block_of[2]
    after = cfg.block_of[10]
    assert ipdom[head] == after and ipdom[len(cfg.blocks) - 1] is None


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

def _cuobjdump(*args: str) -> str:
    return subprocess.run([find_tool("cuobjdump"), *args], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_registers_and_opcodes_equal_cuobjdump(bundle: Path, report: dict[str, Any], target: str, kernel: str) -> None:
    """Both kernels: registers as cuobjdump and the manifest say, and the parsed instruction
    stream (nvdisasm with line info) as cuobjdump's own disassembly: as many instructions, and
    every global load, atomic, fence, L1 invalidation, barrier and MMA opcode as often."""
    man = json.loads((bundle / "manifest.json").read_text())
    info = man["targets"][target] if kernel == "decode" else man["targets"][target]["prefill"]
    facts = report["targets"][target][f"{kernel}_kernel"]
    assert facts["cubin"] == info["cubin"]
    cubin = bundle / facts["cubin"]
    regs = int(re.search(r"REG:(\d+)", _cuobjdump("--dump-resource-usage", str(cubin))).group(1))  # type: ignore[union-attr]
    assert facts["registers"] == regs == info["resources"]["registers"]
    assert facts["spill_bytes"] == 0 and facts["threads_per_program"] == 256 and facts["programs_per_sm"] == 1
    theirs = Counter(m.group(2) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)",
                                                      _cuobjdump("-sass", str(cubin))))
    assert facts["instructions"] == sum(theirs.values())
    ours = facts["memory_and_sync_opcodes"]
    assert ours == {k: theirs[k] for k in ours}
    assert {k for k in theirs if k.startswith(("LDG", "ATOMG", "MEMBAR", "CCTL", "BAR."))} <= set(ours)
    wl = facts["weight_load_opcodes"]
    assert all(0 < v <= theirs[k] for k, v in wl.items())
    if kernel == "decode":  # the specialized bodies' 128-bit weight loads (the rest: activations, norm gains)
        assert 0 < wl[WIDE] <= theirs[WIDE]
    else:  # the prefill kernel feeds tl.dot tiles: tensor-core instructions, no 128-bit weight loads
        assert WIDE not in wl and any("MMA" in k and not k.startswith("HFMA2") for k in ours)


@pytest.mark.parametrize("target", TARGETS)
def test_matrix_vector_reads_weights_wide_and_before_the_wait(bundle: Path, report: dict[str, Any],
                                                              target: str) -> None:
    """Every Linear task takes a specialized body (K 64; RMS-normed, gated with the MLP down fused,
    plain, or the LM head's 256-column one), reads its weights with LDG.E.128 only, and requests
    its whole weight slice (the fused down's columns too) before it polls."""
    mv = _matvec(report, target)
    src = (bundle / "kernel.py").read_text()
    variants = {v for c in mv for v in c["variants"]}
    assert variants == {"_gemv_k64_rms", "_gemv_k64_rms_gated_down64x128", "_gemv_k64", "_gemv_k64_rms_lm256"}
    assert all(f"def {v}(" in src for v in variants)
    tables = json.loads((bundle / "tables" / "gpu.json").read_text())["tables"]["decode"]
    assert sum(c["tasks"] for c in mv) == sum(t["op"] == 1 for t in tables)
    for c in mv:
        p = c["path"]
        assert set(c["weight_opcodes"]) == {WIDE}, c
        # 16 bytes per thread per matrix (a gated body streams two, + the fused down's [64, 32]
        # columns; the LM head's [256, 64] rows are 8 loads), x 256 threads: the slice
        v = c["variants"][0]
        assert c["weight_opcodes"][WIDE] == (3 if "gated" in v else 8 if v.endswith("_lm256") else 1)
        assert c["in_flight_bytes"] == c["prefetch_bytes"] == c["weight_bytes"] == c["weight_opcodes"][WIDE] * 16 * 256
        assert p["waits_in_body"] and p["polls"] == 1 and p["prefetch_per_thread"] > 0
        # the weights leave no later than the poll: the wait slots' words load with the
        # descriptor's, so both go out in the same round trip, the weights first
        assert p["pre_rt"] <= p["poll_rt"]
        # claim index (atomic, not counted) -> task row -> descriptor -> weight address
        assert p["first_weight_rt"] == 2
        assert p["sync"]["fences"] == 1 and p["sync"]["l1_invalidations"] == 0
    lin = report["targets"][target]["decode_kernel"]["bodies"]["op_linear"]
    lines = src.split("\n")
    # the source lines of those loads read W, directly (the generic body) or through a row base
    assert lin["weight_load_lines"] and all(re.search(r"tl\.load\((W|wbase|vbase|dbase) ", lines[n - 1])
                                            for n in lin["weight_load_lines"])
    assert re.search(r"wbase = W \+", src) and re.search(r"vbase = W \+", src)
    assert report["targets"][target]["decode_kernel"]["claim_overlapped"]  # the next task claimed early


@pytest.mark.parametrize("target", TARGETS)
def test_sync_per_task_and_at_launch(report: dict[str, Any], target: str) -> None:
    """One fence (the release) and no whole-L1 invalidation on any task's path; the kernel's one
    CCTL.IVALL runs at launch."""
    classes = report["targets"][target]["prediction"]["classes"]
    assert max(c["path"]["sync"]["fences"] for c in classes) == 1
    assert all(c["path"]["sync"]["l1_invalidations"] == 0 for c in classes)
    dec = report["targets"][target]["decode_kernel"]
    assert dec["per_launch"]["l1_invalidations"] == 1
    assert dec["ctrl_loads"]["launch"] > 0 and set(dec["ctrl_loads"]) <= {"launch", "op_embed"}
    for prefix in ("weights read with 128-bit", "weights requested before", "<= 1 fence", "no spills",
                   "prefill keeps tensor-core", "mapped CTRL"):
        assert _check(report, target, prefix)["met"], prefix
    assert _check(report, target, "<= 4 dependency levels")["met"]  # 11 levels: 2 layers of 4, and 3 outside


@pytest.mark.parametrize("target", TARGETS)
def test_a_task_with_several_waits_polls_each_a_round_trip_after_the_last(report: dict[str, Any], target: str) -> None:
    """Every wait's words are loaded before the first poll, so the next poll issues as soon as the
    previous one's count returns (behind its barrier, the words had been one round trip more)."""
    classes = report["targets"][target]["prediction"]["classes"]
    several = [c for c in classes if c["path"]["polls"] > 1]
    assert several and all(c["path"]["poll_gap_rt"] == 1 for c in several)
    assert any(c["body"] == "op_attention_row" for c in several)  # q, k and v


@pytest.mark.parametrize("target", TARGETS)
def test_decode_kernel_prefetches_the_next_tasks_weights_into_l2(bundle: Path, report: dict[str, Any],
                                                                 target: str) -> None:
    """The compiled decode kernel (PREFETCH) requests the next task's weights into L2 after each
    task's signal: `prefetch.global.L2` is CCTL.E.PF2 in both archs' SASS (cuobjdump's count), on
    every task's path at its end, 128 bytes per thread per instruction; the prefill kernel has
    none. A Linear is priced as prefetched whole: its rows x K of W (and W2), its fused down apart."""
    for kernel in ("decode", "prefill"):
        cubin = bundle / report["targets"][target][f"{kernel}_kernel"]["cubin"]
        n = len(re.findall(r"\bCCTL\.E\.PF2\b", _cuobjdump("-sass", str(cubin))))
        assert (n > 0) == (kernel == "decode"), (kernel, n)
    classes = report["targets"][target]["prediction"]["classes"]
    for c in classes:
        assert c["l2_prefetch_next"] and c["l2_prefetch_at_end"], c["variants"]
        assert c["l2_prefetch_bytes_per_thread"] > 0 and c["l2_prefetch_bytes_per_thread"] % 128 == 0
    ptx = (bundle / "kernels" / f"{target}.ptx").read_text()
    assert "prefetch.global.L2" in ptx and "prefetch.global.L2" not in (bundle / "kernels" / f"{target}.prefill.ptx").read_text()


def test_tables_levels_tasks_and_bytes(bundle: Path, report: dict[str, Any]) -> None:
    dec = report["tables"]["gpu"]["modes"]["decode"]
    readable = json.loads((bundle / "tables" / "gpu.json").read_text())["tables"]["decode"]
    assert dec["tasks"] == len(readable) == 31  # the LM head's 256 columns in one task (lm_block_n), not 8
    assert dec["levels"] == _longest_path(readable) == 11  # 4 per layer + embed, final norm/head, argmax
    assert (dec["levels_per_layer"], dec["levels_outside_layers"]) == (4, 3)
    assert dec["tasks_by_op"]["linear"] == sum(t["op"] == 1 for t in readable)
    man = json.loads((bundle / "manifest.json").read_text())
    place = [p for p in man["weights"]["placement"] if p["arena"] == "W"]
    embed = next(p for p in place if "embed" in p["value"])
    expected = sum(p["shape"][0] * p["shape"][1] * 2 for p in place) - (embed["shape"][0] - 1) * embed["shape"][1] * 2
    assert dec["weight_bytes"] == expected  # untied head: every matrix once, one embedding row
    pred = report["targets"]["h200"]["prediction"]
    assert pred["bytes_per_step"] == dec["weight_bytes"] + dec["kv_bytes"] + dec["p_bytes"]
    # the KV cache at 64 tokens: layers x kv heads x 64 x head dim x (k, v) x f32
    assert dec["kv_bytes"] == 2 * 2 * 64 * 16 * 2 * 4


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
def test_prediction_is_ordered_above_the_floor_and_explained(report: dict[str, Any], target: str) -> None:
    p = report["targets"][target]["prediction"]
    assert p["us"]["low"] <= p["us"]["central"] <= p["us"]["high"]
    assert p["floor_us"]["low"] <= p["floor_us"]["central"] <= p["floor_us"]["high"]
    assert p["us"]["low"] > p["floor_us"]["high"]
    lp = params_for(target, "central")
    assert p["floor_us"]["central"] == round(p["bytes_per_step"] / (lp.hbm_gbs * 1e3), 2)
    crit = p["critical"]
    # one task per level on the critical path. With the calibrated DRAM latency the first q
    # projection's weights (requested at its claim, before its poll) arrive after the embed task
    # has signalled, so the path starts at that projection's claim (10 levels); the embed task
    # heads it (all 11) only where its signal is what the projection waits for
    assert crit["levels"] == crit["length"] == (11 if "embed" in crit["ops"] else 10)
    assert abs(sum(crit["us"].values()) - p["us"]["central"]) < 0.5
    assert p["unpriced_tasks"] == 0
    floor = _check(report, target, "predicted decode")
    assert not floor["met"] and "11 levels" in floor["stopped_by"]


def test_batched_step_reads_weights_once_and_every_rows_cache(bundle: Path) -> None:
    """The batched decode step (prefill kernel, prefill table, T = B rows over a paged cache):
    the same weight bytes at every batch size, the KV bytes B times one row's, every task priced
    from a path through the machine code, slower with more rows but far less than B times."""
    from zlc.bundle import read_manifest
    from zlc.kernelmodel.batch_step import predict_batch
    from zlc.kernelmodel.sass_map import KernelCode
    from zlc.kernelmodel.task_tables import table_facts
    from zlc.kernelmodel.triton_source import KernelSource

    man = read_manifest(bundle)
    src = KernelSource((bundle / man["kernel"]["source"]).read_text(), man["kernel"]["entry"])
    tf = table_facts(bundle, "gpu", src, man, 64)
    code = KernelCode(bundle, "h200", man, src, kernel="prefill")
    one, many = (predict_batch(code, tf, man, b, 64) for b in (4, 16))
    assert one.bytes_per_step["weights"] == many.bytes_per_step["weights"] > 0
    assert many.bytes_per_step["kv"] == 4 * one.bytes_per_step["kv"] > 0
    assert one.unpriced_tasks == many.unpriced_tasks == 0
    assert one.us["low"] <= one.us["central"] <= one.us["high"]
    assert one.us["central"] < many.us["central"] < 4 * one.us["central"]
    assert many.per_op_busy_us["attention"] > one.per_op_busy_us["attention"]
    with pytest.raises(ValueError, match="1..64"):
        predict_batch(code, tf, man, 65, 64)


@pytest.fixture(scope="module")
def masked_bundle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Llama whose row lengths split into no 32-column chunks (hidden 48, mlp 80): no specialized
    body, the masked generic one, for h200 only."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from zlc.build import compile as compile_bundle

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=1,
                                   num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=64,
                                   attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(1))
    out = tmp_path_factory.mktemp("kstats-masked") / "odd.zlc"
    compile_bundle(model, example_inputs=(ids,), targets=["h200"], out=out, max_seq=32, verify=False)
    assert "def _gemv_k" not in (out / "kernel.py").read_text()
    return out


@pytest.fixture(scope="module")
def masked(masked_bundle: Path) -> dict[str, Any]:
    return bundle_report(masked_bundle)


@pytest.mark.parametrize("levels,unreachable", [(123, True), (67, True), (24, False)])
def test_a_level_count_too_high_for_the_floor_target_is_called_unreachable(levels: int, unreachable: bool) -> None:
    """The 1.6x-floor verdict says when no kernel with this many levels could meet it: SmolLM2's
    123 decode levels (and the Llama-1B shape's 67) at the least a level costs on h200 (release
    fence, signal to poll, the first activation and the calibrated per-task cost: ~2.9 µs central)
    exceed 1.6 x its 68 µs floor before any byte streams; 24 levels would not."""
    from zlc.kernelmodel.latency import Prediction
    from zlc.kernelmodel.report import _floor_verdict, min_level_us

    lp = params_for("h200", "central")
    assert min_level_us(lp) == pytest.approx(lp.fence_us + lp.sync_us + lp.l2_us + lp.task_us)
    crit = {"length": 94, "levels": 94, "us": {"fixed": 300.0, "sync": 60.0, "stream": 30.0},  # a shorter path binds
            "terms_us": {"signal_to_poll": 94 * 0.35, "poll_round_trips": 94 * 0.3}}
    pred = Prediction("h200", 512, {"low": 300.0, "central": 390.0, "high": 600.0},
                      {"low": 65.0, "central": 68.1, "high": 75.0}, 0, None, {}, {}, crit, 0.2, [], 0, 0.0)
    value, met, why = _floor_verdict(pred, lp, levels)
    assert not met and value.endswith("5.7x")
    budget = 1.6 * 68.1
    assert ("unreachable at" in why) == unreachable == (lp.launch_us + levels * min_level_us(lp) > budget)
    if unreachable:
        assert f"at most {int((budget - lp.launch_us) // min_level_us(lp))} levels" in why


def test_masked_fallback_is_reported(masked: dict[str, Any]) -> None:
    mv = _matvec(masked, "h200")
    assert mv and all(c["variants"] == [] for c in mv)  # the generic body: no specialized variant
    assert {k for c in mv for k in c["weight_opcodes"]} == {"LDG.E.U16"}  # masked: one element per load
    # it waits, then streams: nothing requested before the poll
    assert all(c["prefetch_bytes"] == 0 and c["path"]["pre_rt"] is None and c["path"]["polls"] == 1 for c in mv)
    wide = _check(masked, "h200", "weights read with 128-bit")
    assert not wide["met"] and "LDG.E.U16" in wide["stopped_by"] and "masked fallback" in wide["stopped_by"]
    assert not _check(masked, "h200", "weights requested before")["met"]
    p = masked["targets"]["h200"]["prediction"]
    assert p["us"]["low"] <= p["us"]["central"] <= p["us"]["high"] and p["us"]["low"] > p["floor_us"]["high"]


def test_cli_kernel_report_and_json(masked_bundle: Path) -> None:
    from zlc.cli import cli

    res = CliRunner().invoke(cli, ["inspect", str(masked_bundle), "--kernel"])
    assert res.exit_code == 0, res.output
    assert "LDG.E.U16" in res.output and "predicted" in res.output and "machine-code and latency targets" in res.output
    assert "masked fallback" in res.output
    res = CliRunner().invoke(cli, ["inspect", str(masked_bundle), "--kernel", "--json", "--target", "h200"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output)
    assert set(rep["targets"]) == {"h200"} and rep["format_version"] == 2
    res = CliRunner().invoke(cli, ["inspect", str(masked_bundle), "--kernel", "--target", "a10"])
    assert res.exit_code != 0 and "no cubin for a10" in res.output


def test_cpu_only_bundle_gives_one_clear_line(bundle: Path, tmp_path: Path) -> None:
    from zlc.bundle import read_manifest, write_manifest
    from zlc.cli import cli

    cpu = tmp_path / "cpu.zlc"
    shutil.copytree(bundle, cpu, ignore=shutil.ignore_patterns("*.safetensors", "native", "kernels"))
    man = read_manifest(cpu)
    man["targets"] = {k: v for k, v in man["targets"].items() if "cubin" not in v}
    write_manifest(cpu, man)
    res = CliRunner().invoke(cli, ["inspect", str(cpu), "--kernel"])
    assert res.exit_code != 0
    lines = [ln for ln in res.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "no GPU target" in lines[0]


# ---- the event simulation's properties -------------------------------------------------------
# Monotone while every program runs at most one task (grid >= tasks) and HBM is never
# oversubscribed (event_sim's docstring); both hold here by construction.

@st.composite
def steps(draw: st.DrawFn) -> list[TaskShape]:
    n = draw(st.integers(1, 12))
    out = []
    for i in range(n):
        waits = [[j] for j in sorted(draw(st.sets(st.integers(0, i - 1), max_size=3)))] if i else []
        pre = draw(st.floats(0, 8))
        out.append(TaskShape(
            op=1, waits=waits, pre_rt=pre, poll_rt=pre + draw(st.floats(0, 3)), prefetch=draw(st.floats(0, 1 << 16)),
            used_before_poll=draw(st.booleans()), lead_rt=draw(st.floats(0, 4)), stream=draw(st.floats(0, 1 << 20)),
            in_flight=draw(st.floats(1024, 1 << 16)), serial_rt=draw(st.floats(0, 8)), par_rt=draw(st.floats(0, 4)),
            tail_rt=draw(st.floats(0, 4)), instrs=draw(st.floats(0, 400)), fences=draw(st.integers(0, 2)),
            atomics=draw(st.integers(0, 2)), barriers=draw(st.integers(0, 6))))
    return out


def _params(target: str, case: str, grid: int) -> SimParams:
    lp = params_for(target, case)
    p = sim_params(lp, grid, 8, True)
    return SimParams(**{**vars(p), "hbm_bw": 1e12})  # never oversubscribed


@settings(max_examples=80, deadline=None)
@given(steps(), st.sampled_from(TARGETS))
def test_slow_end_of_every_range_is_never_faster(tasks: list[TaskShape], target: str) -> None:
    times = [simulate_step(tasks, _params(target, c, len(tasks))).step_us for c in CASES]
    assert times == sorted(times)


@settings(max_examples=80, deadline=None)
@given(steps(), st.floats(1.0, 16.0), st.sampled_from(TARGETS))
def test_more_bytes_in_flight_is_never_slower(tasks: list[TaskShape], factor: float, target: str) -> None:
    p = _params(target, "central", len(tasks))
    fast = [TaskShape(**{**vars(t), "in_flight": t.in_flight * factor}) for t in tasks]
    assert simulate_step(fast, p).step_us <= simulate_step(tasks, p).step_us + 1e-9


@settings(max_examples=80, deadline=None)
@given(steps(), st.data(), st.sampled_from(TARGETS))
def test_one_more_wait_is_never_faster(tasks: list[TaskShape], data: st.DataObject, target: str) -> None:
    if len(tasks) < 2:
        return
    p = _params(target, "central", len(tasks))
    i = data.draw(st.integers(1, len(tasks) - 1))
    j = data.draw(st.integers(0, i - 1))
    more = [TaskShape(**{**vars(t), "waits": [*t.waits, [j]] if k == i else list(t.waits)})
            for k, t in enumerate(tasks)]
    assert simulate_step(more, p).step_us >= simulate_step(tasks, p).step_us - 1e-9


@pytest.mark.slow  # the prefill cubin's SASS mapped: ~20-30 s on 2 busy cores, on top of the module's compile
def test_multirow_sass_facts_of_the_prefill_kernel(bundle: Path) -> None:
    """The multi-row bodies' loop facts (zlc.kernelmodel.multirow.sass_facts) read off the compiled
    h200 prefill cubin at the default GPU tiling: the tl.dot k-loop issues tensor-core MMAs at
    tf32x3 (a multiple of 3 per iteration), the gated arm a second product as many, no spills; every
    loop the model prices is found; they price a prefill launch of the tiny shape."""
    from zlc.bundle import read_manifest
    from zlc.kernelmodel.calibration import load
    from zlc.kernelmodel.latency import params_for
    from zlc.kernelmodel.multirow import BodyFacts, ModelShape, MultiRowTerms, prefill, sass_facts
    from zlc.kernelmodel.sass_map import KernelCode

    man = read_manifest(bundle)
    cx = man["tilings"][man["targets"]["h200"]["tiling"]]["constexprs"]
    f = sass_facts(KernelCode(bundle, "h200", man, kernel="prefill"), cx)
    assert (f["block_t"], f["block_n"], f["block_kd"]) == (16, 32, 32)
    assert f["dot"]["hmma"] > 0 and f["dot"]["hmma"] % 3 == 0 and f["gated"]["hmma"] == f["dot"]["hmma"]
    assert f["dot"]["local"] == 0 and f["dot"]["bars"] > 0
    for loop in ("stats", "gemv", "paged_row", "paged_block", "append"):
        assert f[loop]["instrs"] > 0, loop
    rec = load()["multirow"]["sass"]["16x32x32"]  # the bench tiny model's, recorded: the same loop code
    assert f["dot"]["hmma"] == rec["dot"]["hmma"]
    lp, raw = params_for("h200", "central"), params_for("h200", "central", calibrated=False).dram_us
    p = prefill(ModelShape(64, 2, 4, 2, 128, 256), BodyFacts.from_dict(f), lp, MultiRowTerms(2.0, 1.0), raw, 16)
    assert p.us > lp.launch_us and p.parts["issue"] > 0
