"""Facts of a bundle's megakernel machine code, per GPU target and per op body: the SASS half of
the inputs of the latency model (`kernel_model`); `kernel_tables` reads the task tables.

Per target: registers, occupancy, and per op body the weight loads (address dataflow from the `W`
parameter, confirmed by the source line's `tl.load` being based on `W`), its loops with the weight
bytes in flight per iteration, the dependent global round trips before the first weight byte is in
flight, and the fences / L1 invalidations / atomics / barriers a task meets on its way through the
task loop.

Nothing here knows a particular op body. Bodies, helpers and loops come from kernel.py's AST and
the SASS line table (every instruction carries its inlining chain); which side of a branch a task
takes comes from evaluating the branch's `if` for that task with the real tables
(`kernel_source.Evaluator`). Facts that need a task are given for the first decode task of each
op kind; `KernelCode` answers them for any task (the model asks per task).
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zlc.bundle import OP_NAMES, read_manifest

from .kernel_code import KernelCode, KernelStatsError, LoopFacts, SyncCounts
from .kernel_source import Evaluator, KernelSource

__all__ = ["ARCH_LIMITS", "BodyFacts", "KernelCode", "KernelStatsError", "LoopFacts", "SyncCounts", "TargetFacts",
           "cubin_facts", "decode_summary", "occupancy"]


# Per-SM limits (CUDA occupancy calculator / programming guide, compute capability tables):
# registers, warps, resident programs (CTAs), shared memory bytes, register allocation unit per
# warp, warp allocation granularity.
ARCH_LIMITS: dict[int, dict[str, int]] = {
    80: {"regs": 65536, "warps": 64, "programs": 32, "smem": 167936, "reg_unit": 256, "warp_unit": 4},
    86: {"regs": 65536, "warps": 48, "programs": 16, "smem": 102400, "reg_unit": 256, "warp_unit": 4},
    89: {"regs": 65536, "warps": 48, "programs": 24, "smem": 102400, "reg_unit": 256, "warp_unit": 4},
    90: {"regs": 65536, "warps": 64, "programs": 32, "smem": 233472, "reg_unit": 256, "warp_unit": 4},
}


def occupancy(cc: int, registers: int, threads: int, shared: int) -> dict[str, int]:
    """Programs (CTAs) and warps one SM can hold for this register / thread / shared footprint."""
    lim = ARCH_LIMITS.get(cc) or ARCH_LIMITS[max((k for k in ARCH_LIMITS if k <= cc), default=80)]
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // lim["reg_unit"]) * lim["reg_unit"]
    by_regs = (lim["regs"] // per_warp) // lim["warp_unit"] * lim["warp_unit"] // warps
    by_smem = lim["smem"] // shared if shared else lim["programs"]
    programs = max(0, min(by_regs, by_smem, lim["warps"] // warps, lim["programs"]))
    return {"programs_per_sm": programs, "warps_per_sm": programs * warps, "limit_registers": by_regs,
            "limit_shared": by_smem, "limit_warps": lim["warps"] // warps}


@dataclass
class BodyFacts:
    name: str  # op body function (op_linear, ...)
    op: str | None  # op kind from the dispatch (linear, ...)
    code: int | None
    instructions: int
    max_live_registers: int | None
    weight_loads: dict[str, int]  # opcode -> static count in the body
    weight_load_lines: list[int]  # kernel.py lines of those loads (innermost kernel.py frame)
    loops: list[LoopFacts]
    sample_task: int | None = None  # the decode task the path facts below are for
    decode: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "instructions": self.instructions, "max_live_registers": self.max_live_registers,
                "weight_loads": self.weight_loads, "weight_load_lines": self.weight_load_lines,
                "decode_sample_task": self.sample_task, "decode": self.decode,
                "loops": [lp.as_dict() for lp in self.loops]}


@dataclass
class TargetFacts:
    target: str
    arch: str
    cc: int
    registers: int
    spill_bytes: int
    threads: int
    shared: int
    occupancy: dict[str, int]
    grid: int
    bodies: dict[str, BodyFacts]
    per_task: SyncCounts  # the task loop outside op bodies, once per task
    per_wait: SyncCounts  # one wait
    per_group: SyncCounts  # the extra signal of a group's last task
    per_launch: SyncCounts  # outside the task loop
    wait_round_trips: int | None  # dependent global loads up to a wait's poll result
    code: KernelCode

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "arch": self.arch, "registers": self.registers, "spill_bytes": self.spill_bytes,
                "threads_per_program": self.threads, "shared_bytes": self.shared, "occupancy": self.occupancy,
                "grid": self.grid, "bodies": {k: b.as_dict() for k, b in self.bodies.items()},
                "task_loop": {"per_task": self.per_task.as_dict(), "per_wait": self.per_wait.as_dict(),
                              "per_group_completion": self.per_group.as_dict(),
                              "per_launch": self.per_launch.as_dict(), "wait_round_trips": self.wait_round_trips}}


def _task_loop_counts(code: KernelCode) -> tuple[SyncCounts, SyncCounts, SyncCounts, SyncCounts, int | None]:
    """Sync instructions of the task loop outside op bodies, by the loop statement they come from:
    a statement holding a static_range loop runs once per wait (counts divided by the range), an
    `if` nested in a statement's `if` only for a group's last task, the rest once per task; code
    outside the loop once per launch. Also the round trips up to a wait's poll result."""
    src, cfg, sass = code.src, code.cfg, code.sass
    assert code.task_loop is not None
    in_loop = {n for b in code.task_loop.blocks for n in range(cfg.blocks[b].start, cfg.blocks[b].end)}
    per_task, per_wait, per_group, per_launch = SyncCounts(), SyncCounts(), SyncCounts(), SyncCounts()
    wait_rt = None
    copies = _static_range(src)
    for n in range(code.hi):
        ins = sass.instrs[n]
        if code.where[n] is not None:
            continue
        if n not in in_loop:
            per_launch.add(ins)
            continue
        line = code.chains[n][0][1] if code.chains[n] else None
        st = src.task_loop_statement(line) if line is not None else None
        if st is not None and copies and any(isinstance(x, ast.For) for x in ast.walk(st)):
            per_wait.add(ins, 1 / copies)
            lp = cfg.innermost_loop(n)
            if ins.is_global_load and lp is not None and lp is not code.task_loop and len(lp.instr_indices(cfg)) <= 16:
                wait_rt = max(wait_rt or 0, code.address_depth(n) + 1)  # a poll: its result ends the wait
        elif st is not None and line is not None and _nested_if_depth(st, line) >= 2:
            per_group.add(ins)
        else:
            per_task.add(ins)
    return per_task, per_wait, per_group, per_launch, wait_rt


def _static_range(src: KernelSource) -> int | None:
    for st in src.task_loop.body:  # type: ignore[attr-defined]
        for x in ast.walk(st):
            if isinstance(x, ast.For) and isinstance(x.iter, ast.Call) and x.iter.args:
                a = x.iter.args[0] if len(x.iter.args) == 1 else x.iter.args[1]
                if isinstance(a, ast.Name) and isinstance(src.consts.get(a.id), int):
                    return int(src.consts[a.id])
                if isinstance(a, ast.Constant) and isinstance(a.value, int):
                    return a.value
    return None


def _nested_if_depth(st: ast.stmt, line: int) -> int:
    return sum(1 for x in ast.walk(st) if isinstance(x, ast.If) and x.body[0].lineno <= line
               <= (x.body[-1].end_lineno or x.body[-1].lineno))


def cubin_facts(bundle: Path, target: str, man: dict[str, Any] | None = None, evaluator: Any = None,
                src: KernelSource | None = None) -> TargetFacts:
    """The SASS facts of one GPU target. `evaluator(op code) -> (Evaluator, task index)` gives the
    first decode task of an op kind (`kernel_tables.Tables.sampler`) for the path facts; its
    evaluators must read the same `src` (pass it)."""
    bundle = Path(bundle)
    man = man or read_manifest(bundle)
    code = KernelCode(bundle, target, man, src)
    info = code.info
    bodies: dict[str, BodyFacts] = {}
    code_of = {v: k for k, v in code.src.dispatch.items()}
    for name in sorted(code.body_blocks, key=lambda b: code_of.get(b, 99)):
        idx = [n for n, w in enumerate(code.where) if w == name]
        loops = code.body_loops(name)
        lives = [g for n in idx if (g := code.sass.instrs[n].live_gprs) is not None]
        op = code_of.get(name)
        bf = BodyFacts(name, OP_NAMES[op] if op is not None and op < len(OP_NAMES) else None, op, len(idx),
                       max(lives) if lives else None,
                       dict(Counter(code.sass.instrs[n].opcode for n in idx if n in code.weight)),
                       sorted({code.chains[n][-1][1] for n in idx if n in code.weight and code.chains[n]}), loops)
        sample = evaluator(op) if evaluator is not None and op is not None else None
        ev = None
        if sample is not None:
            ev, task = sample
            bf.sample_task = task
        for lf in loops:
            lf.trips = code.trips(lf, ev) if ev is not None else None
            lf.path = code.loop_path(lf, ev, name)
        bf.decode = decode_summary(code, bf, ev)
        bodies[name] = bf
    per_task, per_wait, per_group, per_launch, wait_rt = _task_loop_counts(code)
    res = info.get("resources", {})
    threads = code.params.threads or int(info.get("metadata", {}).get("num_warps", 4)) * 32
    shared = int(info.get("metadata", {}).get("shared", 0)) + int(res.get("shared", 0))
    cc = int(info["arch"].split("_")[1].rstrip("a"))
    regs = int(res.get("registers", 0))
    return TargetFacts(
        target=target, arch=info["arch"], cc=cc, registers=regs,
        spill_bytes=int(res.get("spill_stores", 0)) + int(res.get("spill_loads", 0)), threads=threads, shared=shared,
        occupancy=occupancy(cc, regs, threads, shared), grid=int(info.get("grid", 1)), bodies=bodies,
        per_task=per_task, per_wait=per_wait, per_group=per_group, per_launch=per_launch, wait_round_trips=wait_rt,
        code=code)


def decode_summary(code: KernelCode, bf: BodyFacts, ev: Evaluator | None) -> dict[str, Any]:
    """The body on one task's path: its main loop (the running loop that moves the most weight
    bytes per task), the weight bytes in flight there, the round trips before its first weight
    load (address chain from the top of the task loop, plus loops that must finish first)."""
    running = [lf for lf in bf.loops if lf.trips is None or lf.trips > 0] if ev is not None else bf.loops
    weighted = [lf for lf in running if lf.path.get("weight_bytes_per_thread")]
    main = max(weighted, key=lambda lf: (lf.trips or 1) * lf.path["weight_bytes_per_thread"], default=None)
    out: dict[str, Any] = {"sync_outside_loops": code.body_sync(bf.name, ev).as_dict()}
    if main is None:
        flat = code.straight_path(bf.name, ev)
        if flat.get("weight_loads"):  # no loop streams weights: they are loaded in straight-line code
            out.update({"main_loop": "straight-line code (no loop)", "weight_load_opcodes": flat["weight_opcodes"],
                        "weight_load_opcodes_all_paths": bf.weight_loads,
                        "weight_loads_per_iteration": flat["weight_loads"],
                        "weight_bytes_per_thread_per_iteration": flat["weight_bytes_per_thread"],
                        "weight_in_flight_per_thread": flat["weight_in_flight_per_thread"],
                        "weight_loads_before_first_use": flat["weight_loads_before_first_use"],
                        "round_trips_per_iteration": flat["round_trips_per_iteration"], "main_trips": 1,
                        "address_round_trips": None, "serial_loops_before": [], "serial_round_trips_before": 0,
                        "round_trips_in_iteration_before_weights": flat["round_trips_before_weights"]})
        return out
    before = [lf for lf in running if lf.header_addr < main.header_addr and lf is not main
              and not (lf.loop.blocks > main.loop.blocks)
              and lf.path.get("round_trips_per_iteration", 0) > 0]
    serial = sum((lf.trips or 0) * lf.path["round_trips_per_iteration"] for lf in before)
    out.update({
        "main_loop": f"{main.source_fn}:{main.source_line}",
        "weight_load_opcodes": main.path["weight_opcodes"],
        "weight_load_opcodes_all_paths": main.weight_loads,
        "weight_loads_per_iteration": main.path["weight_loads"],
        "weight_bytes_per_thread_per_iteration": main.path["weight_bytes_per_thread"],
        "weight_in_flight_per_thread": main.path["weight_in_flight_per_thread"],
        "weight_loads_before_first_use": main.path["weight_loads_before_first_use"],
        "round_trips_per_iteration": main.path["round_trips_per_iteration"],
        "main_trips": main.trips,
        "address_round_trips": main.first_weight_depth,
        "serial_loops_before": [f"{lf.source_fn}:{lf.source_line} x{lf.trips}" for lf in before],
        "serial_round_trips_before": serial,
        "round_trips_in_iteration_before_weights": main.path["round_trips_before_weights"],
    })
    return out
