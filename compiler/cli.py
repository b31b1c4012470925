"""The `zlc` command line: compile, verify, inspect and run models and bundles (click + rich).

Errors: every ZlcError is one red line on stderr and exits with `err.exit_code`; click usage errors
are one line too (exit 2); anything else is an "internal error" line (exit 70) with a hint to rerun
with `--debug`, which shows tracebacks. Results go to stdout, progress and errors to stderr, so
`zlc inspect --ir m.onnx > m.zir` and `zlc verify --json` stay machine-readable.

Heavy imports (torch, ONNX, ONNX Runtime) happen inside the commands, so `zlc --help` is instant.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import __version__
from .errors import VerificationError, ZlcError

if TYPE_CHECKING:
    from .driver import Lowered
    from .ir import Graph
    from .verifier import VerifyReport

EXIT_USAGE = 2  # click's convention
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in zlc, not in the user's input
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `zlc inspect --ir m.onnx | head` ends with

# Mirrors zlc.driver.STAGES; kept here so `--help` does not import the driver (and torch).
STAGE_NAMES = ("import", "fold", "canonicalize", "cse", "dce", "raise", "cleanup", "kv-cache")

_settings = {"debug": False}


def _out() -> Console:
    # Built per use: click's CliRunner swaps sys.stdout between invocations.
    return Console(highlight=False, soft_wrap=True)


def _err() -> Console:
    return Console(stderr=True, highlight=False, soft_wrap=True)


def _one_line(msg: str) -> str:
    return " ".join(msg.split()) or "(no message)"


def _error_line(msg: str) -> None:
    _err().print(f"[bold red]error:[/] {escape(_one_line(msg))}")


# ---- the group: one place that turns exceptions into exit codes ------------------------------

class ZlcGroup(click.Group):
    """Runs click in non-standalone mode so that every failure is reported here, the same way under
    the console script and click's CliRunner."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None,  # type: ignore[override]
             complete_var: str | None = None, standalone_mode: bool = True, **extra: Any) -> Any:
        _settings["debug"] = False
        try:
            with warnings.catch_warnings():  # the --debug callback sets the filter for this run only
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except BaseException as e:  # noqa: B036 - SystemExit/KeyboardInterrupt are mapped too
            sys.exit(_exit_code_for(e))
        sys.exit(rv if isinstance(rv, int) else 0)


def _exit_code_for(e: BaseException) -> int:
    """Reports `e` (one line, or a traceback with --debug) and returns the process exit code."""
    if isinstance(e, SystemExit):
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if isinstance(e, BrokenPipeError):  # the reader went away: nothing to report
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    if _settings["debug"] and not isinstance(e, click.ClickException):
        traceback.print_exception(e)
    if isinstance(e, click.UsageError):
        where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
        _error_line(e.format_message() + where)
        return EXIT_USAGE
    if isinstance(e, click.ClickException):
        _error_line(e.format_message())
        return e.exit_code
    if isinstance(e, (KeyboardInterrupt, click.Abort)):
        _error_line("interrupted")
        return EXIT_INTERRUPTED
    if isinstance(e, ZlcError):
        _error_line(str(e))
        return e.exit_code
    _error_line(f"internal error: {type(e).__name__}: {e} -- this is a bug in zlc; "
                "rerun with 'zlc --debug ...' for the traceback and report it")
    return EXIT_INTERNAL


def _silence_stdout() -> None:
    """Points stdout at /dev/null so the interpreter's final flush does not fail again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # not a real file (CliRunner)
        pass


@click.group(cls=ZlcGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="zlc", message="%(prog)s %(version)s")
@click.option("--debug", is_flag=True, help="Show tracebacks and library warnings.")
def cli(debug: bool) -> None:
    """zlc: a static-graph fusion compiler for transformer LLMs.

    MODEL is an ONNX file of a decoder-only LM (token ids -> logits; stateless, Optimum-style
    KV-cache or onnxruntime-genai-style graphs).
    """
    _settings["debug"] = debug
    if not debug:
        warnings.simplefilter("ignore")  # exporter/runtime warnings are noise for CLI users


# ---- shared options and helpers ----------------------------------------------------------------

class IdList(click.ParamType):
    """Comma-separated token ids: 1,2,3."""

    name = "IDS"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> list[int]:
        if isinstance(value, list):
            return value
        try:
            ids = [int(x) for x in str(value).replace(" ", "").split(",") if x != ""]
        except ValueError:
            self.fail(f"expected comma-separated integers like 1,2,3, got '{value}'", param, ctx)
        if not ids:
            self.fail("needs at least one token id", param, ctx)
        return ids


MODEL = click.argument("model", type=click.Path(dir_okay=False, path_type=Path), metavar="MODEL")
MAX_SEQ = click.option("--max-seq", type=click.IntRange(min=1), default=None,
                       help="Positions the KV cache and rotary tables hold.")


class StageProgress:
    """A rich status line on stderr naming the pipeline stage being run, and a line per finished
    stage (terminals only: piped stderr stays clean). Used as the driver's `observer`."""

    def __init__(self, what: str, then: str = ""):
        self.console = _err()
        self.what, self.then = what, then
        self.status = self.console.status("") if self.console.is_terminal else None
        self.t = time.perf_counter()

    def __enter__(self) -> StageProgress:
        if self.status is not None:
            self.status.start()
        self.show(f"{STAGE_NAMES[0]} (1/{len(STAGE_NAMES)})")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.stop()

    def show(self, text: str) -> None:
        if self.status is not None:
            self.status.update(f"{escape(self.what)}: {escape(text)}")

    def __call__(self, stage: str, graph: Graph) -> None:
        if self.status is None:
            return
        now = time.perf_counter()
        took, self.t = now - self.t, now
        self.console.print(f"[green]✓[/] {escape(stage):<12} {len(graph.nodes):>6} nodes {took:>7.2f} s")
        i = STAGE_NAMES.index(stage) + 1 if stage in STAGE_NAMES else len(STAGE_NAMES)
        if i < len(STAGE_NAMES):
            self.show(f"{STAGE_NAMES[i]} ({i + 1}/{len(STAGE_NAMES)})")
        elif self.then:
            self.show(self.then)


@contextmanager
def progress(what: str, then: str = "") -> Iterator[StageProgress]:
    with StageProgress(what, then) as p:
        yield p


def _check_stage(name: str | None) -> None:
    if name is not None and name not in STAGE_NAMES:
        raise ZlcError(f"unknown stage '{name}'; stages: {', '.join(STAGE_NAMES)}")


def _histogram_table(before: dict[str, int], after: dict[str, int]) -> Table:
    t = Table(title="op histogram (before -> after raising)", title_justify="left")
    t.add_column("op")
    t.add_column("before", justify="right")
    t.add_column("after", justify="right")
    ops = sorted(set(before) | set(after), key=lambda o: (-after.get(o, 0), -before.get(o, 0), o))
    for op in ops:
        t.add_row(op, str(before.get(op, "")), str(after.get(op, "")))
    t.add_row("[bold]total[/]", str(sum(before.values())), str(sum(after.values())))
    return t


# ---- zlc verify -----------------------------------------------------------------------------------

@cli.command()
@MODEL
@click.option("--steps", type=click.IntRange(min=1), default=32, show_default=True,
              help="Decode steps after the prompt.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=8, show_default=True,
              help="Length of the random prompt (ignored with --prompt-ids).")
@click.option("--prompt-ids", type=IdList(), default=None, help="The prompt as token ids: 1,2,3.")
@click.option("--atol", type=click.FloatRange(min=0), default=1e-3, show_default=True,
              help="Max abs logit error allowed.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompt.")
@MAX_SEQ
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(model: Path, steps: int, prompt_len: int, prompt_ids: list[int] | None, atol: float,
           seed: int, max_seq: int | None, as_json: bool) -> None:
    """Compare zlc against ONNX Runtime: prefill a prompt, then STEPS decode steps with zlc's KV
    cache; report logit errors and greedy-token agreement. Exits 0 on pass, 3 beyond tolerance."""
    with progress(f"verify {model.name}", then="comparing with ONNX Runtime") as p:
        from .verifier import verify as run_verify

        rep = run_verify(model, prompt_ids=prompt_ids, prompt_len=prompt_len, steps=steps, atol=atol,
                         max_seq=max_seq, seed=seed, observer=p)
    if as_json:
        click.echo(json.dumps(_report_json(rep), indent=2))
    else:
        _print_report(rep)
    if not rep.ok:
        raise VerificationError(f"verification failed: {rep.summary()}")


def _report_json(rep: VerifyReport) -> dict[str, Any]:
    return {**asdict(rep), "ok": rep.ok, "max_abs": rep.max_abs, "tokens_equal": rep.tokens_equal}


def _mark(ok: bool) -> str:
    return "[green]✓[/]" if ok else "[red]✗[/]"


def _print_report(rep: VerifyReport) -> None:
    out = _out()
    t = Table(title=f"zlc verify {escape(rep.model)} vs ONNX Runtime "
                    f"(prompt {len(rep.prompt)} tokens, {len(rep.tokens_ref)} greedy steps, atol {rep.atol:g})",
              title_justify="left")
    t.add_column("check")
    t.add_column("max abs", justify="right")
    t.add_column("max rel", justify="right")
    t.add_column("", justify="center")
    t.add_row("prefill logits", f"{rep.prefill_max_abs:.3g}", f"{rep.prefill_max_rel:.3g}",
              _mark(rep.prefill_max_abs <= rep.atol))
    if rep.decode_max_abs:
        worst = max(rep.decode_max_abs)
        t.add_row(f"decode logits ({len(rep.decode_max_abs)} steps, worst)", f"{worst:.3g}",
                  f"{max(rep.decode_max_rel):.3g}", _mark(worst <= rep.atol))
    agree = sum(a == b for a, b in zip(rep.tokens_ref, rep.tokens_zlc, strict=True))
    t.add_row("greedy tokens equal", f"{agree}/{len(rep.tokens_ref)}", "", _mark(rep.tokens_equal))
    out.print(t)
    out.print(_histogram_table(rep.histogram_before, rep.histogram_after))
    out.print("[bold green]PASS[/]" if rep.ok else "[bold red]FAIL[/]")


# ---- zlc inspect ----------------------------------------------------------------------------------

@cli.command()
@click.argument("model", type=click.Path(path_type=Path), metavar="MODEL|BUNDLE")
@click.option("--ir", "show_ir", is_flag=True, help="Print the IR text (default: the final decode graph).")
@click.option("--after", "after", metavar="STAGE", default=None,
              help=f"Stop the pipeline after STAGE and dump that graph: {', '.join(STAGE_NAMES)}.")
@click.option("--prefill", is_flag=True, help="With the kv-cache stage, dump the prefill graph instead.")
@click.option("--stats", is_flag=True, help="Per-stage time, node count and statistics; op histograms.")
@click.option("--explain", is_flag=True, help="Why raising rules refused to match (rule, reason, count).")
@click.option("--tasks", "show_tasks", is_flag=True, help="BUNDLE: print the task table (decode; "
              "--prefill for prefill) of the cpu tiling, or --tiling gpu.")
@click.option("--tiling", type=click.Choice(["cpu", "gpu"]), default="cpu", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="BUNDLE: print the manifest.")
@MAX_SEQ
def inspect(model: Path, show_ir: bool, after: str | None, prefill: bool, stats: bool, explain: bool,
            show_tasks: bool, tiling: str, as_json: bool, max_seq: int | None) -> None:
    """Lower MODEL and show what the compiler did (without flags: the stage statistics), or show a
    compiled BUNDLE: model, tasks per step, per-target registers/spills and roofline."""
    if model.is_dir():
        _inspect_bundle(model, show_tasks, tiling, "prefill" if prefill else "decode", as_json,
                        show_ir)
        return
    _check_stage(after)
    show_ir = show_ir or (after is not None and not (stats or explain))
    if not (show_ir or stats or explain):
        stats = True
    with progress(f"lower {model.name}") as p:
        from .driver import CompileOptions, lower

        opts = CompileOptions() if max_seq is None else CompileOptions(max_seq=max_seq)
        lowered = lower(model, options=opts, observer=p, stop_after=after)
    if stats:
        _print_stats(lowered)
    if explain:
        _print_explain(lowered)
    if show_ir:
        from .ir import print_graph

        click.echo(print_graph(_dumped_graph(lowered, after, prefill)), nl=False)


def _inspect_bundle(path: Path, show_tasks: bool, tiling: str, mode: str, as_json: bool, show_ir: bool) -> None:
    from .bundle import read_manifest, verify_checksums

    man = read_manifest(path)
    if as_json:
        click.echo(json.dumps(man, indent=1))
        return
    if show_ir:
        click.echo((path / "ir" / f"{mode}.zir").read_text(), nl=False)
        return
    if not show_tasks:
        _print_bundle(man, path)
        verify_checksums(path, man)
        _out().print(f"checksums: {len(man['files'])} files ok")
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
    _out().print(t)


def _dumped_graph(lowered: Lowered, after: str | None, prefill: bool) -> Graph:
    """The graph the pipeline ended with: decode (or prefill) after kv-cache, else the main one."""
    if after in (None, "kv-cache") and lowered.decode is not None:
        return lowered.prefill if prefill and lowered.prefill is not None else lowered.decode
    return lowered.graph


def _print_stats(lowered: Lowered) -> None:
    out = _out()
    t = Table(title="pipeline stages", title_justify="left")
    t.add_column("stage")
    t.add_column("time (ms)", justify="right")
    t.add_column("nodes", justify="right")
    t.add_column("statistics")
    for s in lowered.stages:
        detail = ", ".join(f"{k}={v}" for k, v in s.stats.items())
        t.add_row(s.name, f"{s.seconds * 1e3:.1f}", str(s.nodes), escape(detail))
    t.add_row("[bold]total[/]", f"{sum(s.seconds for s in lowered.stages) * 1e3:.1f}", "", "")
    out.print(t)
    out.print(_histogram_table(lowered.histogram_before, lowered.histogram_after))
    if lowered.prefill is not None:
        cache = ", ".join(f"{n}: {t}" for n, t in lowered.cache)
        out.print(f"KV cache ({len(lowered.cache)} buffers, max_seq {lowered.max_seq}): {escape(cache)}")


def _print_explain(lowered: Lowered) -> None:
    out = _out()
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


# ---- zlc compile ----------------------------------------------------------------------------------

class CompileProgress:
    """Stage lines on stderr for `zlc compile` (a live status on terminals, plain lines otherwise)."""

    def __init__(self) -> None:
        self.console = _err()
        self.status = self.console.status("") if self.console.is_terminal else None
        self.stage: str | None = None
        self.t = self.t0 = time.perf_counter()

    def __enter__(self) -> CompileProgress:
        if self.status is not None:
            self.status.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.status is not None:
            self.status.stop()

    def __call__(self, stage: str, detail: str) -> None:
        now = time.perf_counter()
        if stage != self.stage:
            if self.stage is not None:
                self.console.print(f"[green]✓[/] {escape(self.stage):<10} {now - self.t:>7.2f} s")
            self.stage, self.t = stage, now
        if self.status is not None:
            self.status.update(f"{escape(stage)}: {escape(detail)}")
        elif stage == "aot":
            self.console.print(f"  {escape(detail)}")

    def done(self) -> None:
        self("done", "")


@cli.command("compile")
@click.argument("model", type=click.Path(dir_okay=False, path_type=Path), metavar="MODEL")
@click.option("--target", "targets", multiple=True, metavar="NAME",
              help="a10 a100 l4 rtx3090 rtx4090 h100 h200 cpu; repeat for several (default: cpu).")
@click.option("-o", "--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Bundle directory (default: MODEL's stem + .zlc, in the current directory).")
@click.option("--dtype", type=click.Choice(["auto", "fp32", "bf16"]), default="auto", show_default=True,
              help="Weight dtype; auto: bf16 when a GPU target is named, else fp32. Math is f32.")
@click.option("--max-seq", type=click.IntRange(min=1), default=2048, show_default=True,
              help="Positions the KV cache and rotary tables hold.")
@click.option("--tokenizer", type=click.Path(exists=True, path_type=Path), default=None,
              help="tokenizer.json, a Hugging Face model directory, or a GGUF file to bundle.")
@click.option("--skip-verify", is_flag=True, help="Do not check the lowered model against ONNX Runtime.")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory that is not a bundle.")
@click.option("--debug-waits", is_flag=True, help="Debug build: a wait that never completes raises an "
              "error flag after 2 s instead of hanging the GPU.")
@click.option("--json", "as_json", is_flag=True, help="Print the compile report as JSON.")
def compile_cmd(model: Path, targets: tuple[str, ...], out: Path | None, dtype: str, max_seq: int,
                tokenizer: Path | None, skip_verify: bool, force: bool, debug_waits: bool, as_json: bool) -> None:
    """Compile MODEL into a bundle: one persistent megakernel (AOT cubins per GPU target), its task
    tables, weights, tokenizer and a manifest. Checks the lowered model against ONNX Runtime first."""
    from .targets import get_target

    for t in targets:
        get_target(t)  # unknown names fail before any work
    with CompileProgress() as p:
        from .compile import compile

        res = compile(model, targets=list(targets) or ["cpu"], out=out, dtype=dtype, max_seq=max_seq,
                      tokenizer=tokenizer, verify=not skip_verify, progress=p, force=force,
                      debug_waits=debug_waits)
        p.done()
    if as_json:
        click.echo(json.dumps(_compile_report(res.manifest, res.seconds, res.path), indent=1))
        return
    _print_bundle(res.manifest, res.path, res.seconds)


def _compile_report(man: dict[str, Any], secs: dict[str, float] | None, path: Path) -> dict[str, Any]:
    return {"bundle": str(path), "model": man["model"]["name"], "dtype": man["dtype"],
            "tasks": {k: v["summary"]["tasks"] for k, v in man["tilings"].items()},
            "targets": {k: {"arch": v["arch"], "resources": v.get("resources"), "roofline": v["roofline"]}
                        for k, v in man["targets"].items()},
            "verification": man["verification"], "seconds": secs or man.get("compile_seconds")}


def _print_bundle(man: dict[str, Any], path: Path, secs: dict[str, float] | None = None) -> None:
    out = _out()
    m = man["model"]
    ver = man.get("verification", {})
    out.print(f"[bold]{escape(str(path))}[/]: {escape(m['name'])}, {m['layers']} layers, vocab {m['vocab']}, "
              f"max_seq {m['max_seq']}, weights {man['dtype']['weights']} (f32 math)")
    vs = ver.get("status", "skipped")
    out.print(f"verification: {vs}" + (f" ({escape(ver['summary'])})" if ver.get("summary") else ""))
    for key, tl in man["tilings"].items():
        sm = tl["summary"]
        by = ", ".join(f"{k} {v}" for k, v in sm["tasks_by_op"]["decode"].items())
        out.print(f"tiling {key}: {sm['tasks']['decode']} tasks per decode step ({by}); "
                  f"{sm['tasks']['prefill']} per prefill launch (≤{tl['layout']['chunk']} tokens); "
                  f"{sm['waits_per_task']['decode']} waits per task")
    t = Table(title="targets", title_justify="left")
    for col in ("target", "arch", "grid", "registers", "spills (B)", "shared (B)", "bytes/step", "floor"):
        t.add_column(col, justify="right" if col not in ("target", "arch") else "left")
    for name, info in man["targets"].items():
        r = info.get("resources") or {}
        rf = info["roofline"]
        ctx = max(int(k.rsplit("_", 1)[1]) for k in rf if k.startswith("floor_us_at_"))
        ctx = min(ctx, 128) if f"floor_us_at_{min(ctx, 128)}" in rf else ctx
        floor = rf.get(f"floor_us_at_{ctx}")
        t.add_row(name, info["arch"], str(info.get("grid", "")), str(r.get("registers", "-")),
                  f"{r.get('spill_stores', 0)}/{r.get('spill_loads', 0)}" if r else "-",
                  str(info.get("metadata", {}).get("shared", "-")) if r else "-",
                  f"{rf[f'bytes_at_{ctx}'] / 1e6:.2f} MB @{ctx}",
                  f"{floor:.1f} µs" if floor is not None else "-")
    out.print(t)
    if secs:
        out.print("compile: " + ", ".join(f"{k} {v:.2f} s" for k, v in secs.items()))


# ---- zlc run --------------------------------------------------------------------------------------

@cli.command()
@click.argument("model", type=click.Path(path_type=Path), metavar="MODEL|BUNDLE")
@click.option("--prompt", default=None, help="Text prompt (bundles with a tokenizer; chat template applied).")
@click.option("--prompt-ids", type=IdList(), default=None, help="The prompt as token ids: 1,2,3.")
@click.option("--raw", is_flag=True, help="With --prompt: no chat template, encode the text as is.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--device", type=click.Choice(["cpu", "cuda", "reference"]), default="cpu", show_default=True,
              help="Bundles: cpu runs the megakernel in Triton's interpreter (slow, exact); cuda its "
              "cubin; reference the bundle's IR on its packed weights with torch on the CPU (fast). "
              "An ONNX MODEL always runs on the reference executor (cpu or reference).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--eos", type=int, default=None, help="Stop after generating this token id (default: the "
              "tokenizer's end-of-sequence ids).")
@MAX_SEQ
@click.option("--json", "as_json", is_flag=True, help="Print prompt and generated ids (and text) as JSON.")
def run(model: Path, prompt: str | None, prompt_ids: list[int] | None, raw: bool, max_new_tokens: int,
        device: str, temperature: float, top_p: float, seed: int, eos: int | None, max_seq: int | None,
        as_json: bool) -> None:
    """Generate from a compiled BUNDLE (the megakernel) or lower an ONNX MODEL and generate with the
    CPU reference executor (one IR node at a time: what the compiled model computes, not how fast).

    With --prompt the text streams as it is produced; with --prompt-ids the new ids are printed.
    """
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    if model.is_dir():
        if max_seq is not None:
            raise click.UsageError("--max-seq is fixed when a bundle is compiled (zlc compile --max-seq)")
        _run_bundle(model, prompt, prompt_ids, raw, max_new_tokens, device, temperature, top_p, seed, eos,
                    as_json)
        return
    if prompt_ids is None:
        raise click.UsageError("--prompt needs a compiled bundle with a tokenizer (zlc compile --tokenizer); "
                               "for an ONNX file use --prompt-ids")
    if device not in ("cpu", "reference"):
        raise click.UsageError("an ONNX MODEL runs on the CPU reference executor; compile it for a GPU")
    need = len(prompt_ids) + max_new_tokens
    if max_seq is not None and need > max_seq:
        raise ZlcError(f"prompt ({len(prompt_ids)}) + max-new-tokens ({max_new_tokens}) exceed "
                       f"--max-seq {max_seq}")
    with progress(f"lower {model.name}") as p:
        from zlc.reference.session import ReferenceSession

        from .driver import CompileOptions, lower
        from .verifier import check_token_ids

        lowered = lower(model, options=CompileOptions(max_seq=max_seq or max(need, 64)), observer=p)
        vocab = lowered.graph.outputs[0].shape[-1] if lowered.graph.outputs[0].shape else None
        if isinstance(vocab, int):
            check_token_ids(prompt_ids, vocab)
        p.show(f"generating {max_new_tokens} tokens (CPU reference executor)")
        ids = ReferenceSession.from_lowered(lowered).generate(
            prompt_ids, max_new_tokens, eos=eos, temperature=temperature, top_p=top_p, seed=seed)
    if as_json:
        click.echo(json.dumps({"prompt": prompt_ids, "generated": ids}))
    else:
        click.echo(",".join(str(i) for i in ids))


def _run_bundle(path: Path, prompt: str | None, prompt_ids: list[int] | None, raw: bool, max_new_tokens: int,
                device: str, temperature: float, top_p: float, seed: int, eos: int | None,
                as_json: bool) -> None:
    from zlc.runtime.loader import load

    bundle = load(path)
    err = _err()
    if not bundle.verified:
        err.print(f"[yellow]warning:[/] {escape(bundle.name)} was compiled without verification "
                  "(--skip-verify); its output is unchecked")
    tok = bundle.tokenizer
    if prompt is not None:
        if tok is None:
            raise ZlcError(f"{path} has no tokenizer; recompile with --tokenizer PATH or use --prompt-ids")
        ids = tok.encode(prompt) if raw or not tok.has_chat_template else tok.encode_chat(prompt)
    else:
        assert prompt_ids is not None
        ids = prompt_ids
    stops: list[int] = [eos] if eos is not None else bundle.eos_token_ids
    if len(ids) + max_new_tokens - 1 > bundle.max_seq:
        raise ZlcError(f"prompt ({len(ids)} tokens) + max-new-tokens ({max_new_tokens}) exceed the bundle's "
                       f"max_seq={bundle.max_seq}; recompile with a larger --max-seq")
    status = err.status(f"starting the {device} executor") if err.is_terminal else None
    if status is not None:
        status.start()
    out_ids: list[int] = []
    t0 = time.perf_counter()
    first: float | None = None
    try:
        with bundle.session(device) as s:
            if status is not None:
                status.update(f"prefill ({len(ids)} tokens, {device})")
            dec = tok.stream_decoder() if (tok is not None and prompt is not None) else None
            for t in s.stream(ids, max_new_tokens, eos=stops, temperature=temperature, top_p=top_p, seed=seed):
                if first is None:
                    first = time.perf_counter() - t0
                    if status is not None:
                        status.stop()
                        status = None
                out_ids.append(t)
                if as_json:
                    continue
                if dec is not None:
                    text = dec.feed(t)
                    if text:
                        click.echo(text, nl=False)
                else:
                    click.echo(("," if len(out_ids) > 1 else "") + str(t), nl=False)
            if dec is not None and not as_json:
                click.echo(dec.flush(), nl=False)
    finally:
        if status is not None:
            status.stop()
    total = time.perf_counter() - t0
    if as_json:
        res: dict[str, Any] = {"prompt": ids, "generated": out_ids}
        if tok is not None:
            res["text"] = tok.decode(out_ids)
        click.echo(json.dumps(res))
        return
    click.echo()
    err.print(f"[dim]{len(out_ids)} tokens on {device}: first after {first or 0:.2f} s, "
              f"{total:.2f} s in all[/]")


# ---- zlc serve ------------------------------------------------------------------------------------

@cli.command()
@click.argument("bundle", type=click.Path(exists=True, file_okay=False, path_type=Path), metavar="BUNDLE")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (elsewhere than loopback: set --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True,
              help="HTTP port (0: any free port, printed at start).")
@click.option("--api-key", envvar="ZLC_API_KEY", default=None,
              help="Require this key (x-api-key or Authorization: Bearer). Env: ZLC_API_KEY.")
@click.option("--model-name", default=None, help="The name clients must send as `model` "
              "(default: the bundle's model name).")
@click.option("--device", type=click.Choice(["cpu", "cuda", "reference"]), default="cpu", show_default=True,
              help="Executor: cpu = the megakernel in Triton's interpreter, cuda = its cubin, "
              "reference = the bundle's IR with torch on the CPU.")
@click.option("--frame-port", type=click.IntRange(0, 65535), default=None,
              help="Also accept binary token frames over TCP on this port (docs/frames.md).")
@click.option("--udp-port", type=click.IntRange(0, 65535), default=None,
              help="Also accept binary token frames over UDP on this port.")
@click.option("--xdp", "xdp", metavar="IFACE", default=None,
              help="Attach the bundle's XDP program (deploy/ebpf/zlc_xdp.o) to IFACE: UDP frames to "
              "--udp-port go through a BPF ring buffer; root needed (docs/deployment.md).")
@click.option("--max-queue", type=click.IntRange(min=1), default=32, show_default=True,
              help="Requests waiting for the engine before new ones get an overload error (529 / 429).")
@click.option("--max-body", type=click.IntRange(min=1024), default=4 * 1024 * 1024, show_default=True,
              help="Largest request body in bytes (413 beyond).")
@click.option("--request-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds a request may take to arrive completely (408 and close beyond).")
@click.option("--spin-us", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Microseconds the engine polls the request ring before it sleeps: lower wake-up "
              "latency for a core that does nothing else (an isolated serving core); 0 sleeps at once.")
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True,
              help="CPU threads of the executor (reference/cpu devices): raise for big models on many "
              "cores; 1 keeps small models' latency steady.")
def serve(bundle: Path, host: str, port: int, api_key: str | None, model_name: str | None, device: str,
          frame_port: int | None, udp_port: int | None, xdp: str | None, max_queue: int, max_body: int,
          request_timeout: float, spin_us: float, threads: int) -> None:
    """Serve a compiled BUNDLE: the Anthropic Messages API (POST /v1/messages) and OpenAI's chat
    completions (POST /v1/chat/completions), both with SSE streaming; GET /v1/models, /health,
    /metrics (Prometheus); binary token frames over TCP/UDP with --frame-port/--udp-port.

    Runs until Ctrl-C / SIGTERM. The engine (one process owning the executor) and this ingress talk
    through shared-memory rings (docs/serving.md)."""
    from zlc.runtime.serve.http import HttpLimits
    from zlc.runtime.serve.server import ServeOptions
    from zlc.runtime.serve.server import run as run_server

    opts = ServeOptions(host=host, port=port, api_key=api_key or None, model_name=model_name, device=device,
                        frame_port=frame_port, udp_port=udp_port, xdp=xdp, max_queue=max_queue, spin_us=spin_us,
                        threads=threads,
                        limits=HttpLimits(max_body_bytes=max_body, request_timeout_s=request_timeout))
    err = _err()
    err.print(f"[dim]zlc serve: loading {escape(str(bundle))} on {device}…[/]")

    def announce(server: Any) -> None:
        a = server.addresses
        http_host, http_port = a["http"]
        parts = [f"http://{http_host}:{http_port}"]
        if "frames_tcp" in a:
            parts.append(f"frames tcp {a['frames_tcp'][1]}")
        if "frames_udp" in a:
            parts.append(f"frames udp {a['frames_udp'][1]}")
        if "xdp" in a:
            parts.append(f"XDP on {a['xdp'][0]}")
        # one machine-readable line on stdout (scripts and tests wait for it), the rest on stderr
        click.echo(json.dumps({"event": "listening", "model": server.model, "device": device,
                               **{k: list(v) for k, v in a.items()}}), nl=True)
        sys.stdout.flush()
        err.print(f"zlc serve: {escape(server.model)} on {device}: " + ", ".join(parts))

    run_server(str(bundle), opts, announce)


# ---- zlc deploy -----------------------------------------------------------------------------------

@cli.group()
def deploy() -> None:
    """Host setup for serving a bundle (docs/deployment.md): each GPU's `zlc serve` pinned to cores on
    its NUMA node, interrupts and kernel housekeeping kept off them (systemd units, tuned profile,
    irqbalance, IRQ affinity, sysctls, kernel arguments), and Kubernetes manifests for fleets."""


class CpuList(click.ParamType):
    """The kernel's list format: 2-5,8."""

    name = "LIST"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> frozenset[int]:
        from .deploy import DeployError, parse_cpulist

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

    from .bundle import read_manifest
    from .deploy import PlanOptions, Topology, plan, read_topology

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
    from .deploy import format_cpulist

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
    from .deploy import write_dir

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
    from zlc.deploy.ebpf import build_into_bundle

    from .deploy import write

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
        _err().print(f"[yellow]warning:[/] XDP program not built ({escape(xdp.reason)}); its source is in "
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
    from .bundle import MANIFEST, read_manifest
    from .deploy import DEPLOY_DIR, apply, host_changes, load_plan

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
    from .deploy import read_topology

    click.echo(json.dumps(read_topology().to_json(), indent=1))


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (`zlc = zlc.cli:main`)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="zlc")


if __name__ == "__main__":  # pragma: no cover
    main()
