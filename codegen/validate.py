"""Host-side validator for task tables.

The Triton interpreter runs programs one after another, so any table in topological order
"works" there even with a dependency missing; on a GPU the same table races. This check is the
guard: it proves from the table alone (waits, signals, declared reads and writes) that
- the order is topological: every task a wait counts is earlier in the table (so a persistent
  kernel never waits on work no running program can reach: no deadlock without co-residency);
- every event's target equals the number of signals it will receive (polls wait for equality);
- every read is covered: each task writing what a task reads has certainly finished before it
  starts, through its waits, transitively;
- no two tasks write overlapping regions unordered (write-write race), except accumulating writes
  (float atomics adding partials), which commute with each other but must follow the region's
  initializing (plain) write; its readers must wait for every accumulator like for any writer.
"""

from __future__ import annotations

from zlc.bundle import MAX_WAITS
from zlc.errors import ZlcError

from .program import Program, Task
from .schedule import happens_before, signalers


class TableError(ZlcError):
    """A task table that could race, deadlock or hang; names the task."""


def validate_tasks(tasks: list[Task], mode: str = "") -> None:
    where = f"{mode} table" if mode else "table"
    sig = signalers(tasks)
    counts = _signal_counts(tasks)
    for i, t in enumerate(tasks):
        if len(t.waits) > MAX_WAITS:
            raise TableError(f"{where}: task {i} ({t.label}) has {len(t.waits)} waits, at most {MAX_WAITS}")
        for e, target in t.waits:
            idx = sig.get(e)
            if not idx:
                raise TableError(f"{where}: task {i} ({t.label}) waits on event {e}, which no task signals")
            late = [j for j in idx if j >= i]
            if late:
                raise TableError(f"{where}: task {i} ({t.label}) waits on event {e} signalled by task "
                                 f"{late[0]} ({tasks[late[0]].label}), which comes later: not topological")
            if target != counts.get(e, 0):
                raise TableError(f"{where}: task {i} ({t.label}) waits for event {e} to reach {target}, "
                                 f"but it receives {counts.get(e, 0)} signals")
    members: dict[int, list[Task]] = {}
    for t in tasks:
        if t.signal >= 0:
            members.setdefault(t.signal, []).append(t)
    for e, ms in members.items():
        if any(t.signal_target != len(ms) for t in ms):
            raise TableError(f"{where}: event {e}: group target {ms[0].signal_target} but "
                             f"{len(ms)} tasks signal it (the parent would never fire)")
    hb = happens_before(tasks)
    writers: dict[str, list[int]] = {}
    for i, t in enumerate(tasks):
        for r in t.writes:
            writers.setdefault(r.buffer, []).append(i)
    for i, t in enumerate(tasks):
        for r in t.reads:
            for j in writers.get(r.buffer, []):
                if j == i or not any(r.overlaps(w) for w in tasks[j].writes):
                    continue
                if not (hb[i] >> j) & 1:
                    raise TableError(f"{where}: task {i} ({t.label}) reads {r.buffer}[{r.lo}:{r.hi}] written "
                                     f"by task {j} ({tasks[j].label}) without a dependency on it")
    for buf in writers:  # sweep by first column: only regions that overlap are compared
        regs = sorted(((r, i) for i, t in enumerate(tasks) for r in t.writes if r.buffer == buf),
                      key=lambda x: x[0].lo)
        for k, (ra, a) in enumerate(regs):
            for rb, b in regs[k + 1:]:
                if rb.lo >= ra.hi:
                    break
                if a == b or not ra.overlaps(rb) or (ra.accumulate and rb.accumulate):
                    continue  # accumulating writes (float atomics) commute with each other
                if ra.accumulate or rb.accumulate:  # the initializing write must come first
                    (init, ri), (acc, _) = ((b, rb), (a, ra)) if ra.accumulate else ((a, ra), (b, rb))
                    if not (hb[acc] >> init) & 1:
                        raise TableError(f"{where}: task {acc} ({tasks[acc].label}) accumulates into {buf}"
                                         f"[{ri.lo}:{ri.hi}] without a dependency on its initializing write by "
                                         f"task {init} ({tasks[init].label})")
                elif not ((hb[a] >> b) & 1 or (hb[b] >> a) & 1):
                    raise TableError(f"{where}: tasks {a} ({tasks[a].label}) and {b} ({tasks[b].label}) "
                                     f"both write {buf} unordered (write-write race)")


def _signal_counts(tasks: list[Task]) -> dict[int, int]:
    """Signals each event receives: its direct signallers, plus one per group whose parent it is."""
    counts: dict[int, int] = {}
    groups: dict[int, set[int]] = {}
    for t in tasks:
        if t.signal >= 0:
            counts[t.signal] = counts.get(t.signal, 0) + 1
        if t.parent >= 0:
            groups.setdefault(t.parent, set()).add(t.signal)
    for e, gs in groups.items():
        counts[e] = counts.get(e, 0) + len(gs)
    return counts


def validate_program(p: Program, tables: dict[str, list[Task]] | None = None) -> None:
    for mode, tasks in (tables or p.tables).items():
        validate_tasks(tasks, mode)
