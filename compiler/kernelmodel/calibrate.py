"""The latency model fitted on the measured device runs: `python -m zlc.kernelmodel.calibrate`
(bench/calibrate_model.py builds the bundles first). docs/kernel-model.md, "Calibration".

The measurements and their sources are the `measurements` of calibration.json. Each names a model
(the bench's shape-faithful random-weight models, bench/device_bench.py), a GPU target, a quantity
and the decode context it was measured at:

    decode_step_us   the decode step's median wall time (launch, kernel, sync): the simulated
                     step (its launch term is the host's too)
    op_busy_us       a trace's mean busy time per task of one op kind: from the later of the task's
                     start and its last dependency's signal to its own signal (runtime/trace.py),
                     read off the simulation's timeline the same way

The fit runs the event simulation (event_sim.py) on each bundle's decode task shapes
(latency.task_shapes, the machine code's paths; cached) with the target's central parameters and a
candidate calibration (calibration.py's terms: the launch measured, the other three fitted), and minimizes the sum of squared log
residuals (Nelder-Mead over the terms' logarithms). Leave-one-out: each measurement predicted by the fit on the others. `--write` stores the
terms, residuals and leave-one-out residuals in calibration.json, which `params_for` then applies.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from zlc.bundle import OP_NAMES, read_manifest

from .calibration import DATA, Calibration, load
from .event_sim import SimParams, SimResult, TaskShape, simulate
from .latency import params_for, sim_params, task_shapes
from .sass_map import KernelCode
from .task_tables import table_facts
from .triton_source import KernelSource

__all__ = ["Case", "Fit", "case_inputs", "fit", "leave_one_out", "nelder_mead", "predicted", "main"]

NAMES = ("launch_us", "task_cycles", "sync_rt", "dram_x")
START = Calibration(launch_us=20.0, task_cycles=2000.0, sync_rt=2.0, dram_x=2.0)


@dataclass
class Case:
    """One bundle's decode step on one target: what the simulation needs (no calibration in it)."""

    model: str
    target: str
    context: int
    shapes: list[TaskShape]
    base: SimParams  # the target's central parameters, uncalibrated


def case_inputs(bundle: Path, target: str, context: int, cache: Path | None = None) -> Case:
    """The decode task shapes of `bundle` on `target` at `context` (pickled into `cache`, keyed by
    the manifest, the cubin and the context: the SASS analysis takes minutes on large models)."""
    bundle = Path(bundle)
    man = read_manifest(bundle)
    key = hashlib.sha256(json.dumps([man, target, context], sort_keys=True, default=str).encode()
                         + (bundle / man["targets"][target]["cubin"]).read_bytes()).hexdigest()[:20]
    pk = cache / f"{man['model']['name']}-{target}-{context}-{key}.pkl" if cache else None
    if pk is not None and pk.exists():
        shapes, grid, warps, overlapped = pickle.loads(pk.read_bytes())
    else:
        src = KernelSource((bundle / man["kernel"]["source"]).read_text(), man["kernel"]["entry"])
        tf = table_facts(bundle, man["targets"][target]["tiling"], src, man, context)
        code = KernelCode(bundle, target, man, src, kernel="decode")
        lp = params_for(target, "central", calibrated=False)
        shapes, _ = task_shapes(code, tf, context, lp.l2_mb)
        grid = int(code.info.get("grid") or man["targets"][target].get("grid") or lp.sms)
        warps = max(1, (code.params.threads or 256) // 32)
        overlapped = bool(code.src.claim.get("overlapped"))
        if pk is not None:
            pk.parent.mkdir(parents=True, exist_ok=True)
            pk.write_bytes(pickle.dumps((shapes, grid, warps, overlapped)))
    base = sim_params(params_for(target, "central", calibrated=False), grid, warps, overlapped)
    return Case(str(man["model"]["name"]), target, context, shapes, base)


def calibrated_params(base: SimParams, cal: Calibration, l2_us: float, clock_ghz: float) -> SimParams:
    t = cal.terms(l2_us, clock_ghz, base.dram)
    return replace(base, launch=t["launch_us"], task=t["task_us"], sig=t["sync_us"], dram=t["dram_us"])


def predicted(m: dict[str, Any], case: Case, res: SimResult) -> float:
    """The simulation's value of measurement `m` (see the module docstring)."""
    q = m["quantity"]
    if q == "decode_step_us":
        return res.step_us
    if q == "op_busy_us":
        tm, busy, n = res.times, 0.0, 0
        for s, x in zip(case.shapes, tm, strict=True):
            if OP_NAMES[s.op] != m["op"]:
                continue
            deps = max((tm[j].finish for g in s.waits for j in g), default=-math.inf)
            busy += x.finish - max(x.start, deps)
            n += 1
        return busy / max(n, 1)
    raise ValueError(f"measurement {m['id']}: unknown quantity '{q}' (decode_step_us, op_busy_us)")


def _clock_l2(target: str) -> tuple[float, float]:
    lp = params_for(target, "central", calibrated=False)
    return lp.l2_us, lp.clock_ghz


def evaluate(cal: Calibration, meas: Sequence[dict[str, Any]], cases: dict[tuple[str, str, int], Case]) -> list[float]:
    """Predicted value of each measurement under `cal` (one simulation per case)."""
    runs: dict[tuple[str, str, int], SimResult] = {}
    out = []
    for m in meas:
        k = (m["model"], m["target"], int(m["context"]))
        c = cases[k]
        if k not in runs:
            runs[k] = simulate(c.shapes, calibrated_params(c.base, cal, *_clock_l2(c.target)))
        out.append(predicted(m, c, runs[k]))
    return out


def _to_cal(x: Sequence[float], launch_us: float) -> Calibration:
    return Calibration(launch_us, math.exp(x[0]), math.exp(x[1]), math.exp(x[2]))


def _from_cal(c: Calibration) -> list[float]:
    return [math.log(c.task_cycles), math.log(c.sync_rt), math.log(c.dram_x)]


def nelder_mead(f: Callable[[list[float]], float], x0: Sequence[float], step: float = 0.3, iters: int = 200,
                tol: float = 1e-6) -> tuple[list[float], float]:
    """The textbook simplex (reflect 1, expand 2, contract 0.5, shrink 0.5): derivative-free,
    which the simulation's piecewise-linear, list-scheduled step needs."""
    n = len(x0)
    pts = [list(x0)] + [[x0[j] + (step if j == i else 0.0) for j in range(n)] for i in range(n)]
    vals = [f(p) for p in pts]
    for _ in range(iters):
        order = sorted(range(n + 1), key=lambda i: vals[i])
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < tol:
            break
        cen = [sum(p[j] for p in pts[:-1]) / n for j in range(n)]
        refl = [cen[j] + (cen[j] - pts[-1][j]) for j in range(n)]
        fr = f(refl)
        if fr < vals[0]:
            exp = [cen[j] + 2 * (cen[j] - pts[-1][j]) for j in range(n)]
            fe = f(exp)
            pts[-1], vals[-1] = (exp, fe) if fe < fr else (refl, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = refl, fr
        else:
            con = [cen[j] + 0.5 * (pts[-1][j] - cen[j]) for j in range(n)]
            fc = f(con)
            if fc < vals[-1]:
                pts[-1], vals[-1] = con, fc
            else:
                pts = [pts[0]] + [[pts[0][j] + 0.5 * (p[j] - pts[0][j]) for j in range(n)] for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
    i = min(range(n + 1), key=lambda i: vals[i])
    return pts[i], vals[i]


@dataclass
class Fit:
    cal: Calibration
    residuals: list[float]  # predicted / measured - 1, per measurement
    loss: float


def fit(meas: Sequence[dict[str, Any]], cases: dict[tuple[str, str, int], Case], start: Calibration = START,
        iters: int = 200) -> Fit:
    """The calibration that minimizes the squared log residuals over `meas` (the launch term is
    measured, not fitted: `start.launch_us` is kept)."""
    def loss(x: list[float]) -> float:
        pred = evaluate(_to_cal(x, start.launch_us), meas, cases)
        return sum(float(m.get("weight", 1.0)) * math.log(p / float(m["value"])) ** 2 for m, p in zip(meas, pred, strict=True))

    x, v = nelder_mead(loss, _from_cal(start), iters=iters)
    cal = _to_cal(x, start.launch_us)
    pred = evaluate(cal, meas, cases)
    return Fit(cal, [p / float(m["value"]) - 1 for m, p in zip(meas, pred, strict=True)], v)


_SHARED: dict[str, Any] = {}


def _loo_one(i: int) -> float:
    meas, cases, start, iters = _SHARED["args"]
    rest = [x for j, x in enumerate(meas) if j != i]
    f = fit(rest, cases, start, iters)
    return evaluate(f.cal, [meas[i]], cases)[0] / float(meas[i]["value"]) - 1


def leave_one_out(meas: Sequence[dict[str, Any]], cases: dict[tuple[str, str, int], Case], full: Fit,
                  iters: int = 80, jobs: int = 1) -> list[float]:
    """Each measurement's residual under the fit on all the others (started from the full fit;
    `jobs` refits at once in forked processes, which share the task shapes)."""
    _SHARED["args"] = (list(meas), cases, full.cal, iters)
    if jobs <= 1:
        return [_loo_one(i) for i in range(len(meas))]
    import multiprocessing as mp

    with mp.get_context("fork").Pool(jobs) as pool:
        return pool.map(_loo_one, range(len(meas)))


def _table(meas: Sequence[dict[str, Any]], fitted: Fit, loo: list[float] | None) -> str:
    lines = ["| measurement | measured | calibrated model | residual | leave-one-out |", "|---|---|---|---|---|"]
    for m, r, lo in zip(meas, fitted.residuals, loo or [math.nan] * len(meas), strict=True):
        v = float(m["value"])
        lines.append(f"| {m['id']} | {v:,.2f} | {v * (1 + r):,.2f} | {100 * r:+.1f}% | "
                     + ("-" if math.isnan(lo) else f"{100 * lo:+.1f}%") + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zlc.kernelmodel.calibrate", description=__doc__.split("\n")[0])
    ap.add_argument("--bundle", type=Path, action="append", required=True,
                    help="a bundle of a measured model (its manifest's model name picks the measurements)")
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "zlc" / "calibrate")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--loo-iters", type=int, default=40, help="simplex steps of each leave-one-out refit")
    ap.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits")
    ap.add_argument("--jobs", type=int, default=1, help="leave-one-out refits at once")
    ap.add_argument("--start", type=float, nargs=4, default=None, metavar=NAMES,
                    help="the simplex's starting terms (default: a physically plausible guess)")
    ap.add_argument("--write", action="store_true", help="store the fit in the data file")
    a = ap.parse_args(argv)
    data = load(a.data)
    names = {read_manifest(b)["model"]["name"]: b for b in a.bundle}
    every = [m for m in data["measurements"] if m["model"] in names]
    meas = [m for m in every if m.get("fit", True)]
    if not meas:
        print(f"no measurement of {', '.join(names)} in {a.data}", file=sys.stderr)
        return 2
    cases: dict[tuple[str, str, int], Case] = {}
    for m in every:
        k = (m["model"], m["target"], int(m["context"]))
        if k not in cases:
            print(f"  task shapes: {k[0]} {k[1]} context {k[2]}", file=sys.stderr, flush=True)
            cases[k] = case_inputs(names[m["model"]], m["target"], k[2], a.cache)
    launch = float(data["launch_us"]["value"])  # measured: the host's share of a step, see the data file
    start = Calibration(*a.start) if a.start else START
    f = fit(meas, cases, replace(start, launch_us=launch), iters=a.iters)
    loo = None if a.no_loo else leave_one_out(meas, cases, f, a.loo_iters, a.jobs)
    terms = {n: round(getattr(f.cal, n), 4) for n in NAMES}
    print(f"fitted on {len(meas)} measurements, {len(NAMES) - 1} terms (launch_us measured): "
          + ", ".join(f"{k} {v:g}" for k, v in terms.items()))
    print(_table(meas, f, loo))
    rest = [m for m in every if not m.get("fit", True)]
    checked = [p / float(m["value"]) - 1 for m, p in zip(rest, evaluate(f.cal, rest, cases), strict=True)]
    if rest:
        print("\nnot fitted (replicate runs, and figures no added term can reach; calibration.json says why):")
        print(_table(rest, Fit(f.cal, checked, 0.0), None))
    if a.write:
        data["fit"] = {"terms": terms, "fitted_on": ", ".join(sorted({m["source"].split(",")[0] for m in meas})),
                       "command": "python -m zlc.kernelmodel.calibrate " + " ".join(argv if argv is not None else sys.argv[1:]),
                       "residuals": {m["id"]: round(r, 4) for m, r in zip(meas, f.residuals, strict=True)},
                       "leave_one_out": None if loo is None else {m["id"]: round(r, 4) for m, r in zip(meas, loo, strict=True)},
                       "not_fitted_residuals": {m["id"]: round(r, 4) for m, r in zip(rest, checked, strict=True)}}
        a.data.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote the fit to {a.data}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
