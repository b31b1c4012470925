"""The kernel-statistics report of a bundle (`zlc inspect BUNDLE --kernel`, bench/kernel_stats.py):
per GPU target the static facts of both kernels (`static_facts`), the task tables' levels and bytes
(`task_tables`), the per-task path facts and the decode latency prediction (`latency`),
and the verdict on each target for the machine code and the predicted latency, with the model term
that stops it where it is missed.
Rendered as JSON, rich tables or the markdown of docs/performance.md.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from zlc.bundle import read_manifest

from .calibration import calibration
from .latency import LatencyParams, Prediction, params_for, predict
from .sass_map import KernelStatsError, kernel_info
from .static_facts import KernelFacts, cubin_facts
from .task_tables import TableFacts, table_facts
from .triton_source import KernelSource

__all__ = ["bundle_report", "checks", "render_markdown", "render_text", "rich_tables", "summary_rows"]

IN_FLIGHT_TARGET = 24 * 1024  # bytes of weights in flight per SM in the matrix-vector path
FLOOR_RATIO_TARGET = 1.6  # predicted SmolLM2 decode <= 1.6x the HBM floor
LEVELS_PER_LAYER_TARGET = 4
WIDE = ("LDG.E.128", "LDG.E.ENL2.128", "LDG.E.LTC128B.128", "LDG.E.EL.128", "LDG.E.128.CONSTANT")


def bundle_report(bundle: Path, targets: list[str] | None = None, context: int | None = None) -> dict[str, Any]:
    """Facts, prediction and target checks for every GPU target of a bundle (JSON-ready)."""
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
                           "layers": man["model"].get("layers"), "context": ctx, "weights": man["dtype"]["weights"],
                           "format_version": man.get("format_version"), "targets": {}}
    for t in chosen:
        tiling = man["targets"][t]["tiling"]
        if tiling not in tables:
            tables[tiling] = table_facts(bundle, tiling, src, man, ctx)
        tf = tables[tiling]
        dec = cubin_facts(bundle, t, man, src, kernel="decode")
        pre_info = kernel_info(man, t, "prefill")
        pre = None
        if pre_info is not None and pre_info.get("cubin") != man["targets"][t]["cubin"]:
            pre = cubin_facts(bundle, t, man, src, kernel="prefill")
        pred = predict(dec.code, tf, man, ctx)
        entry = {"tiling": tiling, "decode_kernel": dec.as_dict(),
                 "prefill_kernel": pre.as_dict() if pre is not None else "the decode kernel (one kernel, format 1)",
                 "prediction": pred.as_dict()}
        entry["checks"] = checks(out, tf, dec, pre, pred)
        out["targets"][t] = entry
    cal = calibration()  # which model priced the predictions (docs/kernel-model.md, "Calibration")
    out["latency_model"] = ("calibrated: " + ", ".join(f"{k} {v:g}" for k, v in vars(cal).items() if k != "source")
                            if cal is not None else "uncalibrated")
    out["tables"] = {k: v.as_dict() for k, v in tables.items()}
    for v in out["tables"].values():
        for m in v["modes"].values():
            m.pop("weight_bytes_per_level", None)
            m.pop("tasks_per_level_all", None)
    return out


def _matvec(pred: Prediction) -> list[dict[str, Any]]:
    """The path classes of the matrix-vector tasks (linear ops that read weights)."""
    return [c for c in pred.classes if c["op"] == "linear" and c["weight_bytes"] > 0]


def checks(rep: dict[str, Any], tf: TableFacts, dec: KernelFacts, pre: KernelFacts | None,
           pred: Prediction) -> list[dict[str, Any]]:
    """The machine-code and latency targets for one GPU target: fact, value, met (True / False), and
    where missed the term that stops it with its number."""
    out: list[dict[str, Any]] = []

    def add(target: str, value: str, met: bool, stopped_by: str = "") -> None:
        out.append({"target": target, "value": value, "met": bool(met), "stopped_by": "" if met else stopped_by})

    mv = _matvec(pred)
    ops: dict[str, int] = {}
    for c in mv:
        for k, v in c["weight_opcodes"].items():
            ops[k] = ops.get(k, 0) + v * c["tasks"]
    narrow = sorted(k for k in ops if k not in WIDE)
    add("weights read with 128-bit loads", ", ".join(f"{k}" for k in sorted(ops)) or "no weight loads found",
        bool(ops) and not narrow,
        f"{', '.join(narrow)} on the path of {sum(c['tasks'] for c in mv if set(c['weight_opcodes']) & set(narrow))}"
        " tasks (shapes the specialized bodies do not cover: the masked fallback)" if narrow else "no weight load found")
    per_sm = dec.programs_per_sm
    found = [c for c in mv if c["weight_opcodes"]]
    lost = sum(c["tasks"] for c in mv if not c["weight_opcodes"])
    flights = [(c["in_flight_bytes"] * per_sm, c) for c in found]
    lo = min(flights, key=lambda fc: fc[0], default=(0, None))
    note = f" ({lost} tasks: no weight load found on their path, unpriced)" if lost else ""
    why = ""
    if lo[1] is not None:
        whole = lo[0] >= lo[1]["weight_bytes"]
        why = (f"{_kb(lo[0])} in {'/'.join(lo[1]['variants']) or lo[1]['body']}: " + (
            f"a task's whole weight slice is {_kb(lo[1]['weight_bytes'])}; more in flight needs wider tasks" if whole
            else f"of its {_kb(lo[1]['weight_bytes'])} slice (the body's prefetch depth)"))
    add(f">= {IN_FLIGHT_TARGET // 1024} KB of weights in flight per SM (matrix-vector)",
        ("/".join(_kb(f) for f in sorted({f for f, _ in flights})) or "-") + note,
        bool(flights) and lo[0] >= IN_FLIGHT_TARGET, why or "no weight load found on any matrix-vector path")
    # Dequantizing bodies issue more instructions per weight byte: the SM's schedulers must keep
    # up with its share of HBM (per thread: ipc x clock x 32 lanes over the SM's bytes per cycle).
    lpc = params_for(dec.target, "central")
    budget = 32 * lpc.ipc * lpc.clock_ghz / (lpc.hbm_gbs / max(lpc.sms, 1))
    ipb = sorted(((c["instructions_per_weight_byte"], c) for c in mv if c.get("instructions_per_weight_byte")),
                 key=lambda ic: -ic[0])
    worst = ipb[0] if ipb else (0.0, None)
    add(f"instructions per weight byte <= the issue budget ({budget:.1f}: ipc x clock x 32 / HBM bytes per SM)",
        ", ".join(f"{'/'.join(c['variants']) or c['body']} {v:g}" for v, c in ipb[:4]) or "-",
        bool(ipb) and worst[0] <= budget,
        f"{worst[0]:g} in {'/'.join(worst[1]['variants']) or worst[1]['body']}: its stream is issue-bound"
        if worst[1] is not None else "no weight load found on any matrix-vector path")
    early = [c for c in mv if c["path"]["prefetch_per_thread"] > 0 and c["path"]["polls"] > 0]
    waited = [c for c in mv if c["path"]["polls"] > 0]
    add("weights requested before the task waits", f"{sum(c['tasks'] for c in early)} of "
        f"{sum(c['tasks'] for c in waited)} waiting matrix-vector tasks",
        bool(waited) and len(early) == len(waited),
        ", ".join('/'.join(c['variants']) or str(c['body']) for c in waited if c not in early) + " poll(s) first")
    fences = max((c["path"]["sync"]["fences"] for c in pred.classes), default=0)
    inval = max((c["path"]["sync"]["l1_invalidations"] for c in pred.classes), default=0)
    add("<= 1 fence and no whole-L1 invalidation per task", f"{fences:g} fences, {inval:g} L1 invalidations (most on "
        "any task's path)", fences <= 1 and inval == 0, f"{fences:g} fences / {inval:g} CCTL.IVALL on a task's path")
    dm = tf.modes["decode"]
    lpl = dm.get("levels_per_layer")
    layers = rep.get("layers") or 0
    lp = params_for(dec.target, "central")
    add(f"<= {LEVELS_PER_LAYER_TARGET} dependency levels per layer", f"{dm['levels']} levels, "
        f"{lpl if lpl is not None else '?'} per layer and {dm.get('levels_outside_layers', 0)} outside the layers "
        "(embedding, LM head, argmax)", lpl is not None and lpl <= LEVELS_PER_LAYER_TARGET,
        f"{dm['levels'] - dm.get('levels_outside_layers', 0)} layer levels / {layers} layers; at {lp.sync_us:g} µs per signal hop that alone is "
        f"{dm['levels'] * lp.sync_us:.0f} µs per step")
    ctrl_loop = {k: v for k, v in dec.ctrl_loads.items() if k != "launch"}
    add("mapped CTRL read once per launch", f"{dec.ctrl_loads.get('launch', 0)} loads at launch; in the task loop: "
        + (", ".join(f"{k} {v}" for k, v in ctrl_loop.items()) or "none"),
        set(ctrl_loop) <= {"op_embed"},  # the step's token ids: one task per step reads them
        "CTRL loads in " + ", ".join(ctrl_loop))
    spills = dec.spill_bytes + (pre.spill_bytes if pre is not None else 0)
    add("no spills", f"decode {dec.spill_bytes} B, prefill {pre.spill_bytes if pre is not None else '-'} B", spills == 0,
        f"{spills} spill bytes")
    if pre is not None:
        mma = sum(b.mma_loops for b in pre.bodies.values() if b.op == "linear")
        add("prefill keeps tensor-core tiles", f"{mma} MMA loops in the prefill kernel's linear body", mma > 0,
            "no MMA loop in the prefill linear body")
    add(f"predicted decode <= {FLOOR_RATIO_TARGET}x the HBM floor", *_floor_verdict(pred, lp, int(dm["levels"])))
    return out


def min_level_us(lp: LatencyParams) -> float:
    """The least a dependency level can cost on the critical path, whatever its tasks do, in the
    simulation's own terms: the producer's release fence, the signal reaching a poller that is
    already spinning (the wait resolves t_sig after the producer's finish), and the one L2 round
    trip that brings the first activation after the wait (the weights may all be in flight before
    it), and the calibrated fixed cost of its task. A step with L levels takes at least L times
    this, plus the launch."""
    return lp.fence_us + lp.sync_us + lp.l2_us + lp.task_us


def _floor_verdict(pred: Prediction, lp: LatencyParams, step_levels: int) -> tuple[str, bool, str]:
    """Predicted vs floor, and where missed the critical path's terms: streaming, and the fixed
    cost per level term by term (the largest first), against the budget the target leaves; and
    whether any kernel with the step's `step_levels` dependency levels could meet it (the
    sync-only bound: its longest chain of waits has that many tasks, whatever path binds)."""
    launch = lp.launch_us
    ratio = pred.us["central"] / max(pred.floor_us["central"], 1e-9)
    crit = pred.critical
    us = crit.get("us", {})
    lv = max(int(crit.get("levels", 0)), 1)
    budget = FLOOR_RATIO_TARGET * pred.floor_us["central"]
    terms = sorted(crit.get("terms_us", {}).items(), key=lambda kv: -kv[1])
    fixed = sum(v for _, v in terms)
    why = (f"critical path {crit.get('length', 0)} tasks over {lv} levels: streaming {us.get('stream', 0):,.0f} µs, "
           f"per-level latency {fixed / lv:.2f} µs x {lv} levels = {fixed:,.0f} µs ("
           + ", ".join(f"{k.replace('_', ' ')} {v / lv:.2f}" for k, v in terms if v / lv >= 0.01)
           + f" µs per level), launch {launch:g} µs; the target leaves {budget:,.0f} µs "
           f"({budget / lv:.2f} µs per level if nothing streamed)")
    least = min_level_us(lp)
    bound = launch + step_levels * least
    if bound > budget:  # no work per level, no overlap lost, and still over: the level count stops it
        why += (f"; unreachable at {step_levels} levels: even at the least a level costs ({least:.2f} µs: release fence "
                f"{lp.fence_us:g}, signal to poll {lp.sync_us:g}, first activation {lp.l2_us:g}) the levels "
                f"alone take {bound:,.0f} µs; {FLOOR_RATIO_TARGET}x the floor allows at most "
                f"{max(0, int((budget - launch) // least))} levels")
    return (f"{pred.us['central']:,.1f} µs vs floor {pred.floor_us['central']:,.1f} µs: {ratio:.1f}x",
            ratio <= FLOOR_RATIO_TARGET, why)


# ---- rendering ----------------------------------------------------------------------------------

def summary_rows(rep: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    """(fact, {target: value}) rows of the headline table."""
    rows: list[tuple[str, dict[str, str]]] = []
    tg = rep["targets"]

    def row(name: str, fn: Any) -> None:
        vals = {}
        for t, r in tg.items():
            try:
                vals[t] = str(fn(r))
            except (KeyError, TypeError, ValueError, StopIteration, ZeroDivisionError, AttributeError):
                vals[t] = "?"
        rows.append((name, vals))

    def mv(r: dict[str, Any]) -> list[dict[str, Any]]:
        return [c for c in r["prediction"]["classes"] if c["op"] == "linear" and c["weight_bytes"] > 0]

    def pre(r: dict[str, Any], key: str) -> Any:
        p = r["prefill_kernel"]
        return p[key] if isinstance(p, dict) else r["decode_kernel"][key]

    row("arch", lambda r: r["decode_kernel"]["arch"])
    row("registers decode / prefill kernel", lambda r: f"{r['decode_kernel']['registers']} / {pre(r, 'registers')}")
    row("spill bytes decode / prefill", lambda r: f"{r['decode_kernel']['spill_bytes']} / {pre(r, 'spill_bytes')}")
    row("threads, programs per SM", lambda r: f"{r['decode_kernel']['threads_per_program']}, "
        f"{r['decode_kernel']['programs_per_sm']}")
    row("matrix-vector variants (tasks)", lambda r: ", ".join(
        f"{'/'.join(c['variants']) or c['body']} ({c['tasks']})" for c in mv(r)))
    row("weight loads on the matrix-vector path", lambda r: ", ".join(sorted(
        {k for c in mv(r) for k in c["weight_opcodes"]})))
    row("weight bytes in flight per SM (matrix-vector)", lambda r: "/".join(
        _kb(b) for b in sorted({c["in_flight_bytes"] * r["decode_kernel"]["programs_per_sm"] for c in mv(r)})))
    row("weights requested before the wait (per SM)", lambda r: "/".join(
        _kb(b) for b in sorted({c["prefetch_bytes"] for c in mv(r)})))
    row("L2 round trips: before the weight request / before the poll", lambda r: "/".join(sorted(
        {f"{c['path']['pre_rt']}" for c in mv(r)})) + " / " + "/".join(sorted({str(c["path"]["poll_rt"]) for c in mv(r)})))
    row("per task: fences / L1 inval. / waited atomics / barriers (most)", lambda r: _sync(r["prediction"]["classes"]))
    for mode in ("decode", "prefill"):
        row(f"{mode}: tasks, levels (per layer), tasks per level min/median",
            lambda r, m=mode: _levels(rep["tables"][r["tiling"]]["modes"][m]))
    row("decode DRAM bytes per step", lambda r: _kb(r["prediction"]["bytes_per_step"]))
    row("predicted µs per token (low/central/high)", lambda r: "/".join(f"{v:,.1f}" for v in r["prediction"]["us"].values()))
    row("HBM floor µs (low/central/high)", lambda r: "/".join(f"{v:,.1f}" for v in r["prediction"]["floor_us"].values()))
    row("predicted / floor (central)",
        lambda r: f"{r['prediction']['us']['central'] / r['prediction']['floor_us']['central']:.1f}x")
    row("critical path: tasks, levels; sync / fixed / stream µs", lambda r: _crit(r["prediction"]["critical"]))
    row("machine-code and latency targets met", lambda r: f"{sum(c['met'] for c in r['checks'])} of {len(r['checks'])}")
    return rows


def _kb(b: float) -> str:
    return f"{b / 1024:,.0f} KB" if b >= 10240 else f"{b / 1024:.1f} KB" if b >= 1024 else f"{b:.0f} B"


def _sync(classes: list[dict[str, Any]]) -> str:
    keys = ("fences", "l1_invalidations")
    most = {k: max((c["path"]["sync"][k] for c in classes), default=0) for k in (*keys, "barriers")}
    at = max((c["path"]["waited_atomics"] for c in classes), default=0)
    return f"{most['fences']:g} / {most['l1_invalidations']:g} / {at:g} / {most['barriers']:g}"


def _levels(m: dict[str, Any]) -> str:
    t = m["tasks_per_level"]
    per = f" ({m['levels_per_layer']:g} per layer + {m.get('levels_outside_layers', 0)})" \
        if m.get("levels_per_layer") is not None else ""
    return f"{m['tasks']:,}, {m['levels']}{per}, {t['min']}/{t['median']:g}"


def _crit(c: dict[str, Any]) -> str:
    us = c.get("us", {})
    return f"{c.get('length', 0)}, {c.get('levels', 0)}; {us.get('sync', 0):,.1f} / {us.get('fixed', 0):,.1f} / " \
           f"{us.get('stream', 0):,.1f}"


def rich_tables(rep: dict[str, Any]) -> list[Any]:
    """The report as rich renderables: the headline table, per target its path classes and the
    checks of the machine-code and latency targets."""
    from rich.markup import escape
    from rich.table import Table

    out: list[Any] = []
    t = Table(title=f"{rep['model']}: megakernel machine code (max_seq {rep['max_seq']}, decode context "
                    f"{rep['context']}, {rep['weights']} weights)", title_justify="left")
    t.add_column("fact")
    for tg in rep["targets"]:
        t.add_column(tg)
    for name, vals in summary_rows(rep):
        t.add_row(escape(name), *(escape(vals[tg]) for tg in rep["targets"]))
    out.append(t)
    for tg, r in rep["targets"].items():
        b = Table(title=f"{tg}: decode task paths (one per op body and variant)", title_justify="left")
        for c in ("body", "variant", "tasks", "weight loads", "in flight / SM", "before wait", "RT pre/poll/lead/tail",
                  "fences", "mean task µs"):
            b.add_column(c)
        per_op = r["prediction"]["per_op"]
        for c in r["prediction"]["classes"]:
            p = c["path"]
            b.add_row(escape(str(c["body"])), escape("/".join(c["variants"]) or "-"), str(c["tasks"]),
                      escape(", ".join(f"{k} x{v}" for k, v in c["weight_opcodes"].items()) or "-"),
                      _kb(c["in_flight_bytes"]), _kb(c["prefetch_bytes"]),
                      f"{p['pre_rt'] if p['pre_rt'] is not None else '-'}/{p['poll_rt']}/{p['lead_rt']}/{p['tail_rt']}",
                      f"{p['sync']['fences']:g}", str(per_op.get(c["op"], {}).get("mean_task_us", "-")))
        out.append(b)
        k = Table(title=f"{tg}: machine-code and latency targets", title_justify="left")
        for c in ("target", "value", "met", "stopped by"):
            k.add_column(c)
        for c in r["checks"]:
            k.add_row(escape(c["target"]), escape(c["value"]), "yes" if c["met"] else "no", escape(c["stopped_by"]))
        out.append(k)
    return out


def render_text(rep: dict[str, Any]) -> str:
    from rich.console import Console

    con = Console(record=True, width=200, file=io.StringIO())
    for item in rich_tables(rep):
        con.print(item)
    return con.export_text()


def render_markdown(reports: list[dict[str, Any]], command: str = "") -> str:
    """The headline table (a column per model and target), then per column the targets missed
    and what stops them."""
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
    lines.append("")
    for rep, tg in cols:
        missed = [c for c in rep["targets"][tg]["checks"] if not c["met"]]
        lines.append(f"- **{rep['model']} {tg}**: " + ("every target met" if not missed else "; ".join(
            f"{c['target']}: no ({c['value']}; {c['stopped_by']})" for c in missed)))
    if command:
        lines += ["", f"Produced by `{command}` (decode context {reports[0]['context'] if reports else '?'})."]
    return "\n".join(lines)
