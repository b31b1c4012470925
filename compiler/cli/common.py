"""What every `zlc` command family shares: the `cli` group and its error handling, the consoles, the
shared options and parameter types, the pipeline progress line, and the two displays used by more
than one family (the op histogram, a bundle's summary).

Errors: every ZlcError is one red line on stderr and exits with `err.exit_code`; click usage errors
are one line too (exit 2); anything else is an "internal error" line (exit 70) with a hint to rerun
with `--debug`, which shows tracebacks. Results go to stdout, progress and errors to stderr, so
`zlc inspect --ir m.onnx > m.zir` and `zlc verify --json` stay machine-readable.

Only click, rich and zlc.errors are imported here: this module is loaded by `zlc --help`.
"""

from __future__ import annotations

import sys
import time
import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..errors import ZlcError
from ..version import __version__

if TYPE_CHECKING:
    from ..ir import Graph

EXIT_USAGE = 2  # click's convention
EXIT_INTERNAL = 70  # EX_SOFTWARE: a bug in zlc, not in the user's input
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what `zlc inspect --ir m.onnx | head` ends with

# Mirror zlc.driver.STAGES / RAISE_STAGES and zlc.build.COMPILE_STAGE_NAMES for `--help` and the
# progress line, which must not import the driver (and torch); tests/test_cli.py checks that they
# agree. Validation reads the driver's own lists (inspect.check_stage).
STAGE_NAMES = ("import", "fold", "canonicalize", "cse", "dce", "raise", "cleanup", "kv-cache")
RAISE_STAGE_NAMES = ("raise-norms", "raise-embedding", "raise-linear", "raise-rope", "raise-attention", "raise-moe",
                     "raise-mlp", "raise-fused-projections", "raise-heads", "raise-rows", "raise-lm-head",
                     "raise-blocks")
COMPILE_STAGE_NAMES = ("lower", "verify", "quantize", "schedule", "emit", "weights", "native", "aot", "tokenizer", "ebpf",
                       "manifest")

# The import names of pyproject's `compile` extra: a runtime-only install (`pip install zlc`) lacks
# them, and the commands that lower or compile a model say so in one line (require_compiler).
COMPILER_MODULES = ("torch", "onnx", "onnx_ir", "onnxruntime", "triton", "gguf", "safetensors")
INSTALL_COMPILER = "pip install 'zlc[compile]'"

_settings = {"debug": False}


def out_console() -> Console:
    """A rich console on stdout (results). Built per use: click's CliRunner swaps sys.stdout between
    invocations."""
    return Console(highlight=False, soft_wrap=True)


def err_console() -> Console:
    """A rich console on stderr (progress, warnings, errors); built per use like out_console."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def one_line(msg: str) -> str:
    """`msg` with every run of whitespace (newlines included) made one space."""
    return " ".join(msg.split()) or "(no message)"


def error_line(msg: str) -> None:
    """Prints `msg` as the one red `error:` line on stderr."""
    err_console().print(f"[bold red]error:[/] {escape(one_line(msg))}")


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
            sys.exit(exit_code_for(e))
        sys.exit(rv if isinstance(rv, int) else 0)


def exit_code_for(e: BaseException) -> int:
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
        error_line(e.format_message() + where)
        return EXIT_USAGE
    if isinstance(e, click.ClickException):
        error_line(e.format_message())
        return e.exit_code
    if isinstance(e, (KeyboardInterrupt, click.Abort)):
        error_line("interrupted")
        return EXIT_INTERRUPTED
    if isinstance(e, ZlcError):
        error_line(str(e))
        return e.exit_code
    if isinstance(e, ModuleNotFoundError) and (e.name or "").partition(".")[0] in COMPILER_MODULES:
        error_line(f"this needs the compiler (no module named '{e.name}'): {INSTALL_COMPILER}")
        return ZlcError.exit_code
    error_line(f"internal error: {type(e).__name__}: {e} -- this is a bug in zlc; "
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

    MODEL is a decoder-only LM (token ids -> logits): an ONNX file (stateless, Optimum-style
    KV-cache or onnxruntime-genai-style graphs), a llama.cpp GGUF file, or a Hugging Face
    checkpoint directory (config.json + *.safetensors, with its tokenizer.json).
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


MODEL = click.argument("model", type=click.Path(path_type=Path), metavar="MODEL")


def require_compiler(command: str) -> None:
    """Refuses `command` in one line, before any work, when the compile extra is not installed."""
    import importlib.util

    missing = [m for m in COMPILER_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise ZlcError(f"{command} needs the compiler: {INSTALL_COMPILER} (not installed: {', '.join(missing)})")


def is_bundle_arg(path: Path) -> bool:
    """Whether a MODEL|BUNDLE argument is a bundle: a directory that is not a Hugging Face
    checkpoint (config.json); one that is neither is refused here in one line."""
    if not path.is_dir() or (path / "manifest.json").is_file():
        return path.is_dir()
    if (path / "config.json").is_file():  # hf_dir.is_checkpoint_dir, without importing the frontend here
        return False
    raise ZlcError(f"{path} is neither a zlc bundle (no manifest.json) nor a Hugging Face checkpoint "
                   "directory (no config.json)")


MAX_SEQ = click.option("--max-seq", type=click.IntRange(min=1), default=None,
                       help="Positions the KV cache and rotary tables hold.")


class StageProgress:
    """A rich status line on stderr naming the pipeline stage being run, and a line per finished
    stage (terminals only: piped stderr stays clean). Used as the driver's `observer`."""

    def __init__(self, what: str, then: str = ""):
        self.console = err_console()
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
    """The pipeline's StageProgress for `what`; `then` names the work after the last stage."""
    with StageProgress(what, then) as p:
        yield p


def histogram_table(before: dict[str, int], after: dict[str, int]) -> Table:
    """The op histogram before and after raising (verify's report, inspect's statistics)."""
    t = Table(title="op histogram (before -> after raising)", title_justify="left")
    t.add_column("op")
    t.add_column("before", justify="right")
    t.add_column("after", justify="right")
    ops = sorted(set(before) | set(after), key=lambda o: (-after.get(o, 0), -before.get(o, 0), o))
    for op in ops:
        t.add_row(op, str(before.get(op, "")), str(after.get(op, "")))
    t.add_row("[bold]total[/]", str(sum(before.values())), str(sum(after.values())))
    return t


def print_bundle(man: dict[str, Any], path: Path, secs: dict[str, float] | None = None,
                 memory: dict[str, Any] | None = None) -> None:
    """A bundle's summary from its manifest: model, verification, tasks per tiling, per-target
    resources and roofline (what `zlc compile` prints at the end, and `zlc inspect BUNDLE`)."""
    out = out_console()
    m = man["model"]
    ver = man.get("verification", {})
    out.print(f"[bold]{escape(str(path))}[/]: {escape(m['name'])}, {m['layers']} layers, vocab {m['vocab']}, "
              f"max_seq {m['max_seq']}, weights {man['dtype']['weights']} (f32 math), "
              f"numerics {man.get('numerics', 'exact')}")
    vs = ver.get("status", "skipped")
    out.print(f"verification: {vs}" + (f" ({escape(ver['summary'])})" if ver.get("summary") else ""))
    q = man.get("quantization")
    if q and q.get("source"):  # the model's own blocks (a GGUF), kept
        by = ", ".join(f"{n} {f}" for f, n in sorted(q["formats"].items()))
        out.print(f"packed as given: {q['packed']} matrices ({by}; {q['f32_bytes'] / 1e6:.1f} MB f32 -> "
                  f"{q['packed_bytes'] / 1e6:.1f} MB), {len(q['dense'])} dense")
        from ..passes.quantize import describe_packed

        for dense in describe_packed(q)[1:]:  # which are dense and why
            out.print(f"  {escape(dense)}")
    elif q:
        out.print(f"quantized: {q['format']}, {q['packed']} Linear weights packed ({q['f32_bytes'] / 1e6:.1f} MB f32 -> "
                  f"{q['packed_bytes'] / 1e6:.1f} MB), {len(q['dense'])} dense; vs unquantized on "
                  f"{q['accuracy']['probes']} probe prompts: {escape(q['accuracy']['summary'])}")
    if (man.get("tokenizer") or {}).get("chat_template_default"):
        out.print("tokenizer: the GGUF has no chat template; using the default ChatML template")
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
    for name, info in man["targets"].items():
        if (line := _cubin_line(info)) is not None:
            out.print(f"cubins {name}: {line}")
    if (line := _cache_line(man.get("cache"))) is not None:
        out.print(escape(line))
    if secs:
        out.print("compile: " + ", ".join(f"{k} {v:.2f} s" for k, v in secs.items()))
    if (line := memory_line(memory)) is not None:
        out.print(escape(line))


def memory_line(mem: dict[str, Any] | None) -> str | None:
    """The compile's peak resident set, its ratio to the model file and the stage that reached it."""
    if not mem or not mem.get("peak_rss"):
        return None
    mib = 1 / 2**20
    peak = mem["peak_rss"]
    at = next((k for k, (_, hwm) in mem["stages"].items() if hwm >= peak), None)
    of = (f" = {mem['ratio']}x the model's {mem['model_bytes'] * mib:.0f} MiB" if mem.get("ratio") else "")
    return f"memory: peak RSS {peak * mib:.0f} MiB{of}" + (f", reached in the {at} stage" if at else "")


def _cache_line(c: dict[str, Any] | None) -> str | None:
    """Which native libraries and cubins came from the compile cache (bundles before it: None)."""
    if not c:
        return None
    hits, built = c.get("hits", []), c.get("built", [])
    if not hits and not built:
        return None
    where = f"compile cache {c['dir']}" if c.get("dir") else "compile cache"
    if c.get("off"):
        return f"{where}: not used ({c['off']}); {len(built)} libraries and cubins built"
    said = f"{where}: {len(hits)} of {len(hits) + len(built)} libraries and cubins from it"
    return said + (f" ({', '.join(hits)})" if hits else "") + (f"; built: {', '.join(built)}" if built else "")


def _cubin_line(info: dict[str, Any]) -> str | None:
    """Which toolkits assembled a GPU target's decode kernel and the oldest driver each needs (the
    CUDA executor loads the first one the driver takes), or None for a target without cubins."""
    cubins = info.get("cubins") or []
    if not cubins:
        return None

    def driver(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"

    parts = [f"CUDA {c['toolkit']} (driver >= {driver(int(c['min_driver']))})" for c in cubins]
    if info.get("fallback_skipped"):
        parts.append(f"no fallback: {info['fallback_skipped']}")
    return ", then ".join(parts)
