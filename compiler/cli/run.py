"""`zlc run`: generate from a compiled bundle (its megakernel, or the bundle's IR on the reference
executor), or lower an ONNX model and generate with the CPU reference executor."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from ..errors import ZlcError
from .common import MAX_SEQ, IdList, cli, err_console, is_bundle_arg, progress, require_compiler


@cli.command()
@click.argument("model", type=click.Path(path_type=Path), metavar="MODEL|BUNDLE")
@click.option("--prompt", default=None, help="Text prompt (bundles with a tokenizer; chat template applied).")
@click.option("--prompt-ids", type=IdList(), default=None, help="The prompt as token ids: 1,2,3.")
@click.option("--raw", is_flag=True, help="With --prompt: no chat template, encode the text as is.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--device", type=click.Choice(["auto", "cpu", "interpret", "cuda", "reference"]), default="auto",
              show_default=True,
              help="Bundles: auto = cuda when this host has a GPU the bundle has a cubin for, else cpu; cpu "
              "runs the native C megakernel on this machine's cores; interpret the Triton kernel in "
              "Triton's interpreter (slow: the check of the Triton source); cuda its cubin; reference the "
              "bundle's IR on its packed weights with torch. An ONNX MODEL always runs on the reference "
              "executor (auto, cpu or reference).")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Worker threads of the native kernel (--device cpu/auto; default: one per CPU this "
              "process may use).")
@click.option("--pin", is_flag=True, help="Pin the native kernel's threads, one per CPU of this process's "
              "affinity mask (what `zlc deploy` assigns).")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="0 is greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--eos", type=int, default=None, help="Stop after generating this token id (default: the "
              "tokenizer's end-of-sequence ids).")
@MAX_SEQ
@click.option("--json", "as_json", is_flag=True, help="Print prompt and generated ids (and text) as JSON.")
def run(model: Path, prompt: str | None, prompt_ids: list[int] | None, raw: bool, max_new_tokens: int,
        device: str, threads: int | None, pin: bool, temperature: float, top_p: float, seed: int,
        eos: int | None, max_seq: int | None, as_json: bool) -> None:
    """Generate from a compiled BUNDLE (the megakernel) or lower an ONNX or GGUF MODEL (or a checkpoint
    directory) and generate with the
    CPU reference executor (one IR node at a time: what the compiled model computes, not how fast).

    With --prompt the text streams as it is produced; with --prompt-ids the new ids are printed.
    """
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-ids")
    if is_bundle_arg(model):
        if max_seq is not None:
            raise click.UsageError("--max-seq is fixed when a bundle is compiled (zlc compile --max-seq)")
        _run_bundle(model, prompt, prompt_ids, raw, max_new_tokens, device, threads, pin, temperature, top_p,
                    seed, eos, as_json)
        return
    if prompt_ids is None:
        raise click.UsageError("--prompt needs a compiled bundle with a tokenizer (zlc compile --tokenizer); "
                               "for an ONNX or GGUF file use --prompt-ids")
    if device not in ("auto", "cpu", "reference"):
        raise click.UsageError("an ONNX MODEL runs on the CPU reference executor; compile it for a GPU")
    require_compiler("zlc run MODEL")
    need = len(prompt_ids) + max_new_tokens
    if max_seq is not None and need > max_seq:
        raise ZlcError(f"prompt ({len(prompt_ids)}) + max-new-tokens ({max_new_tokens}) exceed "
                       f"--max-seq {max_seq}")
    with progress(f"lower {model.name}") as p:
        from zlc.reference.session import ReferenceSession

        from ..driver import CompileOptions, lower
        from ..verifier import check_token_ids

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
                device: str, threads: int | None, pin: bool, temperature: float, top_p: float, seed: int,
                eos: int | None, as_json: bool) -> None:
    from zlc.runtime.loader import load

    bundle = load(path)
    err = err_console()
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
    device = bundle.resolve_device(device)  # auto -> cuda or cpu, so the summary line names it
    status = err.status(f"starting the {device} executor") if err.is_terminal else None
    if status is not None:
        status.start()
    out_ids: list[int] = []
    t0 = time.perf_counter()
    first: float | None = None
    try:
        with bundle.session(device, threads=threads, pin=pin) as s:
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

