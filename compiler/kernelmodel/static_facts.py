"""Static facts of one megakernel of a bundle (a target's decode or prefill kernel): registers,
spills, occupancy, and per op body its weight loads (address dataflow from the `W` parameter,
confirmed by the source line's `tl.load` being based on `W`) and loops. The per-task facts (what a
task's path issues: weights before its wait, bytes in flight, round trips, fences per task) come
from `task_path` through `latency`; `report` puts both together.

Nothing here knows a particular op body: bodies, helpers and loops come from kernel.py's AST and
the SASS line table (every instruction carries its inlining chain).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zlc.bundle import OP_NAMES, read_manifest
from zlc.targets import get_target

from .sass_map import KernelCode, KernelStatsError, LoopFacts, SyncCounts
from .triton_source import KernelSource

__all__ = ["ARCH_LIMITS", "BodyFacts", "KernelCode", "KernelFacts", "KernelStatsError", "LoopFacts", "SyncCounts",
           "cubin_facts", "occupancy"]


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
    weight_fns: list[str]  # the functions those loads sit in (the specialized variants: _gemv_k576_rms, ...)
    loops: list[LoopFacts]
    mma_loops: int  # loops with tensor-core instructions

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "instructions": self.instructions, "max_live_registers": self.max_live_registers,
                "weight_loads": self.weight_loads, "weight_load_lines": self.weight_load_lines,
                "weight_fns": self.weight_fns, "mma_loops": self.mma_loops,
                "loops": [lp.as_dict() for lp in self.loops]}


@dataclass
class KernelFacts:
    target: str
    kernel: str  # "decode" or "prefill"
    arch: str
    cc: int
    registers: int
    spill_bytes: int
    threads: int
    shared: int
    occupancy: dict[str, int]
    grid: int
    bodies: dict[str, BodyFacts]
    per_launch: SyncCounts  # sync instructions outside the task loop
    polls: int  # static poll loads (one per unrolled wait copy, per place that waits)
    ctrl_loads: dict[str, int]  # loads from CTRL (mapped host memory): "launch" and per op body
    code: KernelCode

    @property
    def programs_per_sm(self) -> int:
        """Programs one SM runs at once: the grid spread over the SMs, capped by occupancy."""
        sms = max(get_target(self.target).sms, 1)
        return max(1, min(self.occupancy["programs_per_sm"] or 1, -(-self.grid // sms)))

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "kernel": self.kernel, "arch": self.arch, "cubin": self.code.info["cubin"],
                "registers": self.registers, "spill_bytes": self.spill_bytes, "threads_per_program": self.threads,
                "shared_bytes": self.shared, "occupancy": self.occupancy, "programs_per_sm": self.programs_per_sm,
                "grid": self.grid, "bodies": {k: b.as_dict() for k, b in self.bodies.items()},
                "per_launch": self.per_launch.as_dict(), "poll_loads": self.polls, "ctrl_loads": self.ctrl_loads,
                "claim_overlapped": bool(self.code.src.claim.get("overlapped")),
                "instructions": len(self.code.sass.instrs), "memory_and_sync_opcodes": self.opcode_counts(),
                "weight_load_opcodes": dict(Counter(self.code.sass.instrs[n].opcode for n in self.code.weight))}

    def opcode_counts(self) -> dict[str, int]:
        """Static counts of the global loads / atomics, fences, L1 invalidations, L2 prefetches,
        barriers and tensor-core instructions of the whole kernel (to check against cuobjdump)."""
        return dict(sorted(Counter(i.opcode for i in self.code.sass.instrs if i.is_global_load or i.is_global_atomic
                                   or i.is_fence or i.is_l1_invalidate or i.is_l2_prefetch or i.is_barrier
                                   or i.is_mma).items()))


def cubin_facts(bundle: Path, target: str, man: dict[str, Any] | None = None, src: KernelSource | None = None,
                kernel: str = "decode") -> KernelFacts:
    """The static SASS facts of one kernel ("decode" or "prefill") of one GPU target."""
    bundle = Path(bundle)
    man = man or read_manifest(bundle)
    code = KernelCode(bundle, target, man, src, kernel=kernel)
    info = code.info
    bodies: dict[str, BodyFacts] = {}
    op_of = code.src.op_of
    for name in sorted(code.body_blocks, key=lambda b: (op_of.get(b, 99), b)):
        idx = [n for n, w in enumerate(code.where) if w == name]
        loops = code.body_loops(name)
        lives = [g for n in idx if (g := code.sass.instrs[n].live_gprs) is not None]
        op = op_of.get(name)
        wl = [n for n in idx if n in code.weight]
        bodies[name] = BodyFacts(
            name, OP_NAMES[op] if op is not None and 0 <= op < len(OP_NAMES) else None, op, len(idx),
            max(lives) if lives else None, dict(Counter(code.sass.instrs[n].opcode for n in wl)),
            sorted({code.chains[n][-1][1] for n in wl if code.chains[n]}),
            sorted({code.chains[n][-1][0] for n in wl if code.chains[n]}), loops, sum(lf.mma for lf in loops))
    per_launch = SyncCounts()
    for n in range(code.hi):
        if n not in code.in_loop:
            per_launch.add(code.sass.instrs[n])
    ctrl: Counter[str] = Counter()
    for n in code.ctrl_loads:
        ctrl["launch" if n not in code.in_loop else (code.where[n] or "task loop")] += 1
    res = info.get("resources", {})
    threads = code.params.threads or int(info.get("metadata", {}).get("num_warps", 4)) * 32
    shared = int(info.get("metadata", {}).get("shared", 0)) + int(res.get("shared", 0))
    tinfo = man["targets"][target]
    cc = int(str(info.get("arch") or tinfo["arch"]).split("_")[1].rstrip("a"))
    regs = int(res.get("registers", 0))
    return KernelFacts(
        target=target, kernel=kernel, arch=str(info.get("arch") or tinfo["arch"]), cc=cc, registers=regs,
        spill_bytes=int(res.get("spill_stores", 0)) + int(res.get("spill_loads", 0)), threads=threads, shared=shared,
        occupancy=occupancy(cc, regs, threads, shared), grid=int(info.get("grid") or tinfo.get("grid") or 1),
        bodies=bodies, per_launch=per_launch, polls=len(code.polls), ctrl_loads=dict(ctrl), code=code)
