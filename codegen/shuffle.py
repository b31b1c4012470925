"""Reordering task tables, for tests that check the tables' dependencies are the real ones.

The Triton interpreter runs a launch's programs one after another, so in it any table in
topological order is executed exactly in table order. Running the same program under many
different valid orders (`random_topological_order`) must give the same numbers: that is what the
events promise a GPU, where tasks really do run in any order the waits allow. The negative
control goes the other way: `drop_wait` removes one dependency, and `adversarial_order` schedules
the weakened task before the producer it no longer waits for, so it reads stale data.

The dependency DAG is the one the waits imply: a task depends on every task that signals an event
it waits on (`schedule.signalers`: a group event's members, and for a parent event the members of
every group that bumps it). Event ids are not table positions, so reordering rows needs no
renumbering; descriptors do not change either.
"""

from __future__ import annotations

import copy
import heapq
import random
from pathlib import Path

import numpy as np

from .program import Program, Task
from .schedule import signalers


def _deps(tasks: list[Task]) -> list[set[int]]:
    """Per task, the indices of the tasks it waits for (directly)."""
    sig = signalers(tasks)
    return [{j for e, _ in t.waits for j in sig.get(e, ())} for t in tasks]


def _kahn(tasks: list[Task], key: list[tuple[float, ...]]) -> list[Task]:
    """Topological order that always runs the ready task with the smallest key."""
    deps = _deps(tasks)
    users: list[list[int]] = [[] for _ in tasks]
    for i, ds in enumerate(deps):
        for j in ds:
            users[j].append(i)
    missing = [len(ds) for ds in deps]
    ready = [(key[i], i) for i, m in enumerate(missing) if m == 0]
    heapq.heapify(ready)
    out: list[int] = []
    while ready:
        _, i = heapq.heappop(ready)
        out.append(i)
        for u in users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                heapq.heappush(ready, (key[u], u))
    if len(out) != len(tasks):
        stuck = next(i for i, m in enumerate(missing) if m)
        raise ValueError(f"the waits form a cycle (task {stuck}, {tasks[stuck].label}, is never ready)")
    return [tasks[i] for i in out]


def random_topological_order(tasks: list[Task], rng: random.Random) -> list[Task]:
    """The same Task objects in a random order that respects every wait: Kahn's algorithm with a
    random priority per task (any topological order can come out). A table that passes
    `validate_tasks` still passes it reordered: the checks other than order use only waits."""
    return _kahn(tasks, [(rng.random(),) for _ in tasks])


def drop_wait(tasks: list[Task], index: int, wait_index: int = 0) -> list[Task]:
    """Deep copies of `tasks` with wait `wait_index` of task `index` removed."""
    out = copy.deepcopy(tasks)
    waits = out[index].waits
    if not 0 <= wait_index < len(waits):
        raise IndexError(f"task {index} ({out[index].label}) has {len(waits)} waits, no wait {wait_index}")
    del waits[wait_index]
    return out


def adversarial_order(tasks: list[Task], victim_index: int) -> list[Task]:
    """A topological order of the DAG the waits imply that runs `tasks[victim_index]` as early as
    possible: only its (transitive) dependencies come before it, the rest keep their relative
    order after it. After `drop_wait` on the victim, the producer of the unguarded read is no
    longer a dependency, so it runs after the victim."""
    deps = _deps(tasks)
    before = {victim_index}
    stack = [victim_index]
    while stack:
        for j in deps[stack.pop()]:
            if j not in before:
                before.add(j)
                stack.append(j)
    return _kahn(tasks, [(0 if i in before else 1, i) for i in range(len(tasks))])


def write_tables(path: str | Path, program: Program, tables: dict[str, list[Task]]) -> Path:
    """Writes `tables` (modes missing from it keep the program's) in the bundle's table format
    (tasks, desc_int, desc_float; what `InterpretBackend(..., tables=path)` loads)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"tasks": program.task_table({**program.tables, **tables}),
               "desc_int": np.ascontiguousarray(program.desc_int),
               "desc_float": np.ascontiguousarray(program.desc_float)}, str(path))
    return path
