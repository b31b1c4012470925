"""`zlc verify`: lower a model and compare it with ONNX Runtime, prefill then decode steps, and say
whether the lowered graph fits the megakernel.

Exit codes: 0 when the numbers pass and the model compiles; 3 (VerificationError) when the numbers
do not; 4 (NotCompilableError) when they do but `zlc compile` would fail, so a CI running
`zlc verify` never takes an uncompilable model for a good one. `--numerics-only` makes 4 a 0 (the
"compilable: no" line stays) for models meant for `zlc run model.onnx` on the reference executor."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.markup import escape
from rich.table import Table

from ..errors import VerificationError
from .common import (
    MAX_SEQ,
    MODEL,
    IdList,
    cli,
    histogram_table,
    out_console,
    progress,
    require_compiler,
)

if TYPE_CHECKING:
    from ..verifier import VerifyReport


@cli.command()
@MODEL
@click.option("--steps", type=click.IntRange(min=1), default=32, show_default=True,
              help="Decode steps after the prompt.")
@click.option("--prompt-len", type=click.IntRange(min=1), default=8, show_default=True,
              help="Length of the random prompt (ignored with --prompt-ids).")
@click.option("--prompt-ids", type=IdList(), default=None, help="The prompt as token ids: 1,2,3.")
@click.option("--atol", type=click.FloatRange(min=0), default=None,
              help="Max abs logit error allowed (default by the model's dtype: f32 1e-3, f16 2e-2, bf16 1e-2).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random prompt.")
@MAX_SEQ
@click.option("--numerics-only", is_flag=True,
              help="Exit 0 when the numbers pass even if the model does not fit the megakernel.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify(model: Path, steps: int, prompt_len: int, prompt_ids: list[int] | None, atol: float | None,
           seed: int, max_seq: int | None, numerics_only: bool, as_json: bool) -> None:
    """Compare zlc against ONNX Runtime: prefill a prompt, then STEPS decode steps with zlc's KV
    cache; report logit errors, greedy-token agreement, and whether the lowered model fits the
    megakernel. bf16 models (which ONNX Runtime has no kernels for) are compared with the imported
    graph run in f32 on the same weights by zlc's reference executor. Exits 0 on pass, 3 beyond tolerance, 4 when it passes but does not compile
    (0 with --numerics-only)."""
    require_compiler("zlc verify")
    with progress(f"verify {model.name}", then="comparing with ONNX Runtime") as p:
        from ..verifier import verify as run_verify

        rep = run_verify(model, prompt_ids=prompt_ids, prompt_len=prompt_len, steps=steps, atol=atol,
                         max_seq=max_seq, seed=seed, observer=p)
    if as_json:
        click.echo(json.dumps(_report_json(rep), indent=2))
    else:
        _print_report(rep)
    if not rep.ok:
        raise VerificationError(f"verification failed: {rep.summary()}")
    if not rep.compilable and not numerics_only:
        from ..verifier import NotCompilableError

        raise NotCompilableError(f"verified, but {rep.compilable_line()}; `zlc compile` would fail "
                                 "(--numerics-only to accept it for the reference executor)")


def _report_json(rep: VerifyReport) -> dict[str, Any]:
    return {**asdict(rep), "ok": rep.ok, "max_abs": rep.max_abs, "tokens_equal": rep.tokens_equal,
            "compilable": rep.compilable}


def _mark(ok: bool) -> str:
    return "[green]✓[/]" if ok else "[red]✗[/]"


def _print_report(rep: VerifyReport) -> None:
    out = out_console()
    t = Table(title=f"zlc verify {escape(rep.model)} ({rep.dtype}) vs {escape(rep.oracle)} "
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
    t.add_row("fits the megakernel", "", "", _mark(rep.compilable))
    out.print(t)
    out.print(histogram_table(rep.histogram_before, rep.histogram_after))
    out.print(f"oracle: {escape(rep.oracle)}")
    out.print("[bold green]PASS[/]" if rep.ok else "[bold red]FAIL[/]")
    out.print("compilable: yes" if rep.compilable else "compilable: no")
    for line in rep.megakernel:
        out.print(f"  - {escape(line)}")
