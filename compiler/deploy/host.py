"""Deploying a plan on this host: every change it makes, next to the value the host has now
(`zlc deploy apply --dry-run`), and making the ones that take effect at run time (sysctls, IRQ
affinity, a running process's affinity). Files, restarts and kernel arguments are listed with what
makes them take effect; nothing here edits a boot loader.

The module is named host, not apply, so that `zlc.deploy.apply` stays the function.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .planning import IRQ_SCRIPT, Instance, Plan
from .topology import DeployError, format_cpulist, read_stripped, read_topology


@dataclass
class HostChange:
    """A change as this host sees it: the plan's Change with the current value."""

    kind: str
    target: str
    old: str
    new: str
    needs: str = ""                              # empty: `apply` makes it now
    action: Callable[[], None] | None = None     # how `apply` makes it

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def line(self) -> str:
        if self.kind == "file":
            return f"file     {self.target} <- {self.new} [{self.needs}]"
        what = f"{self.old} -> {self.new}" if self.changed else f"{self.new} (unchanged)"
        tail = f" [{self.needs}]" if self.needs and self.changed else ""
        return f"{self.kind:<8} {self.target}: {what}{tail}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "target": self.target, "old": self.old, "new": self.new,
                "changed": self.changed, "needs": self.needs, "runtime": self.action is not None}


def _sysctl_path(proc_sys: Path, key: str) -> Path:
    return proc_sys / key.replace(".", "/")


def _write_sysctl(path: Path, value: str) -> Callable[[], None]:
    def run() -> None:
        try:
            path.write_text(value + "\n")
        except OSError as e:
            raise DeployError(f"cannot write {path}: {e.strerror}") from e
    return run


_IRQ_LINE = re.compile(r"^irq (\d+) \((.*)\): (\S+) -> (\S+)$")
_IRQ_DEFAULT = re.compile(r"^default irq affinity: (\S+) -> (\S+)$")


def _irq_changes(script: Path) -> list[HostChange]:
    """The moves irq-affinity.sh would make (it runs with --dry-run; PROC_INTERRUPTS and PROC_IRQ
    pass through the environment)."""
    r = subprocess.run(["bash", str(script), "--dry-run"], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise DeployError(f"{script} --dry-run failed: {' '.join(r.stderr.split()) or r.returncode}")
    out = []
    for line in r.stdout.splitlines():
        m = _IRQ_LINE.match(line)
        if m:
            out.append(HostChange("irq", f"irq {m[1]} ({m[2]})", m[3], m[4]))
        elif (m := _IRQ_DEFAULT.match(line)):
            out.append(HostChange("irq", "default irq affinity", m[1], m[2]))
    return out


def _descendants(pid: int) -> list[int]:
    """pid and its descendant processes (zlc serve's engine runs as a child)."""
    kids: dict[int, list[int]] = {}
    for st in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(st.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(st.parent.name))
    out, todo = [], [pid]
    while todo:
        q = todo.pop()
        out.append(q)
        todo += kids.get(q, [])
    return out


def _set_affinity(pid: int, cpus: frozenset[int]) -> Callable[[], None]:
    def run() -> None:
        for proc in _descendants(pid):
            for task in Path(f"/proc/{proc}/task").glob("*"):
                try:
                    os.sched_setaffinity(int(task.name), cpus)
                except ProcessLookupError:
                    pass  # exited meanwhile
    return run


def host_changes(p: Plan, deploy_dir: Path | str, *, pid: int | None = None, gpu: int | None = None,
                 proc_sys: Path | str = "/proc/sys") -> list[HostChange]:
    """Every change the plan makes on this host, with the values it has now. Refuses a plan made for
    another machine (its CPUs are not this host's online CPUs)."""
    d = Path(deploy_dir)
    here = read_topology().online
    if p.isolated | p.housekeeping != here:
        raise DeployError(f"this plan is for a machine with CPUs {format_cpulist(p.isolated | p.housekeeping)}; "
                          f"this one has {format_cpulist(here)} online: plan on this host (zlc deploy build) or with "
                          "its topology (zlc deploy topology > t.json; --topology t.json)")
    out: list[HostChange] = []
    for key, new in p.sysctls.items():
        path = _sysctl_path(Path(proc_sys), key)
        old = read_stripped(path, "(absent)")
        out.append(HostChange("sysctl", key, " ".join(old.split()), new, "",
                              _write_sysctl(path, new) if path.exists() else None))
    run_script = _irq_runner(d / IRQ_SCRIPT)
    for c in _irq_changes(d / IRQ_SCRIPT):
        c.action = run_script  # one run of the script makes every move; later calls do nothing
        out.append(c)
    if pid is not None:
        inst = _instance(p, gpu)
        try:
            old = format_cpulist(os.sched_getaffinity(pid))
        except ProcessLookupError as e:
            raise DeployError(f"no process {pid}") from e
        name = read_stripped(Path(f"/proc/{pid}/comm"), "?")
        out.append(HostChange("affinity", f"pid {pid} ({name}) and its threads and children, GPU {inst.gpu}",
                              old, format_cpulist(inst.cpus), "", _set_affinity(pid, frozenset(inst.cpus))))
    else:
        out += [HostChange("affinity", pc.target, "-", pc.value, pc.needs) for pc in p.changes if pc.kind == "affinity"]
    for pc in p.changes:
        if pc.kind == "file":
            src = d / pc.value
            size = f"{src.stat().st_size} bytes" if src.is_file() else "missing"
            out.append(HostChange("file", pc.target, "-", f"{pc.value} ({size})", pc.needs))
    cmdline = set(read_stripped(Path("/proc/cmdline"), "").split())
    for a in p.kernel_args:
        out.append(HostChange("kernel", a, "present" if a in cmdline else "absent", "present",
                              "reboot: not applied (zlc never edits the boot loader; see kernel-args.txt)"))
    return out


def _irq_runner(script: Path) -> Callable[[], None]:
    done: list[bool] = []

    def run() -> None:
        if done:
            return
        done.append(True)
        r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise DeployError(f"{script} failed: {' '.join(r.stderr.split()) or r.returncode}")
    return run


def _instance(p: Plan, gpu: int | None) -> Instance:
    if gpu is None:
        if len(p.instances) != 1:
            raise DeployError(f"--pid needs --gpu N: the plan serves GPUs {format_cpulist(i.gpu for i in p.instances)}")
        return p.instances[0]
    for i in p.instances:
        if i.gpu == gpu:
            return i
    raise DeployError(f"--gpu {gpu}: the plan serves GPUs {format_cpulist(i.gpu for i in p.instances)}")


def apply(changes: Iterable[HostChange]) -> list[HostChange]:
    """Makes the run-time changes that differ from the host's current values; returns those made.
    Sysctls and IRQ affinity need root (a process's affinity needs only permission over it)."""
    todo = [c for c in changes if c.action is not None and c.changed]
    if os.geteuid() != 0 and any(c.kind in ("sysctl", "irq") for c in todo):
        raise DeployError("zlc deploy apply writes sysctls and IRQ affinity: run it as root "
                          "(or see the changes with --dry-run)")
    for c in todo:
        assert c.action is not None
        c.action()
    return todo
