"""The compile's memory: its peak resident set per stage (for the compile report and `--json`), and
the check that refuses a model too large for the memory left, before any work starts.

Resident sets are read from /proc/self/status (VmRSS, VmHWM: file-backed pages of a mapped model
count once touched, as they do for the kernel's OOM killer); memory left from /proc/meminfo's
MemAvailable and the cgroup's memory.max - memory.current where one is set (a container's limit).
Off Linux every figure is None and nothing is refused.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ZlcError

__all__ = ["MemoryLog", "check_room", "model_bytes", "map_large_blocks", "needed_bytes", "release_mapped", "rss"]

#: What a compile needs beyond the model's bytes: the interpreter with torch, transformers, onnx and
#: gguf imported (~250-400 MiB measured, bench/compile_memory.py), the IR, the tables and the
#: reference executor's activations at the probe lengths.
BASE_BYTES = 768 << 20
#: ... and per byte of the model: its mapped pages (1x, touched by verification and the weight
#: writers) and the largest transient (one matrix widened to f32 by the reference executor, the
#: panel layout of one matrix; bounded by the 1.5x aim of issue 33).
PER_MODEL_BYTE = 1.5


#: Blocks from this size up are mapped and unmapped on their own (glibc's M_MMAP_THRESHOLD, fixed
#: for the compile's process by map_large_blocks).
MMAP_THRESHOLD = 1 << 20


def rss() -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of this process in bytes, or None where /proc has neither."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        return None
    f = {k: v for k, _, v in (ln.partition(":") for ln in lines)}
    if "VmRSS" not in f or "VmHWM" not in f:
        return None
    return int(f["VmRSS"].split()[0]) * 1024, int(f["VmHWM"].split()[0]) * 1024


def model_bytes(model: Any) -> int | None:
    """The bytes of the model's file (an .onnx with its external data, a .gguf) or, for a checkpoint
    directory, of its safetensors files; None for a module."""
    if not isinstance(model, (str, os.PathLike)):
        return None
    p = Path(model)
    try:
        if p.is_dir():
            return sum(f.stat().st_size for f in p.glob("*.safetensors")) or None
        if p.suffix == ".onnx":
            return p.stat().st_size + sum(f.stat().st_size for f in p.parent.glob(p.name + ".data"))
        return p.stat().st_size
    except OSError:
        return None


def needed_bytes(nbytes: int) -> int:
    return BASE_BYTES + int(PER_MODEL_BYTE * nbytes)


def available_bytes() -> int | None:
    """Memory this process may still take: MemAvailable, or less where a cgroup limit is nearer."""
    try:
        info = {k: int(v.split()[0]) * 1024 for k, _, v in
                (ln.partition(":") for ln in Path("/proc/meminfo").read_text().splitlines()) if v.strip()}
    except (OSError, ValueError):
        return None
    avail = info.get("MemAvailable")
    try:
        top = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if top != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            left = int(top) - used
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def check_room(model: Any, name: str) -> None:
    """Raises ZlcError naming the memory a compile of `model` needs when less is available."""
    nbytes = model_bytes(model)
    avail = available_bytes()
    if nbytes is None or avail is None:
        return
    need = needed_bytes(nbytes)
    cur = rss()
    # what this process holds already counts against the base allowance (imports, interpreter), never
    # against the model's share: a process that is large already (a test run, a notebook) still needs that
    held = min(cur[0], BASE_BYTES) if cur else 0
    need_more = need - held
    if need_more > avail:
        raise ZlcError(f"{name}: compiling a {_gib(nbytes)} model needs about {_gib(need)} of memory "
                       f"({PER_MODEL_BYTE}x the model + {_gib(BASE_BYTES)}); {_gib(avail)} is available")


def release_mapped(model: Any) -> None:
    """Drops the model's mapped pages from this process's resident set (madvise DONTNEED: the pages
    stay in the page cache and fault back in if read again): a GGUF file's (the reader's read-only
    map), a checkpoint directory's safetensors files' (the maps `safe_open` made). Called once the
    weights stage has written the bundle's weights: no later stage reads them, so they need not
    count against the compile's peak while the kernels and tokenizer are built."""
    import mmap

    if not isinstance(model, (str, os.PathLike)):
        return
    p = Path(model)
    if p.is_dir():
        _drop_file_pages({str(f.resolve()) for f in p.glob("*.safetensors")})
        return
    if p.suffix != ".gguf":
        return
    from .gguf_reader import open_gguf

    try:
        m = getattr(open_gguf(p).data, "_mmap", None)
        if m is not None and hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED)
    except (OSError, ValueError, AttributeError):  # no map to release: nothing lost but the saving
        pass


def _drop_file_pages(paths: set[str]) -> None:
    """madvise(DONTNEED) on this process's maps of `paths` (/proc/self/smaps). safetensors maps a
    file private and writable (a torch storage over it); a map with a page written in it (copied on
    write: its Anonymous kB) is left alone, since dropping would lose the write."""
    import ctypes
    import mmap

    if not paths or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
        madvise = ctypes.CDLL(None).madvise  # the process's own symbols: libc's
    except (OSError, AttributeError):
        return
    maps: dict[tuple[int, int], int] = {}  # (start, end) of each map of one of `paths` -> its written kB
    cur: tuple[int, int] | None = None  # the map whose fields the lines below describe, if one of ours
    for ln in lines:
        head = ln.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a map's header line
            cur = None
            if len(head) == 6 and head[5] in paths:
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                cur = (lo, hi)
                maps[cur] = -1
        elif cur is not None and ln.startswith("Anonymous:"):
            maps[cur] = int(ln.split()[1])
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for (lo, hi), written in maps.items():
        if written == 0:
            madvise(lo, hi - lo, mmap.MADV_DONTNEED)


def map_large_blocks() -> None:
    """Fixes glibc's mmap threshold at MMAP_THRESHOLD for this process, so a freed large block goes
    back to the system at once. By default glibc raises the threshold to the size of each mapped
    block freed (up to 32 MiB): from then on the reference executor's widened matrices (one f32
    matrix per node that reads it, freed after) come from the heap, and the holes they leave among
    the activations stayed resident (+150-250 MiB at verification's end for a 254 MiB bf16
    checkpoint, bench/compile_memory.py). Elsewhere (no mallopt) nothing changes."""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, MMAP_THRESHOLD)  # -3: M_MMAP_THRESHOLD (malloc.h)
    except (OSError, AttributeError):
        pass


class MemoryLog:
    """Resident set and high-water mark as each stage ends; the peak and its ratio to the model."""

    def __init__(self, model: Any) -> None:
        self.model_bytes = model_bytes(model)
        self.stages: dict[str, tuple[int, int]] = {}
        self.start = rss()

    def mark(self, stage: str) -> None:
        now = rss()
        if now is not None:
            self.stages[stage] = now

    def report(self) -> dict[str, Any]:
        """{peak_rss, model_bytes, ratio, start_rss, stages: {stage: [rss, peak so far]}} (bytes)."""
        peak = max((h for _, h in self.stages.values()), default=None)
        ratio = round(peak / self.model_bytes, 2) if peak and self.model_bytes else None
        return {"peak_rss": peak, "model_bytes": self.model_bytes, "ratio": ratio,
                "start_rss": self.start[0] if self.start else None,
                "stages": {k: list(v) for k, v in self.stages.items()}}
