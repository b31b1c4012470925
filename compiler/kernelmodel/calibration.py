"""The latency model's calibration: the terms fitted on the measured device runs
(docs/device-runs, fitted by `calibrate.py`; docs/kernel-model.md, "Calibration"), read from
`calibration.json` beside this module, and how they apply to a target's parameter ranges.

The fitted terms are stated in units that carry across GPU families, so a target without a
measurement takes them through its own physical parameters:

    launch_us      per step, host side: the launch, the kernel's exit and the host's sync (µs)
    task_cycles    a fixed cost every task pays before its signal (SM cycles: / the target's clock)
    sync_rt        signal -> poll, the per-level wait (L2 round trips: x the target's L2 latency)
    dram_x         the DRAM latency under the kernel's load, as a multiple of the target's unloaded
                   range: a stream's first byte, and by Little's law its rate (bytes in flight /
                   latency), both follow it
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["DATA", "Calibration", "calibration", "load"]

DATA = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class Calibration:
    launch_us: float
    task_cycles: float
    sync_rt: float
    dram_x: float
    source: str = ""  # which runs it was fitted on

    def terms(self, l2_us: float, clock_ghz: float, dram_us: float) -> dict[str, float]:
        """The terms in µs for a target's L2 latency, clock and DRAM latency (LatencyParams fields)."""
        return {"launch_us": self.launch_us, "task_us": self.task_cycles / (clock_ghz * 1e3),
                "sync_us": self.sync_rt * l2_us, "dram_us": self.dram_x * dram_us}


def load(path: Path = DATA) -> dict[str, Any]:
    return json.loads(path.read_text())


@lru_cache(maxsize=1)
def calibration() -> Calibration | None:
    """The fitted terms of calibration.json (None before a fit was written)."""
    fit = load().get("fit")
    if not fit:
        return None
    t = fit["terms"]
    return Calibration(float(t["launch_us"]), float(t["task_cycles"]), float(t["sync_rt"]), float(t["dram_x"]),
                       str(fit.get("fitted_on", "")))
