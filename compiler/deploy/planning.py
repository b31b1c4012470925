"""The plan: which cores serve which GPU, and the files that make a host do it. Pure: a Topology
and PlanOptions in, a Plan out, no I/O but reading the templates.

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

The module is named planning, not plan, so that `zlc.deploy.plan` stays the function.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

from zlc.version import __version__

from .topology import DeployError, Gpu, Nic, Topology, cpumask_hex, format_cpulist, parse_cpulist

PLAN_VERSION = 1
IRQ_SCRIPT = "irq-affinity.sh"
IRQ_SCRIPT_INSTALLED = "/usr/local/lib/zlc/irq-affinity.sh"

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


# ---- what a plan is -----------------------------------------------------------------------------

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


# ---- planning: plan() and its steps -------------------------------------------------------------

def plan(topology: Topology, options: PlanOptions, *, model: str = "model") -> Plan:
    """Decides which CPUs serve which GPU and renders every file. Pure: no I/O but the templates.

    Per NUMA node, the GPUs on it share that node's serving cores evenly (whole physical cores).
    A GPU whose node is unknown or has fewer serving cores than GPUs takes cores from nodes without
    GPUs; if those are not enough either, all serving cores are split over all GPUs (and a note says
    NUMA locality was lost). Raises DeployError, one line, for options that contradict each other
    or the topology."""
    gpus = _choose_gpus(topology, options)
    pool = _serving_pool(topology, options, gpus)
    assigned, notes = _assign_cores(topology, gpus, _cores_by_node(topology, pool, len(gpus)))
    isolated, housekeeping, hk_notes = _split_housekeeping(topology, pool, assigned)
    instances = _instances(topology, options, gpus, assigned)
    nics = _choose_nics(topology, options)
    p = Plan(model, topology, options, instances, isolated, housekeeping, nics,
             {k: v for k, (v, _) in SYSCTLS.items()}, _kernel_args(isolated, housekeeping),
             tuple(notes + hk_notes))
    p.changes = _changes(p)  # before rendering: plan.json lists them
    p.files = _render(p)
    return p


def _choose_gpus(topo: Topology, o: PlanOptions) -> list[Gpu]:
    """--gpus checked against the topology's GPUs (any index when it lists none), or all of them."""
    known = {g.index: g for g in topo.gpus}
    if o.gpus is None:
        if not known:
            raise DeployError("no GPUs found on this host; name them with --gpus 0,1 (or give the "
                              "target's topology with --topology FILE)")
        return list(known.values())
    if not o.gpus:
        raise DeployError("--gpus is empty")
    dup = sorted({g for g in o.gpus if o.gpus.count(g) > 1})
    if dup:
        raise DeployError(f"--gpus lists GPU {dup[0]} twice")
    missing = [g for g in o.gpus if known and g not in known]
    if missing:
        raise DeployError(f"--gpus lists GPU {missing[0]}, but the topology has GPUs "
                          f"{format_cpulist(known)}")
    return [known.get(g, Gpu(g, None, 0 if len(topo.nodes) == 1 else None)) for g in o.gpus]


def _serving_pool(topo: Topology, o: PlanOptions, gpus: list[Gpu]) -> frozenset[int]:
    """The CPUs that may serve: --cpus, or the online CPUs less housekeeping (--housekeeping, by
    default the first physical core of each node), kept to --numa-node or to the GPUs' nodes."""
    online = topo.online
    nodes = topo.nodes
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
    return pool


def _cores_by_node(topo: Topology, pool: frozenset[int], n_gpus: int) -> dict[int, list[list[int]]]:
    """The pool as whole physical cores (each a sorted list of SMT siblings), grouped by NUMA node."""
    cores: dict[tuple[int, int], list[int]] = {}
    for c in sorted(pool):
        cores.setdefault((topo.cpu(c).package, topo.cpu(c).core), []).append(c)
    if len(cores) < n_gpus:
        raise DeployError(f"not enough serving cores: {n_gpus} GPUs need at least one physical core each; "
                          f"the serving CPUs {format_cpulist(pool) or '(none)'} have {len(cores)}")
    by_node: dict[int, list[list[int]]] = {}
    for cs in sorted(cores.values()):
        by_node.setdefault(topo.cpu(cs[0]).node, []).append(cs)
    return by_node


def _assign_cores(topo: Topology, gpus: list[Gpu],
                  by_node: dict[int, list[list[int]]]) -> tuple[dict[int, list[int]], list[str]]:
    """GPU index -> its serving CPUs (the locality policy of `plan`), and notes where NUMA locality
    could not be kept."""
    notes: list[str] = []
    assigned: dict[int, list[int]] = {}
    floating = []  # GPUs their own node cannot serve
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
    return assigned, notes


def _split(items: list[Any], k: int) -> list[list[Any]]:
    """k contiguous chunks whose sizes differ by at most one (the larger ones first)."""
    q, r = divmod(len(items), k)
    out, i = [], 0
    for j in range(k):
        n = q + (1 if j < r else 0)
        out.append(items[i:i + n])
        i += n
    return out


def _split_housekeeping(topo: Topology, pool: frozenset[int],
                        assigned: dict[int, list[int]]) -> tuple[frozenset[int], frozenset[int], list[str]]:
    """(isolated, housekeeping, notes): the CPUs that serve a GPU, every other online CPU, and what
    the split leaves behind (pool CPUs no GPU took, a serving core shared with housekeeping)."""
    notes: list[str] = []
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
    return isolated, topo.online - isolated, notes


def _instances(topo: Topology, o: PlanOptions, gpus: list[Gpu],
               assigned: dict[int, list[int]]) -> tuple[Instance, ...]:
    """One instance per GPU with its CPUs and ports (port + GPU index, frame_port + GPU index)."""
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
    return tuple(instances)


def _choose_nics(topo: Topology, o: PlanOptions) -> tuple[Nic, ...]:
    """The NICs whose interrupts move: --nic checked against the topology's (any name when it lists
    none), or all of them."""
    tnics = {n.name: n for n in topo.nics}
    for name in o.nics or ():
        if not re.fullmatch(r"[A-Za-z0-9_.:@-]{1,15}", name):
            raise DeployError(f"--nic {name!r}: not an interface name")
    if o.nics is None:
        return tuple(topo.nics)
    bad = [n for n in o.nics if tnics and n not in tnics]
    if bad:
        raise DeployError(f"NIC {bad[0]} is not in the topology (NICs: {', '.join(tnics) or 'none'})")
    return tuple(tnics.get(n, Nic(n, None, None)) for n in o.nics)


def _kernel_args(isolated: frozenset[int], housekeeping: frozenset[int]) -> tuple[str, ...]:
    """The boot arguments for the split (see the module docstring for why not isolcpus=domain)."""
    iso = format_cpulist(isolated)
    return (f"isolcpus=managed_irq,{iso}", f"nohz_full={iso}", f"rcu_nocbs={iso}",
            f"irqaffinity={format_cpulist(housekeeping)}")


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
