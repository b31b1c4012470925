"""The native CPU megakernel: C source rendered from `templates/megakernel.c.jinja`, compiled by the
system C compiler into one shared library per ISA level.

Why a C kernel next to the Triton one: Triton's CPU story is its interpreter, which runs programs
one after another at tens of ms per task: fine as a check of the Triton source, useless for serving,
and blind to the memory ordering of the protocol. The C kernel walks the same task tables with real
threads and C11 atomics, so it is both the CPU executor and the test of the tables under real
concurrency (ThreadSanitizer builds are the same source with `-fsanitize=thread`).

What is specialized per model: the tiling's constants (prefill chunk, query rows per attention
task, KV splits), the largest reduction size (scratch), the weight dtype, and the distinct K of the
Linears and head sizes of the attentions, which become `switch` cases calling always-inlined
bodies with constant sizes.

`build_native` is what `zlc compile` runs (compiler/build.py, stage "native"); `compile_library`
builds one variant (the tests use it for sanitizer builds). The manifest entry it returns is all
the runtime (runtime/native.py) reads.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from zlc import abi
from zlc.abi import AttentionDesc, EmbedDesc, LinearDesc
from zlc.bundle import CPU_FAST_FORMATS, check_numerics
from zlc.errors import ZlcError
from zlc.ir.quant import FORMATS
from zlc.targets import IsaLevel, isa_levels_for

from .emit import DEBUG_WAIT_TIMEOUT_NS, kernel_constants
from .kcache import KernelCache, content_key
from .program import Program

TEMPLATES = Path(__file__).resolve().parent / "templates"
SOURCE = "native/megakernel.c"
ENTRY = "zlc_native_launch"
ABI = 4  # bump when an exported function's signature changes (runtime/native.py checks it); 2: packed weights,
# 3: batched launches, 4: zlc_native_layout and mapped weights (zlc_native_create's `mapped`)
ERROR_BAD_OP = 2  # CTRL[ERROR] flag: the table holds an op code the kernel does not know

# -O3 and the level's -march; no -ffast-math (sums keep their written order); -ffp-contract=fast
# lets a*b+c become an FMA; math errno off so sqrtf is one instruction.
BASE_FLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-ffp-contract=fast",
              "-fvisibility=hidden", "-Wall", "-Wno-unused-function")
LIBS = ("-lm",)
COMPILERS = ("cc", "gcc", "clang")


class NativeBuildError(ZlcError):
    """The C compiler rejected the generated kernel (a bug in zlc's template, not in the model)."""


def find_compiler() -> tuple[str | None, str]:
    """(path of the C compiler, "") or (None, why none): $ZLC_CC, $CC, else cc/gcc/clang on PATH.
    ZLC_CC=none turns the native kernel off."""
    for var in ("ZLC_CC", "CC"):
        want = os.environ.get(var)
        if want is None or not want.strip():
            continue
        if want.strip().lower() == "none":
            return None, f"{var}=none"
        found = shutil.which(want.strip())
        return (found, "") if found else (None, f"{var}={want!r} is not an executable")
    for name in COMPILERS:
        found = shutil.which(name)
        if found:
            return found, ""
    return None, f"no C compiler found ({', '.join(COMPILERS)} not on PATH; set CC)"


def compiler_version(cc: str) -> str:
    try:
        out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return Path(cc).name
    return out.splitlines()[0].strip() if out.strip() else Path(cc).name


def render(p: Program, *, weight_dtype: str, version: str, numerics: str = "exact") -> str:
    """The C source for program `p` (any tiling of the model; the native one in bundles); `numerics`
    "fast": the Linears of CPU_FAST_FORMATS take 8-bit activations (templates/qfast.c.jinja)."""
    if p.tiling.fuse_mlp_down:  # the native tiling keeps it off; no C body adds partials atomically
        raise NativeBuildError("the native C kernel does not run the MLP split-K fusion (Tiling.fuse_mlp_down, "
                               "a GPU tiling's): schedule it with the native tiling")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    consts = kernel_constants()
    used = {(t.op, t.desc) for tasks in p.tables.values() for t in tasks}
    ks = sorted({int(p.desc_int[d, LinearDesc.k]) for op, d in used if op == abi.OP_LINEAR})
    dims = sorted({int(p.desc_int[d, AttentionDesc.head_dim]) for op, d in used  # cache_append's word too
                   if op in (abi.OP_ATTENTION, abi.OP_CACHE_APPEND)})
    # the packed formats (ir/quant.py codes) the Linears stream; each gets its own loop body
    formats = sorted(({int(p.desc_int[d, LinearDesc.w_format]) for op, d in used
                       if op == abi.OP_LINEAR and not p.desc_int[d, LinearDesc.route]}
                      # a packed embedding table needs the dequantization (W_PACKED) too
                      | {int(p.desc_int[d, EmbedDesc.table_format]) for op, d in used if op == abi.OP_EMBED}) - {0})
    fast = [FORMATS[n].code for n in CPU_FAST_FORMATS] if check_numerics(numerics) == "fast" else []
    t = p.tiling
    return env.get_template("megakernel.c.jinja").render(
        version=version, model=p.model.replace("*/", "* /"), weight_dtype=weight_dtype, c=consts, desc=abi.desc_constants(),
        wait_timeout_ns=DEBUG_WAIT_TIMEOUT_NS, abi=ABI, error_bad_op=ERROR_BAD_OP, chunk=t.chunk,
        block_t=t.block_t, kv_splits=t.kv_splits, max_seq=p.max_seq, max_k=max(ks or [1]),
        head_p2=max(16, 1 << (p.head_dim - 1).bit_length()), linear_ks=ks, head_dims=dims, w_formats=formats,
        fast_formats=[f for f in formats if f in fast])


@dataclass
class NativeBuild:
    """What `build_native` made: the manifest's `native` entry (`skipped` says why when nothing)."""

    source: str | None = None
    compiler: str | None = None
    flags: list[str] = field(default_factory=list)
    levels: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped: str | None = None
    seconds: float = 0.0  # the compilers' wall time (the levels compile side by side)

    def manifest(self, tiling: str = "native") -> dict[str, Any]:
        if self.skipped is not None:
            return {"skipped": self.skipped}
        return {"source": self.source, "tiling": tiling, "entry": ENTRY, "abi": ABI, "compiler": self.compiler,
                "flags": self.flags, "levels": self.levels, "compile_seconds": self.seconds}


def level_flags(level: IsaLevel) -> list[str]:
    return [*BASE_FLAGS, *level.cflags, f'-DZLC_LEVEL="{level.name}"']


def _command(cc: str, level: IsaLevel, source: Path, out: Path, extra: Sequence[str] = ()) -> list[str]:
    return [cc, *level_flags(level), *extra, str(source), "-o", str(out), *LIBS]


def compile_library(source: Path, out: Path, level: IsaLevel, cc: str, extra: Sequence[str] = ()) -> float:
    """Compiles `source` for `level` into the shared library `out`; returns the seconds it took.
    `extra` flags come last (e.g. -fsanitize=thread -g -O1 for a test build)."""
    t0 = time.perf_counter()
    proc = subprocess.run(_command(cc, level, source, out, extra), capture_output=True, text=True)
    if proc.returncode != 0:
        raise NativeBuildError(f"{Path(cc).name} failed on the native kernel for {level.name} "
                               f"(exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[:2000]}")
    return time.perf_counter() - t0


def level_key(source: str, cc: str, cc_version: str, level: IsaLevel) -> str:
    """The compile cache's key of one level's library: the source less its first line (it names
    the model and zlc version only, so models with the same shapes and features share libraries),
    the compiler (path and version), the level's flags and the libraries linked."""
    body = source.split("\n", 1)[1]
    return content_key("native", body, os.path.realpath(cc), cc_version, " ".join(level_flags(level)), *LIBS)


def build_native(p: Program, out_dir: Path, *, weight_dtype: str, version: str, numerics: str = "exact",
                 machine: str | None = None, progress: Callable[[str], None] | None = None,
                 cache: KernelCache | None = None, pool: Executor | None = None) -> NativeBuild:
    """Renders the kernel into `out_dir/megakernel.c` and compiles one library per ISA level of
    `machine` (this host's by default) as `out_dir/<level>.so`, the compilers running side by side
    (as jobs of `pool` when given, else all at once), or copies them from the compile `cache`
    (codegen/kcache.py; the environment's by default, see `KernelCache.open`). No C compiler:
    nothing is written and the result says why (the bundle still runs on a GPU or the interpreter).
    `numerics` "fast" also builds the integer dot-product levels (zlc.targets.VNNI_LEVELS)."""
    cc, why = find_compiler()
    if cc is None:
        return NativeBuild(skipped=why)
    cache = cache if cache is not None else KernelCache.open()
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "megakernel.c"
    text = render(p, weight_dtype=weight_dtype, version=version, numerics=numerics)
    src.write_text(text)
    levels = isa_levels_for(machine or platform.machine(), numerics)
    cc_version = compiler_version(cc)
    t0 = time.perf_counter()
    rel = out_dir.name
    keys = {lv.name: level_key(text, cc, cc_version, lv) for lv in levels}
    hits = {lv.name: cache.get(keys[lv.name], f"native {lv.name}") for lv in levels}
    todo = [lv for lv in levels if hits[lv.name] is None]
    if progress:
        progress(f"{Path(cc).name}: " + ", ".join(lv.name + ("" if lv in todo else " (cached)") for lv in levels))
    for lv in levels:
        got = hits[lv.name]
        if got is not None:
            (out_dir / f"{lv.name}.so").write_bytes(got["lib.so"])
        cache.note(f"{rel}/{lv.name}.so", got is not None)
    if todo:
        _compile_levels(cc, todo, src, out_dir, pool, progress)
        for lv in todo:
            cache.put(keys[lv.name], {"lib.so": (out_dir / f"{lv.name}.so").read_bytes()},
                      {"kind": "native", "level": lv.name, "compiler": cc_version})
    return NativeBuild(
        source=f"{rel}/megakernel.c", compiler=cc_version, flags=[*BASE_FLAGS, *LIBS],
        levels={lv.name: {"library": f"{rel}/{lv.name}.so", "machine": lv.machine, "cflags": list(lv.cflags),
                          "requires": list(lv.requires)} for lv in levels},
        seconds=round(time.perf_counter() - t0, 3))


def _compile_levels(cc: str, levels: Sequence[IsaLevel], src: Path, out_dir: Path, pool: Executor | None,
                    progress: Callable[[str], None] | None) -> None:
    def one(lv: IsaLevel) -> str | None:
        proc = subprocess.run(_command(cc, lv, src, out_dir / f"{lv.name}.so"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
        if progress:
            progress(f"built {lv.name}")
        return None if proc.returncode == 0 else f"{lv.name} (exit {proc.returncode}): {proc.stdout.strip()[:2000]}"

    if pool is not None:
        results = list(pool.map(one, levels))
    else:  # one thread per level, each waiting on its compiler process
        with ThreadPoolExecutor(max_workers=len(levels)) as own:
            results = list(own.map(one, levels))
    failed = [r for r in results if r is not None]
    if failed:
        raise NativeBuildError(f"{Path(cc).name} failed on the native kernel: {'; '.join(failed)}")


# The mapped layout's sections start on page boundaries: a session maps the file once and hands the
# kernel both pointers; page alignment also keeps every panel aligned for the vector loads.
LAYOUT_ALIGN = 4096


def _round_up(n: int, to: int = LAYOUT_ALIGN) -> int:
    return (n + to - 1) // to * to


def write_layout(library: Path, tasks: np.ndarray, desc_int: np.ndarray, w: np.ndarray, q: np.ndarray,
                 out: Path) -> dict[str, Any]:
    """Writes W and Q in the layout `library`'s kernel reads (every Linear matrix in panels, packed
    ones in block panels) into `out`, by running the library's own `zlc_native_layout`: the
    layout is its level's (panels are two vectors wide), and the same code lays it out as a
    session that copies would, so the mapped and the copied weights are the same bytes. `w` is
    the W arena (element size 2: bf16 bits, 4: f32), `q` the Q bytes. Returns the manifest entry {file, bytes, w: {offset, bytes},
    q: {offset, bytes}} (file relative to out's parent's parent, i.e. the bundle root)."""
    lib = ctypes.CDLL(str(library))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.zlc_native_layout.restype = ctypes.c_int
    lib.zlc_native_layout.argtypes = [p, p, i64, p, i64, p, i64, p, p]
    esize = w.dtype.itemsize
    if esize not in (2, 4):
        raise NativeBuildError(f"W's elements are 2 (bf16) or 4 (f32) bytes, not {esize}")
    tasks = np.ascontiguousarray(tasks, dtype=np.int32)
    desc_int = np.ascontiguousarray(desc_int, dtype=np.int64)
    wb = np.ascontiguousarray(w).view(np.uint8).reshape(-1)
    qb = np.ascontiguousarray(q).view(np.uint8).reshape(-1)
    q_at = _round_up(wb.size)
    buf = np.zeros(q_at + _round_up(qb.size) if qb.size else max(wb.size, 1), dtype=np.uint8)
    err = lib.zlc_native_layout(tasks.ctypes.data, desc_int.ctypes.data, desc_int.shape[0], wb.ctypes.data,
                                wb.size // esize, qb.ctypes.data if qb.size else None, qb.size,
                                buf.ctypes.data, buf[q_at:].ctypes.data if qb.size else None)
    if err:
        raise NativeBuildError(f"{library.name}: the weight layout failed ({os.strerror(err)}): the tables name "
                               "a matrix outside the arenas or a format this kernel does not stream (a zlc bug)")
    out.parent.mkdir(parents=True, exist_ok=True)
    buf.tofile(out)
    return {"file": f"{out.parent.name}/{out.name}", "bytes": int(buf.size), "w": {"offset": 0, "bytes": int(wb.size)},
            "q": {"offset": int(q_at) if qb.size else 0, "bytes": int(qb.size)}}
