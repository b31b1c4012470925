"""`zlc.compile`: a model -> an artifact bundle (see `zlc.bundle` for the layout).

    lower -> verify (against ONNX Runtime / the torch module) -> schedule + validate per tiling
    -> emit kernel.py -> pack weights -> AOT per GPU target -> tokenizer -> manifest

Two tilings at most: `cpu` (coarse tiles for the Triton interpreter; always present, so any
bundle runs with `--device cpu`) and `gpu` (one Linear block per task, split-KV), shared by every
GPU target; the targets differ only in arch (cubin) and grid (SM count).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .bundle import write_manifest
from .driver import CompileOptions, Lowered, lower
from .errors import VerificationError, ZlcError
from .ir import DType
from .targets import Target, decode_traffic, get_target

Progress = Callable[[str, str], None]  # (stage, detail)
DTYPES = ("auto", "fp32", "bf16")


@dataclass
class CompileResult:
    path: Path
    manifest: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)


def _stage(progress: Progress | None, stage: str, detail: str = "") -> None:
    if progress is not None:
        progress(stage, detail)


def compile(model: Any, *, targets: Sequence[str] = ("cpu",), out: str | Path | None = None,
            dtype: str = "auto", max_seq: int = 2048, tokenizer: str | Path | None = None,
            example_inputs: tuple[Any, ...] | None = None, verify: bool = True, atol: float = 1e-3,
            name: str | None = None, progress: Progress | None = None, force: bool = False,
            debug_waits: bool = False) -> CompileResult:
    """Compiles `model` (an .onnx path or a torch.nn.Module with example_inputs) into a bundle
    directory `out` and returns its manifest. Raises ZlcError on bad input; VerificationError
    (exit code 3) when the lowered model does not match its reference. `debug_waits` builds the
    kernels whose waits time out (2 s) into an error flag instead of hanging on a bad table."""
    from zlc.codegen.emit import ENTRY, render, signature
    from zlc.codegen.schedule import pack_arenas, schedule, tiling_for
    from zlc.codegen.validate import validate_program

    tgs = _targets(targets)
    if dtype not in DTYPES:
        raise ZlcError(f"unknown --dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    wdtype = dtype if dtype != "auto" else ("bf16" if any(t.is_gpu for t in tgs) else "fp32")
    if max_seq < 1:
        raise ZlcError(f"--max-seq must be positive, got {max_seq}")
    src_name = name or (Path(model).stem if isinstance(model, (str, Path)) else type(model).__name__)
    outdir = Path(out) if out is not None else Path(f"{src_name}.zlc")
    _prepare_out(outdir, force)
    secs: dict[str, float] = {}
    t0 = time.perf_counter()

    _stage(progress, "lower", f"{src_name}, max_seq {max_seq}")
    lowered = lower(model, example_inputs, options=CompileOptions(max_seq=max_seq),
                    observer=(lambda st, g: _stage(progress, "lower", st)) if progress else None)
    if lowered.decode is None or lowered.prefill is None:
        raise ZlcError("the model was lowered without a KV cache; nothing to compile")
    secs["lower"] = time.perf_counter() - t0

    t = time.perf_counter()
    verification = {"status": "skipped"}
    if verify:
        _stage(progress, "verify", "against ONNX Runtime" if isinstance(model, (str, Path)) else "against the module")
        verification = _verify(model, example_inputs, lowered, atol)
        if not verification["ok"]:
            raise VerificationError(f"{src_name}: lowered model differs from its reference "
                                    f"({verification['summary']}); not compiling it (see `zlc verify`)")
    secs["verify"] = time.perf_counter() - t

    t = time.perf_counter()
    tmp = outdir.with_name(outdir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    (tmp / "tables").mkdir(parents=True)
    tilings: dict[str, Any] = {}
    programs = {}
    wanted = ["cpu"] + (["gpu"] if any(t.is_gpu for t in tgs) else [])
    for key in wanted:
        _stage(progress, "schedule", f"{key} tiling")
        proto = next((t for t in tgs if t.is_gpu), None) if key == "gpu" else get_target("cpu")
        prog = schedule(lowered.decode, tiling_for(proto, max_seq), max_seq, model=src_name)
        validate_program(prog)
        programs[key] = prog
        tilings[key] = _write_tables(tmp, key, prog, debug_waits)
    secs["schedule"] = time.perf_counter() - t

    _stage(progress, "emit", "kernel.py")
    src = render(_union_program(programs), weight_dtype=wdtype, version=__version__)
    (tmp / "kernel.py").write_text(src)

    t = time.perf_counter()
    _stage(progress, "weights", f"{wdtype} arenas")
    W, P = pack_arenas(lowered.decode, programs["cpu"], wdtype)
    from safetensors.torch import save_file

    save_file({"W": W, "P": P}, str(tmp / "weights.safetensors"))
    secs["weights"] = time.perf_counter() - t
    _write_ir(tmp, lowered)

    t = time.perf_counter()
    target_info: dict[str, Any] = {}
    gpu_targets = [t for t in tgs if t.is_gpu]
    if gpu_targets:
        from zlc.codegen.aot import check_ptx_sync, compile_kernel

        gp = programs["gpu"]
        _stage(progress, "aot", f"{', '.join(t.name for t in gpu_targets)} (ptxas)")
        results = compile_kernel(tmp / "kernel.py", ENTRY, signature(wdtype), gp.constexprs(debug=debug_waits),
                                 gpu_targets, num_warps=gp.tiling.num_warps,
                                 on_progress=lambda s: _stage(progress, "aot", s))
        (tmp / "kernels").mkdir()
        for r in results:
            problems = check_ptx_sync(r.ptx)
            if problems:
                raise ZlcError(f"{r.target}: the PTX lacks the memory ordering the megakernel relies on: "
                               f"{'; '.join(problems)} (a Triton upgrade changed its lowering?)")
            (tmp / "kernels" / f"{r.target}.cubin").write_bytes(r.cubin)
            (tmp / "kernels" / f"{r.target}.ptx").write_text(r.ptx)
            target_info[r.target] = {"arch": r.arch, "tiling": "gpu", "grid": get_target(r.target).sms,
                                     "cubin": f"kernels/{r.target}.cubin", "ptx": f"kernels/{r.target}.ptx",
                                     "metadata": r.metadata, "params": r.params,
                                     "resources": asdict(r.resources), "compile_seconds": round(r.seconds, 3)}
    for tg in tgs:
        info = target_info.setdefault(tg.name, {"arch": tg.arch, "tiling": "cpu", "grid": tilings["cpu"]["grid"]})
        info["roofline"] = roofline(lowered, tg, wdtype)
    secs["aot"] = time.perf_counter() - t

    tok_info = None
    if tokenizer is not None:
        _stage(progress, "tokenizer", str(tokenizer))
        from zlc.runtime.tokenizer import bundle_tokenizer

        cfg = bundle_tokenizer(tokenizer, tmp / "tokenizer")
        tok_info = {"dir": "tokenizer", "chat_template": cfg.get("chat_template") is not None,
                    "eos_token_ids": cfg.get("eos_token_ids", [])}

    from .deploy import ebpf

    xdp = ebpf.build(tmp / "deploy" / "ebpf")  # topology-free: host setup is `zlc deploy build`'s job
    _stage(progress, "ebpf", "XDP ingress program " + ("built" if xdp.object else f"source only: {xdp.reason}"))

    import triton

    decode = programs["cpu"]
    manifest = {
        "zlc_version": __version__, "triton_version": triton.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"name": src_name, "source": str(model) if isinstance(model, (str, Path)) else src_name,
                  "ir_sha256": _ir_hash(lowered), "vocab": decode.vocab, "max_seq": max_seq,
                  "layers": sum(1 for n in lowered.decode.nodes if n.op == "Attention"),
                  "ops": lowered.histogram_after},
        "dtype": {"weights": wdtype, "activations": "fp32", "kv_cache": "fp32", "accumulation": "fp32"},
        "kernel": {"source": "kernel.py", "entry": ENTRY, "signature": signature(wdtype),
                   "params": list(signature(wdtype)), "debug_waits": debug_waits},
        "weights": {"file": "weights.safetensors", "W": {"dtype": wdtype, "elements": decode.w_size},
                    "P": {"dtype": "fp32", "elements": decode.p_size}, "placement": decode.weights},
        "tilings": tilings, "targets": target_info, "verification": verification,
        "tokenizer": tok_info, "compile_seconds": {k: round(v, 3) for k, v in secs.items()},
    }
    _stage(progress, "manifest", "sha256 of every file")
    write_manifest(tmp, manifest)
    if outdir.exists():
        shutil.rmtree(outdir)
    tmp.rename(outdir)
    secs["total"] = time.perf_counter() - t0
    return CompileResult(outdir, manifest, secs)


def _targets(names: Sequence[str]) -> list[Target]:
    if isinstance(names, str):
        names = [names]
    out: list[Target] = []
    for n in names or ["cpu"]:
        t = get_target(n)
        if t not in out:
            out.append(t)
    return out


def _prepare_out(outdir: Path, force: bool) -> None:
    if outdir.exists():
        if not outdir.is_dir():
            raise ZlcError(f"output path {outdir} exists and is not a directory")
        if any(outdir.iterdir()) and not (outdir / "manifest.json").is_file() and not force:
            raise ZlcError(f"output directory {outdir} is not empty and not a zlc bundle; "
                           "choose another -o (or --force to replace it)")


def _verify(model: Any, example_inputs: Any, lowered: Lowered, atol: float) -> dict[str, Any]:
    if isinstance(model, (str, Path)) and Path(model).is_file():
        from .verifier import verify

        rep = verify(model, steps=4, prompt_len=8, atol=atol, max_seq=64)
        return {"status": "passed" if rep.ok else "failed", "ok": rep.ok, "reference": "onnxruntime",
                "max_abs": rep.max_abs, "tokens_equal": rep.tokens_equal, "summary": rep.summary()}
    import torch

    from zlc.reference.session import ReferenceSession

    if example_inputs is None:
        return {"status": "skipped", "ok": True, "summary": "no reference"}
    ids = example_inputs[0]
    with torch.no_grad():
        out = model(ids)
    ref = out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)
    got = ReferenceSession.from_lowered(lowered).prefill([int(i) for i in ids[0]])
    err = float((ref[0].float() - got.float()).abs().max())
    ok = err <= atol
    return {"status": "passed" if ok else "failed", "ok": ok, "reference": "torch module",
            "max_abs": err, "summary": f"prefill max abs {err:.3g} (atol {atol})"}


def _write_tables(root: Path, key: str, prog: Any, debug: bool) -> dict[str, Any]:
    import torch
    from safetensors.torch import save_file

    save_file({"tasks": torch.from_numpy(prog.task_table()),
               "desc_int": torch.from_numpy(np.ascontiguousarray(prog.desc_int)),
               "desc_float": torch.from_numpy(np.ascontiguousarray(prog.desc_float))},
              str(root / "tables" / f"{key}.safetensors"))
    readable = {"descriptors": prog.desc_labels, "events": prog.event_labels,
                "tables": {mode: [{"op": t.op, "label": t.label, "desc": t.desc, "args": [t.a, t.b, t.c],
                                   "waits": t.waits, "signal": t.signal, "signal_target": t.signal_target,
                                   "parent": t.parent} for t in tasks]
                           for mode, tasks in prog.tables.items()}}
    (root / "tables" / f"{key}.json").write_text(json.dumps(readable, indent=0) + "\n")
    lb = prog.buffers[prog.logits]
    return {"tables": f"tables/{key}.safetensors", "readable": f"tables/{key}.json",
            "constexprs": prog.constexprs(debug=debug), "grid": prog.tiling.grid, "summary": prog.summary(),
            "layout": {"a_size": prog.a_size, "ctrl_size": prog.ctrl_size(),
                       "counters_size": prog.counters_size(), "chunk": prog.tiling.chunk,
                       "logits": {"offset": lb.offset, "rows": lb.rows, "cols": lb.cols}}}


def _union_program(programs: dict[str, Any]) -> Any:
    """The program whose op kinds cover every tiling (one kernel source serves them all)."""
    import copy

    base = copy.copy(next(iter(programs.values())))
    base.tables = {f"{k}.{m}": t for k, p in programs.items() for m, t in p.tables.items()}
    return base


def _write_ir(root: Path, lowered: Lowered) -> None:
    (root / "ir").mkdir()
    for g in (lowered.prefill, lowered.decode):
        assert g is not None
        (root / "ir" / f"{g.name}.zir").write_text(_ir_text(g))


def _ir_text(g: Any) -> str:
    from zlc.ir.text import print_graph

    return print_graph(g)


def _ir_hash(lowered: Lowered) -> str:
    h = hashlib.sha256()
    for g in (lowered.prefill, lowered.decode):
        h.update(_ir_text(g).encode())
    return h.hexdigest()


def roofline(lowered: Lowered, target: Target, wdtype: str) -> dict[str, Any]:
    """Bytes a decode step reads (weights in `wdtype`, the f32 KV cache) and the bandwidth floor."""
    assert lowered.decode is not None
    w = decode_traffic(lowered.decode, context=1, weight_dtype=DType.bf16 if wdtype == "bf16" else DType.f32)
    kv = decode_traffic(lowered.decode, context=1, weight_dtype=DType.f32).kv_bytes_per_token
    out: dict[str, Any] = {"weight_bytes": w.weight_bytes, "kv_bytes_per_token": kv,
                           "bandwidth_gbs": target.bandwidth_gbs}
    for ctx in sorted({min(128, lowered.max_seq), lowered.max_seq}):
        total = w.weight_bytes + kv * ctx
        out[f"bytes_at_{ctx}"] = total
        out[f"floor_us_at_{ctx}"] = (round(total / (target.bandwidth_gbs * 1e3), 2)
                                     if target.bandwidth_gbs else None)
    return out
