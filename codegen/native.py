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
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import numpy as np

from zlc import abi
from zlc.abi import AttentionDesc, EmbedDesc, LinearDesc
from zlc.errors import ZlcError
from zlc.targets import IsaLevel, isa_levels_for

from .emit import DEBUG_WAIT_TIMEOUT_NS, kernel_constants
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


def render(p: Program, *, weight_dtype: str, version: str) -> str:
    """The C source for program `p` (any tiling of the model; the native one in bundles)."""
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
    t = p.tiling
    return env.get_template("megakernel.c.jinja").render(
        version=version, model=p.model.replace("*/", "* /"), weight_dtype=weight_dtype, c=consts, desc=abi.desc_constants(),
        wait_timeout_ns=DEBUG_WAIT_TIMEOUT_NS, abi=ABI, error_bad_op=ERROR_BAD_OP, chunk=t.chunk,
        block_t=t.block_t, kv_splits=t.kv_splits, max_seq=p.max_seq, max_k=max(ks or [1]),
        head_p2=max(16, 1 << (p.head_dim - 1).bit_length()), linear_ks=ks, head_dims=dims, w_formats=formats)


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


def cache_dir() -> Path | None:
    """Where built libraries are kept by content ($ZLC_NATIVE_CACHE, default ~/.cache/zlc/native;
    "none" turns it off): recompiling a model, or the test suite's many bundles of one model, then
    skips the C compiler (seconds per bundle)."""
    env = os.environ.get("ZLC_NATIVE_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "none") else Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zlc" / "native"


def _cache_key(source: str, cc: str, version: str, levels: Sequence[IsaLevel]) -> str:
    body = source.split("\n", 1)[1]  # not the first line: it names the model and zlc version only
    h = hashlib.sha256()
    for part in (body, os.path.realpath(cc), version, *(" ".join(level_flags(lv)) for lv in levels), *LIBS):
        h.update(part.encode() + b"\0")
    return h.hexdigest()[:32]


def build_native(p: Program, out_dir: Path, *, weight_dtype: str, version: str,
                 machine: str | None = None, progress: Callable[[str], None] | None = None) -> NativeBuild:
    """Renders the kernel into `out_dir/megakernel.c` and compiles one library per ISA level of
    `machine` (this host's by default) as `out_dir/<level>.so`, the compilers running side by side
    (or copies them from the cache, see `cache_dir`). No C compiler: nothing is written and the
    result says why (the bundle still runs on a GPU or the interpreter)."""
    cc, why = find_compiler()
    if cc is None:
        return NativeBuild(skipped=why)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "megakernel.c"
    text = render(p, weight_dtype=weight_dtype, version=version)
    src.write_text(text)
    levels = isa_levels_for(machine or platform.machine())
    cc_version = compiler_version(cc)
    t0 = time.perf_counter()
    cached = cache_dir()
    key = _cache_key(text, cc, cc_version, levels)
    hit = cached is not None and all((cached / key / f"{lv.name}.so").is_file() for lv in levels)
    if progress:
        progress(f"{Path(cc).name}: {', '.join(lv.name for lv in levels)}" + (" (cached)" if hit else ""))
    if hit:
        assert cached is not None
        for lv in levels:
            shutil.copyfile(cached / key / f"{lv.name}.so", out_dir / f"{lv.name}.so")
    else:
        _compile_levels(cc, levels, src, out_dir)
        if cached is not None:
            _store(cached / key, [out_dir / f"{lv.name}.so" for lv in levels])
    rel = out_dir.name
    return NativeBuild(
        source=f"{rel}/megakernel.c", compiler=cc_version, flags=[*BASE_FLAGS, *LIBS],
        levels={lv.name: {"library": f"{rel}/{lv.name}.so", "machine": lv.machine, "cflags": list(lv.cflags),
                          "requires": list(lv.requires)} for lv in levels},
        seconds=round(time.perf_counter() - t0, 3))


def _compile_levels(cc: str, levels: Sequence[IsaLevel], src: Path, out_dir: Path) -> None:
    procs = [(lv, subprocess.Popen(_command(cc, lv, src, out_dir / f"{lv.name}.so"), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)) for lv in levels]
    failed = []
    for lv, proc in procs:
        log, _ = proc.communicate()
        if proc.returncode != 0:
            failed.append(f"{lv.name} (exit {proc.returncode}): {log.strip()[:2000]}")
    if failed:
        raise NativeBuildError(f"{Path(cc).name} failed on the native kernel: {'; '.join(failed)}")


def _store(entry: Path, libs: Sequence[Path]) -> None:
    """Puts the libraries into the cache entry atomically (a reader sees all of them or none). A
    read-only or full cache, or another writer that got there first, leaves the build as it is."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}."))
    except OSError:
        return
    try:
        for lib in libs:
            shutil.copyfile(lib, tmp / lib.name)
        os.replace(tmp, entry)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


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
