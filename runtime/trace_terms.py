"""Each traced task's time split into the terms the latency model prices (docs/kernel-model.md,
"Calibration"), from the trace build's per-task stamps (`trace.STAMP_WORDS`):

    claim       start -> the claim's result (the next task's index) has arrived
    descriptor  -> the task row's words have arrived
    wait        -> its waits passed: stamped where the dispatch waits before the body; the decode
                   bodies that wait themselves (after requesting their first weights) are not
                   stamped, and their wait ends when the last task they depend on had signalled
                   (inferred, as `trace.analyze` does), so their weight prefetch counts as wait
    body        -> the body's loads and stores issued: the weight stream and the compute after the
                   waits (one term: the bodies carry no stamp between them)
    signal      -> the end: the release fence and the signal's atomics

`split` gives the terms per task; `summarize` their means per op kind and per dependency level;
`format_terms` the text a device run prints beside `trace.format_report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .trace import TERMS, TableTask, Trace, producers

__all__ = ["TermSummary", "format_terms", "levels", "split", "summarize"]


def levels(table: Sequence[TableTask]) -> list[int]:
    """Dependency level of every task: 1 + the deepest task whose signal it waits for."""
    prod = producers(table)
    out = [0] * len(table)
    for t in table:
        out[t.index] = 1 + max((out[j] for ev, _ in t.waits for j in prod.get(ev, ()) if j < t.index), default=0)
    return out


def split(table: Sequence[TableTask], trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(terms, stamped): per task the TERMS in the trace's unit (n x 5, NaN for a task without a
    record), and whether its wait's end was stamped (else inferred from its producers' ends)."""
    n = len(table)
    if trace.stamps is None or trace.stamps.shape[0] != n:
        raise ValueError("the trace has no per-task stamps (a trace build from before STAMP_WORDS)")
    s, e, st = trace.start, trace.end, trace.stamps
    prod = producers(table)
    out = np.full((n, len(TERMS)), np.nan)
    stamped = st[:, 2] >= 0
    for t in table:
        i = t.index
        if not trace.recorded[i]:
            continue
        claim, desc, body = int(st[i, 0]), int(st[i, 1]), int(st[i, 3])
        if stamped[i]:
            waited = int(st[i, 2])
        else:
            deps = [int(e[j]) for ev, _ in t.waits for j in prod.get(ev, ()) if trace.recorded[j]]
            waited = min(max([desc, *(d - int(s[i]) for d in deps)]), body)
        # the stamps are read in this order on the task's path: each term is the step between two
        marks = [0, claim, max(desc, claim), max(waited, desc, claim), max(body, waited, desc, claim), int(e[i] - s[i])]
        out[i] = np.diff(np.maximum.accumulate(np.array(marks, dtype=np.float64)))
    return out, stamped


@dataclass
class TermSummary:
    key: str  # op kind or "level N"
    tasks: int
    mean: dict[str, float]  # term -> mean per task (trace unit)
    stamped_waits: int


def summarize(table: Sequence[TableTask], trace: Trace) -> tuple[list[TermSummary], list[TermSummary]]:
    """Mean terms per op kind, and per dependency level (a level's tasks of every kind)."""
    terms, stamped = split(table, trace)
    lv = levels(table)

    def group(keys: list[str]) -> list[TermSummary]:
        out = []
        for k in dict.fromkeys(keys):
            idx = [i for i, x in enumerate(keys) if x == k and not np.isnan(terms[i, 0])]
            if idx:
                m = terms[idx].mean(axis=0)
                out.append(TermSummary(k, len(idx), dict(zip(TERMS, m.tolist(), strict=True)), int(stamped[idx].sum())))
        return out

    return (group([t.kind for t in table]),
            sorted(group([f"level {x}" for x in lv]), key=lambda g: int(g.key.split()[1])))


def format_terms(table: Sequence[TableTask], trace: Trace, *, level_rows: int = 12) -> str:
    """Per op kind and per level, the mean µs (or ticks) of each term per task."""
    u = "µs" if trace.unit == "ns" else "ticks"
    scale = 1e-3 if trace.unit == "ns" else 1.0
    kinds, lvls = summarize(table, trace)
    head = f"  {'':<14}{'tasks':>7}" + "".join(f"{t:>12}" for t in TERMS) + f"{'waits stamped':>15}"

    def row(g: TermSummary) -> str:
        return (f"  {g.key:<14}{g.tasks:>7}" + "".join(f"{g.mean[t] * scale:>12.2f}" for t in TERMS)
                + f"{g.stamped_waits:>15}")

    lines = [f"time per task by term ({u}, mean; wait unstamped = until the last dependency's signal):", head,
             *(row(g) for g in kinds), "", "per dependency level:", head]
    shown: list[TermSummary | None] = (list(lvls) if len(lvls) <= level_rows
                                       else [*lvls[:level_rows // 2], None, *lvls[-(level_rows // 2):]])
    lines += ["    ..." if g is None else row(g) for g in shown]
    return "\n".join(lines)
