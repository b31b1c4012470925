"""`zlc inspect`: what the compiler did to a model (IR after any stage, stage statistics, raising
refusals), or what a compiled bundle holds (manifest, task tables, per-target resources)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.markup import escape
from rich.table import Table

from ..errors import ZlcError
from .common import (
    COMPILE_STAGE_NAMES,
    MAX_SEQ,
    RAISE_STAGE_NAMES,
    STAGE_NAMES,
    cli,
    histogram_table,
    is_bundle_arg,
    out_console,
    print_bundle,
    progress,
    require_compiler,
)

if TYPE_CHECKING:
    from ..driver import Lowered
    from ..ir import Graph


@cli.command()
@click.argument("model", type=click.Path(path_type=Path), metavar="MODEL|BUNDLE")
@click.option("--ir", "show_ir", is_flag=True, help="Print the IR text (default: the final decode graph).")
@click.option("--after", "after", metavar="STAGE", default=None,
              help=f"Stop the pipeline after STAGE and dump what it made. Lowering stages (the IR): "
                   f"{', '.join(STAGE_NAMES)}; raising rule sets (the IR): {', '.join(RAISE_STAGE_NAMES)}; "
                   f"compile stages (what zlc compile made, e.g. the task tables or the kernel source): "
                   f"{', '.join(COMPILE_STAGE_NAMES)}.")
@click.option("--prefill", is_flag=True, help="With the kv-cache stage, dump the prefill graph instead.")
@click.option("--stats", is_flag=True, help="Per-stage time, node count and statistics; op histograms.")
@click.option("--explain", is_flag=True, help="Why raising rules refused to match (rule, reason, count).")
@click.option("--tasks", "show_tasks", is_flag=True, help="BUNDLE: print the task table (decode; "
              "--prefill for prefill) of the cpu tiling, or --tiling gpu.")
@click.option("--tiling", type=click.Choice(["cpu", "gpu", "native"]), default="cpu", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="BUNDLE: print the manifest (with --kernel: the report).")
@click.option("--target", "targets", multiple=True, metavar="NAME",
              help="With a compile stage for --after: the targets to compile for (default: cpu). "
                   "With --kernel: the GPU targets to report (default: every cubin).")
@click.option("--kernel", "show_kernel", is_flag=True,
              help="BUNDLE: facts of each GPU target's megakernel machine code (SASS) and task tables, and "
                   "the predicted µs per decode token (docs/kernel-model.md).")
@click.option("--context", type=int, default=None, metavar="N",
              help="With --kernel: tokens of KV cache for the decode prediction (default: max_seq).")
@MAX_SEQ
def inspect(model: Path, show_ir: bool, after: str | None, prefill: bool, stats: bool, explain: bool,
            show_tasks: bool, tiling: str, as_json: bool, targets: tuple[str, ...], show_kernel: bool,
            context: int | None, max_seq: int | None) -> None:
    """Lower MODEL and show what the compiler did (without flags: the stage statistics), or show a
    compiled BUNDLE: model, tasks per step, per-target registers/spills and roofline."""
    if show_kernel:
        if not model.is_dir():
            raise ZlcError(f"--kernel reads a compiled bundle; {model} is not one (run `zlc compile` first)")
        require_compiler("zlc inspect --kernel")  # the machine code is read with Triton's NVIDIA tools
        _inspect_kernel(model, list(targets) or None, context, as_json)
        return
    if is_bundle_arg(model):
        _inspect_bundle(model, show_tasks, tiling, "prefill" if prefill else "decode", as_json,
                        show_ir)
        return
    require_compiler("zlc inspect MODEL")
    if _check_stage(after) == "compile":
        _inspect_compile_stage(model, str(after), targets, max_seq)
        return
    show_ir = show_ir or (after is not None and not (stats or explain))
    if not (show_ir or stats or explain):
        stats = True
    late: ZlcError | None = None
    with progress(f"lower {model.name}") as p:
        from ..driver import CompileOptions, lower

        opts = CompileOptions() if max_seq is None else CompileOptions(max_seq=max_seq)
        try:
            lowered = lower(model, options=opts, observer=p, stop_after=after)
        except ZlcError as e:
            # A stage after raising failed (KV-cache synthesis, the decode check): --explain is
            # where that error points, so it still says what raising did, and then the failure.
            if not explain or after is not None:
                raise
            lowered = lower(model, options=opts, observer=p, stop_after="cleanup")
            late = e
    if stats:
        _print_stats(lowered)
    if explain:
        _print_explain(lowered)
        if after in (None, "kv-cache"):
            _print_fit(lowered, late)
    if show_ir:
        from ..ir import print_graph

        click.echo(print_graph(_dumped_graph(lowered, after, prefill)), nl=False)


def _check_stage(name: str | None) -> str | None:
    """Which pipeline NAME belongs to ("lower" or "compile"); fails on a name neither knows, before
    anything runs. Reads the pipelines' own lists (not the mirrors in common.py)."""
    if name is None:
        return None
    from ..build import COMPILE_STAGE_NAMES as compile_stages
    from ..driver import DUMP_POINTS, STAGES

    if name in DUMP_POINTS:
        return "lower"
    if name in compile_stages:
        return "compile"
    raise ZlcError(f"unknown stage '{name}'; stages: {', '.join(STAGES)}")


def _inspect_compile_stage(model: Path, stage: str, targets: tuple[str, ...], max_seq: int | None) -> None:
    """Compiles into a scratch directory up to `stage` and prints what that stage made."""
    import tempfile

    from ..build import COMPILE_STAGES, compile
    from .compile import CompileProgress

    with tempfile.TemporaryDirectory(prefix="zlc-inspect-") as d, CompileProgress() as p:
        res = compile(model, targets=list(targets) or ["cpu"], out=Path(d) / "model.zlc",
                      max_seq=max_seq or 2048, progress=p, stop_after=stage)
        p.done()
        assert res.build is not None
        text = next(s for s in COMPILE_STAGES if s.name == stage).show(res.build)
    click.echo(text if text.endswith("\n") else text + "\n", nl=False)


def _inspect_bundle(path: Path, show_tasks: bool, tiling: str, mode: str, as_json: bool, show_ir: bool) -> None:
    from ..bundle import read_manifest, verify_checksums

    man = read_manifest(path)
    if as_json:
        click.echo(json.dumps(man, indent=1))
        return
    if show_ir:
        click.echo((path / "ir" / f"{mode}.zir").read_text(), nl=False)
        return
    if not show_tasks:
        print_bundle(man, path)
        verify_checksums(path, man)
        out_console().print(f"checksums: {len(man['files'])} files ok")
        return
    if tiling not in man["tilings"]:
        raise ZlcError(f"{path} has no {tiling} tiling (tilings: {', '.join(man['tilings'])})")
    from zlc.codegen.program import OP_NAMES

    tables = json.loads((path / man["tilings"][tiling]["readable"]).read_text())
    t = Table(title=f"{tiling} {mode} tasks", title_justify="left")
    for col in ("#", "op", "task", "waits (event=target)", "signals"):
        t.add_column(col)
    for i, task in enumerate(tables["tables"][mode]):
        sig = "" if task["signal"] < 0 else f"{task['signal']}/{task['signal_target']}"
        if task["parent"] >= 0:
            sig += f" -> {task['parent']}"
        t.add_row(str(i), OP_NAMES[task["op"]], escape(task["label"]),
                  " ".join(f"{e}={n}" for e, n in task["waits"]), sig)
    out_console().print(t)


def _inspect_kernel(path: Path, targets: list[str] | None, context: int | None, as_json: bool) -> None:
    """`--kernel`: the machine-code facts and the latency prediction (zlc.kernelmodel.report)."""
    from zlc.kernelmodel.report import bundle_report, rich_tables

    rep = bundle_report(path, targets=targets, context=context)  # errors are ZlcErrors: one line
    if as_json:
        click.echo(json.dumps(rep, indent=1))
        return
    out = out_console()
    for item in rich_tables(rep):
        out.print(item)


def _dumped_graph(lowered: Lowered, after: str | None, prefill: bool) -> Graph:
    """The graph the pipeline ended with: decode (or prefill) after kv-cache, else the main one."""
    if after in (None, "kv-cache") and lowered.decode is not None:
        return lowered.prefill if prefill and lowered.prefill is not None else lowered.decode
    return lowered.graph


def _print_stats(lowered: Lowered) -> None:
    out = out_console()
    t = Table(title="pipeline stages", title_justify="left")
    t.add_column("stage")
    t.add_column("time (ms)", justify="right")
    t.add_column("nodes", justify="right")
    t.add_column("statistics")
    for s in lowered.stages:
        detail = ", ".join(f"{k}={v}" for k, v in s.stats.items())
        t.add_row(s.name, f"{s.seconds * 1e3:.1f}", str(s.nodes), escape(detail))
        for part in s.parts:  # the raising rule sets
            detail = ", ".join(f"{k}={v}" for k, v in part.stats.items())
            t.add_row(f"  {part.name}", f"{part.seconds * 1e3:.1f}", str(part.nodes), escape(detail))
    t.add_row("[bold]total[/]", f"{sum(s.seconds for s in lowered.stages) * 1e3:.1f}", "", "")
    out.print(t)
    out.print(histogram_table(lowered.histogram_before, lowered.histogram_after))
    if lowered.prefill is not None:
        cache = ", ".join(f"{n}: {t}" for n, t in lowered.cache)
        out.print(f"KV cache ({len(lowered.cache)} buffers, max_seq {lowered.max_seq}): {escape(cache)}")


def _print_explain(lowered: Lowered) -> None:
    out = out_console()
    raised = next((s for s in lowered.stages if s.name == "raise"), None)
    if raised is None:
        out.print("raising did not run (the pipeline stopped before the 'raise' stage)")
        return
    applied = ", ".join(f"{k}={v}" for k, v in raised.stats.items()) or "nothing"
    out.print(f"raised: {escape(applied)}")
    if not lowered.refused:
        out.print("no rule refused a candidate")
        return
    t = Table(title="refusals (a rule looked at a candidate node and said why it did not match)",
              title_justify="left")
    t.add_column("rule")
    t.add_column("reason")
    t.add_column("count", justify="right")
    for rule, reasons in sorted(lowered.refused.items()):
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            t.add_row(escape(rule), escape(reason), str(n))
    out.print(t)


def _print_fit(lowered: Lowered, late: ZlcError | None) -> None:
    """What stops the model after raising: the stage that failed, or what does not fit the megakernel."""
    out = out_console()
    if late is not None:
        out.print(f"[red]lowering stopped after raising:[/] {escape(str(late))}")
        return
    from ..verifier import megakernel_fit

    fit = megakernel_fit(lowered.decode, lowered.max_seq)
    if fit.compilable:
        out.print("megakernel: the decode graph fits (zlc compile can build it)")
        return
    out.print("megakernel: the decode graph does not fit (zlc compile fails on):")
    for line in fit.lines():
        out.print(f"  - {escape(line)}")
