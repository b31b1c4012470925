"""`zlc.compile`: a model -> an artifact bundle (see `zlc.bundle` for the layout). The module is
`zlc.build`, not `zlc.compile`: a submodule of that name would shadow the function on the package
(importing a submodule binds it as the package's attribute).

The compile pipeline is data: `COMPILE_STAGES`, a list of named stages run in order over one
`Build` (what the stages share). Each stage records its time (`CompileResult.seconds`), reports
progress under its name, and can show what it made (`zlc inspect MODEL --after schedule`):

    lower -> verify (against ONNX Runtime / the torch module) -> quantize (--quantize) -> schedule
    + validate per tiling -> emit kernel.py and the IR -> weights (arenas) -> native (the C kernel per ISA level)
    -> aot (cubin per GPU target) -> tokenizer -> ebpf (the XDP program) -> manifest (sha256 of
    every file)

Two tilings at most: `cpu` (coarse tiles for the Triton interpreter; always present, so any
bundle runs with `--device cpu`) and `gpu` (one Linear block per task, split-KV), shared by every
GPU target; the targets differ only in arch (cubin) and grid (SM count). The native stage adds a
third, `native` (tasks sized for threads), run by the C kernel it compiles with the system C
compiler for every ISA level of this machine; without a compiler the bundle is built without it
and its manifest says why.
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

from .bundle import check_numerics, write_manifest
from .driver import CompileOptions, Lowered, lower
from .errors import VerificationError, ZlcError
from .frontend.gguf_file import gguf_tokenizer, is_gguf, packed_tensor
from .ir import DType
from .passes.quantize import QuantizeError, describe_packed, packed_as_given, quantize_lowered, scheme_for
from .targets import Target, decode_traffic, get_target
from .version import __version__

Progress = Callable[[str, str], None]  # (stage, detail)
DTYPES = ("auto", "fp32", "bf16")


@dataclass
class Build:
    """One compilation: its inputs, then what each stage made (filled in stage order)."""

    model: Any
    example_inputs: tuple[Any, ...] | None
    targets: list[Target]
    wdtype: str  # weight dtype in the arenas: "fp32" or "bf16"
    max_seq: int
    name: str
    out: Path
    tmp: Path  # the bundle being written (`out` + ".partial"); renamed to `out` by the manifest stage
    tokenizer: str | Path | None = None
    verify: bool = True
    atol: float | None = None  # None: the default of the model's dtype (verifier.DEFAULT_ATOL)
    debug_waits: bool = False
    quantize: str | None = None  # the packed format of --quantize (ir/quant.py), None: weights as given
    numerics: str = "exact"  # zlc.bundle.NUMERICS: the native kernel's arithmetic for packed matrices
    progress: Progress | None = None
    lowered: Lowered | None = None
    quantization: dict[str, Any] | None = None  # what --quantize packed and what it cost
    verification: dict[str, Any] = field(default_factory=lambda: {"status": "skipped"})
    programs: dict[str, Any] = field(default_factory=dict)  # tiling -> codegen Program
    tilings: dict[str, Any] = field(default_factory=dict)  # tiling -> manifest entry
    kernel_source: str = ""
    kernel_features: list[str] = field(default_factory=list)  # the optional code paths kernel.py compiles in
    target_info: dict[str, Any] = field(default_factory=dict)
    tokenizer_info: dict[str, Any] | None = None
    xdp: Any = None
    native: dict[str, Any] = field(default_factory=dict)  # the manifest's `native` entry
    arenas: tuple[Any, Any] | None = None  # (W, Q) as written by the weights stage: the native layout's input
    manifest: dict[str, Any] = field(default_factory=dict)

    def report(self, stage: str, detail: str = "") -> None:
        if self.progress is not None:
            self.progress(stage, detail)

    @property
    def decode(self) -> Any:
        assert self.lowered is not None and self.lowered.decode is not None
        return self.lowered.decode


@dataclass(frozen=True)
class CompileStage:
    name: str
    run: Callable[[Build], None]
    show: Callable[[Build], str]  # what `zlc inspect MODEL --after NAME` prints
    doc: str


@dataclass
class CompileResult:
    path: Path | None  # None when the pipeline stopped before the bundle was written
    manifest: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)
    build: Build | None = None


# ---- the stages ----------------------------------------------------------------------------------

def _lower(b: Build) -> None:
    b.report("lower", f"{b.name}, max_seq {b.max_seq}")
    b.lowered = lower(b.model, b.example_inputs, options=CompileOptions(max_seq=b.max_seq),
                      observer=(lambda st, g: b.report("lower", st)) if b.progress else None)
    if b.lowered.decode is None or b.lowered.prefill is None:
        raise ZlcError("the model was lowered without a KV cache; nothing to compile")


def _verify(b: Build) -> None:
    from .verifier import check_lowered, megakernel_fit

    assert b.lowered is not None
    # Every op that does not fit the megakernel, named, before the schedule stage meets the first.
    megakernel_fit(b.lowered.decode, b.max_seq).check(b.name)
    if not b.verify:
        return
    b.report("verify", ("against its imported graph" if is_gguf(b.model) else "against ONNX Runtime")
             if isinstance(b.model, (str, Path)) else "against the module")
    b.verification = check_lowered(b.model, b.example_inputs, b.lowered, b.atol)
    if not b.verification["ok"]:
        raise VerificationError(f"{b.name}: lowered model differs from its reference "
                                f"({b.verification['summary']}); not compiling it (see `zlc verify`)")


def _quantize(b: Build) -> None:
    if b.quantize is not None:
        b.quantization = quantize_lowered(b.lowered, b.quantize, lambda d: b.report("quantize", d),
                                          [t.name for t in b.targets if t.is_gpu])
        return
    b.quantization = packed_as_given(b.lowered, [t.name for t in b.targets if t.is_gpu])
    for line in describe_packed(b.quantization) if b.quantization else ():
        b.report("quantize", line)


def _schedule(b: Build) -> None:
    from zlc.codegen.schedule import schedule, tiling_for
    from zlc.codegen.validate import validate_program

    (b.tmp / "tables").mkdir(parents=True)
    wanted = ["cpu"] + (["gpu"] if any(t.is_gpu for t in b.targets) else [])
    for key in wanted:
        b.report("schedule", f"{key} tiling")
        proto = next((t for t in b.targets if t.is_gpu), None) if key == "gpu" else get_target("cpu")
        prog = schedule(b.decode, tiling_for(proto, b.max_seq, heads=_query_heads(b.decode)), b.max_seq, model=b.name)
        validate_program(prog)
        b.programs[key] = prog
        b.tilings[key] = _write_tables(b.tmp, key, prog, b.debug_waits)


def _query_heads(g: Any) -> int:
    """The most query heads of any Attention node (0 where the graph has none or they are symbolic)."""
    heads = [n.inputs[0].type.shape[1] for n in g.nodes if n.op == "Attention"]
    return max((int(h) for h in heads if isinstance(h, int)), default=0)


def _emit(b: Build) -> None:
    from zlc.codegen.emit import Features, render

    b.report("emit", "kernel.py")
    sizing = b.programs.get("gpu", b.programs["cpu"]).tiling.block_n  # the matrix-vector bodies fit the GPUs
    b.kernel_features = Features.of(list(b.programs.values())).used()
    b.kernel_source = render(list(b.programs.values()), weight_dtype=b.wdtype, version=__version__,
                             gemv_block_n=sizing)
    (b.tmp / "kernel.py").write_text(b.kernel_source)
    assert b.lowered is not None
    _write_ir(b.tmp, b.lowered)


def _weights(b: Build) -> None:
    from safetensors.torch import save_file

    from zlc.codegen.pack import pack_arenas

    b.report("weights", f"{b.wdtype} arenas")
    W, P, Q = pack_arenas(b.decode, b.programs["cpu"], b.wdtype)
    save_file({"W": W, "P": P, **({"Q": Q} if Q.numel() else {})}, str(b.tmp / "weights.safetensors"))
    b.arenas = (W, Q)


def _native(b: Build) -> None:
    from zlc.codegen.native import NativeBuild, build_native, find_compiler
    from zlc.codegen.schedule import schedule, tiling_for
    from zlc.codegen.validate import validate_program

    cc, why = find_compiler()
    if cc is None:  # the bundle still runs on GPUs and the interpreter; its manifest says why not here
        b.native = NativeBuild(skipped=why).manifest()
        b.report("native", f"native CPU kernel skipped: {why}")
        return
    b.report("native", "native tiling")
    prog = schedule(b.decode, tiling_for(get_target("cpu"), b.max_seq, native=True), b.max_seq, model=b.name)
    validate_program(prog)
    if prog.weights != b.programs["cpu"].weights:  # one W/P arena serves every tiling
        raise ZlcError("the native tiling places weights differently from the cpu tiling (a scheduler bug)")
    b.programs["native"] = prog
    b.tilings["native"] = _write_tables(b.tmp, "native", prog, b.debug_waits)
    built = build_native(prog, b.tmp / "native", weight_dtype=b.wdtype, version=__version__, numerics=b.numerics,
                         progress=lambda s: b.report("native", s))
    b.native = built.manifest()
    if any(t.name == "cpu" for t in b.targets):
        _native_layout(b, prog)


def _native_layout(b: Build, prog: Any) -> None:
    """native/<level>.weights: W and Q as the native kernel reads them (Linear matrices in panels),
    for the best level this host runs, so that sessions of that level map the file instead of
    laying the weights out (docs/artifact.md, "Mapped native weights"). Panels are two vectors
    wide, so each level has its own layout; one level only, because each copy costs the size of
    W + Q in the bundle. A host that runs another level lays the weights out at session start."""
    import torch

    from zlc.codegen.native import write_layout
    from zlc.runtime.native import NativeError, select_level

    try:
        level = select_level(b.native)
    except NativeError:
        b.report("native", "no level of the native kernel runs on this host: no mapped weight layout")
        return
    assert b.arenas is not None
    W, Q = b.arenas
    w = W.contiguous().view(torch.int16 if W.dtype == torch.bfloat16 else W.dtype).numpy()  # numpy has no bf16
    b.report("native", f"{level}: the weights in its panel layout")
    entry = write_layout(b.tmp / b.native["levels"][level]["library"], prog.task_table(), prog.desc_int, w,
                         Q.contiguous().numpy(), b.tmp / "native" / f"{level}.weights")
    b.native["levels"][level]["weights"] = entry


# The builds of each kernel: `release` always; with --debug-waits the diagnostic ones too, which
# the CUDA executor runs for the first launch of each kernel (debug: waits time out into CTRL's
# error words) and for traced launches (trace: SM id and timestamps per task). Extra constexprs:
_BUILDS: dict[str, dict[str, int]] = {"release": {}, "debug": {"DEBUG": 1}, "trace": {"TRACE": 1}}


def _aot(b: Build) -> None:
    gpu_targets = [t for t in b.targets if t.is_gpu]
    if gpu_targets:
        import os
        from concurrent.futures import ThreadPoolExecutor

        from zlc.bundle import MODE_DECODE, MODE_PREFILL
        from zlc.codegen.aot import compile_kernel
        from zlc.codegen.emit import ENTRY, signature

        gp = b.programs["gpu"]
        (b.tmp / "kernels").mkdir()
        # Two kernels from the one source, per target: STEP picks the prefill or the decode bodies,
        # so neither carries the other's registers (docs/megakernel.md, "Two kernels").
        builds = [k for k in _BUILDS if k == "release" or b.debug_waits]
        # PREFETCH: the decode kernel requests up to that many bytes of the next task's weights
        # into L2 (inline PTX, which the interpreter cannot run: it keeps the default 0), sized per
        # target to its L2 (l2_prefetch; docs/megakernel.md); the prefill kernel compiles it out
        prefetch = {t.name: l2_prefetch(gp, t, b.wdtype) for t in gpu_targets}
        caps = sorted({int(p["bytes"]) for p in prefetch.values()})  # one decode kernel per cap (0: none)
        jobs = [("decode", MODE_DECODE, build, cap) for build in builds for cap in caps] + \
               [("prefill", MODE_PREFILL, build, 0) for build in builds]
        for t in gpu_targets:
            b.report("aot", f"{t.name}: L2 prefetch of the next task's weights {'on' if prefetch[t.name]['on'] else 'off'}: "
                            f"{prefetch[t.name]['why']}")

        def run(job: tuple[str, int, str, int]) -> list[Any]:
            kind, step, build, cap = job
            targets = [t for t in gpu_targets if prefetch[t.name]["bytes"] == cap] if kind == "decode" else gpu_targets
            what = kind if build == "release" else f"{kind} ({build})"
            b.report("aot", f"{what} kernel: {', '.join(t.name for t in targets)} (ptxas)")
            consts = {**gp.constexprs(debug=False), "STEP": step, "TRACE": 0, "PREFETCH": cap, **_BUILDS[build]}
            results = compile_kernel(b.tmp / "kernel.py", ENTRY, signature(b.wdtype), consts, targets,
                                     num_warps=gp.tiling.num_warps,
                                     on_progress=lambda s: b.report("aot", f"{what}: {s}"))
            for r in {r.arch: r for r in results}.values():
                for c in r.cubins[1:]:
                    b.report("aot", f"{what}: {r.arch}: assembled again with ptxas {c.toolkit} (PTX ISA {c.ptx_isa}) "
                                    f"in {c.seconds:.1f} s")
                if r.fallback_skipped:
                    b.report("aot", f"{what}: {r.arch}: no cubin from the older ptxas: {r.fallback_skipped}")
            return results

        # one compiler process per job; they are independent (a few GB of memory at most each)
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1, 4))) as pool:
            compiled = dict(zip(jobs, pool.map(run, jobs), strict=True))
        entries: dict[str, dict[str, dict[str, Any]]] = {}
        for (kind, _, build, _), results in compiled.items():
            for r in results:
                entries.setdefault(r.target, {}).setdefault(kind, {})[build] = _kernel_entry(b.tmp, r, kind, build)
        for name in (t.name for t in gpu_targets if t.name in entries):  # the targets' order, not the jobs'
            dec, pre = entries[name]["decode"], entries[name]["prefill"]
            # the target's own fields: the decode kernel's release build, what a step runs
            info = {"arch": dec["release"].pop("arch"), "tiling": "gpu", "grid": get_target(name).sms,
                    **dec["release"]}
            prefill = {k: v for k, v in pre["release"].items() if k != "arch"}
            for build in builds[1:]:
                info[build] = {k: v for k, v in dec[build].items() if k != "arch"}
                prefill[build] = {k: v for k, v in pre[build].items() if k != "arch"}
            b.target_info[name] = {**info, "prefill": prefill, "l2_prefetch": prefetch[name]}
    assert b.lowered is not None
    for tg in b.targets:
        info = b.target_info.setdefault(tg.name, {"arch": tg.arch, "tiling": "cpu",
                                                  "grid": b.tilings["cpu"]["grid"]})
        info["roofline"] = roofline(b.lowered, tg, b.wdtype)


def l2_prefetch(prog: Any, target: Any, wdtype: str) -> dict[str, Any]:
    """Whether, and how much of, the next task's weights `target`'s decode kernel prefetches into L2
    (PREFETCH: the most bytes one prefetch requests, 0 for none): half the L2 shared by one
    prefetch per program (the other half for the KV cache, activations and partials;
    docs/kernel-model.md prices lines beyond it as evicted before use: their bytes cross HBM
    twice), on where that share is at least what a task requests into its registers before its
    wait (gemv_plan.PREFETCH_BYTES): below it the L2 prefetch adds little but its instructions."""
    from zlc.codegen.gemv_plan import PREFETCH_BYTES
    from zlc.codegen.program import PF_UNIT

    item = 4 if wdtype == "fp32" else 2
    sizes = [r[1] * PF_UNIT * item * (2 if r[2] >= 0 else 1)
             for r in (prog.prefetch_record(t) for t in prog.tables["decode"]) if r[1] > 0]
    mean = sum(sizes) / len(sizes) if sizes else 0.0
    have = target.l2_mb * 1e6 / 2
    share = int(have / target.sms) // 1024 * 1024
    on = bool(sizes) and share >= PREFETCH_BYTES
    return {"on": on, "bytes": share if on else 0,
            "why": f"half the L2 ({have / 1e6:.0f} MB) over {target.sms} programs = {share / 1024:.0f} KB per prefetch "
                   f"{'>=' if on else '<'} {PREFETCH_BYTES / 1024:.0f} KB (a task's own requests before its wait); "
                   f"the decode step's tasks prefetch {mean / 1024:.0f} KB each on average"
                   + (f", at most {share / 1024:.0f} KB" if on else "")}


def _kernel_entry(root: Path, r: Any, kind: str, build: str) -> dict[str, Any]:
    """Writes one compiled kernel's files (every toolkit's cubin, the PTX) and returns its manifest
    entry: `kernels/<target>[.prefill][.<build>].cubin` is Triton's own ptxas's, `....cu129.cubin`
    the older ptxas's (e.g. CUDA 12.9) from the same PTX; `cubins` lists them, preferred first."""
    from zlc.codegen.aot import check_ptx_sync

    problems = check_ptx_sync(r.ptx)
    if problems:
        raise ZlcError(f"{r.target} ({kind} kernel, {build} build): the PTX lacks the memory ordering the "
                       f"megakernel relies on: {'; '.join(problems)} (a Triton upgrade changed its lowering?)")
    stem = "kernels/" + r.target + ("" if kind == "decode" else ".prefill") + ("" if build == "release" else f".{build}")
    (root / f"{stem}.ptx").write_text(r.ptx)
    cubins = []
    for i, c in enumerate(r.cubins):
        path = f"{stem}.cubin" if i == 0 else f"{stem}.cu{c.toolkit.replace('.', '')}.cubin"
        (root / path).write_bytes(c.cubin)
        cubins.append(c.entry(path))
    entry: dict[str, Any] = {
        "cubin": cubins[0]["cubin"], "ptx": f"{stem}.ptx", "metadata": r.metadata, "params": r.params,
        "resources": asdict(r.resources), "compile_seconds": round(r.seconds, 3), "arch": r.arch, "cubins": cubins}
    if r.fallback_skipped:
        entry["fallback_skipped"] = r.fallback_skipped
    return entry


def _tokenizer(b: Build) -> None:
    if b.tokenizer is None:
        return
    from zlc.runtime.tokenizer import bundle_tokenizer

    b.report("tokenizer", str(b.tokenizer))
    cfg = bundle_tokenizer(b.tokenizer, b.tmp / "tokenizer")
    b.tokenizer_info = {"dir": "tokenizer", "chat_template": cfg.get("chat_template") is not None,
                        "eos_token_ids": cfg.get("eos_token_ids", [])}
    if cfg.get("chat_template_default"):  # a GGUF without one (print_bundle says so in one line)
        b.tokenizer_info["chat_template_default"] = True


def _ebpf(b: Build) -> None:
    from .deploy import ebpf

    b.xdp = ebpf.build(b.tmp / "deploy" / "ebpf")  # topology-free: host setup is `zlc deploy build`'s job
    b.report("ebpf", "XDP ingress program " + ("built" if b.xdp.object else f"source only: {b.xdp.reason}"))


def _manifest(b: Build) -> None:
    import triton

    from zlc.codegen.emit import ENTRY, signature

    assert b.lowered is not None
    decode = b.programs["cpu"]
    b.manifest = {
        "zlc_version": __version__, "triton_version": triton.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": {"name": b.name, "source": str(b.model) if isinstance(b.model, (str, Path)) else b.name,
                  "ir_sha256": _ir_hash(b.lowered), "vocab": decode.vocab, "max_seq": b.max_seq,
                  "layers": sum(1 for n in b.decode.nodes if n.op == "Attention"),
                  "ops": b.lowered.histogram_after},
        "dtype": {"weights": b.wdtype, "activations": "fp32", "kv_cache": "fp32", "accumulation": "fp32"},
        "kernel": {"source": "kernel.py", "entry": ENTRY, "signature": signature(b.wdtype),
                   "params": list(signature(b.wdtype)), "debug_waits": b.debug_waits,
                   "features": b.kernel_features},
        "weights": {"file": "weights.safetensors", "W": {"dtype": b.wdtype, "elements": decode.w_size},
                    "P": {"dtype": "fp32", "elements": decode.p_size}, "placement": decode.weights,
                    **({"Q": decode.q_arena()} if decode.q_size else {})},
        "numerics": b.numerics, "quantization": b.quantization, "tilings": b.tilings, "targets": b.target_info, "native": b.native,
        "verification": b.verification, "tokenizer": b.tokenizer_info, "compile_seconds": {},  # filled by compile()
    }
    b.report("manifest", "sha256 of every file")


# What each stage shows (`zlc inspect MODEL --after NAME`): the thing it made, as text.

def _show_lower(b: Build) -> str:
    from .ir.text import print_graph

    return print_graph(b.decode)


def _show_verify(b: Build) -> str:
    return json.dumps(b.verification, indent=1)


def _show_schedule(b: Build) -> str:
    return json.dumps({k: v["summary"] for k, v in b.tilings.items()}, indent=1)


def _show_weights(b: Build) -> str:
    return json.dumps(b.programs["cpu"].weights, indent=1)


def _show_aot(b: Build) -> str:
    return json.dumps({k: {f: v.get(f) for f in ("arch", "tiling", "grid", "resources", "roofline")}
                       for k, v in b.target_info.items()}, indent=1)


def _show_tokenizer(b: Build) -> str:
    return json.dumps(b.tokenizer_info, indent=1)


def _show_ebpf(b: Build) -> str:
    x = b.xdp
    return json.dumps({"source": str(x.source), "object": str(x.object) if x.object else None,
                       "reason": x.reason, "max_tokens": x.max_tokens, "ring_bytes": x.ring_bytes}, indent=1)


def _show_manifest(b: Build) -> str:
    return json.dumps(b.manifest, indent=1)


COMPILE_STAGES: tuple[CompileStage, ...] = (
    CompileStage("lower", _lower, _show_lower, "the lowering pipeline (zlc.driver.STAGES): raised prefill/decode"),
    CompileStage("verify", _verify, _show_verify, "the lowered model against ONNX Runtime or the torch module"),
    CompileStage("quantize", _quantize, lambda b: json.dumps(b.quantization), "--quantize: packed Linear weights"),
    CompileStage("schedule", _schedule, _show_schedule, "task tables per tiling (cpu, gpu), validated"),
    CompileStage("emit", _emit, lambda b: b.kernel_source, "kernel.py from the template; the IR files"),
    CompileStage("weights", _weights, _show_weights, "the W/P arenas, laid out as the kernel reads them"),
    CompileStage("native", _native, lambda b: json.dumps(b.native, indent=1),
                 "the native CPU kernel: C source, one library per ISA level (system C compiler)"),
    CompileStage("aot", _aot, _show_aot, "a cubin per GPU target (ptxas), resources, roofline"),
    CompileStage("tokenizer", _tokenizer, _show_tokenizer, "the tokenizer and chat template, when given"),
    CompileStage("ebpf", _ebpf, _show_ebpf, "the XDP ingress program (clang -target bpf, when present)"),
    CompileStage("manifest", _manifest, _show_manifest, "manifest.json with the sha256 of every file"),
)
COMPILE_STAGE_NAMES = tuple(s.name for s in COMPILE_STAGES)


def compile(model: Any, *, targets: Sequence[str] = ("cpu",), out: str | Path | None = None,
            dtype: str = "auto", max_seq: int = 2048, tokenizer: str | Path | None = None,
            example_inputs: tuple[Any, ...] | None = None, verify: bool = True, atol: float | None = None,
            name: str | None = None, progress: Progress | None = None, force: bool = False,
            debug_waits: bool = False, stop_after: str | None = None, quantize: str | None = None,
            numerics: str = "exact") -> CompileResult:
    """Compiles `model` (an .onnx or .gguf path, or a torch.nn.Module with example_inputs) into a bundle
    directory `out` and returns its manifest. Raises ZlcError on bad input; VerificationError
    (exit code 3) when the lowered model does not match its reference. `debug_waits` builds the
    kernels whose waits time out (2 s) into an error flag instead of hanging on a bad table.
    `stop_after=STAGE` ends after that stage: nothing is written to `out`, and the result's
    `build` holds what the stages made (`zlc inspect MODEL --after STAGE`). `quantize`: "int8",
    "int4", "int4:q4_0" or "int4:q4_1" packs the Linear weights (passes/quantize.py). `numerics`: zlc.bundle's."""
    tgs = _targets(targets)
    check_numerics(numerics, gpu_targets=[t.name for t in tgs if t.is_gpu])
    if dtype not in DTYPES:
        raise ZlcError(f"unknown --dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    if max_seq < 1:
        raise ZlcError(f"--max-seq must be positive, got {max_seq}")
    if stop_after is not None and stop_after not in COMPILE_STAGE_NAMES:
        raise ZlcError(f"unknown compile stage '{stop_after}'; stages: {', '.join(COMPILE_STAGE_NAMES)}")
    qfmt = scheme_for(quantize, [t.name for t in tgs if t.is_gpu])
    if qfmt is not None and is_gguf(model):
        quantized = packed_tensor(model)
        if quantized:
            raise QuantizeError(f"--quantize: {Path(model).name} is already quantized ('{quantized[0]}' is "
                                f"{quantized[1]}); compile it without --quantize")
    src_name = name or (Path(model).stem if isinstance(model, (str, Path)) else type(model).__name__)
    if tokenizer is None:  # a GGUF file carries its tokenizer and chat template
        tokenizer = gguf_tokenizer(model)
    outdir = Path(out) if out is not None else Path(f"{src_name}.zlc")
    _prepare_out(outdir, force)
    tmp = outdir.with_name(outdir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    b = Build(model=model, example_inputs=example_inputs, targets=tgs, max_seq=max_seq, name=src_name,
              wdtype=dtype if dtype != "auto" else ("bf16" if any(t.is_gpu for t in tgs) else "fp32"),
              out=outdir, tmp=tmp, tokenizer=tokenizer, verify=verify, atol=atol, debug_waits=debug_waits,
              progress=progress, quantize=qfmt, numerics=numerics)
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    try:
        for stage in COMPILE_STAGES:
            t = time.perf_counter()
            stage.run(b)
            secs[stage.name] = time.perf_counter() - t
            if stage.name == stop_after:
                shutil.rmtree(tmp)
                secs["total"] = time.perf_counter() - t0
                return CompileResult(None, b.manifest, secs, b)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed compile leaves no half-written bundle
        raise
    b.manifest["compile_seconds"] = {k: round(v, 3) for k, v in secs.items() if k != "total"}
    write_manifest(tmp, b.manifest)
    if outdir.exists():
        shutil.rmtree(outdir)
    tmp.rename(outdir)
    secs["total"] = time.perf_counter() - t0
    return CompileResult(outdir, b.manifest, secs, b)


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
                       "logits": {"offset": lb.offset, "rows": lb.rows, "cols": lb.cols},
                       "paged_kv": prog.kv_page_map()}}


def _write_ir(root: Path, lowered: Lowered) -> None:
    (root / "ir").mkdir()
    for g in (lowered.prefill, lowered.decode):
        assert g is not None
        (root / "ir" / f"{g.name}.zir").write_text(_ir_text(g))


def _ir_text(g: Any) -> str:
    from .ir.text import print_graph

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
