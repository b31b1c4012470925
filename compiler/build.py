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

The libraries and cubins are independent builds: jobs of one pool (`jobs` at a time, default the
CPUs), the cubins submitted as soon as emit has written kernel.py, so they build beside the
weights and the native libraries; the aot stage waits for what is left. Each is looked up in the
compile cache first (codegen/kcache.py, by content: source, toolchain, flags, target) and stored
there after; the manifest's `cache` entry says which came from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .bundle import check_numerics, write_manifest
from .driver import CompileOptions, Lowered, lower
from .errors import VerificationError, ZlcError
from .frontend.gguf_file import gguf_tokenizer, is_gguf, packed_tensor
from .frontend.hf_dir import auto_wdtype, checkpoint_tokenizer, is_checkpoint_dir
from .ir import DType
from .memory import MemoryLog, check_room, map_large_blocks, release_mapped
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
    arenas: Any = None  # codegen.arena_file.ArenaFile: where the weights stage wrote W, P and Q
    manifest: dict[str, Any] = field(default_factory=dict)
    cache: Any = None  # the compile cache (codegen/kcache.py KernelCache): libraries and cubins by content
    pool: Any = None  # the independent builds' jobs (C compilers, Triton compiles): `jobs` at a time
    kernel_jobs: Any = None  # the GPU kernels' submitted jobs (codegen/kernel_builds.py), from emit to aot
    stage: str = ""  # the stage running (where a line from the cache or a job is reported)
    stop_after: str | None = None  # compile(stop_after=...): no cubin jobs start when aot will not run

    def report(self, stage: str, detail: str = "") -> None:
        if self.progress is not None:
            self.progress(stage, detail)

    def count(self, what: str, done: int, total: int) -> None:
        """Progress inside a long stage (layers lowered, matrices packed, kernels built): a bar
        where the progress shows one (the CLI's on a terminal), nothing otherwise."""
        if self.progress is not None and hasattr(self.progress, "count"):
            self.progress.count(what, done, total)

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
    memory: dict[str, Any] = field(default_factory=dict)  # memory.MemoryLog.report(): peak RSS per stage


# ---- the stages ----------------------------------------------------------------------------------

def _lower(b: Build) -> None:
    b.report("lower", f"{b.name}, max_seq {b.max_seq}")
    from .driver import STAGES

    def seen(st: str, g: Any) -> None:
        b.report("lower", st)
        b.count("lowering passes", STAGES.index(st) + 1 if st in STAGES else 0, len(STAGES))

    b.lowered = lower(b.model, b.example_inputs, options=CompileOptions(max_seq=b.max_seq),
                      observer=seen if b.progress else None)
    if b.lowered.decode is None or b.lowered.prefill is None:
        raise ZlcError("the model was lowered without a KV cache; nothing to compile")


def _verify(b: Build) -> None:
    from .verifier import check_lowered, megakernel_fit

    assert b.lowered is not None
    # Every op that does not fit the megakernel, named, before the schedule stage meets the first.
    megakernel_fit(b.lowered.decode, b.max_seq).check(b.name)
    if not b.verify:
        return
    b.report("verify", ("against its imported graph" if is_gguf(b.model) or is_checkpoint_dir(b.model)
                        else "against ONNX Runtime")
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
    aot_runs = b.stop_after is None or COMPILE_STAGE_NAMES.index(b.stop_after) >= COMPILE_STAGE_NAMES.index("aot")
    if aot_runs and any(t.is_gpu for t in b.targets):  # the cubins build from here on, beside weights and native
        from zlc.codegen.kernel_builds import start

        b.kernel_jobs = start(b.programs["gpu"], b.tmp / "kernel.py", b.targets, b.wdtype, b.debug_waits, b.pool,
                              b.cache, lambda d: b.report("aot", d))


def _weights(b: Build) -> None:
    from zlc.codegen.arena_file import write_arenas

    b.report("weights", f"{b.wdtype} arenas")
    # written constant by constant from the model's (mapped) data: no arena is built in memory
    b.arenas = write_arenas(b.decode, b.programs["cpu"], b.wdtype, b.tmp / "weights.safetensors",
                            lambda i, n: b.count("weights packed", i, n))
    release_mapped(b.model)  # the later stages read the written files, not the model's map


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
                         progress=lambda s: b.report("native", s), cache=b.cache, pool=b.pool)
    b.native = built.manifest()
    if any(t.name == "cpu" for t in b.targets):
        _native_layout(b, prog)


def _native_layout(b: Build, prog: Any) -> None:
    """native/<level>.weights: W and Q as the native kernel reads them (Linear matrices in panels),
    for the best level this host runs, so that sessions of that level map the file instead of
    laying the weights out (docs/artifact.md, "Mapped native weights"). Panels are two vectors
    wide, so each level has its own layout; one level only, because each copy costs the size of
    W + Q in the bundle. A host that runs another level lays the weights out at session start."""
    from zlc.codegen.arena_file import write_layout
    from zlc.runtime.native import NativeError, select_level

    try:
        level = select_level(b.native)
    except NativeError:
        b.report("native", "no level of the native kernel runs on this host: no mapped weight layout")
        return
    assert b.arenas is not None
    b.report("native", f"{level}: the weights in its panel layout")
    entry = write_layout(b.tmp / b.native["levels"][level]["library"], prog.task_table(), prog.desc_int, b.arenas,
                         b.tmp / "native" / f"{level}.weights")
    b.native["levels"][level]["weights"] = entry


def _aot(b: Build) -> None:
    if b.kernel_jobs is not None:  # submitted by the emit stage; this waits for them and writes their files
        from zlc.codegen.kernel_builds import finish

        b.target_info.update(finish(b.kernel_jobs, b.tmp))
    assert b.lowered is not None
    for tg in b.targets:
        info = b.target_info.setdefault(tg.name, {"arch": tg.arch, "tiling": "cpu",
                                                  "grid": b.tilings["cpu"]["grid"]})
        info["roofline"] = roofline(b.lowered, tg, b.wdtype)


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
        "cache": b.cache.manifest(),  # which libraries and cubins came from the compile cache
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
            numerics: str = "exact", cache: bool = True, jobs: int | None = None) -> CompileResult:
    """Compiles `model` (an .onnx or .gguf path, a Hugging Face checkpoint directory, or a
    torch.nn.Module with example_inputs) into a bundle
    directory `out` and returns its manifest. Raises ZlcError on bad input; VerificationError
    (exit code 3) when the lowered model does not match its reference. `debug_waits` builds the
    kernels whose waits time out (2 s) into an error flag instead of hanging on a bad table.
    `stop_after=STAGE` ends after that stage: nothing is written to `out`, and the result's
    `build` holds what the stages made (`zlc inspect MODEL --after STAGE`). `quantize`: "int8",
    "int4", "int4:q4_0" or "int4:q4_1" packs the Linear weights (passes/quantize.py). `numerics`:
    zlc.bundle's. `cache`: take libraries and cubins from the compile cache and store them there
    (codegen/kcache.py); `jobs`: how many builds (C compilers, Triton compiles) run at once (default:
    the CPUs this process may use)."""
    tgs = _targets(targets)
    check_numerics(numerics, gpu_targets=[t.name for t in tgs if t.is_gpu])
    if dtype not in DTYPES:
        raise ZlcError(f"unknown --dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    if max_seq < 1:
        raise ZlcError(f"--max-seq must be positive, got {max_seq}")
    if jobs is not None and jobs < 1:
        raise ZlcError(f"--jobs must be positive, got {jobs}")
    if stop_after is not None and stop_after not in COMPILE_STAGE_NAMES:
        raise ZlcError(f"unknown compile stage '{stop_after}'; stages: {', '.join(COMPILE_STAGE_NAMES)}")
    qfmt = scheme_for(quantize, [t.name for t in tgs if t.is_gpu])
    if qfmt is not None and is_gguf(model):
        quantized = packed_tensor(model)
        if quantized:
            raise QuantizeError(f"--quantize: {Path(model).name} is already quantized ('{quantized[0]}' is "
                                f"{quantized[1]}); compile it without --quantize")
    src_name = name or (Path(model).stem if isinstance(model, (str, Path)) else type(model).__name__)
    check_room(model, src_name)  # a model too large for the memory left: one line, before any work
    map_large_blocks()  # freed matrices leave the resident set (verification widens one at a time)
    mem = MemoryLog(model)
    if tokenizer is None:  # a GGUF file carries its tokenizer and chat template, a checkpoint holds them
        tokenizer = gguf_tokenizer(model) or checkpoint_tokenizer(model)
    outdir = Path(out) if out is not None else Path(f"{src_name}.zlc")
    _prepare_out(outdir, force)
    tmp = outdir.with_name(outdir.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    b = Build(model=model, example_inputs=example_inputs, targets=tgs, max_seq=max_seq, name=src_name,
              wdtype=dtype if dtype != "auto" else ("bf16" if any(t.is_gpu for t in tgs) else auto_wdtype(model)),
              out=outdir, tmp=tmp, tokenizer=tokenizer, verify=verify, atol=atol, debug_waits=debug_waits,
              progress=progress, quantize=qfmt, stop_after=stop_after, numerics=numerics)
    secs: dict[str, float] = {}
    t0 = time.perf_counter()
    b.cache = _open_cache(cache, b)
    b.pool = _CountingPool(jobs or len(os.sched_getaffinity(0)), lambda d, n: b.count("libraries and cubins built", d, n))
    try:
        for stage in COMPILE_STAGES:
            t = time.perf_counter()
            b.stage = stage.name
            begin = getattr(progress, "begin", None)  # the CLI's: stages start here, whatever jobs report
            if begin is not None:
                begin(stage.name)
            stage.run(b)
            secs[stage.name] = time.perf_counter() - t
            mem.mark(stage.name)
            if stage.name == stop_after:
                b.pool.shutdown(wait=True, cancel_futures=True)
                shutil.rmtree(tmp)
                secs["total"] = time.perf_counter() - t0
                return CompileResult(None, b.manifest, secs, b, mem.report())
    except BaseException:
        b.pool.shutdown(wait=True, cancel_futures=True)  # no compiler writes into the bundle after this
        shutil.rmtree(tmp, ignore_errors=True)  # a failed compile leaves no half-written bundle
        raise
    finally:
        b.pool.shutdown(wait=True, cancel_futures=True)
    b.manifest["compile_seconds"] = {k: round(v, 3) for k, v in secs.items() if k != "total"}
    write_manifest(tmp, b.manifest)
    if outdir.exists():
        shutil.rmtree(outdir)
    tmp.rename(outdir)
    secs["total"] = time.perf_counter() - t0
    return CompileResult(outdir, b.manifest, secs, b, mem.report())


class _CountingPool(ThreadPoolExecutor):
    """The builds' pool, counting the jobs submitted and done (the progress bar of the builds)."""

    def __init__(self, workers: int, on_count: Callable[[int, int], None]) -> None:
        super().__init__(max_workers=workers, thread_name_prefix="zlc-build")
        self.on_count, self.submitted, self.done = on_count, 0, 0
        self.lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            self.submitted += 1
        fut = super().submit(fn, *args, **kwargs)
        fut.add_done_callback(self._one_done)
        self.on_count(self.done, self.submitted)
        return fut

    def _one_done(self, _: Any) -> None:
        with self.lock:
            self.done += 1
        self.on_count(self.done, self.submitted)


def _open_cache(enabled: bool, b: Build) -> Any:
    from zlc.codegen.kcache import KernelCache

    try:
        return KernelCache.open(enabled, say=lambda line: b.report(b.stage or "lower", line))
    except ValueError as e:  # ZLC_KERNEL_CACHE_SIZE
        raise ZlcError(str(e)) from None


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
