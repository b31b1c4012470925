"""The multi-row bodies' terms fitted on the measured prefill and batched steps (calibration.json,
`multirow`; docs/kernel-model.md, "Multi-row bodies"): `python -m zlc.kernelmodel.calibrate_multirow`
(bench/calibrate_model.py runs it after the decode fit).

No bundle is needed: the model shapes, the SASS facts per tiling (read off the prefill cubins by
`multirow.sass_facts`, recorded with the command that made them) and the measurements with their
sources are all in calibration.json. The decode terms (per-task cost, signal -> poll, the launch)
are the decode fit's, applied through `params_for` as for every other figure; the fit adds the
multi-row terms only and minimizes the weighted squared log residuals (Nelder-Mead over their
logarithms). Leave-one-out: each figure predicted by the fit on the others.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from .calibrate import nelder_mead
from .calibration import DATA, load
from .latency import params_for
from .multirow import BodyFacts, ModelShape, MultiRowTerms, Priced, batch_step, prefill

__all__ = ["MultiRowFit", "evaluate", "fit", "leave_one_out", "main", "predict"]

NAMES = tuple(f.name for f in fields(MultiRowTerms))
START = MultiRowTerms(kstep_rt=2.0, tile_dram_x=2.0, local_rt=0.5)


def predict(m: dict[str, Any], mr: dict[str, Any], terms: MultiRowTerms) -> Priced:
    """The model's value of measurement `m` (µs; a TTFT in ms is compared as ms by `evaluate`)."""
    shape = ModelShape(**mr["models"][m["model"]])
    facts = BodyFacts.from_dict(mr["sass"][m["tile"]])
    lp, raw = params_for(m["target"], "central"), params_for(m["target"], "central", calibrated=False).dram_us
    if m["quantity"] == "ttft_ms":
        return prefill(shape, facts, lp, terms, raw, int(m.get("tokens", 128)))
    if m["quantity"] == "batch_step_us":
        return batch_step(shape, facts, lp, terms, raw, int(m["batch"]), int(m["context"]))
    raise ValueError(f"measurement {m['id']}: unknown quantity '{m['quantity']}' (ttft_ms, batch_step_us)")


def value(m: dict[str, Any], p: Priced) -> float:
    return p.us / 1e3 if m["quantity"] == "ttft_ms" else p.us


def evaluate(terms: MultiRowTerms, meas: Sequence[dict[str, Any]], mr: dict[str, Any]) -> list[float]:
    return [value(m, predict(m, mr, terms)) for m in meas]


def _terms(x: Sequence[float], free: Sequence[str], base: MultiRowTerms) -> MultiRowTerms:
    kw = {f.name: getattr(base, f.name) for f in fields(MultiRowTerms)}
    kw.update({n: math.exp(v) for n, v in zip(free, x, strict=True)})
    return MultiRowTerms(**kw)


@dataclass
class MultiRowFit:
    terms: MultiRowTerms
    residuals: list[float]
    loss: float


def fit(meas: Sequence[dict[str, Any]], mr: dict[str, Any], free: Sequence[str] = NAMES,
        start: MultiRowTerms = START, iters: int = 400) -> MultiRowFit:
    """The terms in `free` that minimize the weighted squared log residuals over `meas`."""
    def loss(x: list[float]) -> float:
        pred = evaluate(_terms(x, free, start), meas, mr)
        return sum(float(m.get("weight", 1.0)) * math.log(p / float(m["value"])) ** 2 for m, p in zip(meas, pred, strict=True))

    x, v = nelder_mead(loss, [math.log(getattr(start, n)) for n in free], step=0.5, iters=iters, tol=1e-10)
    t = _terms(x, free, start)
    pred = evaluate(t, meas, mr)
    return MultiRowFit(t, [p / float(m["value"]) - 1 for m, p in zip(meas, pred, strict=True)], v)


def leave_one_out(meas: Sequence[dict[str, Any]], mr: dict[str, Any], full: MultiRowFit,
                  free: Sequence[str] = NAMES, iters: int = 40) -> list[float]:
    """Each figure's residual under the fit on the others (`iters` simplex steps from the full fit)."""
    out = []
    for i, m in enumerate(meas):
        f = fit([x for j, x in enumerate(meas) if j != i], mr, free, full.terms, iters=iters)
        out.append(evaluate(f.terms, [m], mr)[0] / float(m["value"]) - 1)
    return out


def table(meas: Sequence[dict[str, Any]], mr: dict[str, Any], terms: MultiRowTerms,
          loo: Sequence[float] | None = None) -> str:
    lines = ["| measurement (H200) | measured | calibrated model | residual | leave-one-out | limiting term |",
             "|---|---|---|---|---|---|"]
    for i, m in enumerate(meas):
        p = predict(m, mr, terms)
        v, mv = value(m, p), float(m["value"])
        lo = "-" if loo is None or math.isnan(loo[i]) else f"{100 * loo[i]:+.1f} %"
        lines.append(f"| {m['id']} | {mv:,.1f} | {v:,.1f} | {100 * (v / mv - 1):+.1f} % | {lo} | {p.limit} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zlc.kernelmodel.calibrate_multirow", description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--free", nargs="*", default=list(NAMES), choices=NAMES, help="the terms to fit (the rest: --start's)")
    ap.add_argument("--no-loo", action="store_true")
    ap.add_argument("--loo-iters", type=int, default=40, help="simplex steps of each leave-one-out refit")
    ap.add_argument("--write", action="store_true", help="store the fit in the data file")
    a = ap.parse_args(argv)
    data = load(a.data)
    mr = data["multirow"]
    meas = [m for m in mr["measurements"] if m.get("fit", True)]
    rest = [m for m in mr["measurements"] if not m.get("fit", True)]
    f = fit(meas, mr, a.free)
    loo = None if a.no_loo else leave_one_out(meas, mr, f, a.free, a.loo_iters)
    terms = {n: round(getattr(f.terms, n), 4) for n in NAMES}
    print(f"multi-row bodies: {len(a.free)} terms fitted on {len(meas)} figures: "
          + ", ".join(f"{k} {v:g}" for k, v in terms.items()))
    print(table(meas, mr, f.terms, loo))
    if rest:
        print("\nnot fitted (replicate runs; calibration.json says why):")
        print(table(rest, mr, f.terms))
    if a.write:
        why = (mr.get("fit") or {}).get("outside_25", {})
        every = list(zip(meas, f.residuals, strict=True)) + [
            (m, v / float(m["value"]) - 1) for m, v in zip(rest, evaluate(f.terms, rest, mr), strict=True)]
        mr["fit"] = {"terms": terms, "free": list(a.free),
                     "outside_25": {m["id"]: why.get(m["id"], "not explained yet: docs/kernel-model.md, Multi-row bodies")
                                    for m, r in every if abs(r) > 0.25},
                     "command": "python -m zlc.kernelmodel.calibrate_multirow " + " ".join(argv if argv is not None else sys.argv[1:]),
                     "residuals": {m["id"]: round(r, 4) for m, r in zip(meas, f.residuals, strict=True)},
                     "leave_one_out": None if loo is None else {m["id"]: round(r, 4) for m, r in zip(meas, loo, strict=True)},
                     "not_fitted_residuals": {m["id"]: round(v / float(m["value"]) - 1, 4)
                                              for m, v in zip(rest, evaluate(f.terms, rest, mr), strict=True)}}
        a.data.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote the fit to {a.data}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
