"""What one megakernel launch did, per task and per SM, and why it took as long as it did.

A **trace build** of the kernel (the constexpr TRACE: 1 in a cubin, 2 under the interpreter;
`zlc compile --debug-waits` ships one per kernel) writes records of `TRACE_WORDS` int32 into CNT
after the counters, from `trace_offset(n_events)` on (the executor allocates CNT that much larger):

    record 0                 header (word 0: the interpreter's logical clock)
    record 1 + t             task t of the launch's table: sm, program, start lo/hi, end lo/hi,
                             cycles (%clock64 from start to end), 1
    record 1 + n_max + p     program p: sm, p, entry lo/hi, exit lo/hi, cycles, tasks it ran

    stamps (after them)      task t: STAMP_WORDS int32 at 4 t: claim, descriptor, waited, body end

(`n_max`: the longer of the two tables). Start is taken when the program begins the task (before
its waits and weight prefetch), end after its signal; times are `%globaltimer` nanoseconds, one
clock for every SM. The interpreter has neither `%globaltimer` nor `%smid`: there every reading
of the clock takes one tick of a counter in the header (a logical clock: the order is the run's,
durations are in readings, `Trace.unit == "ticks"`) and the SM id is the program id.

`analyze` turns a trace plus the task table into the three things that explain a slow run:

- **time per op kind**: each task's time split into *waiting* (from its start until the last task
  it depends on had signalled; inferred from the table's waits and the producers' end times, the
  kernel records no wake-up time) and *busy* (the rest: the wake-up, its loads and arithmetic);
- **idle per SM**: the launch's span minus the busy time of the tasks the SM ran, split into
  waiting on dependencies, between tasks (claiming, the loop), before its program started and
  after it exited;
- **the critical path**: from the task that ended last, back through whatever it waited for:
  the dependency that signalled last when it had to wait, else the task its program ran before
  (the SM was busy), to the launch's start; per op kind time along it, and its dependency steps.

`describe_timeout` and `diagnose_stuck` read the debug build's CTRL error words and the counters
of a launch that timed out or never finished.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from zlc import abi as fmt

# ---- the task table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class TableTask:
    """One row of a mode's task table (docs/megakernel.md, "Task row")."""

    index: int
    op: int
    desc: int
    args: tuple[int, int, int]
    waits: tuple[tuple[int, int], ...]  # (event, target)
    signal: int  # -1: none
    signal_target: int
    parent: int  # -1: none

    @property
    def kind(self) -> str:
        return fmt.OP_NAMES[self.op] if 0 <= self.op < len(fmt.OP_NAMES) else f"op{self.op}"


def table_tasks(tasks: np.ndarray, mode: int) -> list[TableTask]:
    """The rows of `mode`'s table in the raw int32 task table (header + rows)."""
    out = []
    for i, r in enumerate(fmt.mode_rows(tasks, mode).tolist()):
        out.append(TableTask(i, r[fmt.TASK_OP], r[fmt.TASK_DESC], (r[fmt.TASK_A], r[fmt.TASK_B], r[fmt.TASK_C]),
                             tuple(fmt.row_waits(r)), r[fmt.TASK_SIGNAL], r[fmt.TASK_SIGNAL_TARGET],
                             r[fmt.TASK_PARENT]))
    return out


def producers(table: Sequence[TableTask]) -> dict[int, list[int]]:
    """event -> the tasks whose signals complete it: its direct signallers, plus every member of a
    group whose parent it is (the group's last task bumps the parent)."""
    direct: dict[int, list[int]] = {}
    for t in table:
        if t.signal >= 0:
            direct.setdefault(t.signal, []).append(t.index)
    out = {e: list(ts) for e, ts in direct.items()}
    for t in table:
        if t.signal >= 0 and t.parent >= 0:
            out.setdefault(t.parent, []).append(t.index)
    return out


def signals_expected(table: Sequence[TableTask]) -> dict[int, int]:
    """event -> how many increments it receives in a complete launch of this table."""
    out: dict[int, int] = {}
    groups: dict[int, int] = {}
    for t in table:
        if t.signal >= 0:
            out[t.signal] = out.get(t.signal, 0) + 1
            if t.parent >= 0:
                groups[t.signal] = t.parent
    for parent in groups.values():
        out[parent] = out.get(parent, 0) + 1
    return out


# ---- the trace region ------------------------------------------------------------------------------


def trace_offset(n_events: int) -> int:
    """First CNT word of the trace region: the counters rounded up to whole records (the
    template computes the same)."""
    used = fmt.CNT_EVENTS + max(n_events, 1)
    return (used + fmt.TRACE_WORDS - 1) // fmt.TRACE_WORDS * fmt.TRACE_WORDS


STAMP_WORDS = fmt.STAMP_WORDS  # per task after the records (zlc.abi: ST_CLAIM .. ST_BODY_END)
TERMS = ("claim", "descriptor", "wait", "body", "signal")


def trace_words(tasks: np.ndarray, grid: int) -> int:
    """Words of the trace region for the table `tasks` launched with `grid` programs: the records,
    then the per-task stamps (rounded up to whole records)."""
    t = np.asarray(tasks).reshape(-1)
    n_max = max(int(t[fmt.HDR_N_PREFILL]), int(t[fmt.HDR_N_DECODE]))
    return fmt.TRACE_WORDS * (1 + n_max + grid) + _stamp_words(n_max)


def _stamp_words(n_max: int) -> int:
    return (STAMP_WORDS * n_max + fmt.TRACE_WORDS - 1) // fmt.TRACE_WORDS * fmt.TRACE_WORDS


@dataclass
class Trace:
    """One traced launch: per task of the mode's table and per program (arrays, int64)."""

    mode: int
    unit: str  # "ns" (%globaltimer) or "ticks" (the interpreter's logical clock)
    sm: np.ndarray
    program: np.ndarray
    start: np.ndarray
    end: np.ndarray
    cycles: np.ndarray
    recorded: np.ndarray  # bool: the task wrote its record
    prog_sm: np.ndarray
    prog_entry: np.ndarray
    prog_exit: np.ndarray
    prog_cycles: np.ndarray
    prog_tasks: np.ndarray
    # per task, STAMP_WORDS columns (claim, descriptor, waited, body end) after its start; -1: none
    stamps: np.ndarray | None = None


def _stamp(rec: np.ndarray, lo: int) -> np.ndarray:
    """The int64 stamp whose low word is at `lo` (TR_START_LO, TR_END_LO; the high word follows it)."""
    return (rec[:, lo + 1].astype(np.int64) << 32) | (rec[:, lo].astype(np.int64) & 0xFFFFFFFF)


def read_trace(region: np.ndarray, tasks: np.ndarray, mode: int, grid: int, *, unit: str = "ns") -> Trace:
    """Decodes the trace region (the int32 words from `trace_offset` on) of a launch of `mode`."""
    t = np.asarray(tasks).reshape(-1)
    n = int(t[fmt.HDR_N_PREFILL + fmt.HDR_MODE_WORDS * mode])
    n_max = max(int(t[fmt.HDR_N_PREFILL]), int(t[fmt.HDR_N_DECODE]))
    need = trace_words(t, grid)
    words = np.asarray(region, dtype=np.int32).reshape(-1)
    if words.size < need:
        raise ValueError(f"the trace region has {words.size} words; this launch needs {need}")
    n_rec = fmt.TRACE_WORDS * (1 + n_max + grid)
    recs = words[:n_rec].reshape(-1, fmt.TRACE_WORDS)
    task, prog = recs[1:1 + n], recs[1 + n_max:1 + n_max + grid]
    stamps = words[n_rec:n_rec + STAMP_WORDS * n].reshape(n, STAMP_WORDS).astype(np.int64)
    return Trace(mode=mode, unit=unit, sm=task[:, fmt.TR_SM].astype(np.int64),
                 program=task[:, fmt.TR_PROGRAM].astype(np.int64), start=_stamp(task, fmt.TR_START_LO),
                 end=_stamp(task, fmt.TR_END_LO), cycles=task[:, fmt.TR_CYCLES].astype(np.int64),
                 recorded=task[:, fmt.TR_COUNT] == 1, prog_sm=prog[:, fmt.TR_SM].astype(np.int64),
                 prog_entry=_stamp(prog, fmt.TR_START_LO), prog_exit=_stamp(prog, fmt.TR_END_LO),
                 prog_cycles=prog[:, fmt.TR_CYCLES].astype(np.int64), prog_tasks=prog[:, fmt.TR_COUNT].astype(np.int64),
                 stamps=stamps)


# ---- analysis ---------------------------------------------------------------------------------------


@dataclass
class OpTime:
    tasks: int = 0
    total: int = 0  # start -> end, summed
    waiting: int = 0
    busy: int = 0
    max_busy: int = 0
    cycles: int = 0


@dataclass
class SmTime:
    sm: int
    tasks: int
    busy: int
    waiting: int
    between: int  # inside its program's lifetime, not in a task
    head: int  # launch start -> its program's entry
    tail: int  # its program's exit -> launch end

    @property
    def idle(self) -> int:
        return self.waiting + self.between + self.head + self.tail


@dataclass
class PathStep:
    task: int
    kind: str
    label: str
    sm: int
    start: int  # from the launch's start
    busy: int
    waited: int  # start -> the dependency's signal
    # what it had to wait for: the row above it as a "dependency", or as its program's previous
    # task ("program": the SM was busy), or nothing before it ("start")
    after: str


@dataclass
class Analysis:
    mode: int
    unit: str
    tasks: int
    span: int
    ops: dict[str, OpTime]
    sms: list[SmTime]
    path: list[PathStep]
    path_ops: dict[str, int] = field(default_factory=dict)  # busy time along the path per op kind
    timer_step: int | None = None  # smallest nonzero difference of the timer: its resolution
    clock_ghz: float | None = None  # %clock64 cycles per globaltimer ns, over the programs' lifetimes
    missing: int = 0  # tasks without a record


def analyze(table: Sequence[TableTask], trace: Trace, labels: Sequence[str] | None = None) -> Analysis:
    """Time per op kind, idle per SM and the critical path of one traced launch of `table`."""
    n = len(table)
    if trace.start.size != n:
        raise ValueError(f"the trace has {trace.start.size} tasks; the table {n}")
    s, e = trace.start, trace.end
    ok = trace.recorded
    prod = producers(table)
    firsts, lasts = np.concatenate([trace.prog_entry, s[ok]]), np.concatenate([trace.prog_exit, e[ok]])
    t0 = int(firsts.min()) if firsts.size else 0
    t1 = int(lasts.max()) if lasts.size else 0
    deps_end = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    last_dep = np.full(n, -1, dtype=np.int64)
    for t in table:
        for ev, _ in t.waits:
            for j in prod.get(ev, ()):
                if ok[j] and e[j] > deps_end[t.index]:
                    deps_end[t.index], last_dep[t.index] = e[j], j
    ready = np.maximum(s, deps_end)
    busy = np.maximum(e - ready, 0)
    waiting = np.clip(ready - s, 0, None)

    ops: dict[str, OpTime] = {}
    for t in table:
        if not ok[t.index]:
            continue
        o = ops.setdefault(t.kind, OpTime())
        o.tasks += 1
        o.total += int(e[t.index] - s[t.index])
        o.waiting += int(waiting[t.index])
        o.busy += int(busy[t.index])
        o.max_busy = max(o.max_busy, int(busy[t.index]))
        o.cycles += int(trace.cycles[t.index])

    sms = []
    for sm in sorted(set(trace.prog_sm.tolist()) | set(trace.sm[ok].tolist())):
        mine = ok & (trace.sm == sm)
        progs = trace.prog_sm == sm
        entry = int(trace.prog_entry[progs].min()) if progs.any() else t0
        leave = int(trace.prog_exit[progs].max()) if progs.any() else t1
        inside = int((trace.prog_exit[progs] - trace.prog_entry[progs]).sum())
        sms.append(SmTime(sm=sm, tasks=int(mine.sum()), busy=int(busy[mine].sum()), waiting=int(waiting[mine].sum()),
                          between=max(inside - int((e[mine] - s[mine]).sum()), 0), head=entry - t0,
                          tail=t1 - leave))

    path = _critical_path(table, trace, ok, busy, waiting, last_dep, deps_end, t0, labels)
    path_ops: dict[str, int] = {}
    for p in path:
        path_ops[p.kind] = path_ops.get(p.kind, 0) + p.busy
    stamps = np.unique(np.concatenate([s[ok], e[ok]]))
    steps = np.diff(stamps)
    prog_ns = (trace.prog_exit - trace.prog_entry).astype(np.float64)
    ghz = (float(trace.prog_cycles.sum() / prog_ns.sum())
           if trace.unit == "ns" and prog_ns.sum() > 0 and trace.prog_cycles.sum() > 0 else None)
    return Analysis(mode=trace.mode, unit=trace.unit, tasks=n, span=t1 - t0, ops=ops, sms=sms, path=path,
                    path_ops=path_ops, timer_step=int(steps.min()) if steps.size else None, clock_ghz=ghz,
                    missing=int((~ok).sum()))


def _critical_path(table: Sequence[TableTask], trace: Trace, ok: np.ndarray, busy: np.ndarray,
                   waiting: np.ndarray, last_dep: np.ndarray, deps_end: np.ndarray, t0: int,
                   labels: Sequence[str] | None) -> list[PathStep]:
    s, e = trace.start, trace.end
    if not ok.any():
        return []
    # the task each program ran before task i: same program, latest end not after i's start
    prev = np.full(len(table), -1, dtype=np.int64)
    for p in np.unique(trace.program[ok]):
        mine = np.flatnonzero(ok & (trace.program == p))
        mine = mine[np.argsort(s[mine], kind="stable")]
        prev[mine[1:]] = mine[:-1]
    cur = int(np.flatnonzero(ok)[np.argmax(e[ok])])
    out: list[PathStep] = []
    seen: set[int] = set()
    while cur >= 0 and cur not in seen:
        seen.add(cur)
        t = table[cur]
        dep = int(last_dep[cur])
        if dep >= 0 and deps_end[cur] >= s[cur]:
            nxt, after = dep, "dependency"  # it had to wait for this one
        elif prev[cur] >= 0:
            nxt, after = int(prev[cur]), "program"  # it started when its program was free
        else:
            nxt, after = -1, "start"
        label = labels[cur] if labels is not None and cur < len(labels) else f"{t.kind}{list(t.args)}"
        out.append(PathStep(task=cur, kind=t.kind, label=label, sm=int(trace.sm[cur]), start=int(s[cur] - t0),
                            busy=int(busy[cur]), waited=int(waiting[cur]), after=after))
        cur = nxt
    out.reverse()
    return out


def _fmt_time(v: float, unit: str) -> str:
    if unit != "ns":
        return f"{v:.0f}"
    return f"{v / 1e3:.2f}"


def format_report(a: Analysis, *, top: int = 6, path_rows: int = 24) -> str:
    """The analysis as text: what a device run prints so that a slow launch explains itself."""
    u = "µs" if a.unit == "ns" else "ticks"

    def f(v: float) -> str:
        return _fmt_time(v, a.unit)

    mode = "decode" if a.mode == fmt.MODE_DECODE else "prefill"
    lines = [f"trace of one {mode} launch: {a.tasks} tasks on {len(a.sms)} SMs, span {f(a.span)} {u}"
             + (f", {a.missing} tasks without a record" if a.missing else "")]
    if a.unit == "ns" and a.timer_step is not None:
        lines.append(f"  %globaltimer resolution <= {a.timer_step} ns"
                     + (f"; SM clock {a.clock_ghz:.2f} GHz (%clock64 / %globaltimer)" if a.clock_ghz else ""))
        if a.timer_step >= 500:  # some GPUs tick %globaltimer every ~1 µs unless a profiler runs
            lines.append("  the timer is coarse next to a task: read durations from the cycles column")
    elif a.unit != "ns":
        lines.append("  (interpreter: a logical clock, one tick per reading; SM = program)")
    lines += ["", f"time per op kind ({u}; waiting = start until its last dependency signalled):",
              f"  {'op':<14}{'tasks':>7}{'busy':>12}{'waiting':>12}{'busy/task':>11}{'max busy':>10}"
              f"{'cycles/task':>13}"]
    for name, o in sorted(a.ops.items(), key=lambda kv: -kv[1].busy):
        lines.append(f"  {name:<14}{o.tasks:>7}{f(o.busy):>12}{f(o.waiting):>12}{f(o.busy / max(o.tasks, 1)):>11}"
                     f"{f(o.max_busy):>10}{o.cycles / max(o.tasks, 1):>13.0f}")
    total_busy = sum(o.busy for o in a.ops.values())
    capacity = a.span * max(len(a.sms), 1)
    lines += ["", f"idle per SM ({u}): busy {100 * total_busy / max(capacity, 1):.0f}% of {len(a.sms)} x span"]
    if a.sms:
        idle = np.array([x.idle for x in a.sms], dtype=np.float64)
        lines.append(f"  idle min {f(idle.min())}, median {f(float(np.median(idle)))}, max {f(idle.max())}; "
                     f"summed: waiting {f(sum(x.waiting for x in a.sms))}, between tasks "
                     f"{f(sum(x.between for x in a.sms))}, before start {f(sum(x.head for x in a.sms))}, "
                     f"after exit {f(sum(x.tail for x in a.sms))}")
        lines.append(f"  {'sm':>5}{'tasks':>7}{'busy':>10}{'waiting':>10}{'between':>10}{'head':>8}{'tail':>8}")
        ranked = sorted(a.sms, key=lambda x: -x.idle)
        shown = ranked[:top] + ([] if len(ranked) <= 2 * top else [None]) + ranked[max(top, len(ranked) - top):]
        for x in shown:
            if x is None:
                lines.append("    ...")
                continue
            lines.append(f"  {x.sm:>5}{x.tasks:>7}{f(x.busy):>10}{f(x.waiting):>10}{f(x.between):>10}"
                         f"{f(x.head):>8}{f(x.tail):>8}")
    deps = sum(1 for p in a.path if p.after == "dependency")
    lines += ["", f"critical path: {len(a.path)} tasks, {deps} dependency steps, busy "
              f"{f(sum(p.busy for p in a.path))} of the span {f(a.span)} {u}; by op kind: "
              + ", ".join(f"{k} {f(v)}" for k, v in sorted(a.path_ops.items(), key=lambda kv: -kv[1]))]
    lines.append(f"  {'task':>6} {'op':<13}{'sm':>5}{'start':>10}{'waited':>9}{'busy':>9}  {'after':<12}  label")
    half = path_rows // 2
    rows: list[PathStep | None] = (list(a.path) if len(a.path) <= path_rows
                                   else [*a.path[:half], None, *a.path[-half:]])
    for p in rows:
        if p is None:
            lines.append("     ...")
            continue
        lines.append(f"  {p.task:>6} {p.kind:<13}{p.sm:>5}{f(p.start):>10}{f(p.waited):>9}{f(p.busy):>9}  "
                     f"{p.after:<12}  {p.label}")
    return "\n".join(lines)


# ---- a launch that timed out or never finished -------------------------------------------------------


def _task_name(table: Sequence[TableTask], i: int, labels: Sequence[str] | None) -> str:
    if labels is not None and 0 <= i < len(labels):
        return f"task {i} ({table[i].kind} {labels[i]})"
    return f"task {i} ({table[i].kind})" if 0 <= i < len(table) else f"task {i}"


def _event_name(ev: int, event_labels: Mapping[int, str] | Sequence[str] | None) -> str:
    if isinstance(event_labels, Mapping) and ev in event_labels:
        return f"event {ev} ({event_labels[ev]})"
    if isinstance(event_labels, Sequence) and 0 <= ev < len(event_labels):
        return f"event {ev} ({event_labels[ev]})"
    return f"event {ev}"


def describe_timeout(ctrl: np.ndarray, tasks: np.ndarray, mode: int, tasks_address: int, *,
                     labels: Sequence[str] | None = None,
                     event_labels: Mapping[int, str] | Sequence[str] | None = None) -> str | None:
    """The debug build's record of the first wait that timed out, as a sentence; None if none."""
    c = np.asarray(ctrl).reshape(-1)
    if c.size <= fmt.CTRL_ERR_ROW or int(c[fmt.CTRL_ERR_EVENT]) <= 0:
        return None
    ev = int(c[fmt.CTRL_ERR_EVENT]) - 1
    target, seen = int(c[fmt.CTRL_ERR_TARGET]), int(c[fmt.CTRL_ERR_SEEN])
    t = np.asarray(tasks).reshape(-1)
    word = ((int(c[fmt.CTRL_ERR_ROW]) - tasks_address) & 0xFFFFFFFF) // 4  # low 32 bits of the row address
    index, rest = divmod(word - fmt.HEADER_WORDS - int(t[fmt.HDR_BASE_PREFILL + fmt.HDR_MODE_WORDS * mode]),
                         fmt.TASK_WORDS)
    table = table_tasks(t, mode)
    who = _task_name(table, index, labels) if rest == 0 and 0 <= index < len(table) else "a task"
    return f"{who} waited for {_event_name(ev, event_labels)} to reach {target} and saw {seen}"


def diagnose_stuck(tasks: np.ndarray, mode: int, counters: np.ndarray, *, grid: int,
                   labels: Sequence[str] | None = None,
                   event_labels: Mapping[int, str] | Sequence[str] | None = None, limit: int = 4) -> str:
    """What the counters of a launch that has not finished say: tasks claimed, programs exited,
    and the first claimed tasks whose waits are not met (with the events' counts and targets)."""
    cnt = np.asarray(counters).reshape(-1).astype(np.int64)
    table = table_tasks(tasks, mode)
    n = len(table)
    claimed, exited = int(cnt[fmt.CNT_QUEUE]), int(cnt[fmt.CNT_EXIT])

    def count(ev: int) -> int:
        i = fmt.CNT_EVENTS + ev
        return int(cnt[i]) if i < cnt.size else -1

    blocked = []
    for t in table[:min(claimed, n)]:
        unmet = [(ev, tgt, count(ev)) for ev, tgt in t.waits if count(ev) != tgt]
        if unmet:
            blocked.append((t, unmet))
    parts = [f"{min(claimed, n)} of {n} tasks claimed, {exited} of {grid} programs exited"]
    for t, unmet in blocked[:limit]:
        waits = "; ".join(f"{_event_name(ev, event_labels)} at {c} of {tgt}" for ev, tgt, c in unmet)
        parts.append(f"{_task_name(table, t.index, labels)} waits for {waits}")
    if len(blocked) > limit:
        parts.append(f"{len(blocked) - limit} more claimed tasks wait")
    if not blocked and claimed < n:
        parts.append("no claimed task has an unmet wait (a program stopped inside an op body?)")
    over = [ev for ev, want in signals_expected(table).items() if count(ev) > want]
    if over:
        parts.append("events counted past their signals: " + ", ".join(_event_name(ev, event_labels) for ev in over[:limit]))
    return "; ".join(parts)


def readable_labels(tables_json: Mapping[str, Any], mode: int) -> tuple[list[str], list[str]]:
    """(task labels of `mode`, event labels) from a bundle's tables/<tiling>.json."""
    key = "decode" if mode == fmt.MODE_DECODE else "prefill"
    tasks = [str(t.get("label", "")) for t in tables_json.get("tables", {}).get(key, [])]
    return tasks, [str(x) for x in tables_json.get("events", [])]
