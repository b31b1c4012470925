"""`zlc deploy`: host setup for serving a bundle (plan, build, apply, topology). The plans, files and
host changes are zlc.deploy's; this module is the command line around them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from ..errors import ZlcError
from .common import cli, err_console


@cli.group()
def deploy() -> None:
    """Host setup for serving a bundle (docs/deployment.md): each GPU's `zlc serve` pinned to cores on
    its NUMA node, interrupts and kernel housekeeping kept off them (systemd units, tuned profile,
    irqbalance, IRQ affinity, sysctls, kernel arguments), and Kubernetes manifests for fleets."""


class CpuList(click.ParamType):
    """The kernel's list format: 2-5,8."""

    name = "LIST"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> frozenset[int]:
        from ..deploy import DeployError, parse_cpulist

        if isinstance(value, frozenset):
            return value
        try:
            out = parse_cpulist(str(value), "list")
        except DeployError as e:
            self.fail(str(e), param, ctx)
        if not out:
            self.fail("is empty", param, ctx)
        return out


def _plan_options(f: Any) -> Any:
    opts = [
        click.option("--topology", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                     help="The target machine's topology as JSON (`zlc deploy topology` there); default: this host."),
        click.option("--gpus", type=CpuList(), default=None, help="GPUs to serve, one instance each: 0,1 or 0-7 "
                     "(default: every GPU found)."),
        click.option("--cpus", type=CpuList(), default=None, help="Serving CPUs, split over the GPUs: 2-5,8 "
                     "(default: the GPUs' NUMA nodes minus housekeeping)."),
        click.option("--housekeeping", type=CpuList(), default=None, help="CPUs kept for the kernel, "
                     "interrupts and other processes (default: the first core of each NUMA node)."),
        click.option("--numa-node", type=click.IntRange(min=0), default=None, help="Serve only from this node's CPUs."),
        click.option("--nic", "nics", multiple=True, metavar="IFACE", help="NIC whose interrupts move off the "
                     "serving cores; repeat for several (default: every NIC found)."),
        click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True,
                     help="HTTP port of GPU 0's instance; GPU g listens on PORT+g."),
        click.option("--frame-port", type=click.IntRange(1, 65535), default=None,
                     help="Binary frames over TCP and UDP on FRAME_PORT+g."),
        click.option("--host", default="0.0.0.0", show_default=True, help="Address the instances listen on."),
        click.option("--user", default="zlc", show_default=True, help="User the systemd units run as."),
        click.option("--zlc-bin", default=None, help="Absolute path of zlc on the target (default: this zlc)."),
        click.option("--bundle-path", default=None, help="Where the bundle lives on the target (default: "
                     "BUNDLE's absolute path)."),
        click.option("--device", type=click.Choice(["cuda", "cpu", "reference"]), default="cuda", show_default=True),
        click.option("--image", default=None, help="Container image for the Kubernetes manifests."),
        click.option("--memory", default="16Gi", show_default=True, help="Memory per pod (request = limit)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _make_plan(bundle: Path, kw: dict[str, Any]) -> Any:
    import shutil

    from ..bundle import read_manifest
    from ..deploy import PlanOptions, Topology, plan, read_topology

    man = read_manifest(bundle)
    if kw["topology"] is not None:
        try:
            data = json.loads(kw["topology"].read_text())
        except ValueError as e:
            raise ZlcError(f"{kw['topology']}: not JSON ({e})") from e
        topo = Topology.from_json(data, str(kw["topology"]))
    else:
        topo = read_topology()
    zlc_bin = kw["zlc_bin"] or shutil.which("zlc") or str(Path(sys.executable).parent / "zlc")
    if not Path(zlc_bin).is_absolute():
        raise click.BadParameter("must be an absolute path", param_hint="--zlc-bin")
    opts = PlanOptions(
        bundle_path=kw["bundle_path"] or str(bundle.resolve()),
        gpus=None if kw["gpus"] is None else tuple(sorted(kw["gpus"])), cpus=kw["cpus"],
        housekeeping=kw["housekeeping"], numa_node=kw["numa_node"], nics=tuple(kw["nics"]) or None,
        port=kw["port"], frame_port=kw["frame_port"], host=kw["host"], user=kw["user"], zlc_bin=zlc_bin,
        device=kw["device"], memory=kw["memory"], **({"image": kw["image"]} if kw["image"] else {}))
    return plan(topo, opts, model=man["model"]["name"])


def _print_plan(p: Any) -> None:
    from ..deploy import format_cpulist

    topo = p.topology
    click.echo(f"{p.model}: {len(p.instances)} instance(s) on a machine with {len(topo.cpus)} CPUs, "
               f"{len(topo.nodes)} NUMA node(s), {len(topo.gpus)} GPU(s) found")
    for i in p.instances:
        gpu = f"GPU {i.gpu}" + (f" ({i.pci})" if i.pci else "") + \
              ("" if i.gpu_node is None else f" node {i.gpu_node}")
        ports = f"port {i.port}" + ("" if i.frame_port is None else f", frames {i.frame_port}")
        click.echo(f"  {i.unit:<22} {gpu:<28} CPUs {format_cpulist(i.cpus)} (node {format_cpulist(i.nodes)}), {ports}")
    click.echo(f"serving (isolated) CPUs: {format_cpulist(p.isolated)}")
    click.echo(f"housekeeping CPUs: {format_cpulist(p.housekeeping)}")
    click.echo("interrupts moved: nvidia" + "".join(f", {n.name}" for n in p.nics))
    click.echo("sysctls: " + ", ".join(f"{k} = {v}" for k, v in p.sysctls.items()))
    click.echo(f"kernel arguments (reboot): {' '.join(p.kernel_args)}")
    for n in p.notes:
        click.echo(f"note: {n}")


@deploy.command("plan")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="BUNDLE")
@_plan_options
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Also write the files into this folder (the bundle is not touched).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def deploy_plan(bundle: Path, out: Path | None, as_json: bool, **kw: Any) -> None:
    """Show which cores would serve which GPU, the housekeeping CPUs, and the files `build` writes."""
    from ..deploy import write_dir

    p = _make_plan(bundle, kw)
    if out is not None:
        write_dir(p, out)
    if as_json:
        click.echo(json.dumps(p.summary(), indent=1))
        return
    _print_plan(p)
    click.echo(f"files: {', '.join(sorted(p.files))}" + (f" (written to {out})" if out else ""))


@deploy.command("build")
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="BUNDLE")
@_plan_options
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def deploy_build(bundle: Path, as_json: bool, **kw: Any) -> None:
    """Write the host setup files and the XDP ingress program (source, and the object when clang is
    present) into BUNDLE/deploy/ and record them in the manifest (the bundle stays loadable); a
    previous build's files are replaced."""
    from ..deploy import write
    from ..deploy.ebpf import build_into_bundle

    p = _make_plan(bundle, kw)
    files = write(p, bundle)
    xdp = build_into_bundle(bundle)
    if as_json:
        click.echo(json.dumps({**p.summary(), "xdp_object": str(xdp.object) if xdp.object else None,
                               "xdp_note": xdp.reason}, indent=1))
        return
    _print_plan(p)
    click.echo(f"wrote {len(files)} files into {bundle / 'deploy'} (manifest updated)")
    if xdp.object is not None:
        click.echo(f"XDP ingress program: {xdp.object} ({xdp.reason})")
    else:
        err_console().print(f"[yellow]warning:[/] XDP program not built ({escape(xdp.reason)}); its source is in "
                     f"{escape(str(xdp.source))}")


@deploy.command("apply")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="BUNDLE|DIR")
@click.option("--dry-run", is_flag=True, help="Print every change with the current value; change nothing.")
@click.option("--only", "only", multiple=True, type=click.Choice(["sysctl", "irq", "affinity"]),
              help="Apply only these run-time parts (repeatable; default: all).")
@click.option("--pid", type=click.IntRange(min=1), default=None,
              help="Pin this running zlc serve (its threads and children) to its GPU's cores.")
@click.option("--gpu", type=click.IntRange(min=0), default=None, help="The GPU --pid serves.")
@click.option("--json", "as_json", is_flag=True, help="Print the changes as JSON.")
def deploy_apply(path: Path, dry_run: bool, only: tuple[str, ...], pid: int | None, gpu: int | None,
                 as_json: bool) -> None:
    """Apply a built plan (BUNDLE/deploy, or a `plan --out` DIR) on this host: sysctls, IRQ affinity
    and (--pid) a process's affinity take effect now (root); files to install, service restarts and
    kernel arguments (reboot) are listed, not done. Never edits the boot loader."""
    from ..bundle import MANIFEST, read_manifest
    from ..deploy import DEPLOY_DIR, apply, host_changes, load_plan

    if (path / MANIFEST).is_file():
        read_manifest(path, check=True)  # apply runs the bundle's irq-affinity.sh: only an intact one
        path = path / DEPLOY_DIR
    p = load_plan(path)
    changes = host_changes(p, path, pid=pid, gpu=gpu)
    kinds = set(only or ("sysctl", "irq", "affinity"))
    made = [] if dry_run else apply(c for c in changes if c.kind in kinds)
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, "changes": [c.to_json() for c in changes],
                               "applied": [c.to_json() for c in made]}, indent=1))
        return
    if dry_run:
        click.echo(f"dry run: {sum(c.changed for c in changes)} change(s); nothing is changed")
        for c in changes:
            click.echo(f"  {c.line()}")
        return
    click.echo(f"applied {len(made)} change(s):")
    for c in made:
        click.echo(f"  {c.line()}")
    done = {id(c) for c in made}
    rest = [c for c in changes if c.changed and id(c) not in done]
    if rest:
        click.echo("not applied (what [...] says does it; rows without [...] were left out by --only):")
        for c in rest:
            click.echo(f"  {c.line()}")


@deploy.command("topology")
def deploy_topology() -> None:
    """Print this host's topology as JSON (online CPUs with core, package, NUMA node; GPUs; NICs),
    for `zlc deploy plan/build --topology FILE` elsewhere."""
    from ..deploy import read_topology

    click.echo(json.dumps(read_topology().to_json(), indent=1))
