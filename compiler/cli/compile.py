"""`zlc compile`: a model into a bundle (megakernel, AOT cubins per target, tables, weights)."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from .common import cli, err_console, print_bundle, require_compiler


class CompileProgress:
    """`zlc compile`'s progress on stderr: a line per finished stage; on a terminal, a live line
    with what the stage is doing and a bar inside the stages that count their work (lowering
    passes, weights packed, libraries and cubins built). Bars and the live line stay off under
    --json and when stdout is not a terminal (a pipe or a log file gets the stage lines only).
    Called from the build's job threads too: rich's Progress locks its own updates."""

    def __init__(self, console: Console | None = None, live: bool | None = None) -> None:
        self.console = console or err_console()
        if live is None:
            live = self.console.is_terminal and sys.stdout.isatty()
        self.bars = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(), console=self.console,
                             transient=True) if live else None
        self.line: TaskID | None = None
        self.counts: dict[str, TaskID] = {}
        self.stage: str | None = None
        self.explicit = False  # begin() marks the stages; else a new stage name in a report does
        self.lock = threading.Lock()  # the stage's bars change from the build's job threads too
        self.pending: str | None = None  # the finished stage's line, printed once the next one reports
        self.t = self.t0 = time.perf_counter()

    def __enter__(self) -> CompileProgress:
        if self.bars is not None:
            self.bars.start()
            self.line = self.bars.add_task("", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bars is not None:
            self.bars.stop()

    def begin(self, stage: str) -> None:
        """A stage starts (zlc.compile calls it before each stage's work). The finished stage's line
        waits for the new stage's first report: a compile that fails as a stage starts prints its
        one error line, not a line of progress before it."""
        self.explicit = True
        self._switch(stage, defer=True)

    def _flush(self) -> None:
        if self.pending is not None:
            self.console.print(self.pending)
            self.pending = None

    def _switch(self, stage: str, defer: bool = False) -> None:
        now = time.perf_counter()
        if stage == self.stage:
            return
        self._flush()
        if self.stage is not None:
            line = f"[green]✓[/] {escape(self.stage):<10} {now - self.t:>7.2f} s"
            if defer:
                self.pending = line
            else:
                self.console.print(line)
        self.stage, self.t = stage, now
        if self.bars is not None:
            with self.lock:
                for task in self.counts.values():  # a stage's bars end with it
                    self.bars.remove_task(task)
                self.counts.clear()
            assert self.line is not None
            self.bars.update(self.line, description=escape(stage))

    def __call__(self, stage: str, detail: str) -> None:
        if not self.explicit:
            self._switch(stage)
        self._flush()
        if self.bars is not None and self.line is not None:
            self.bars.update(self.line, description=f"{escape(stage)}: {escape(detail)}")
        # a part of the bundle that could not be built says so on every console, not only in a
        # live status line that the next stage overwrites; so does the compile cache
        if "skipped" in detail or "source only" in detail or detail.startswith("kernel cache"):
            self.console.print(f"  [yellow]{escape(detail)}[/]")
        elif self.bars is None and stage == "aot":
            self.console.print(f"  {escape(detail)}")

    def count(self, what: str, done: int, total: int) -> None:
        """`done` of `total` units of `what` inside the running stage: a bar on a live console."""
        if self.bars is None:
            return
        with self.lock:
            if what not in self.counts:
                self.counts[what] = self.bars.add_task(escape(what), total=total)
            self.bars.update(self.counts[what], completed=done, total=total)

    def done(self) -> None:
        self._switch("done")


@cli.command("compile")
@click.argument("model", type=click.Path(path_type=Path), metavar="MODEL")
@click.option("--target", "targets", multiple=True, metavar="NAME",
              help="a10 a100 l4 rtx3090 rtx4090 h100 h200 cpu; repeat for several (default: cpu).")
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Bundle directory (default: MODEL's stem + .zlc, in the current directory).")
@click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="Weight dtype; auto: bf16 when a GPU target is named or a checkpoint directory's weights "
                   "are bf16, else fp32. Math is f32.")
@click.option("--max-seq", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Positions the KV cache and rotary tables hold.")
@click.option("--tokenizer", type=click.Path(exists=True, path_type=Path), default=None,
              help="tokenizer.json, a Hugging Face model directory, or a GGUF file to bundle (default: the "
                   "GGUF file's or the checkpoint directory's own).")
@click.option("--skip-verify", is_flag=True, help="Do not check the lowered model against ONNX Runtime.")
@click.option("--atol", type=click.FloatRange(min=0), default=None,
              help="Max abs logit error the check allows (default by the model's dtype: f32 1e-3, f16 2e-2, "
                   "bf16 1e-2; `zlc verify --help` says why).")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory that is not a bundle.")
@click.option("--debug-waits", is_flag=True, help="Also ship each GPU kernel's debug build (a wait that never "
              "completes raises an error flag after 2 s instead of hanging the GPU; the first launch "
              "runs it under a host deadline) and its trace build (per-task SM and timestamps).")
@click.option("--quantize", default=None, metavar="int8|int4[:q4_0|q4_1]",
              help="Pack the Linear weights (weight-only, GGUF blocks of 32: int8 = q8_0, int4 = q4_0, "
                   "int4:q4_1 with a min per block); the report gives the logit cost on probe prompts. "
                   "The native and the Triton kernel both stream them.")
@click.option("--numerics", type=click.Choice(["exact", "fast"]), default="exact", show_default=True,
              help="fast: the native CPU kernel rounds each input row of a Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 matrix to 8 bits per "
                   "block of 32 (llama.cpp's Q8_0) and multiplies with integer dot products.")
@click.option("--no-cache", is_flag=True, help="Build every native library and cubin, neither taking them from "
              "the compile cache nor storing them there ($ZLC_KERNEL_CACHE, default ~/.cache/zlc/kernels; "
              "$ZLC_KERNEL_CACHE_SIZE bounds it, default 2G).")
@click.option("--jobs", "-j", type=click.IntRange(min=1), default=None,
              help="Builds (C compilers, Triton compiles) at once [default: the CPUs this process may use].")
@click.option("--json", "as_json", is_flag=True, help="Print the compile report as JSON.")
def compile_cmd(model: Path, targets: tuple[str, ...], out: Path | None, dtype: str, max_seq: int,
                tokenizer: Path | None, skip_verify: bool, atol: float | None, force: bool, debug_waits: bool,
                quantize: str | None, numerics: str, no_cache: bool, jobs: int | None, as_json: bool) -> None:
    """Compile MODEL into a bundle: one persistent megakernel (AOT cubins per GPU target), its task
    tables, weights, tokenizer and a manifest. MODEL: an ONNX or GGUF file, or a Hugging Face checkpoint
    directory. Checks the lowered model first (against ONNX Runtime; a GGUF file or a checkpoint
    directory against its imported graph)."""
    require_compiler("zlc compile")
    from ..targets import get_target

    for t in targets:
        get_target(t)  # unknown names fail before any work
    with CompileProgress(live=False if as_json else None) as p:
        from ..build import compile

        res = compile(model, targets=list(targets) or ["cpu"], out=out, dtype=dtype, max_seq=max_seq,
                      tokenizer=tokenizer, verify=not skip_verify, atol=atol, progress=p, force=force,
                      debug_waits=debug_waits, quantize=quantize, cache=not no_cache, jobs=jobs, numerics=numerics)
        p.done()
    assert res.path is not None  # the whole pipeline ran
    if as_json:
        click.echo(json.dumps({**_compile_report(res.manifest, res.seconds, res.path), "memory": res.memory}, indent=1))
        return
    print_bundle(res.manifest, res.path, res.seconds, res.memory)


def _compile_report(man: dict[str, Any], secs: dict[str, float] | None, path: Path) -> dict[str, Any]:
    return {"bundle": str(path), "model": man["model"]["name"], "dtype": man["dtype"],
            "numerics": man.get("numerics", "exact"),
            "tasks": {k: v["summary"]["tasks"] for k, v in man["tilings"].items()},
            "targets": {k: {"arch": v["arch"], "resources": v.get("resources"), "roofline": v["roofline"]}
                        for k, v in man["targets"].items()},
            "verification": man["verification"], "quantization": man.get("quantization"),
            "cache": man.get("cache"), "seconds": secs or man.get("compile_seconds")}
