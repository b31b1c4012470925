"""Host setup for serving a bundle: which cores serve which GPU, and the files that make a host do it.

    topo = read_topology()                       # this host (sysfs, nvidia-smi), or Topology.from_json(...)
    p = plan(topo, PlanOptions(gpus=(0, 1), bundle_path="/srv/m.zlc"), model="m")   # pure
    write(p, "m.zlc")                            # into m.zlc/deploy/, registered in manifest.json
    for c in host_changes(p, "m.zlc/deploy"): print(c.line())   # `zlc deploy apply --dry-run`

The wing, in the order data flows through it (each module imports only those before it):

    topology.py   CPU lists (the kernel's format), the Topology and reading it from this host
    planning.py   PlanOptions -> Plan: the CPU split per GPU, the rendered files (templates/*.j2)
    files.py      a plan into a bundle's deploy/ or a folder; load_plan reads one back
    host.py       what a plan changes on this host, and applying the run-time changes
    ebpf.py       the XDP ingress program (templates/ebpf/zlc_xdp.c) and its clang build

Nothing here edits a boot loader; `apply` changes only what takes effect at run time (sysctls,
IRQ affinity, a process's affinity) and says what needs a restart or a reboot.
"""

from __future__ import annotations

from . import ebpf
from .files import DEPLOY_DIR, add_bundle_files, load_plan, write, write_dir
from .host import HostChange, apply, host_changes
from .planning import PLAN_VERSION, SYSCTLS, Change, Instance, Plan, PlanOptions, plan
from .topology import (
    Cpu,
    DeployError,
    Gpu,
    Nic,
    Topology,
    cpumask_hex,
    format_cpulist,
    parse_cpulist,
    read_topology,
)

__all__ = [
    "DEPLOY_DIR", "PLAN_VERSION", "SYSCTLS", "Change", "Cpu", "DeployError", "Gpu", "HostChange", "Instance",
    "Nic", "Plan", "PlanOptions", "Topology", "add_bundle_files", "apply", "cpumask_hex", "ebpf",
    "format_cpulist", "host_changes", "load_plan", "parse_cpulist", "plan", "read_topology", "write",
    "write_dir",
]
