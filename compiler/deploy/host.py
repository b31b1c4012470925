"""Host setup for serving a bundle: which cores serve which GPU, and the files that make a host do it.

    topo = read_topology()                       # this host (sysfs, nvidia-smi), or Topology.from_json(...)
    p = plan(topo, PlanOptions(gpus=(0, 1), bundle_path="/srv/m.zlc"), model="m")   # pure
    write(p, "m.zlc")                            # into m.zlc/deploy/, registered in manifest.json
    for c in host_changes(p, "m.zlc/deploy"): print(c.line())   # `zlc deploy apply --dry-run`

The plan splits the online CPUs into *serving* cores (isolated: one set per GPU, on the GPU's NUMA
node when it has enough, whole physical cores so no two instances share a core's pipeline) and
*housekeeping* CPUs (everything else: the kernel's timers and RCU callbacks, device interrupts,
other processes). By default one physical core per NUMA node is kept for housekeeping, the
cpu-partitioning convention. From that split it renders (templates/):

    systemd/zlc-serve@.service              what every instance shares (ExecStart, hardening, limits)
    systemd/zlc-serve@<gpu>.service.d/      per instance: CPUAffinity=, AllowedCPUs=, NUMAPolicy=bind
        10-zlc.conf                         + NUMAMask=, ports. A template + drop-ins rather than one
                                            unit per GPU: `systemctl start zlc-serve@{0..7}`, one
                                            place to edit the command, and systemd-analyze verifies
                                            each instance with its drop-in.
    systemd/zlc-irq-affinity.service        runs irq-affinity.sh at boot
    tuned/zlc-serving/tuned.conf            cpu-partitioning with isolated_cores = the serving cores
    tuned/cpu-partitioning-variables.conf   the same for hosts using cpu-partitioning itself
    irqbalance.conf                         IRQBALANCE_BANNED_CPULIST = the serving cores
    irq-affinity.sh                         NIC and GPU interrupts -> housekeeping CPUs (--dry-run)
    sysctl.d/90-zlc.conf                    network sysctls (all per network namespace)
    kernel-args.txt                         isolcpus=managed_irq, nohz_full, rcu_nocbs, irqaffinity
    k8s/deployment.yaml, k8s/service.yaml   one pod per GPU, Guaranteed QoS, integer CPUs
    k8s/kubelet-config.yaml                 static CPU manager + single-numa-node topology manager
    README.md, plan.json                    the plan for people and for `zlc deploy apply`

`isolcpus` gets `managed_irq` but not `domain`: domain isolation turns off load balancing on those
CPUs, so the processes and threads of one `zlc serve` (ingress, engine) would all stay on the
first CPU of their affinity mask. Isolation from other work comes from systemd's CPUAffinity
(cpu-partitioning sets everything else to the housekeeping CPUs) and cgroup cpusets instead.

Nothing here edits a boot loader; `apply` changes only what takes effect at run time (sysctls,
IRQ affinity, a process's affinity) and says what needs a restart or a reboot.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from zlc import __version__
from zlc.bundle import MANIFEST, add_files, atomic_write
from zlc.errors import ZlcError

PLAN_VERSION = 1
DEPLOY_DIR = "deploy"
IRQ_SCRIPT = "irq-affinity.sh"
IRQ_SCRIPT_INSTALLED = "/usr/local/lib/zlc/irq-affinity.sh"
EXECUTABLE = {IRQ_SCRIPT}  # files written with mode 0755

#: Written to /etc/sysctl.d and applied by `apply`. Only per-network-namespace keys: they help a
#: socket server and change nothing outside the namespace they are written in.
SYSCTLS: dict[str, tuple[str, str]] = {
    "net.ipv4.tcp_fastopen": ("3", "TCP Fast Open for clients and server: a repeat client's request "
                              "rides in the SYN, one round trip less per new connection"),
    "net.ipv4.tcp_slow_start_after_idle": ("0", "a keep-alive connection idle between requests keeps its "
                                           "congestion window; the next streamed reply does not restart slow"),
    "net.core.somaxconn": ("4096", "accept backlog for connection bursts (the kernel default was 128 "
                           "before 5.4)"),
}


class DeployError(ZlcError):
    """A plan that cannot be made (contradictory options, a topology that does not fit) or applied."""


# ---- CPU lists ----------------------------------------------------------------------------------

def parse_cpulist(text: str, what: str = "CPU list") -> frozenset[int]:
    """The kernel's list format: '2-5,8' -> {2, 3, 4, 5, 8}; '' -> {}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise DeployError(f"bad {what} '{text.strip()}': expected CPU numbers and ranges like 2-5,8")
        lo = int(m.group(1))
        out.update(range(lo, int(m.group(2) or lo) + 1))
    return frozenset(out)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The inverse of parse_cpulist, in the kernel's own form ({0, 1, 5} -> '0-1,5'), so a list
    read back from /proc/irq/N/smp_affinity_list compares equal."""
    s = sorted(set(cpus))
    runs: list[str] = []
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[j] + 1:
            j += 1
        runs.append(str(s[i]) if i == j else f"{s[i]}-{s[j]}")
        i = j + 1
    return ",".join(runs)


def cpumask_hex(cpus: Iterable[int]) -> str:
    """A hex CPU mask in the kernel's form: 32-bit groups separated by commas ({0, 33} -> '2,00000001')."""
    v = sum(1 << c for c in set(cpus))
    words = []
    while True:
        words.append(v & 0xFFFFFFFF)
        v >>= 32
        if not v:
            break
    return ",".join([f"{words[-1]:x}"] + [f"{w:08x}" for w in reversed(words[:-1])])


# ---- topology -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Cpu:
    id: int
    core: int     # physical core: CPUs with the same (package, core) are SMT siblings
    package: int
    node: int     # NUMA node


@dataclass(frozen=True)
class Gpu:
    index: int            # nvidia-smi's index = CUDA's with CUDA_DEVICE_ORDER=PCI_BUS_ID
    pci: str | None       # 0000:17:00.0
    node: int | None      # NUMA node; None when the firmware does not say


@dataclass(frozen=True)
class Nic:
    name: str
    pci: str | None
    node: int | None


@dataclass(frozen=True)
class Topology:
    """What a plan needs to know about a machine. JSON form (`zlc deploy topology`, `--topology`):
    {"cpus": [{"id", "core", "package", "node"}], "gpus": [{"index", "pci", "node"}],
     "nics": [{"name", "pci", "node"}]} with online CPUs only."""

    cpus: tuple[Cpu, ...]
    gpus: tuple[Gpu, ...] = ()
    nics: tuple[Nic, ...] = ()

    @property
    def online(self) -> frozenset[int]:
        return frozenset(c.id for c in self.cpus)

    @cached_property
    def nodes(self) -> dict[int, frozenset[int]]:
        out: dict[int, set[int]] = {}
        for c in self.cpus:
            out.setdefault(c.node, set()).add(c.id)
        return {n: frozenset(v) for n, v in sorted(out.items())}

    def cpu(self, i: int) -> Cpu:
        return self._by_id[i]

    @cached_property
    def _by_id(self) -> dict[int, Cpu]:
        return {c.id: c for c in self.cpus}

    def siblings(self, i: int) -> frozenset[int]:
        c = self.cpu(i)
        return frozenset(d.id for d in self.cpus if (d.package, d.core) == (c.package, c.core))

    def to_json(self) -> dict[str, Any]:
        return {"cpus": [asdict(c) for c in self.cpus], "gpus": [asdict(g) for g in self.gpus],
                "nics": [asdict(n) for n in self.nics]}

    @classmethod
    def from_json(cls, data: Any, where: str = "topology") -> Topology:
        try:
            cpus = tuple(sorted((Cpu(int(c["id"]), int(c["core"]), int(c.get("package", 0)), int(c.get("node", 0)))
                                 for c in data["cpus"]), key=lambda c: c.id))
            gpus = tuple(sorted((Gpu(int(g["index"]), g.get("pci"), None if g.get("node") is None else int(g["node"]))
                                 for g in data.get("gpus", [])), key=lambda g: g.index))
            nics = tuple(Nic(str(n["name"]), n.get("pci"), None if n.get("node") is None else int(n["node"]))
                         for n in data.get("nics", []))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DeployError(f"{where}: not a topology ({type(e).__name__}: {e}); expected "
                              '{"cpus": [{"id", "core", "package", "node"}], "gpus": [{"index", "pci", "node"}]}') from e
        if not cpus:
            raise DeployError(f"{where}: lists no CPUs")
        for kind, ids in (("CPU", [c.id for c in cpus]), ("GPU", [g.index for g in gpus])):
            if len(set(ids)) != len(ids):
                raise DeployError(f"{where}: a {kind} is listed twice")
        return cls(cpus, gpus, nics)


def _read(p: Path, default: str | None = None) -> str:
    try:
        return p.read_text().strip()
    except OSError:
        if default is None:
            raise
        return default


_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def _pci_node(root: Path, pci: str | None, single_node: bool) -> int | None:
    if single_node:
        return 0
    if pci is None:
        return None
    n = int(_read(root / "sys/bus/pci/devices" / pci / "numa_node", "-1"))
    return n if n >= 0 else None


def read_topology(root: Path | str = "/", *, nvidia_smi: bool = True) -> Topology:
    """This machine's topology from sysfs (root is for tests: a fake tree). GPUs from
    `nvidia-smi --query-gpu=index,pci.bus_id` when it runs, else /proc/driver/nvidia/gpus (PCI
    order, which is nvidia-smi's); a device's NUMA node from /sys/bus/pci/devices/<bdf>/numa_node."""
    root = Path(root)
    sysd = root / "sys/devices/system"
    try:
        online = parse_cpulist(_read(sysd / "cpu/online"), "online CPUs")
    except OSError as e:
        raise DeployError(f"cannot read the CPU topology ({e}); pass --topology FILE") from e
    node_of: dict[int, int] = {}
    for nd in sorted((sysd / "node").glob("node[0-9]*")):
        for c in parse_cpulist(_read(nd / "cpulist", "")):
            node_of[c] = int(nd.name[4:])
    cpus = []
    for c in sorted(online):
        t = sysd / f"cpu/cpu{c}/topology"
        sib = parse_cpulist(_read(t / "thread_siblings_list", str(c)))
        pkg = max(0, int(_read(t / "physical_package_id", "0")))
        cpus.append(Cpu(c, min(sib | {c}), pkg, node_of.get(c, 0)))
    single = len(set(node_of.values()) | {0}) == 1
    gpus = [Gpu(i, pci, _pci_node(root, pci, single)) for i, pci in _read_gpus(root, nvidia_smi)]
    nics = []
    for dev in sorted((root / "sys/class/net").glob("*/device")):
        pci = next((p for p in reversed(dev.resolve().parts) if _BDF.fullmatch(p)), None)
        nics.append(Nic(dev.parent.name, pci, _pci_node(root, pci, single)))
    return Topology(tuple(cpus), tuple(gpus), tuple(nics))


def _read_gpus(root: Path, nvidia_smi: bool) -> list[tuple[int, str | None]]:
    smi = shutil.which("nvidia-smi") if nvidia_smi and root == Path("/") else None
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30, check=True).stdout
            gpus: list[tuple[int, str | None]] = []
            for line in out.splitlines():
                idx, bus = (x.strip() for x in line.split(","))
                dom, rest = bus.split(":", 1)
                gpus.append((int(idx), f"{int(dom, 16):04x}:{rest.lower()}"))
            return gpus
        except (OSError, subprocess.SubprocessError, ValueError):
            pass  # no driver loaded, or output we do not understand: fall back to procfs
    gdir = root / "proc/driver/nvidia/gpus"
    return [(i, d.name.lower()) for i, d in enumerate(sorted(gdir.glob("*")))] if gdir.is_dir() else []


# ---- the plan -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanOptions:
    """What `zlc deploy plan/build` takes; None means "choose" (see `plan`)."""

    bundle_path: str                        # where the bundle lives on the serving host
    gpus: tuple[int, ...] | None = None     # default: every GPU in the topology
    cpus: frozenset[int] | None = None      # serving CPUs; default: the rest of the GPUs' NUMA nodes
    housekeeping: frozenset[int] | None = None  # default: the first physical core of each NUMA node
    numa_node: int | None = None            # serve only from this node's CPUs
    nics: tuple[str, ...] | None = None     # NICs whose IRQs move; default: every NIC in the topology
    port: int = 8000                        # HTTP port of GPU g's instance: port + g
    frame_port: int | None = None           # frames over TCP and UDP: frame_port + g
    host: str = "0.0.0.0"
    user: str = "zlc"
    zlc_bin: str = "/usr/local/bin/zlc"
    device: str = "cuda"
    image: str = f"zlc:{__version__}"
    memory: str = "16Gi"                    # k8s memory request (= limit)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("cpus", "housekeeping"):
            d[k] = None if d[k] is None else format_cpulist(d[k])
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PlanOptions:
        d = dict(d)
        for k in ("cpus", "housekeeping"):
            d[k] = None if d.get(k) is None else parse_cpulist(d[k])
        for k in ("gpus", "nics"):
            d[k] = None if d.get(k) is None else tuple(d[k])
        return cls(**d)


@dataclass(frozen=True)
class Instance:
    """One `zlc serve` process: zlc-serve@<gpu>.service, or one pod."""

    gpu: int
    pci: str | None
    gpu_node: int | None
    cpus: tuple[int, ...]
    nodes: tuple[int, ...]  # NUMA nodes of its CPUs: NUMAMask=
    port: int
    frame_port: int | None

    @property
    def unit(self) -> str:
        return f"zlc-serve@{self.gpu}.service"


@dataclass(frozen=True)
class Change:
    """One thing deploying the plan changes on a host. `needs` is empty when `zlc deploy apply`
    makes the change at run time; otherwise it says what does (a reboot, a restart, a command)."""

    kind: str    # file | sysctl | irq | affinity | kernel
    target: str  # host path, sysctl key, unit, "kernel command line"
    value: str   # what it becomes (for a file: its path in deploy/)
    needs: str = ""


@dataclass
class Plan:
    model: str
    topology: Topology
    options: PlanOptions
    instances: tuple[Instance, ...]
    isolated: frozenset[int]      # serving CPUs, all instances
    housekeeping: frozenset[int]  # every other online CPU
    nics: tuple[Nic, ...]
    sysctls: dict[str, str]
    kernel_args: tuple[str, ...]
    notes: tuple[str, ...]
    files: dict[str, bytes] = field(default_factory=dict)  # path in deploy/ -> content
    changes: tuple[Change, ...] = ()

    def summary(self) -> dict[str, Any]:
        """plan.json: the inputs (`load_plan` re-plans from them) and the outcome, for machines."""
        return {"plan_version": PLAN_VERSION, "zlc_version": __version__, "model": self.model,
                "options": self.options.to_json(), "topology": self.topology.to_json(),
                "isolated": format_cpulist(self.isolated), "housekeeping": format_cpulist(self.housekeeping),
                "instances": [{**asdict(i), "cpus": format_cpulist(i.cpus), "unit": i.unit} for i in self.instances],
                "nics": [asdict(n) for n in self.nics], "sysctls": self.sysctls,
                "kernel_args": list(self.kernel_args), "notes": list(self.notes),
                "files": sorted(self.files), "changes": [asdict(c) for c in self.changes]}


def _split(items: list[Any], k: int) -> list[list[Any]]:
    """k contiguous chunks whose sizes differ by at most one (the larger ones first)."""
    q, r = divmod(len(items), k)
    out, i = [], 0
    for j in range(k):
        n = q + (1 if j < r else 0)
        out.append(items[i:i + n])
        i += n
    return out


def plan(topology: Topology, options: PlanOptions, *, model: str = "model") -> Plan:
    """Decides which CPUs serve which GPU and renders every file. Pure: no I/O but the templates.

    Per NUMA node, the GPUs on it share that node's serving cores evenly (whole physical cores).
    A GPU whose node is unknown or has fewer serving cores than GPUs takes cores from nodes without
    GPUs; if those are not enough either, all serving cores are split over all GPUs (and a note says
    NUMA locality was lost). Raises DeployError, one line, for options that contradict each other
    or the topology."""
    o = options
    topo = topology
    online = topo.online
    notes: list[str] = []
    nodes = topo.nodes

    # GPUs
    known = {g.index: g for g in topo.gpus}
    if o.gpus is None:
        if not known:
            raise DeployError("no GPUs found on this host; name them with --gpus 0,1 (or give the "
                              "target's topology with --topology FILE)")
        gpus = list(known.values())
    else:
        if not o.gpus:
            raise DeployError("--gpus is empty")
        dup = sorted({g for g in o.gpus if o.gpus.count(g) > 1})
        if dup:
            raise DeployError(f"--gpus lists GPU {dup[0]} twice")
        missing = [g for g in o.gpus if known and g not in known]
        if missing:
            raise DeployError(f"--gpus lists GPU {missing[0]}, but the topology has GPUs "
                              f"{format_cpulist(known)}")
        gpus = [known.get(g, Gpu(g, None, 0 if len(nodes) == 1 else None)) for g in o.gpus]

    # the CPU split
    if o.numa_node is not None and o.numa_node not in nodes:
        raise DeployError(f"--numa-node {o.numa_node}: no such node with online CPUs "
                          f"(nodes: {format_cpulist(nodes)})")
    for name, s in (("--cpus", o.cpus), ("--housekeeping", o.housekeeping)):
        if s is not None:
            if not s:
                raise DeployError(f"{name} is empty")
            off = sorted(s - online)
            if off:
                raise DeployError(f"CPU {off[0]} in {name} is not online (online: {format_cpulist(online)})")
    if o.cpus is not None and o.housekeeping is not None and o.cpus & o.housekeeping:
        raise DeployError(f"--cpus and --housekeeping overlap: {format_cpulist(o.cpus & o.housekeeping)}")
    if o.cpus is not None:
        pool = o.cpus
        if o.numa_node is not None and pool - nodes[o.numa_node]:
            c = min(pool - nodes[o.numa_node])
            raise DeployError(f"CPU {c} in --cpus is on NUMA node {topo.cpu(c).node}, not --numa-node {o.numa_node}")
    else:
        # default housekeeping: the first physical core of each node, with its SMT siblings
        reserved = o.housekeeping if o.housekeeping is not None else \
            frozenset().union(*(topo.siblings(min(cs)) for cs in nodes.values()))
        pool = online - reserved
        if o.numa_node is not None:
            pool &= nodes[o.numa_node]
        elif all(g.node is not None for g in gpus):
            pool = frozenset(c for c in pool if topo.cpu(c).node in {g.node for g in gpus})
    if not (online - pool):
        raise DeployError("no housekeeping CPU left: keep at least one CPU out of --cpus for the kernel, "
                          "interrupts and other processes")

    # whole physical cores, grouped by node
    cores: dict[tuple[int, int], list[int]] = {}
    for c in sorted(pool):
        cores.setdefault((topo.cpu(c).package, topo.cpu(c).core), []).append(c)
    if len(cores) < len(gpus):
        raise DeployError(f"not enough serving cores: {len(gpus)} GPUs need at least one physical core each; "
                          f"the serving CPUs {format_cpulist(pool) or '(none)'} have {len(cores)}")
    by_node: dict[int, list[list[int]]] = {}
    for cs in sorted(cores.values()):
        by_node.setdefault(topo.cpu(cs[0]).node, []).append(cs)
    assigned: dict[int, list[int]] = {}
    floating = []
    for n, ncores in by_node.items():
        here = [g for g in gpus if g.node == n]
        floating += here[len(ncores):]
        here = here[:len(ncores)]
        for g, chunk in zip(here, _split(ncores, len(here)) if here else [], strict=True):
            assigned[g.index] = [c for core in chunk for c in core]
    floating += [g for g in gpus if g.node not in by_node]
    if floating:
        spare = [cs for n, ncores in by_node.items() if not any(g.node == n for g in gpus) for cs in ncores]
        if len(spare) >= len(floating):
            for g, chunk in zip(floating, _split(spare, len(floating)), strict=True):
                assigned[g.index] = [c for core in chunk for c in core]
        else:
            notes.append("not enough serving cores to keep every GPU on its own NUMA node: the serving cores "
                         "are split over all GPUs in order")
            allc = [cs for ncores in by_node.values() for cs in ncores]
            assigned = {g.index: [c for core in chunk for c in core]
                        for g, chunk in zip(gpus, _split(allc, len(gpus)), strict=True)}
    for g in gpus:
        where = {topo.cpu(c).node for c in assigned[g.index]}
        if g.node is not None and where != {g.node}:
            notes.append(f"GPU {g.index} is on NUMA node {g.node} but serves from CPUs on node "
                         f"{format_cpulist(where)} (node {g.node} has too few serving cores)")

    isolated = frozenset(c for cs in assigned.values() for c in cs)
    unused = pool - isolated
    if unused:
        notes.append(f"CPUs {format_cpulist(unused)} serve no GPU (no GPU on their NUMA node): left to housekeeping")
    for c in sorted(isolated):
        lone = topo.siblings(c) - isolated
        if lone:
            notes.append(f"CPU {c} serves, but its SMT sibling {format_cpulist(lone)} does not: housekeeping "
                         "work there shares the core")
            break
    housekeeping = online - isolated

    # ports, NICs
    instances = []
    used: set[int | None] = set()
    for g in gpus:
        port = o.port + g.index
        fport = None if o.frame_port is None else o.frame_port + g.index
        if port > 65535 or (fport is not None and fport > 65535):
            raise DeployError(f"port {max(port, fport or 0)} for GPU {g.index} is above 65535; lower --port/--frame-port")
        if port in used or fport in used or port == fport:
            raise DeployError(f"the HTTP ports ({o.port}+GPU) and frame ports ({o.frame_port}+GPU) overlap; "
                              "move --frame-port")
        used |= {port, fport} - {None}
        mine = tuple(sorted(assigned[g.index]))
        instances.append(Instance(g.index, g.pci, g.node, mine, tuple(sorted({topo.cpu(c).node for c in mine})),
                                  port, fport))
    tnics = {n.name: n for n in topo.nics}
    for name in o.nics or ():
        if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", name):
            raise DeployError(f"--nic {name!r}: not an interface name")
    if o.nics is None:
        nics = tuple(topo.nics)
    else:
        bad = [n for n in o.nics if tnics and n not in tnics]
        if bad:
            raise DeployError(f"NIC {bad[0]} is not in the topology (NICs: {', '.join(tnics) or 'none'})")
        nics = tuple(tnics.get(n, Nic(n, None, None)) for n in o.nics)

    iso = format_cpulist(isolated)
    kargs = (f"isolcpus=managed_irq,{iso}", f"nohz_full={iso}", f"rcu_nocbs={iso}",
             f"irqaffinity={format_cpulist(housekeeping)}")
    p = Plan(model, topo, o, tuple(instances), isolated, housekeeping, nics,
             {k: v for k, (v, _) in SYSCTLS.items()}, kargs, tuple(notes))
    p.changes = _changes(p)
    p.files = _render(p)
    return p


# ---- rendering ----------------------------------------------------------------------------------

def _k8s_name(model: str) -> str:
    """A DNS-1123 label for the Deployment and Service."""
    s = re.sub(r"[^a-z0-9-]+", "-", model.lower()).strip("-")[:40].strip("-")
    return f"zlc-{s or 'model'}"


def _render(p: Plan) -> dict[str, bytes]:
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(
            lambda name: resources.files("zlc.deploy").joinpath("templates", name).read_text()),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    env.filters["cpus"] = format_cpulist
    env.filters["q"] = lambda v: json.dumps(v)  # JSON strings are YAML double-quoted scalars
    hk = format_cpulist(p.housekeeping)
    match = ["nvidia"] + [x for n in p.nics for x in (n.name, n.pci) if x] + [i.pci for i in p.instances if i.pci]
    ctx = {"p": p, "o": p.options, "version": __version__, "iso": format_cpulist(p.isolated), "hk": hk,
           "iso_mask": cpumask_hex(p.isolated), "hk_mask": cpumask_hex(p.housekeeping),
           "irq_regex": r"(^|[^[:alnum:]_])(" + "|".join(re.escape(m) for m in dict.fromkeys(match)) + r")([^[:alnum:]_]|$)",
           "irq_script": IRQ_SCRIPT_INSTALLED, "sysctls": SYSCTLS, "k8s_name": _k8s_name(p.model),
           "k8s_cpus": min(len(i.cpus) for i in p.instances), "installs": _installs(p)}
    files = {
        "systemd/zlc-serve@.service": env.get_template("zlc-serve@.service.j2").render(ctx),
        "systemd/zlc-irq-affinity.service": env.get_template("zlc-irq-affinity.service.j2").render(ctx),
        "tuned/zlc-serving/tuned.conf": env.get_template("tuned.conf.j2").render(ctx),
        "tuned/cpu-partitioning-variables.conf": env.get_template("cpu-partitioning-variables.conf.j2").render(ctx),
        "irqbalance.conf": env.get_template("irqbalance.conf.j2").render(ctx),
        IRQ_SCRIPT: env.get_template("irq-affinity.sh.j2").render(ctx),
        "sysctl.d/90-zlc.conf": env.get_template("sysctl.conf.j2").render(ctx),
        "kernel-args.txt": env.get_template("kernel-args.txt.j2").render(ctx),
        "k8s/deployment.yaml": env.get_template("deployment.yaml.j2").render(ctx),
        "k8s/service.yaml": env.get_template("service.yaml.j2").render(ctx),
        "k8s/kubelet-config.yaml": env.get_template("kubelet-config.yaml.j2").render(ctx),
        "README.md": env.get_template("README.md.j2").render(ctx),
    }
    for i in p.instances:
        files[f"systemd/zlc-serve@{i.gpu}.service.d/10-zlc.conf"] = \
            env.get_template("instance.conf.j2").render(ctx, i=i)
    files["plan.json"] = json.dumps(p.summary() | {"files": sorted([*files, "plan.json"])}, indent=1) + "\n"
    return {k: v.encode() for k, v in sorted(files.items())}


def _installs(p: Plan) -> list[tuple[str, str, str]]:
    """(file in deploy/, where it goes on the host, what makes it take effect)."""
    restart = "systemctl daemon-reload; systemctl restart " + " ".join(i.unit for i in p.instances)
    out = [("systemd/zlc-serve@.service", "/etc/systemd/system/zlc-serve@.service", restart)]
    out += [(f"systemd/zlc-serve@{i.gpu}.service.d/10-zlc.conf",
             f"/etc/systemd/system/zlc-serve@{i.gpu}.service.d/10-zlc.conf", restart) for i in p.instances]
    out += [
        ("systemd/zlc-irq-affinity.service", "/etc/systemd/system/zlc-irq-affinity.service",
         "systemctl daemon-reload; systemctl enable zlc-irq-affinity"),
        (IRQ_SCRIPT, IRQ_SCRIPT_INSTALLED, "zlc-irq-affinity.service runs it at boot"),
        ("tuned/zlc-serving/tuned.conf", "/etc/tuned/zlc-serving/tuned.conf",
         "tuned-adm profile zlc-serving, then reboot (its kernel arguments)"),
        ("tuned/cpu-partitioning-variables.conf", "/etc/tuned/cpu-partitioning-variables.conf",
         "tuned-adm profile zlc-serving"),
        ("irqbalance.conf", "/etc/default/irqbalance (Debian) or /etc/sysconfig/irqbalance (RHEL): append",
         "systemctl restart irqbalance"),
        ("sysctl.d/90-zlc.conf", "/etc/sysctl.d/90-zlc.conf", "persists the sysctls across reboots"),
    ]
    return out


def _changes(p: Plan) -> tuple[Change, ...]:
    ch = [Change("sysctl", k, v) for k, v in p.sysctls.items()]
    ch.append(Change("irq", "NIC and GPU interrupts", format_cpulist(p.housekeeping)))
    ch += [Change("affinity", i.unit, format_cpulist(i.cpus),
                  "the unit's CPUAffinity= at its next start; `zlc deploy apply --pid` for a running process")
           for i in p.instances]
    ch += [Change("file", dst, src, how) for src, dst, how in _installs(p)]
    ch.append(Change("kernel", "kernel command line", " ".join(p.kernel_args),
                     "reboot (grubby --update-kernel=ALL --args=..., or the tuned profile)"))
    return tuple(ch)


# ---- writing into a bundle ----------------------------------------------------------------------

def _safe_rel(rel: str) -> str:
    parts = Path(rel).parts
    if Path(rel).is_absolute() or ".." in parts or not parts or rel == MANIFEST:
        raise DeployError(f"not a path inside a bundle: {rel!r}")
    if parts[0] != DEPLOY_DIR:
        raise DeployError(f"{rel}: deployment files go under {DEPLOY_DIR}/")
    return Path(rel).as_posix()


def add_bundle_files(bundle: Path | str, files: Mapping[str, bytes], *, remove: Iterable[str] = (),
                     modes: Mapping[str, int] | None = None) -> None:
    """Writes `files` ({"deploy/...": bytes}) into a bundle, registered in its manifest (see
    `zlc.bundle.add_files`), after removing `remove`. Paths must be relative and under deploy/."""
    add_files(bundle, {_safe_rel(r): d for r, d in files.items()}, remove=[_safe_rel(r) for r in remove],
              modes=modes)


def write(p: Plan, bundle: Path | str) -> list[str]:
    """Writes the plan's files into BUNDLE/deploy/ and registers them; removes what a previous plan
    wrote that this one does not (e.g. the drop-in of a GPU no longer served). Returns the paths."""
    root = Path(bundle)
    new = {f"{DEPLOY_DIR}/{k}": v for k, v in p.files.items()}
    old_plan = root / DEPLOY_DIR / "plan.json"
    old: list[str] = []
    if old_plan.is_file():
        try:
            old = [f"{DEPLOY_DIR}/{f}" for f in json.loads(old_plan.read_text()).get("files", [])]
        except ValueError:
            old = []
    add_bundle_files(root, new, remove=[f for f in old if f not in new],
                     modes={f"{DEPLOY_DIR}/{f}": 0o755 for f in EXECUTABLE})
    return sorted(new)


def write_dir(p: Plan, out: Path | str) -> list[Path]:
    """Writes the plan's files into a plain folder (`zlc deploy plan --out`); no bundle involved."""
    out = Path(out)
    paths = []
    for rel, data in p.files.items():
        atomic_write(out / rel, data, 0o755 if rel in EXECUTABLE else 0o644)
        paths.append(out / rel)
    return paths


def load_plan(deploy_dir: Path | str) -> Plan:
    """The plan a deploy/ folder was written from, re-made from its plan.json inputs."""
    d = Path(deploy_dir)
    f = d / "plan.json"
    if not f.is_file():
        raise DeployError(f"{d}: no plan.json (run `zlc deploy build BUNDLE` or `zlc deploy plan BUNDLE --out DIR`)")
    try:
        data = json.loads(f.read_text())
        if data.get("plan_version") != PLAN_VERSION:
            raise DeployError(f"{f}: plan version {data.get('plan_version')!r}; this zlc reads {PLAN_VERSION}")
        return plan(Topology.from_json(data["topology"], str(f)), PlanOptions.from_json(data["options"]),
                    model=data["model"])
    except (ValueError, KeyError, TypeError) as e:
        raise DeployError(f"{f}: unreadable plan ({type(e).__name__}: {e})") from e


# ---- applying on a host -------------------------------------------------------------------------

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
        old = _read(path, "(absent)")
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
        name = _read(Path(f"/proc/{pid}/comm"), "?")
        out.append(HostChange("affinity", f"pid {pid} ({name}) and its threads and children, GPU {inst.gpu}",
                              old, format_cpulist(inst.cpus), "", _set_affinity(pid, frozenset(inst.cpus))))
    else:
        out += [HostChange("affinity", pc.target, "-", pc.value, pc.needs) for pc in p.changes if pc.kind == "affinity"]
    for pc in p.changes:
        if pc.kind == "file":
            src = d / pc.value
            size = f"{src.stat().st_size} bytes" if src.is_file() else "missing"
            out.append(HostChange("file", pc.target, "-", f"{pc.value} ({size})", pc.needs))
    cmdline = set(_read(Path("/proc/cmdline"), "").split())
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
