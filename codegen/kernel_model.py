"""The megakernel decode latency model: µs per token per GPU target (low / central / high), from
the machine-code facts (`kernel_stats`), the task tables (`kernel_tables`) and stated per-target
latency and bandwidth ranges. docs/kernel-model.md explains every term; this module is the code.

    task    = atomics x t_atomic + fences x t_fence + L1 invalidations x t_inval + barriers x t_bar
            + L2 x max(address chain, wait chain)                          # before the first loop
            + sum over the task's loops: trips x max(round trips per iteration x latency,
                                                     bytes per iteration / per-SM bandwidth)
    level   = max(list schedule of its tasks on the grid, its bytes / HBM bandwidth)
    step    = launch + sum of levels + (levels - 1) x t_sync

A loop that moves weights waits DRAM latency for its weight round trips and L2 latency for the
others (activations are written by other SMs moments before, so they sit in L2); a loop whose
trips grow with the context streams the KV cache (DRAM unless the cache fits in half the L2).
Per-SM bandwidth in a level is min(t_sm, HBM / active SMs). Little's law is the per-iteration
term: an SM that keeps B bytes in flight per DRAM latency L gets B / L.
"""

from __future__ import annotations

import heapq
import io
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from zlc.bundle import MODE_DECODE, OP_NAMES, read_manifest
from zlc.targets import get_target

from .kernel_source import KernelSource
from .kernel_stats import KernelStatsError, SyncCounts, TargetFacts, cubin_facts
from .kernel_tables import TableFacts, table_facts

__all__ = ["CASES", "LatencyParams", "LoopCost", "Prediction", "TaskCost", "bundle_report", "params_for", "predict",
           "render_markdown", "render_text", "rich_tables", "step_time", "summary_rows", "task_costs", "task_time"]

CASES = ("low", "central", "high")  # low: every range at its fast end


@dataclass(frozen=True)
class LatencyParams:
    """One case (low / central / high) of a target's ranges; times in µs, bandwidths in GB/s."""

    sms: int
    hbm_gbs: float  # measured device copy bandwidth (not the spec sheet)
    dram_us: float  # DRAM latency under load
    l2_us: float  # L2 hit round trip as an SM sees it
    atomic_us: float  # a global atomic whose result the task waits for (the queue claim, the signal)
    fence_us: float  # MEMBAR.GPU: outstanding stores acknowledged by L2
    inval_us: float  # CCTL.IVALL
    barrier_us: float  # BAR.SYNC of one program's warps
    sync_us: float  # a signal reaching L2 until the polling program sees it (between levels)
    launch_us: float  # per step: launch, and the last program's exit and counter reset
    sm_gbs: float  # most one SM pulls from L2/DRAM
    l2_mb: float


# Ranges per GPU (low = fast end, high = slow end). Sources: measured copy bandwidth of H100/H200
# SXM (~85-95 % of the 4.8 TB/s spec) and A10 GDDR6 (~500 of 600 GB/s); loaded DRAM latency and
# L2 hit latency from published microbenchmarks of Hopper / Ampere (~480-900 ns, ~150-450 ns);
# one fence or atomic about one L2 round trip, more under contention on the one queue counter.
_RANGES: dict[str, dict[str, tuple[float, float, float]]] = {
    "sm_90": {"hbm_gbs": (4500, 4300, 3900), "dram_us": (0.55, 0.7, 0.9), "l2_us": (0.2, 0.3, 0.45),
              "atomic_us": (0.3, 0.5, 0.9), "fence_us": (0.2, 0.4, 0.8), "inval_us": (0.01, 0.02, 0.05),
              "barrier_us": (0.01, 0.02, 0.04), "sync_us": (0.2, 0.35, 0.6), "launch_us": (2.0, 4.0, 8.0),
              "sm_gbs": (120, 100, 80)},
    "sm_8x": {"hbm_gbs": (550, 500, 450), "dram_us": (0.45, 0.6, 0.8), "l2_us": (0.15, 0.22, 0.35),
              "atomic_us": (0.25, 0.4, 0.8), "fence_us": (0.15, 0.3, 0.6), "inval_us": (0.01, 0.02, 0.05),
              "barrier_us": (0.01, 0.02, 0.04), "sync_us": (0.15, 0.3, 0.5), "launch_us": (2.0, 4.0, 8.0),
              "sm_gbs": (100, 90, 70)},
}
_L2_MB = {"a10": 6, "a100": 40, "l4": 48, "rtx3090": 6, "rtx4090": 72, "h100": 50, "h200": 50}
# targets measured against a different bandwidth than the family's reference part: scale it
_REFERENCE_GBS = {"sm_90": 4800.0, "sm_8x": 600.0}


def params_for(target: str, case: str) -> LatencyParams:
    """The `case` column of `target`'s ranges (SM count from zlc.targets)."""
    t = get_target(target)
    if not t.is_gpu:
        raise KernelStatsError(f"target '{target}' is not a GPU")
    fam = "sm_90" if (t.compute_capability or 0) >= 90 else "sm_8x"
    k = CASES.index(case)
    r = {name: v[k] for name, v in _RANGES[fam].items()}
    r["hbm_gbs"] *= (t.bandwidth_gbs or _REFERENCE_GBS[fam]) / _REFERENCE_GBS[fam]
    return LatencyParams(sms=t.sms, l2_mb=float(_L2_MB.get(t.name, 6)), **r)


@dataclass
class Prediction:
    target: str
    context: int
    us: dict[str, float]  # case -> µs per decode token
    floor_us: dict[str, float]  # case -> bytes per step / HBM bandwidth
    bytes_per_step: int
    terms: dict[str, float]  # central: where the time goes (µs)
    per_op: dict[str, dict[str, float]]  # central: op kind -> tasks, mean task µs

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _sync_cost(c: SyncCounts, p: LatencyParams) -> float:
    return c.atomics * p.atomic_us + c.fences * p.fence_us + c.l1_invalidations * p.inval_us \
        + c.barriers * p.barrier_us


@dataclass
class LoopCost:
    """One loop as one task runs it."""

    trips: int
    round_trips: int  # dependent global round trips per iteration
    before_weights: int  # of those, the ones before its weight loads issue (activations: L2)
    weight: bool  # it streams weights
    kv: bool  # its trips grow with the context: it streams the KV cache
    nbytes: float  # bytes it moves for the task
    in_flight: float  # bytes one SM keeps in flight in it (per thread x threads x programs per SM)


@dataclass
class TaskCost:
    op: int
    level: int
    sync: SyncCounts  # fences, L1 invalidations, atomics, barriers on its path
    chain: int  # dependent loads before its first loop (address chain, or up to its waits' polls)
    loops: list[LoopCost]
    nbytes: float  # bytes it must read from DRAM (weights + its KV share)


def task_time(t: TaskCost, p: LatencyParams, kv_in_l2: bool) -> tuple[float, dict[str, float]]:
    """µs of one task on one SM, split into fixed (sync instructions), chain and loops."""
    sm_bw = p.sm_gbs * 1e3  # bytes per µs
    fixed = _sync_cost(t.sync, p)
    chain = t.chain * p.l2_us
    loops = 0.0
    for lp in t.loops:
        if lp.weight and lp.in_flight > 0:  # Little's law: B bytes in flight per DRAM latency
            loops += lp.trips * lp.before_weights * p.l2_us + lp.nbytes / min(lp.in_flight / p.dram_us, sm_bw)
        elif lp.weight or lp.kv:
            lat = p.l2_us if lp.kv and kv_in_l2 else p.dram_us
            loops += max(lp.trips * lp.round_trips * lat, lp.nbytes / sm_bw)
        else:
            loops += lp.trips * lp.round_trips * p.l2_us
    return fixed + chain + loops, {"fixed": fixed, "chain": chain, "loops": loops}


def step_time(tasks: list[TaskCost], p: LatencyParams, grid: int, kv_in_l2: bool = False
              ) -> tuple[float, dict[str, float]]:
    """µs of one decode step: launch, then the levels in sequence, each the list schedule of its
    tasks (table order) on `grid` programs but no shorter than its bytes over HBM bandwidth, with
    one sync latency between consecutive levels."""
    by_level: dict[int, list[TaskCost]] = {}
    for t in tasks:
        by_level.setdefault(t.level, []).append(t)
    terms = {"launch": p.launch_us, "fixed": 0.0, "chain": 0.0, "loops": 0.0, "sync": 0.0, "level_bw_bound": 0.0}
    total = p.launch_us
    for lv in sorted(by_level):
        level = by_level[lv]
        heap = [0.0] * max(1, min(len(level), grid))
        parts = {"fixed": 0.0, "chain": 0.0, "loops": 0.0}
        for t in level:
            dt, part = task_time(t, p, kv_in_l2)
            heapq.heappush(heap, heapq.heappop(heap) + dt)
            for k in parts:
                parts[k] += part[k]
        span = max(heap)
        bound = sum(t.nbytes for t in level) / (p.hbm_gbs * 1e3)
        total += max(span, bound)
        work = sum(parts.values()) or 1.0
        for k in parts:  # the level's span, shared out like its tasks' time
            terms[k] += span * parts[k] / work
        terms["level_bw_bound"] += max(0.0, bound - span)
    terms["sync"] = (len(by_level) - 1) * p.sync_us
    return total + terms["sync"], terms


def task_costs(facts: TargetFacts, tables: TableFacts, context: int, kv_bytes: int) -> list[TaskCost]:
    """The model's inputs for every decode task: its loops' trips evaluated for it, its path
    through each loop and the body (the `if`s it takes), its waits and signals."""
    code, src, tabs = facts.code, facts.code.src, tables.tables
    ev = tabs.evaluator(MODE_DECODE, context)
    ev2 = tabs.evaluator(MODE_DECODE, context * 2 + 64)  # trips that change with the context: KV
    rows = tabs.rows(MODE_DECODE)
    last_of_group = set({r["signal"]: i for i, r in enumerate(rows) if r["parent"] >= 0}.values())
    per_sm = max(1, min(facts.occupancy["programs_per_sm"] or 1, -(-facts.grid // max(get_target(facts.target).sms, 1))))
    sync_cache: dict[tuple[Any, ...], SyncCounts] = {}
    out: list[TaskCost] = []
    pending_kv: list[tuple[TaskCost, LoopCost]] = []
    for i, r in enumerate(rows):
        body = src.dispatch.get(r["op"])
        ev.set_task(i)
        ev2.set_task(i)
        sync = facts.per_task.plus(facts.per_wait, len(r["waits"]))
        if i in last_of_group:
            sync = sync.plus(facts.per_group)
        loops: list[LoopCost] = []
        first_depth = None
        items = []
        for lf in facts.bodies[body].loops if body in facts.bodies else []:
            trips = code.trips(lf, ev)
            if trips == 0:
                continue
            trips = 1 if trips is None else trips  # unknown (the facts say so): counted once
            path = code.loop_path(lf, ev, body)  # type: ignore[arg-type]
            if first_depth is None:
                first_depth = lf.first_load_depth or 0
            items.append((trips, path, code.trips(lf, ev2) not in (trips, None)))
            sync = sync.plus(SyncCounts(**path["sync"]), trips)
        wsum = sum(tr * pa["weight_bytes_per_thread"] for tr, pa, _ in items if pa["weight_loads"]) or 1
        wbytes = tables.weight_bytes["decode"][i]
        for trips, path, kv in items:
            w = path["weight_loads"] > 0
            nbytes = wbytes * trips * path["weight_bytes_per_thread"] / wsum if w else \
                trips * path["global_bytes_per_thread"] * facts.threads * per_sm
            loops.append(LoopCost(trips, path["round_trips_per_iteration"], path["round_trips_before_weights"], w,
                                  kv and not w, nbytes, path["weight_in_flight_per_thread"] * facts.threads * per_sm))
        if body and body in code.body_blocks:
            flat = code.straight_path(body, ev)
            if flat.get("weight_loads"):  # weights loaded outside any loop (unrolled): priced as one pass
                loops.append(LoopCost(1, flat["round_trips_per_iteration"], flat["round_trips_before_weights"], True,
                                      False, wbytes if not any(lp.weight for lp in loops) else 0.0,
                                      flat["weight_in_flight_per_thread"] * facts.threads * per_sm))
            key = (body, tuple(tuple(code.successors(b, ev, body)) for b in sorted(code.body_blocks.get(body, ()))
                               if code.branch(b) is not None))
            if key not in sync_cache:
                sync_cache[key] = code.body_sync(body, ev)
            sync = sync.plus(sync_cache[key])
        chain = max(first_depth or 0, (facts.wait_round_trips or 0) if r["waits"] else 0)
        t = TaskCost(r["op"], tables.levels["decode"][i], sync, chain, loops, float(wbytes))
        pending_kv += [(t, lp) for lp in loops if lp.kv]
        out.append(t)
    for t, lp in pending_kv:  # the KV cache bytes of the step, shared by the loops that stream it
        lp.nbytes = kv_bytes / len(pending_kv)
        t.nbytes += lp.nbytes
    return out


def predict(facts: TargetFacts, tables: TableFacts, man: dict[str, Any], context: int) -> Prediction:
    """µs per decode token (low / central / high) and the HBM floor, for one target."""
    roof = man["targets"][facts.target].get("roofline", {})
    kv = int(roof.get("kv_bytes_per_token", 0)) * context
    tasks = task_costs(facts, tables, context, kv)
    us, floor, terms = {}, {}, {}
    nbytes = tables.modes["decode"]["weight_bytes"] + kv
    for case in CASES:
        p = params_for(facts.target, case)
        us[case], parts = step_time(tasks, p, facts.grid, kv_in_l2=kv <= p.l2_mb * 1e6 / 2)
        floor[case] = nbytes / (p.hbm_gbs * 1e3)
        if case == "central":
            terms = {k: round(v, 1) for k, v in parts.items()}
    p = params_for(facts.target, "central")
    per_op: dict[str, dict[str, float]] = {}
    for t in tasks:
        name = OP_NAMES[t.op] if t.op < len(OP_NAMES) else str(t.op)
        d = per_op.setdefault(name, {"tasks": 0, "us": 0.0})
        d["tasks"] += 1
        d["us"] += task_time(t, p, kv <= p.l2_mb * 1e6 / 2)[0]
    for d in per_op.values():
        d["mean_task_us"] = round(d.pop("us") / d["tasks"], 2)
    return Prediction(facts.target, context, {k: round(v, 1) for k, v in us.items()},
                      {k: round(v, 3) for k, v in floor.items()}, nbytes, terms, per_op)


# ---- the report ---------------------------------------------------------------------------------

def bundle_report(bundle: Path, targets: list[str] | None = None, context: int | None = None) -> dict[str, Any]:
    """Facts and prediction for every GPU target of a bundle (JSON-ready)."""
    bundle = Path(bundle)
    man = read_manifest(bundle)
    gpu = [t for t, i in man["targets"].items() if "cubin" in i]
    if not gpu:
        raise KernelStatsError(f"{bundle} has no GPU target (compiled for {', '.join(man['targets'])}): no machine "
                               "code to read; compile it with a GPU target, e.g. --target h200")
    chosen = targets or gpu
    missing = [t for t in chosen if t not in gpu]
    if missing:
        raise KernelStatsError(f"{bundle} has no cubin for {', '.join(missing)} (has: {', '.join(gpu)})")
    for need in [man["kernel"]["source"], *{man["tilings"][man["targets"][t]["tiling"]]["tables"] for t in chosen}]:
        if not (bundle / need).is_file():
            raise KernelStatsError(f"{bundle}: {need} is missing (a slim device copy?); the kernel statistics need "
                                   "the manifest, kernel.py, the tables and the cubins")
    src = KernelSource((bundle / man["kernel"]["source"]).read_text(), man["kernel"]["entry"])
    ctx = context or int(man["model"]["max_seq"])
    tables: dict[str, TableFacts] = {}
    out: dict[str, Any] = {"bundle": str(bundle), "model": man["model"]["name"], "max_seq": man["model"]["max_seq"],
                           "context": ctx, "weights": man["dtype"]["weights"], "targets": {}}
    for t in chosen:
        tiling = man["targets"][t]["tiling"]
        if tiling not in tables:
            tables[tiling] = table_facts(bundle, tiling, src, man)
        tf = tables[tiling]
        facts = cubin_facts(bundle, t, man, evaluator=tf.tables.sampler(MODE_DECODE, ctx), src=src)
        pred = predict(facts, tf, man, ctx)
        out["targets"][t] = {"facts": facts.as_dict(), "prediction": pred.as_dict(), "tiling": tiling}
    out["tables"] = {k: v.as_dict() for k, v in tables.items()}
    for v in out["tables"].values():
        for m in v["modes"].values():
            m.pop("weight_bytes_per_level", None)
    return out


def summary_rows(rep: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """(fact, {target: value}) rows of the headline table."""
    rows: list[tuple[str, dict[str, str]]] = []
    tg = rep["targets"]

    def row(name: str, fn: Any) -> None:
        vals = {}
        for t, r in tg.items():
            try:
                vals[t] = str(fn(r))
            except (KeyError, TypeError, ValueError, StopIteration, ZeroDivisionError):
                vals[t] = "?"
        rows.append((name, vals))

    def lin(r: dict[str, Any]) -> dict[str, Any]:
        return next(b["decode"] for b in r["facts"]["bodies"].values() if b["op"] == "linear")

    row("arch", lambda r: r["facts"]["arch"])
    row("registers / spill bytes", lambda r: f"{r['facts']['registers']} / {r['facts']['spill_bytes']}")
    row("threads, programs and warps per SM", lambda r: f"{r['facts']['threads_per_program']}, "
        f"{r['facts']['occupancy']['programs_per_sm']}, {r['facts']['occupancy']['warps_per_sm']}")
    row("weight loads per thread per main-loop iteration (linear; all paths)",
        lambda r: ", ".join(f"{k} x{v}" for k, v in lin(r)["weight_load_opcodes"].items())
        + " (" + ", ".join(f"x{v}" for v in lin(r)["weight_load_opcodes_all_paths"].values()) + ")")
    row("weight bytes in flight per SM", lambda r: _kb(lin(r)["weight_in_flight_per_thread"]
                                                       * r["facts"]["threads_per_program"]
                                                       * r["facts"]["occupancy"]["programs_per_sm"]))
    row("dependent round trips before the first weight byte",
        lambda r: f"1 atomic + {lin(r)['address_round_trips']} loads (claim -> row -> descriptor); "
                  f"then {lin(r)['serial_round_trips_before']} in serial loops "
                  f"({', '.join(lin(r)['serial_loops_before']) or 'none'}) and "
                  f"{lin(r)['round_trips_in_iteration_before_weights']} in the iteration")
    row("round trips per main-loop iteration", lambda r: lin(r)["round_trips_per_iteration"])
    row("per task (1 wait): fences / L1 inval. / atomics / barriers", lambda r: _sync1(r["facts"]["task_loop"]))
    row("+ a group's last task", lambda r: _sync0(r["facts"]["task_loop"]["per_group_completion"]))
    for mode in ("decode", "prefill"):
        row(f"{mode}: tasks, levels, tasks per level min/median/max",
            lambda r, m=mode: _levels(rep["tables"][r["tiling"]]["modes"][m]))
    row("decode weight bytes per level (min/median/max)",
        lambda r: "/".join(_kb(v) for v in rep["tables"][r["tiling"]]["modes"]["decode"]
                           ["weight_bytes_per_level_stats"].values()))
    row("predicted µs per token (low/central/high)", lambda r: "/".join(f"{v:,.0f}" for v in r["prediction"]["us"].values()))
    row("HBM floor µs (bytes per step / bandwidth)", lambda r: "/".join(f"{v:,.1f}" for v in
                                                                        r["prediction"]["floor_us"].values()))
    row("predicted / floor (central)", lambda r: f"{r['prediction']['us']['central'] / r['prediction']['floor_us']['central']:.1f}x")
    return rows


def _kb(b: float) -> str:
    return f"{b / 1024:,.0f} KB" if b >= 10240 else f"{b / 1024:.1f} KB" if b >= 1024 else f"{b:.0f} B"


def _sync0(c: dict[str, float]) -> str:
    return f"{c['fences']:g} / {c['l1_invalidations']:g} / {c['atomics']:g} / {c['barriers']:g}"


def _sync1(tl: dict[str, Any]) -> str:
    a, w = tl["per_task"], tl["per_wait"]
    return _sync0({k: a[k] + w[k] for k in a})


def _levels(m: dict[str, Any]) -> str:
    t = m["tasks_per_level"]
    return f"{m['tasks']:,}, {m['levels']}, {t['min']}/{t['median']:g}/{t['max']}"


def rich_tables(rep: dict[str, Any]) -> list[Any]:
    """The report as rich renderables: the headline table, then per target its op bodies."""
    from rich.table import Table
    from rich.text import Text

    out: list[Any] = []
    t = Table(title=f"{rep['model']}: megakernel machine code (max_seq {rep['max_seq']}, decode context "
                    f"{rep['context']}, {rep['weights']} weights)", title_justify="left")
    t.add_column("fact")
    for tg in rep["targets"]:
        t.add_column(tg)
    for name, vals in summary_rows(rep):
        t.add_row(name, *(vals[tg] for tg in rep["targets"]))
    out.append(t)
    for tg, r in rep["targets"].items():
        b = Table(title=f"{tg}: op bodies on the decode path (first task of each kind)", title_justify="left")
        for c in ("body", "live regs", "main loop", "weight loads / it.", "in flight / thread", "RT / it.",
                  "address RT", "serial RT", "mean task µs"):
            b.add_column(c)
        per_op = r["prediction"]["per_op"]
        for name, bf in r["facts"]["bodies"].items():
            d = bf["decode"]
            b.add_row(name, str(bf["max_live_registers"] or "n/a"), d.get("main_loop", "-"),
                      str(d.get("weight_loads_per_iteration", "-")), f"{d.get('weight_in_flight_per_thread', '-')}",
                      str(d.get("round_trips_per_iteration", "-")), str(d.get("address_round_trips", "-")),
                      str(d.get("serial_round_trips_before", "-")),
                      str(per_op.get(bf["op"], {}).get("mean_task_us", "-")))
        out.append(b)
        out.append(Text(f"{tg} central terms (µs): " + ", ".join(f"{k} {v:,.1f}" for k, v in
                                                                r["prediction"]["terms"].items())))
    return out


def render_text(rep: dict[str, Any]) -> str:
    from rich.console import Console

    con = Console(record=True, width=160, file=io.StringIO())
    for item in rich_tables(rep):
        con.print(item)
    return con.export_text()


def render_markdown(reports: list[dict[str, Any]], command: str = "") -> str:
    cols = [(rep, tg) for rep in reports for tg in rep["targets"]]
    head = "| fact | " + " | ".join(f"{rep['model']} {tg}" for rep, tg in cols) + " |"
    lines = [head, "|---|" + "---|" * len(cols)]
    rows: dict[str, dict[tuple[str, str], str]] = {}
    order: list[str] = []
    for rep in reports:
        for name, vals in summary_rows(rep):
            if name not in rows:
                rows[name] = {}
                order.append(name)
            for tg, v in vals.items():
                rows[name][(rep["model"], tg)] = v
    for name in order:
        lines.append(f"| {name} | " + " | ".join(rows[name].get((rep["model"], tg), "") for rep, tg in cols) + " |")
    if command:
        lines += ["", f"Produced by `{command}` (decode context {reports[0]['context'] if reports else '?'})."]
    return "\n".join(lines)

