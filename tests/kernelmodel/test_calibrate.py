"""The latency model's calibration (zlc.kernelmodel.calibrate / calibration): the fit recovers the
terms that made a set of simulated measurements, the fitted terms reach the model through
`params_for` on every GPU target, and the committed fit meets its stated aims on the measured
runs (docs/kernel-model.md, "Calibration")."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.bundle import OP_LINEAR, OP_NAMES
from zlc.kernelmodel.calibrate import START, Case, evaluate, fit, leave_one_out, nelder_mead
from zlc.kernelmodel.calibration import Calibration, calibration, load
from zlc.kernelmodel.event_sim import TaskShape
from zlc.kernelmodel.latency import CASES, params_for, sim_params


@settings(max_examples=25, deadline=None)
@given(st.lists(st.floats(-3, 3), min_size=2, max_size=4), st.floats(0.5, 4.0))
def test_simplex_finds_a_quadratic_minimum(center: list[float], scale: float) -> None:
    x, v = nelder_mead(lambda p: sum(scale * (a - c) ** 2 for a, c in zip(p, center, strict=True)),
                       [0.0] * len(center), iters=2000, tol=1e-14)
    assert v < 1e-8
    assert all(abs(a - c) < 1e-3 for a, c in zip(x, center, strict=True))


def _layers(levels: int, width: int, seed: int) -> list[TaskShape]:
    """A decode-like table: `levels` levels of `width` Linear tasks, each waiting for the whole
    level before it, streaming 32-64 KB with 32 KB in flight."""
    rnd = random.Random(seed)
    out: list[TaskShape] = []
    prev: list[int] = []
    for _ in range(levels):
        cur = []
        for _ in range(width):
            out.append(TaskShape(op=OP_LINEAR, waits=[list(prev)] if prev else [], pre_rt=2, poll_rt=3,
                                 prefetch=16384, lead_rt=1, stream=rnd.uniform(16384, 49152), in_flight=32768,
                                 tail_rt=2, instrs=40, fences=1, barriers=4))
            cur.append(len(out) - 1)
        prev = cur
    return out


def _cases() -> dict[tuple[str, str, int], Case]:
    base = sim_params(params_for("h200", "central", calibrated=False), 16, 8, True)
    return {("wide", "h200", 0): Case("wide", "h200", 0, _layers(3, 24, 1), base),
            ("narrow", "h200", 0): Case("narrow", "h200", 0, _layers(12, 2, 2), base),
            ("deep", "h200", 0): Case("deep", "h200", 0, _layers(16, 6, 3), base)}


def test_the_fit_recovers_the_terms_that_made_the_measurements() -> None:
    """Measurements simulated with known terms (a step and the Linear tasks' busy time per table):
    the fit from the default start (the launch given, as the measured one is) reproduces every one
    of them, and leave-one-out predicts each from the others."""
    cases = _cases()
    truth = Calibration(launch_us=15.0, task_cycles=4000.0, sync_rt=6.0, dram_x=2.5)
    meas = []
    for name, _, _ in cases:
        meas.append({"id": f"{name} step", "model": name, "target": "h200", "context": 0,
                     "quantity": "decode_step_us", "value": 0.0})
        meas.append({"id": f"{name} linear", "model": name, "target": "h200", "context": 0,
                     "quantity": "op_busy_us", "op": OP_NAMES[OP_LINEAR], "value": 0.0})
    for m, v in zip(meas, evaluate(truth, meas, cases), strict=True):
        m["value"] = v
    f = fit(meas, cases, replace(START, launch_us=truth.launch_us), iters=150)  # the launch is measured
    assert max(abs(r) for r in f.residuals) < 0.03, f.residuals
    assert max(abs(r) for r in leave_one_out(meas, cases, f, iters=40)) < 0.06


def test_the_committed_fit_meets_its_aims_on_the_measured_runs() -> None:
    """calibration.json (written by `python -m zlc.kernelmodel.calibrate --write`): every fitted
    decode step within +-15 %, and the replicate runs' steps too; fewer fitted terms than
    measurements; every residual and leave-one-out residual recorded (the busy times per task are
    not all within +-25 %: docs/kernel-model.md, "Calibration", says which and why)."""
    data = load()
    fitd = data["fit"]
    assert fitd is not None
    fitted = [m for m in data["measurements"] if m.get("fit", True)]
    assert len(fitd["terms"]) - 1 < len(fitted)  # launch_us is measured, not fitted
    res = fitd["residuals"]
    assert set(res) == {m["id"] for m in fitted}
    assert set(fitd["leave_one_out"]) == set(res)
    for m in fitted:
        if m["quantity"] == "decode_step_us":
            assert abs(res[m["id"]]) <= 0.15, m["id"]
    for m in data["measurements"]:
        if m["quantity"] == "decode_step_us" and "run)" in m["id"]:  # replicates: the same kernel, another run
            assert abs(fitd["not_fitted_residuals"][m["id"]]) <= 0.15, m["id"]
    for m in data["measurements"]:  # every entry names the report it was read from
        assert m["source"].startswith("docs/device-runs/")


@pytest.mark.parametrize("target", ["h200", "h100", "a10"])
def test_params_carry_the_fitted_terms_through_each_targets_clock_and_l2(target: str) -> None:
    cal = calibration()
    assert cal is not None
    for case in CASES:
        raw, lp = params_for(target, case, calibrated=False), params_for(target, case)
        assert lp.calibrated and not raw.calibrated
        assert lp.task_us == pytest.approx(cal.task_cycles / (raw.clock_ghz * 1e3))
        assert lp.sync_us == pytest.approx(cal.sync_rt * raw.l2_us)
        assert lp.dram_us == pytest.approx(cal.dram_x * raw.dram_us) and lp.launch_us == cal.launch_us
        assert (lp.hbm_gbs, lp.l2_us, lp.clock_ghz) == (raw.hbm_gbs, raw.l2_us, raw.clock_ghz)
        p = sim_params(lp, 132, 8, True)
        assert (p.task, p.dram, p.sig) == (lp.task_us, lp.dram_us, lp.sync_us)
    # the slow end of every range stays the slow end
    us = [params_for(target, c).task_us + params_for(target, c).sync_us + params_for(target, c).dram_us for c in CASES]
    assert us == sorted(us) and all(math.isfinite(u) for u in us)
