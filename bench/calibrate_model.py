"""Fit the latency model's calibrated terms on the measured H200 runs (docs/kernel-model.md,
"Calibration" and "Multi-row bodies"), and print every measured figure of the five runs in
docs/device-runs beside the calibrated model's and the residual:

    python bench/calibrate_model.py                 # decode fit (builds the bundles), multi-row fit
    python bench/calibrate_model.py --write         # and store both fits in calibration.json
    python bench/calibrate_model.py --no-decode     # the decode fit as recorded; the multi-row fit (~3 min)
    python bench/calibrate_model.py --sass-facts    # first re-read the multi-row loops' SASS facts per tiling

The decode fit runs the event simulation on the measured models' h200 bundles (bench/kernel_stats.py's:
the bench's shape-faithful random-weight models, max_seq 512, cached in --cache). On a 2-core
machine: the tiny model ~1 min, SmolLM2 ~10 min, the Llama-1B shape ~20 min and ~12 GB to build;
the task shapes (the SASS paths) a few minutes each, cached; the fit and its leave-one-out refits
~10 min. The multi-row fit needs no bundle (calibration.json holds the model shapes and the SASS
facts); --sass-facts compiles the tiny model's prefill kernel at each tiling of the tile sweep
(bench/device_bench.py VARIANTS, ~3-5 min each) and reads its loops (zlc.kernelmodel.multirow.sass_facts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
MODELS = ("tiny", "smollm2-135m", "llama-1b-shape")


def sass_facts(cache: Path) -> None:
    """The tiny model's prefill kernel at the default GPU tiling and each tile-sweep variant:
    its multi-row loops' facts into calibration.json (multirow.sass, keyed BLOCK_T x BLOCK_N x BLOCK_KD)."""
    from device_bench import VARIANTS
    from kernel_stats import MAX_SEQ, build

    import zlc.codegen.schedule as sched
    from zlc.bundle import read_manifest
    from zlc.kernelmodel.calibration import DATA, load
    from zlc.kernelmodel.multirow import sass_facts as facts_of
    from zlc.kernelmodel.sass_map import KernelCode

    plain = sched.tiling_for
    data = load()
    for tag, over in [("", {})] + list(VARIANTS.items()):
        def tiling_for(*a: object, _o: dict[str, int] = over, **kw: object) -> object:
            t = plain(*a, **kw)  # type: ignore[arg-type]
            return dataclasses.replace(t, **_o) if _o and t.grid > 0 and t.num_warps > 1 else t

        sched.tiling_for = tiling_for  # type: ignore[assignment]
        try:
            b = build("tiny", cache / (tag or "default"), ("h200",), MAX_SEQ)
        finally:
            sched.tiling_for = plain
        man = read_manifest(b)
        cx = man["tilings"][man["targets"]["h200"]["tiling"]]["constexprs"]
        f = facts_of(KernelCode(b, "h200", man, kernel="prefill"), cx)
        key = f"{f['block_t']}x{f['block_n']}x{f['block_kd']}"
        data["multirow"]["sass"][key] = f
        print(f"  sass facts {key}: {json.dumps(f)}", file=sys.stderr)
    DATA.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")


def recorded_decode() -> None:
    from zlc.kernelmodel.calibration import load

    d = load()
    fit = d["fit"]
    print(f"decode (recorded fit, {fit['command']}): " + ", ".join(f"{k} {v:g}" for k, v in fit["terms"].items()))
    print("| measurement (H200) | measured | calibrated model | residual | leave-one-out |\n|---|---|---|---|---|")
    res = {**fit["residuals"], **fit["not_fitted_residuals"]}
    for m in d["measurements"]:
        r, lo = res[m["id"]], (fit["leave_one_out"] or {}).get(m["id"])
        print(f"| {m['id']}{'' if m.get('fit', True) else ' (not fitted)'} | {m['value']:,.2f} | "
              f"{m['value'] * (1 + r):,.2f} | {100 * r:+.1f} % | {'-' if lo is None else f'{100 * lo:+.1f} %'} |")


def main() -> int:
    from zlc.kernelmodel.calibrate import main as fit_main
    from zlc.kernelmodel.calibrate_multirow import main as mr_main

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("ZLC_CACHE_DIR", Path.home() / ".cache" / "zlc"))
                    / "kernel-stats")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--no-loo", action="store_true")
    ap.add_argument("--no-decode", action="store_true", help="print the recorded decode fit instead of refitting it")
    ap.add_argument("--sass-facts", action="store_true", help="re-read the multi-row loops' SASS facts first")
    a = ap.parse_args()
    if a.sass_facts:
        sass_facts(a.cache / "tilings")
    if a.no_decode:
        recorded_decode()
    else:
        from kernel_stats import MAX_SEQ, build

        bundles = [build(m, a.cache, ("h200",), MAX_SEQ) for m in a.models]
        argv = [x for b in bundles for x in ("--bundle", str(b))] + ["--cache", str(a.cache / "calibrate")]
        rc = fit_main(argv + (["--write"] if a.write else []) + (["--no-loo"] if a.no_loo else []))
        if rc:
            return rc
    print()
    return mr_main((["--write"] if a.write else []) + (["--no-loo"] if a.no_loo else []))


if __name__ == "__main__":
    raise SystemExit(main())
