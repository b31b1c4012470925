"""Fit the latency model's calibrated terms on the measured H200 runs (docs/kernel-model.md,
"Calibration"): builds (or reuses) the measured models' h200 bundles, then runs the fit.

    python bench/calibrate_model.py                 # fit, print the residuals and leave-one-out
    python bench/calibrate_model.py --write         # and store the terms in calibration.json

The bundles are bench/kernel_stats.py's (the bench's shape-faithful random-weight models, max_seq
512, cached in --cache); the measurements and their sources are compiler/kernelmodel/calibration.json's.
On a 2-core machine: the tiny model ~1 min, SmolLM2 ~10 min, the Llama-1B shape ~20 min and ~12 GB
to build; the task shapes (the SASS paths) a few minutes each, cached; the fit and its
leave-one-out refits ~10 min.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
MODELS = ("tiny", "smollm2-135m", "llama-1b-shape")


def main() -> int:
    from kernel_stats import MAX_SEQ, build

    from zlc.kernelmodel.calibrate import main as fit_main

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("ZLC_CACHE_DIR", Path.home() / ".cache" / "zlc"))
                    / "kernel-stats")
    ap.add_argument("--write", action="store_true")
    ap.add_argument("--no-loo", action="store_true")
    a = ap.parse_args()
    bundles = [build(m, a.cache, ("h200",), MAX_SEQ) for m in a.models]
    argv = [x for b in bundles for x in ("--bundle", str(b))] + ["--cache", str(a.cache / "calibrate")]
    return fit_main(argv + (["--write"] if a.write else []) + (["--no-loo"] if a.no_loo else []))


if __name__ == "__main__":
    raise SystemExit(main())
