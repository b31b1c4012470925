"""The `cpu` executor: the bundle's native megakernel (native/<level>.so) on this process's cores.

`zlc compile` builds the C kernel once per ISA level (codegen/native.py); this module picks the
best level the host's CPU flags allow (`select_level`, read from /proc/cpuinfo), loads it with
ctypes and drives it through the `Backend` protocol of runtime/megakernel.py. The library owns the
worker threads: `zlc_native_create` starts `threads - 1` of them once per session (the calling
thread is worker 0 during a launch), `zlc_native_launch` runs one prefill chunk or decode step and
returns with every worker back at its idle wait; `zlc_native_batch_launch` runs one batched step
(rows of several sequences over a paged KV cache, runtime/batch.py). ctypes releases the GIL for the call.

Why ctypes: a few C functions, plain pointers and ints; no extension module to build per Python.
Why no torch: the arenas are read as raw bytes (`read_safetensors`), so a server on this executor
starts in well under a second and never imports torch.

Weights: when the bundle holds the selected level's layout (native/<level>.weights, written by
`zlc compile --target cpu` with every Linear matrix already in panels), the session maps that file
read-only and the kernel reads it in place: no copy, and the page cache holds one copy for every
session and process on the host (`map_weights`). Otherwise the library lays W and Q out in memory
of its own at session start (0.5-0.9 s for SmolLM2).

Threads default to the CPUs this process may run on (`os.sched_getaffinity`, which is what `zlc
deploy`'s CPUAffinity= sets); `pin=True` pins worker i to the i-th of them, `pin=[cpus]` to a list.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
import warnings
import weakref
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from zlc import bundle as fmt
from zlc.errors import ZlcError
from zlc.targets import ISA_LEVELS

from .cuda_launch import read_safetensors

ABI = 4  # codegen/native.py's ABI: the exported functions' signatures
ERROR_FLAGS = {1: "a wait timed out", 2: "the table holds an op code this kernel does not know"}


class NativeError(ZlcError):
    """The native CPU kernel cannot run here: none built, the host's ISA, a library that fails to load."""


@lru_cache(maxsize=1)
def _qdot(lib: Any) -> str:
    """The library's integer dot-product path (zlc_native_qdot; "none" in exact builds and older ones)."""
    try:
        fn = lib.zlc_native_qdot
    except AttributeError:
        return "none"
    fn.restype = ctypes.c_char_p
    return str(fn().decode())


def host_cpu_flags() -> frozenset[str]:
    """The CPU feature flags of this host (/proc/cpuinfo `flags`, or `Features` on ARM)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def host_level(flags: frozenset[str] | None = None, machine: str | None = None) -> str:
    """This host in the levels' terms: its best x86-64 level, or its machine name."""
    flags = host_cpu_flags() if flags is None else flags
    machine = machine or platform.machine()
    for lv in ISA_LEVELS:
        if lv.machine == machine and set(lv.requires) <= flags:
            return lv.name
    return machine if machine != "x86_64" else "x86-64 below v2"


def select_level(native: Mapping[str, Any], *, want: str | None = None, flags: frozenset[str] | None = None,
                 machine: str | None = None) -> str:
    """The best of the bundle's levels this host runs (the manifest lists them best first), or
    `want` when the host runs it; `want` defaults to $ZLC_NATIVE_LEVEL (a switch that forces every
    session onto one level: a test run at each level checks each summation order). One-line
    NativeError naming the bundle's and the host's levels."""
    want = want or os.environ.get("ZLC_NATIVE_LEVEL") or None
    flags = host_cpu_flags() if flags is None else flags
    machine = machine or platform.machine()
    levels: Mapping[str, Any] = native.get("levels") or {}

    def runs(info: Mapping[str, Any]) -> bool:
        return str(info.get("machine")) == machine and set(info.get("requires", ())) <= flags

    if want is not None:
        if want not in levels:
            raise NativeError(f"the bundle has no native kernel for {want} (it has {', '.join(levels) or 'none'})")
        if not runs(levels[want]):
            raise NativeError(f"the bundle's native kernel for {want} does not run on this host "
                              f"({host_level(flags, machine)})")
        return want
    for name, info in levels.items():
        if runs(info):
            return str(name)
    raise NativeError(f"the bundle's native CPU kernel is built for {', '.join(levels) or 'no level'}; this "
                      f"host is {host_level(flags, machine)} and runs none of them (recompile the bundle "
                      "on a host like this one, or use --device interpret or reference)")


def native_entry(bundle: Path, manifest: Mapping[str, Any]) -> Mapping[str, Any]:
    """The manifest's `native` entry, or a one-line NativeError saying why the bundle has none."""
    native = manifest.get("native")
    if not native:
        raise NativeError(f"{bundle} has no native CPU kernel (compiled by an older zlc); recompile it, "
                          "or use --device interpret or reference")
    if native.get("skipped"):
        raise NativeError(f"{bundle} has no native CPU kernel: `zlc compile` skipped it ({native['skipped']}); "
                          "install a C compiler and recompile, or use --device interpret or reference")
    return native  # type: ignore[no-any-return]


def _bind(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.zlc_native_abi.restype = i32
    lib.zlc_native_level.restype = ctypes.c_char_p
    lib.zlc_native_create.restype = p
    lib.zlc_native_create.argtypes = [p, p, p, i64, p, p, p, i64, p, i64, i32, p, p, i32, p, i32, i32]
    lib.zlc_native_launch.restype = i32
    lib.zlc_native_launch.argtypes = [p]
    lib.zlc_native_kv_token_floats.restype = i64
    lib.zlc_native_kv_token_floats.argtypes = [p]
    lib.zlc_native_batch_launch.restype = i32
    lib.zlc_native_batch_launch.argtypes = [p, p, i64, i64, i32, p, p, p, p, i64, p, i32]
    lib.zlc_native_destroy.restype = None
    lib.zlc_native_destroy.argtypes = [p]


def _cpus(pin: bool | Sequence[int]) -> list[int]:
    if pin is True:
        return sorted(os.sched_getaffinity(0))
    if pin is False:
        return []
    return [int(c) for c in pin]  # type: ignore[union-attr]


def _ptr(a: np.ndarray) -> int:
    return int(a.ctypes.data)


def _arena(n: int) -> np.ndarray:
    """n zeroed f32 in anonymous memory asking for transparent huge pages, touched once: the first
    prefill then does not pay ~25,000 page faults on the activations (SmolLM2: ~180 MB with the
    KV cache), and the kernel's streaming over them misses the TLB less."""
    nbytes = max(4 * n, 4)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP disabled: plain pages
            pass
    a = np.frombuffer(mm, dtype=np.float32, count=n)
    a[::1024] = 0.0  # one write per 4 KiB page faults every page in now
    return a


class WeightMap:
    """A bundle's native weight layout, mapped read-only and shared (MAP_SHARED: the page cache's
    pages, one copy for every process on the host). Sessions of one process on the same file
    share one WeightMap (`map_weights`); it is unmapped when the last of them lets go."""

    def __init__(self, path: Path, size: int):
        with open(path, "rb") as f:
            # MAP_POPULATE: the page tables are filled now, from the page cache, instead of by
            # ~65,000 faults in the first launch (SmolLM2); a cold file is read in here too.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # 2 MiB mappings where the kernel can (large folios, khugepaged)
            try:  # the decode streams all of it: fewer TLB misses, as with the copy's anonymous THP
                self.mm.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass
        self.path, self.size = path, size
        self.bytes = np.frombuffer(self.mm, dtype=np.uint8)

    @property
    def address(self) -> int:
        return int(self.bytes.ctypes.data)


_MAPS: weakref.WeakValueDictionary[tuple[int, int, int, int], WeightMap] = weakref.WeakValueDictionary()
_MAPS_LOCK = threading.Lock()


def map_weights(bundle: Path, entry: Mapping[str, Any]) -> WeightMap:
    """The mapping of the layout file `entry` (a level's manifest `weights`) names, shared with the
    other sessions of this process on the same file (same inode, size and mtime). A file whose
    size is not the manifest's (truncated, or half copied) is a one-line NativeError, checked
    here because a read past the end of a mapping is a SIGBUS, not an exception."""
    path = bundle / str(entry["file"])
    want = int(entry["bytes"])
    try:
        st = path.stat()
    except OSError as e:
        raise NativeError(f"{bundle}: the native weight layout {entry['file']} is missing ({e.strerror})") from e
    if st.st_size != want:
        raise NativeError(f"{bundle}: {entry['file']} has {st.st_size} bytes, the manifest says {want} "
                          "(truncated or modified; recompile or copy the bundle again)")
    for part in ("w", "q"):
        sec = entry[part]
        if int(sec["offset"]) + int(sec["bytes"]) > want:
            raise NativeError(f"{bundle}: the manifest places {part.upper()} outside {entry['file']}")
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _MAPS_LOCK:
        m = _MAPS.get(key)
        if m is None:
            try:
                m = WeightMap(path, want)
            except (OSError, ValueError) as e:
                raise NativeError(f"{bundle}: cannot map {entry['file']} ({e})") from e
            _MAPS[key] = m
        return m


class NativeBackend:
    """One bundle on this host's cores: a `Backend` for `MegakernelSession`.

    `tables` replaces the native tiling's task tables (a safetensors file of tasks, desc_int,
    desc_float: shuffled or broken tables in tests); `library` loads another build of the same
    source (a ThreadSanitizer build in tests); `level` picks one of the bundle's ISA levels.
    `mapped` (default: when the bundle has this level's layout and neither `library` nor `tables`
    is given) reads the weights from the mapped layout file; False lays them out in memory of the
    session's own. `weights` is the mapping in use (None when copied)."""

    def __init__(self, bundle: str | Path, manifest: Mapping[str, Any] | None = None, *, threads: int | None = None,
                 pin: bool | Sequence[int] = False, debug: bool = False, tables: str | Path | None = None,
                 level: str | None = None, library: str | Path | None = None, mapped: bool | None = None):
        self.bundle = Path(bundle)
        if manifest is None:
            manifest = fmt.read_manifest(self.bundle, check=True)
        self._ctx: int | None = None
        native = native_entry(self.bundle, manifest)
        self.level = select_level(native, want=level) if library is None else (level or "custom")
        path = Path(library) if library is not None else self.bundle / native["levels"][self.level]["library"]
        try:
            self.lib = ctypes.CDLL(str(path))
            _bind(self.lib)
        except (OSError, AttributeError) as e:
            raise NativeError(f"cannot load the native kernel {path}: {e}") from e
        if self.lib.zlc_native_abi() != ABI:
            raise NativeError(f"{path} has kernel ABI {self.lib.zlc_native_abi()}, this zlc speaks {ABI}; recompile")
        self.qdot = _qdot(self.lib)  # --numerics fast: the integer dot-product path ("none": exact)
        if self.qdot == "portable":  # said once (warnings' default), not per session
            warnings.warn(f"zlc: {path.name}: this CPU grants no integer dot-product extension the fast numerics "
                          "use (VNNI, AVX2, SSSE3): its Linears take the portable loop", stacklevel=2)
        tiling = manifest["tilings"][native["tiling"]]
        lay = tiling["layout"]
        self.chunk = int(lay["chunk"])
        t = read_safetensors(Path(tables) if tables else self.bundle / tiling["tables"])
        self.TASKS = np.ascontiguousarray(t["tasks"][1], dtype=np.int32)
        self.DI = np.ascontiguousarray(t["desc_int"][1], dtype=np.int64)
        self.DF = np.ascontiguousarray(t["desc_float"][1], dtype=np.float32)
        arenas = read_safetensors(self.bundle / manifest["weights"]["file"])
        wdt = {"bf16": "BF16", "fp32": "F32"}[str(manifest["dtype"]["weights"])]
        if arenas["W"][0] != wdt:
            raise NativeError(f"{self.bundle}: W is {arenas['W'][0]}, the manifest says {wdt}")
        W = arenas["W"][1].reshape(-1)  # memory-mapped
        # packed weights (bytes; absent from bundles without any)
        Q = arenas["Q"][1].reshape(-1) if "Q" in arenas else np.zeros(0, dtype=np.uint8)
        if Q.dtype != np.uint8:
            raise NativeError(f"{self.bundle}: Q is {arenas['Q'][0]}, packed weights are bytes (U8)")
        self.P = np.array(arenas["P"][1].reshape(-1), dtype=np.float32)
        # the layout is the bundle's level's (panels are two of its vectors wide) for the bundle's
        # tables' matrices: another library (a test build of another level) or other tables copy
        layout = native["levels"].get(self.level, {}).get("weights") if library is None and tables is None else None
        if mapped and layout is None:
            raise NativeError("a session on other tables or another library lays the weights out itself"
                              if library is not None or tables is not None else
                              f"{self.bundle} has no mapped weight layout for {self.level} "
                              "(compiled without --target cpu, or on a host of another level)")
        self.weights: WeightMap | None = None
        w_ptr, q_ptr = _ptr(W), (_ptr(Q) if Q.size else None)
        if layout is not None and mapped is not False:
            if int(layout["w"]["bytes"]) != W.nbytes or int(layout["q"]["bytes"]) != Q.nbytes:
                raise NativeError(f"{self.bundle}: {layout['file']} holds {layout['w']['bytes']} + "
                                  f"{layout['q']['bytes']} bytes of W + Q, the arenas have {W.nbytes} + {Q.nbytes}")
            self.weights = map_weights(self.bundle, layout)
            w_ptr = self.weights.address + int(layout["w"]["offset"])
            q_ptr = self.weights.address + int(layout["q"]["offset"]) if Q.size else None
        self.A = _arena(int(lay["a_size"]))
        self.CTRL = np.zeros(int(lay["ctrl_size"]), dtype=np.int32)
        self.CNT = np.zeros(int(lay["counters_size"]), dtype=np.int32)
        self.logits = lay["logits"]
        cpus = np.array(_cpus(pin), dtype=np.int32)
        self.threads = int(threads) if threads else len(os.sched_getaffinity(0))
        if self.threads < 1:
            raise NativeError(f"threads must be at least 1, got {threads}")
        ctypes.set_errno(0)
        ctx = self.lib.zlc_native_create(
            _ptr(self.TASKS), _ptr(self.DI), _ptr(self.DF), self.DI.shape[0], _ptr(self.CTRL), _ptr(self.CNT),
            w_ptr, W.size, q_ptr, Q.size, int(self.weights is not None), _ptr(self.P), _ptr(self.A), self.threads,
            _ptr(cpus) if cpus.size else None, int(cpus.size), int(bool(debug)))
        if not ctx:
            err = ctypes.get_errno()
            raise NativeError(f"the native kernel could not start a session ({os.strerror(err) if err else 'failed'})")
        self._ctx = ctx
        del W, Q, arenas  # weights.safetensors' mapping: the library reads its copy or self.weights

    def launch(self, mode: int, ids: list[int], past: int, all_logits: bool,
               want_logits: bool) -> tuple[int, np.ndarray | None]:
        if self._ctx is None:
            raise NativeError("the native session is closed")
        c = self.CTRL
        c[fmt.CTRL_MODE], c[fmt.CTRL_T], c[fmt.CTRL_PAST] = mode, len(ids), past
        c[fmt.CTRL_ALL_LOGITS], c[fmt.CTRL_ERROR], c[fmt.CTRL_AUTO_ADVANCE] = int(all_logits), 0, 0
        c[fmt.CTRL_TOKENS:fmt.CTRL_TOKENS + len(ids)] = ids
        flags = self.lib.zlc_native_launch(self._ctx)
        if flags:
            what = "; ".join(v for k, v in ERROR_FLAGS.items() if flags & k) or "unknown"
            raise ZlcError(f"the megakernel raised error flags {flags} ({what})")
        if self.CNT.any():
            raise ZlcError("the megakernel did not reset its counters")
        tok = int(c[fmt.CTRL_OUT_TOKEN])
        if not want_logits:
            return tok, None
        lg = self.logits
        rows = self.A[lg["offset"]:lg["offset"] + lg["rows"] * lg["cols"]].reshape(lg["rows"], lg["cols"])
        sel = rows[:len(ids)] if all_logits else rows[len(ids) - 1:len(ids)]
        return tok, sel.copy()

    def kv_token_floats(self) -> int:
        """f32 of the paged KV cache per token (every layer's K and V); -1 when this model's
        tables have no batched launch (an attention reads a cache no cache_append writes)."""
        if self._ctx is None:
            raise NativeError("the native session is closed")
        return int(self.lib.zlc_native_kv_token_floats(self._ctx))

    def batch_launch(self, kv: np.ndarray, page_size: int, tokens: np.ndarray, pos: np.ndarray, pt: np.ndarray,
                     pages: np.ndarray, lrows: np.ndarray) -> np.ndarray:
        """One batched launch (the kernel's "batched steps"): row r is token tokens[r] at position
        pos[r] of the sequence whose page table starts at pages[pt[r]]; the pages live in `kv`
        (f32, page_size * kv_token_floats() per page). Returns the logits of rows `lrows`
        ([len(lrows), vocab], a copy). The int arrays must be int32 and contiguous (runtime/batch.py
        builds them)."""
        if self._ctx is None:
            raise NativeError("the native session is closed")
        n_pages = kv.size // max(1, page_size * self.kv_token_floats())
        flags = self.lib.zlc_native_batch_launch(
            self._ctx, _ptr(kv), page_size, n_pages, len(tokens), _ptr(tokens), _ptr(pos), _ptr(pt), _ptr(pages),
            pages.size, _ptr(lrows), len(lrows))
        if flags < 0:
            raise ZlcError("the native kernel refused a batched launch (a position, page or row out of range)")
        if flags:
            what = "; ".join(v for k, v in ERROR_FLAGS.items() if flags & k) or "unknown"
            raise ZlcError(f"the megakernel raised error flags {flags} ({what})")
        if self.CNT.any():
            raise ZlcError("the megakernel did not reset its counters")
        lg = self.logits
        n = len(lrows)
        return self.A[lg["offset"]:lg["offset"] + n * lg["cols"]].reshape(n, lg["cols"]).copy()

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self.lib.zlc_native_destroy(ctx)
        self.weights = None  # after the destroy: the last session out unmaps the layout

    def __del__(self) -> None:  # a forgotten session must not leave threads spinning
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
