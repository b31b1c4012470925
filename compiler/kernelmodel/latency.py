"""The megakernel decode latency model: µs per token per GPU target (low / central / high), from
the machine code (`sass_map`, each task's path through it: `task_path`), the task tables and
their bytes (`task_tables`), and stated per-target latency and bandwidth ranges, through a
discrete-event simulation of the decode step (`event_sim`). docs/kernel-model.md explains every
term; this module builds the simulation's inputs and reads its outputs.

Per task, from its path: L2 round trips before its weight request and before its first poll, the
weight bytes it requests before the poll (`prefetch`, capped by its bytes from the tables), the
round trips after the waits before, beside and after its stream, the bytes in flight per SM while
streaming (Little's law: an SM with D bytes in flight at latency L moves D / L), the round trips its
loops add per iteration beyond the streamed load, the instructions after its last weight byte,
and its fences, waited atomics, barriers and L1 invalidations. Per step: the floor is the step's
DRAM bytes over the measured HBM bandwidth.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from zlc.abi import LinearDesc
from zlc.bundle import MODE_DECODE, OP_LINEAR, OP_NAMES
from zlc.targets import get_target

from .calibration import calibration
from .event_sim import SimParams, SimResult, TaskShape, simulate
from .sass_map import KernelCode, KernelStatsError, SyncCounts
from .task_path import PathFacts, nest, task_path
from .task_tables import TableFacts, waits_of

__all__ = ["CASES", "LatencyParams", "Prediction", "params_for", "path_shape", "predict", "sim_params",
           "task_shapes"]

CASES = ("low", "central", "high")  # low: every range at its fast end


@dataclass(frozen=True)
class LatencyParams:
    """One case (low / central / high) of a target's ranges; times in µs, bandwidths in GB/s."""

    sms: int
    hbm_gbs: float  # measured device copy bandwidth (not the spec sheet)
    dram_us: float  # DRAM latency under load
    l2_us: float  # L2 hit round trip as an SM sees it
    atomic_us: float  # a global atomic whose result the task waits for
    fence_us: float  # MEMBAR.GPU: outstanding stores acknowledged by L2
    inval_us: float  # CCTL.IVALL
    barrier_us: float  # BAR.SYNC of one program's warps
    sync_us: float  # a signal landing in L2 until the polling program sees it
    launch_us: float  # per step: launch, the first claim's wait, the last program's exit and reset
    sm_gbs: float  # most one SM pulls from L2/DRAM
    clock_ghz: float  # SM clock under load
    ipc: float  # warp instructions issued per cycle per SM (4 schedulers)
    l2_mb: float
    # the calibrated terms (calibration.py): neutral unless params_for applied the fit
    task_us: float = 0.0  # a fixed cost every task pays before its signal
    calibrated: bool = False


# Ranges per GPU family (low = fast end, high = slow end). Sources: measured copy bandwidth of
# H100/H200 SXM (~85-95 % of the 4.8 TB/s spec) and A10 GDDR6 (~500 of 600 GB/s); loaded DRAM and
# L2 hit latency from published microbenchmarks of Hopper / Ampere (~480-900 ns, ~150-450 ns); a
# fence or a waited atomic about one L2 round trip, more under contention; clocks between the
# sustained and the boost clock.
_RANGES: dict[str, dict[str, tuple[float, float, float]]] = {
    "sm_90": {"hbm_gbs": (4500, 4300, 3900), "dram_us": (0.55, 0.7, 0.9), "l2_us": (0.2, 0.3, 0.45),
              "atomic_us": (0.3, 0.5, 0.9), "fence_us": (0.2, 0.4, 0.8), "inval_us": (0.01, 0.02, 0.05),
              "barrier_us": (0.01, 0.02, 0.04), "sync_us": (0.2, 0.35, 0.6), "launch_us": (2.0, 4.0, 8.0),
              "sm_gbs": (120, 100, 80), "clock_ghz": (1.98, 1.75, 1.5), "ipc": (4, 3, 2)},
    "sm_8x": {"hbm_gbs": (550, 500, 450), "dram_us": (0.45, 0.6, 0.8), "l2_us": (0.15, 0.22, 0.35),
              "atomic_us": (0.25, 0.4, 0.8), "fence_us": (0.15, 0.3, 0.6), "inval_us": (0.01, 0.02, 0.05),
              "barrier_us": (0.01, 0.02, 0.04), "sync_us": (0.15, 0.3, 0.5), "launch_us": (2.0, 4.0, 8.0),
              "sm_gbs": (100, 90, 70), "clock_ghz": (1.69, 1.5, 1.3), "ipc": (4, 3, 2)},
}
# targets measured against a different bandwidth than the family's reference part: scale it
_REFERENCE_GBS = {"sm_90": 4800.0, "sm_8x": 600.0}


def params_for(target: str, case: str, calibrated: bool = True) -> LatencyParams:
    """The `case` column of `target`'s ranges (SM count from zlc.targets), with the calibrated
    terms of calibration.json applied through the case's L2 latency, clock and DRAM latency
    (`calibrated`, where a fit exists): the launch, the per-task cost, signal -> poll and the DRAM
    latency under load."""
    t = get_target(target)
    if not t.is_gpu:
        raise KernelStatsError(f"target '{target}' is not a GPU")
    fam = "sm_90" if (t.compute_capability or 0) >= 90 else "sm_8x"
    k = CASES.index(case)
    r = {name: v[k] for name, v in _RANGES[fam].items()}
    r["hbm_gbs"] *= (t.bandwidth_gbs or _REFERENCE_GBS[fam]) / _REFERENCE_GBS[fam]
    cal = calibration() if calibrated else None
    if cal is not None:
        r.update(cal.terms(r["l2_us"], r["clock_ghz"], r["dram_us"]))
    return LatencyParams(sms=t.sms, l2_mb=float(t.l2_mb or 6), calibrated=cal is not None, **r)


def sim_params(lp: LatencyParams, grid: int, warps: int, claim_overlapped: bool) -> SimParams:
    return SimParams(grid=grid, l2=lp.l2_us, dram=lp.dram_us, atomic=lp.atomic_us, fence=lp.fence_us,
                     inval=lp.inval_us, barrier=lp.barrier_us, sig=lp.sync_us, launch=lp.launch_us,
                     sm_bw=lp.sm_gbs * 1e3, hbm_bw=lp.hbm_gbs * 1e3, instr=warps / lp.ipc / (lp.clock_ghz * 1e3),
                     claim_overlapped=claim_overlapped, l2_cap=lp.l2_mb * 1e6 / 2, task=lp.task_us)


@dataclass
class ShapeInfo:
    """How the task shapes were made: path classes (per op body and variant), and what could not
    be priced from the machine code."""

    classes: dict[tuple[Any, ...], dict[str, Any]]  # (body, variants) -> sample task, tasks, path facts
    unpriced: int  # tasks with bytes but no stream found on their path
    ctrl_loads_per_step: float  # CTRL (mapped) loads inside the task loop, per step


def task_shapes(code: KernelCode, tables: TableFacts, context: int, l2_mb: float) -> tuple[list[TaskShape], ShapeInfo]:
    """The simulation's input for every decode task (see the module docstring)."""
    tabs = tables.tables
    # the most bytes one L2 prefetch requests on this target (the kernel's PREFETCH; a bundle from
    # before the cap has none: the task's whole rows)
    pf_cap = (tabs.man.get("targets", {}).get(code.target, {}).get("l2_prefetch") or {}).get("bytes") or math.inf
    ev = tabs.evaluator(MODE_DECODE, context, step=MODE_DECODE)
    rows = tabs.rows(MODE_DECODE)
    waits = waits_of(rows)
    tr = tables.traffic["decode"]
    kv_in_l2 = sum(tr.kv) <= l2_mb * 1e6 / 2
    threads = code.params.threads or int(code.info.get("metadata", {}).get("num_warps", 8)) * 32
    last_of_group = set({r["signal"]: i for i, r in enumerate(rows) if r["parent"] >= 0}.values())
    group = SyncCounts()
    for n in range(code.hi):
        if n in code.in_loop and code.in_group_arm(n):
            group.add(code.sass.instrs[n])
    cache: dict[tuple[Any, ...], list[tuple[tuple[int, ...], tuple[Any, ...], PathFacts]]] = {}
    classes: dict[tuple[Any, ...], dict[str, Any]] = {}
    shapes: list[TaskShape] = []
    unpriced = 0
    ctrl = 0.0
    for i, r in enumerate(rows):
        ev.set_task(i)
        key = (r["op"], r["desc"], len(r["waits"]), tr.kv[i] > 0)
        pf = None
        for blocks, vals, cand in cache.get(key, []):
            if tuple(tuple(code.successors(b, ev)) for b in blocks) == vals:
                pf = cand
                break
        if pf is None:
            pf = task_path(code, ev, r["op"], len(r["waits"]), kv=tr.kv[i] > 0)
            vals = tuple(tuple(code.successors(b, ev)) for b in pf.decisions)
            cache.setdefault(key, []).append((pf.decisions, vals, pf))
        s, priced, c = path_shape(code, ev, pf, tr.weights[i], tr.kv[i], threads, kv_in_l2)
        cls = classes.get((pf.body, pf.variants))
        if cls is None:
            cls = classes[(pf.body, pf.variants)] = {"sample_task": i, "tasks": 0, "path": pf, "shape": s,
                                                     "weight_bytes": tr.weights[i],
                                                     "weight_opcodes": _weight_opcodes(code, ev, pf)}
        cls["tasks"] += 1
        unpriced += not priced
        ctrl += c
        s.op, s.waits, s.level = r["op"], waits[i], tables.levels["decode"][i]
        s.l2_bytes = float(min(tr.weights[i], _prefetchable(tabs, r), pf_cap))
        if i in last_of_group:
            s.fences += group.fences
            s.invalidations += group.l1_invalidations
            s.barriers += group.barriers
        shapes.append(s)
    return shapes, ShapeInfo(classes, unpriced, ctrl)


def _prefetchable(tabs: Any, r: dict[str, Any]) -> int:
    """The weight bytes of a task that the kernel's L2 prefetch requests for it (PREFETCH,
    `_prefetch_next`): a Linear's contiguous rows [n0, n1) x K of W, and of W2 when gated."""
    if r["op"] != OP_LINEAR:
        return 0
    di = tabs.desc_int[r["desc"]]
    item = 4 if str(tabs.man["dtype"]["weights"]) in ("fp32", "f32") else 2
    return max(0, r["b"] - r["a"]) * int(di[LinearDesc.k]) * item * (2 if int(di[LinearDesc.w2]) >= 0 else 1)


def path_shape(code: KernelCode, ev: Any, pf: PathFacts, wbytes: int, kvbytes: float, threads: int,
               kv_in_l2: bool) -> tuple[TaskShape, bool, float]:
    """One task's simulation shape from its path and bytes: (shape, priced, CTRL loads); the
    batched step (batch_step.py) prices the prefill kernel's tasks with it too."""
    s = TaskShape(op=-1, waits=[])
    prefetch = min(float(wbytes), pf.prefetch_per_thread * threads)
    s.pre_rt = float(pf.pre_rt or 0)
    s.poll_rt = float(pf.poll_rt)
    s.poll_gap_rt = float(pf.poll_gap_rt)
    s.prefetch = prefetch
    s.used_before_poll = pf.used_before_poll_per_thread > 0
    s.lead_rt, s.par_rt, s.tail_rt = float(pf.lead_rt), float(pf.par_rt), float(pf.tail_rt)
    s.instrs = float(pf.tail_instrs)
    s.issue = float(pf.instructions)
    s.fences, s.invalidations = pf.sync.fences, pf.sync.l1_invalidations
    s.barriers, s.atomics = pf.sync.barriers, float(pf.waited_atomics)
    s.l2_next_rt = float(pf.l2_prefetch_rt or 0) if pf.l2_prefetches else -1.0
    s.l2_next_at_end = pf.l2_prefetch_at_end
    s.post_rt, s.post_instrs = float(pf.post_signal_rt), float(pf.post_signal_instrs)
    s.claim_waited = pf.claim_waited
    in_flight = [pf.in_flight_per_thread * threads] if pf.in_flight_per_thread else []
    streams_w = bool(pf.weight_opcodes) and wbytes > prefetch
    stream_kv = False
    ctrl = float(pf.ctrl_loads)
    body = pf.body or ""
    for outer, region in pf.loops:
        for lf in nest(code, outer):
            trips = code.trips(lf, ev)
            if trips == 0:
                continue
            trips = 1 if trips is None else trips  # unknown (the facts say so): once
            s.issue += trips * len(lf.own)
            it = code.loop_path(lf, ev, body)
            rt = it["round_trips_per_iteration"]
            sy = it["sync"]  # per iteration; a loop's atomics are the body's own (none waited on in practice)
            s.fences += trips * sy["fences"]
            s.invalidations += trips * sy["l1_invalidations"]
            s.barriers += trips * sy["barriers"]
            ctrl += trips * sum(1 for n in lf.own if n in code.ctrl_loads)
            if lf.weight_loads:
                in_flight.append(it["weight_in_flight_per_thread"] * threads)
                s.serial_rt += trips * max(0, rt - 1)
                streams_w = True
            elif lf.loop.header == pf.kv_loop:
                in_flight.append(it["global_in_flight_per_thread"] * threads)
                s.serial_rt += trips * max(0, rt - 1)
                stream_kv = True
            elif region in ("lead", "pre"):
                s.lead_l2 += trips * rt
            elif region in ("par", "stream"):
                s.serial_rt += trips * rt
            else:
                s.tail_rt += trips * rt
                s.instrs += trips * len(lf.own)
    s.stream = (wbytes - prefetch if streams_w else 0.0) + (kvbytes if stream_kv else 0.0)
    s.stream_l2 = stream_kv and not streams_w and kv_in_l2
    s.in_flight = max(in_flight, default=0.0)
    priced = (wbytes == 0 or streams_w or prefetch >= wbytes) and (kvbytes == 0 or stream_kv)
    if not priced:  # bytes the path shows no load for: streamed at the per-SM limit, and counted
        s.stream = wbytes - prefetch + kvbytes
    return s, priced, ctrl


def _weight_opcodes(code: KernelCode, ev: Any, pf: PathFacts) -> dict[str, int]:
    """Weight-load opcodes on the task's path: its straight-line code once, each loop that runs
    for the task per iteration (the masked fallback streams its weights in a loop)."""
    out = dict(pf.weight_opcodes)
    for outer, _ in pf.loops:
        for lf in nest(code, outer):
            if lf.weight_loads and code.trips(lf, ev) != 0:
                for k, v in code.loop_path(lf, ev, pf.body or "")["weight_opcodes"].items():
                    out[k] = out.get(k, 0) + v
    return out


@dataclass
class Prediction:
    target: str
    context: int
    us: dict[str, float]  # case -> µs per decode token
    floor_us: dict[str, float]  # case -> bytes per step / HBM bandwidth
    bytes_per_step: int
    roofline_bytes: int | None  # the manifest's roofline at the nearest context it lists, for comparison
    per_op: dict[str, dict[str, float]]  # central: tasks, busy µs, mean task µs, polling µs, share
    sms: dict[str, Any]  # central: idle and polling µs per SM (min / median / max), busy share
    critical: dict[str, Any]  # central: the critical path
    hbm_utilization: float  # central: HBM bytes / (step x bandwidth)
    classes: list[dict[str, Any]]  # path classes: body, variants, tasks, sample task, path facts
    unpriced_tasks: int
    ctrl_loads_per_step: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(code: KernelCode, tables: TableFacts, man: dict[str, Any], context: int) -> Prediction:
    """µs per decode token (low / central / high), the floor and the simulation's breakdown."""
    target = code.target
    central = params_for(target, "central")
    shapes, info = task_shapes(code, tables, context, central.l2_mb)
    grid = int(code.info.get("grid") or man["targets"][target].get("grid") or central.sms)
    warps = max(1, (code.params.threads or 256) // 32)
    overlapped = bool(code.src.claim.get("overlapped"))
    nbytes = tables.traffic["decode"].total
    us, floor = {}, {}
    res: SimResult | None = None
    for case in CASES:
        lp = params_for(target, case)
        r = simulate(shapes, sim_params(lp, grid, warps, overlapped))
        us[case] = round(r.step_us, 1)
        floor[case] = round(nbytes / (lp.hbm_gbs * 1e3), 2)
        if case == "central":
            res = r
    assert res is not None
    busy_total = sum(res.busy_us) or 1.0
    per_op = {}
    for op, d in sorted(res.per_op.items()):
        name = OP_NAMES[op] if 0 <= op < len(OP_NAMES) else str(op)
        per_op[name] = {"tasks": d["tasks"], "busy_us": round(d["busy_us"], 1),
                        "mean_task_us": round(d["busy_us"] / max(d["tasks"], 1), 2),
                        "polling_us": round(d["polling_us"], 1), "share_of_busy": round(d["busy_us"] / busy_total, 3)}
    span = res.step_us - central.launch_us
    idle = [span - b for b in res.busy_us]
    sms = {"idle_us": _stats(idle), "polling_us": _stats(res.polling_us),
           "busy_share": round(busy_total / (span * len(res.busy_us)), 3) if span > 0 else 0.0}
    crit = dict(res.critical)
    chain = crit.pop("tasks")
    crit["signal_hops"] = sum(1 for k in chain if res.times[k].wait_by >= 0)
    crit["levels"] = len({shapes[k].level for k in chain})
    crit["ops"] = {OP_NAMES[o] if 0 <= o < len(OP_NAMES) else str(o): n for o, n in crit.get("ops", {}).items()}
    crit["terms_us"] = _chain_terms([shapes[k] for k in chain], sim_params(central, grid, warps, overlapped),
                                    crit["signal_hops"])
    roof = man["targets"][target].get("roofline", {})
    rb = roof.get(f"bytes_at_{context}") or roof.get(f"bytes_at_{context + 1}")
    classes = [{"body": body, "op": OP_NAMES[shapes[c["sample_task"]].op], "variants": list(var), "tasks": c["tasks"],
                "sample_task": c["sample_task"], "weight_bytes": c["weight_bytes"],
                "weight_opcodes": c["weight_opcodes"], "in_flight_bytes": round(c["shape"].in_flight), "prefetch_bytes": round(c["shape"].prefetch),
                "l2_prefetch_next": c["path"].l2_prefetches > 0,
                "l2_prefetch_bytes_per_thread": c["path"].l2_prefetch_bytes_per_thread,
                "l2_prefetch_at_end": c["path"].l2_prefetch_at_end,
                "fences": c["shape"].fences, "l1_invalidations": c["shape"].invalidations,
                "instructions": round(c["shape"].issue),
                # per thread: the path's instructions over the weight bytes each thread loads
                "instructions_per_weight_byte": round(c["shape"].issue * warps * 32 / c["weight_bytes"], 2)
                if c["weight_bytes"] else None,
                "path": c["path"].as_dict()} for (body, var), c in info.classes.items()]
    return Prediction(target, context, us, floor, int(nbytes), int(rb) if rb else None, per_op, sms, crit,
                      round(res.hbm_bytes / max(span, 1e-9) / (central.hbm_gbs * 1e3), 3), classes, info.unpriced,
                      info.ctrl_loads_per_step)


def _chain_terms(chain: list[TaskShape], p: SimParams, hops: int) -> dict[str, float]:
    """The fixed terms the critical path's tasks pay after their waits, summed over the chain
    (µs, central): what a level costs beyond streaming, term by term."""
    t = {"signal_to_poll": hops * p.sig,
         "poll_round_trips": sum(len(s.waits) for s in chain) * p.l2,
         "l2_round_trips_after_wait": sum(s.lead_rt + s.lead_l2 + s.par_rt + s.tail_rt + s.serial_rt for s in chain) * p.l2,
         "release_fences": sum(s.fences for s in chain) * p.fence,
         "waited_atomics": sum(s.atomics for s in chain) * p.atomic,
         "barriers": sum(s.barriers for s in chain) * p.barrier,
         "math_after_stream": sum(s.instrs for s in chain) * p.instr,
         "l1_invalidations": sum(s.invalidations for s in chain) * p.inval}
    return {k: round(v, 1) for k, v in t.items()}


def _stats(v: list[float]) -> dict[str, float]:
    return {"min": round(min(v, default=0.0), 1), "median": round(statistics.median(v or [0.0]), 1),
            "max": round(max(v, default=0.0), 1)}
