"""What a plan needs to know about a machine, and reading it from this one.

The kernel's CPU-list format (parse_cpulist, format_cpulist, cpumask_hex) is spoken everywhere in
deployment: in options, plan.json, unit files and /proc/irq. The Topology (online CPUs with their
physical core, package and NUMA node; GPUs and NICs with their PCI address and node) is the only
input a plan takes from the machine, so a plan made elsewhere from `zlc deploy topology`'s JSON is
the same as one made on the host. read_topology is the only code here that looks at the machine
(sysfs, nvidia-smi).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from zlc.errors import ZlcError


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


def read_stripped(p: Path, default: str | None = None) -> str:
    """A sysfs/procfs file's content without surrounding whitespace; `default` when it cannot be
    read (None: the OSError propagates). Host changes read current values the same way."""
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
    n = int(read_stripped(root / "sys/bus/pci/devices" / pci / "numa_node", "-1"))
    return n if n >= 0 else None


def read_topology(root: Path | str = "/", *, nvidia_smi: bool = True) -> Topology:
    """This machine's topology from sysfs (root is for tests: a fake tree). GPUs from
    `nvidia-smi --query-gpu=index,pci.bus_id` when it runs, else /proc/driver/nvidia/gpus (PCI
    order, which is nvidia-smi's); a device's NUMA node from /sys/bus/pci/devices/<bdf>/numa_node."""
    root = Path(root)
    sysd = root / "sys/devices/system"
    try:
        online = parse_cpulist(read_stripped(sysd / "cpu/online"), "online CPUs")
    except OSError as e:
        raise DeployError(f"cannot read the CPU topology ({e}); pass --topology FILE") from e
    node_of: dict[int, int] = {}
    for nd in sorted((sysd / "node").glob("node[0-9]*")):
        for c in parse_cpulist(read_stripped(nd / "cpulist", "")):
            node_of[c] = int(nd.name[4:])
    cpus = []
    for c in sorted(online):
        t = sysd / f"cpu/cpu{c}/topology"
        sib = parse_cpulist(read_stripped(t / "thread_siblings_list", str(c)))
        pkg = max(0, int(read_stripped(t / "physical_package_id", "0")))
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
