"""Shared by test_deploy_plan.py and test_deploy_cli.py: synthetic machine topologies, the tiny
bundle, and a fake /proc/interrupts."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any


def synthetic_topology(sockets: int = 2, cores: int = 32, threads: int = 2, gpus_per_socket: int = 4,
                       nics: tuple[str, ...] = ("eth0",)) -> dict[str, Any]:
    """A machine numbered the way Linux numbers a multi-socket SMT server: CPU = thread * (sockets *
    cores) + socket * cores + core, so CPU n's sibling is n + sockets * cores. The default is the
    2-socket, 64-core (128-CPU), 8-GPU machine the tests plan for."""
    per = sockets * cores
    cpus = [{"id": t * per + s * cores + c, "core": c, "package": s, "node": s}
            for t in range(threads) for s in range(sockets) for c in range(cores)]
    gpus = [{"index": s * gpus_per_socket + g, "pci": f"0000:{0x17 + 0x10 * (s * gpus_per_socket + g):02x}:00.0",
             "node": s} for s in range(sockets) for g in range(gpus_per_socket)]
    nic = [{"name": n, "pci": f"0000:{0xa0 + i:02x}:00.0", "node": 0} for i, n in enumerate(nics)]
    return {"cpus": sorted(cpus, key=lambda c: c["id"]), "gpus": gpus, "nics": nic}


def compile_tiny(tiny_onnx: Path, out: Path) -> Path:
    """The zoo's tiny Llama as a cpu-only bundle (~5 s, no verification: these tests only need a
    bundle's layout and manifest)."""
    import zlc

    zlc.compile(tiny_onnx, targets=["cpu"], out=out, max_seq=64, verify=False, name="tiny-llama")
    return out


def copy_bundle(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# A /proc/interrupts of a 4-CPU host: an mlx5 NIC named by PCI address, an Intel NIC named by
# interface, an nvidia GPU, an NVMe queue and an unrelated virtio device, plus the non-numeric rows.
FAKE_INTERRUPTS = """\
           CPU0       CPU1       CPU2       CPU3
   0:         22          0          0          0   IO-APIC   2-edge      timer
  24:          0        120          0          0  IR-PCI-MSI 524288-edge      mlx5_comp0@pci:0000:a0:00.0
  25:          0          0         33          0  IR-PCI-MSI 524289-edge      eth1-TxRx-0
  26:          0          0          0         12  IR-PCI-MSI 1048576-edge      nvidia
  27:          1          0          0          0  IR-PCI-MSI 2097152-edge      nvme0q1
  28:          0          5          0          0  PCI-MSIX-0000:00:03.0   1-edge      virtio2-input.0
  29:          0          0          7          0  IR-PCI-MSI 524290-edge      veth10-rx
 NMI:          0          0          0          0   Non-maskable interrupts
 LOC:       1234       1234       1234       1234   Local timer interrupts
"""


def fake_proc_irq(root: Path, irqs: dict[int, str], default_mask: str = "f") -> Path:
    """A /proc/irq look-alike: N/smp_affinity_list per IRQ and default_smp_affinity."""
    for irq, cpus in irqs.items():
        (root / str(irq)).mkdir(parents=True)
        (root / str(irq) / "smp_affinity_list").write_text(cpus + "\n")
    (root / "default_smp_affinity").write_text(default_mask + "\n")
    return root
