"""The `cuda` executor: the bundle's AOT cubin launched through the CUDA driver API.

No Triton and no nvcc at serve time: the cubin compiled by `zlc compile --target ...` is loaded
with `cuModuleLoadData` and launched with `cuLaunchKernel`, following the recipe in
docs/artifact.md ("Launching the cubin", "The control block protocol").

The executor is three modules:

- runtime/cuda_launch.py: the pure part, unit-tested on CPU-only machines: `select_target`
  (which of the bundle's cubins runs on this GPU), `LaunchConfig.from_manifest` (grid, block,
  shared memory, scratch buffers), `pack_params` (the kernel parameter array, checked against the
  manifest), `read_safetensors` (raw arena bytes without torch);
- runtime/cuda_driver.py: a thin driver layer (`Driver`) with the dozen driver calls the backend
  needs, and `CudaDriver`, its implementation over `cuda.bindings.driver` (why not ctypes: see
  there). Tests substitute a fake driver to exercise the host protocol without a GPU;
- this module: `CudaBackend`, the `Backend` of runtime/megakernel.py: uploads tables and weights
  once, allocates A (activations + KV cache), CNT (zeroed once; the kernel leaves it zero) and
  CTRL, and launches one kernel per prefill chunk / decode step on its own stream.

Host <-> kernel traffic per step. CTRL lives in pinned, device-mapped host memory
(`cuMemHostAlloc(DEVICEMAP)`): the host writes the step's inputs with plain stores and reads
`OUT_TOKEN` / `ERROR` after `cuStreamSynchronize(stream)` (not a context-wide synchronize), so a
greedy step needs no memcpy at all. `ctrl="device"` keeps CTRL in device memory instead and moves
it with two small async copies per step (for comparing the two on a given machine). Logits are
copied only when asked for, and only the rows asked for.

`decode_chain(token, n)` runs n greedy decode steps with one host synchronisation: the kernel's
auto-advance (CTRL_AUTO_ADVANCE) writes each step's token back as the next step's input and bumps
PAST, so n launches are queued back to back, each followed by a 4-byte device copy of OUT_TOKEN
into a history buffer; `graph=True` captures that sequence once as a CUDA graph and replays it.

A first run that cannot be wasted (docs/megakernel.md, "Debugging"):

- **Which cubin.** Each kernel lists one cubin per toolkit (`cubins` in the manifest: Triton's
  CUDA 13 ptxas, and the CUDA 12.9 one for sm_90+). The executor keeps those whose `min_driver`
  the driver (cuDriverGetVersion) meets, loads them in the bundle's order and moves to the next
  when the driver refuses one (CUDA_ERROR_UNSUPPORTED_PTX_VERSION, NO_BINARY_FOR_GPU,
  INVALID_IMAGE), and logs what it loaded (`loaded`); a driver too old for all of them is one
  error naming both versions.
- **The first launch of each kernel** (prefill, decode) runs its debug-waits build when the bundle
  has one (`zlc compile --debug-waits`): a wait that never completes times out in the kernel into
  CTRL's error words (which task waited for which event), and the host polls the stream
  (cuStreamQuery) against `first_launch_deadline_s` instead of blocking in cuStreamSynchronize. A
  launch still running at the deadline raises `CudaTimeout` with what the control block and the
  counters say (tasks claimed, programs exited, the first tasks whose waits are unmet); the
  session is then unusable (the kernel may still run; the process's exit ends it).
- **Traced launches** (`trace_launch`) run the trace build: SM id and timestamps per task, read
  back as a `zlc.runtime.trace.Trace`.
"""

from __future__ import annotations

import ctypes
import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zlc import abi
from zlc import bundle as fmt

from . import trace as tr
from .cuda_driver import CudaDriver, Driver
from .cuda_launch import (
    BUILDS,
    LOAD_FALLBACK_ERRORS,
    CudaError,
    CudaLoadError,
    CudaTimeout,
    LaunchConfig,
    PackedParams,
    align_up,
    arena_bytes,
    cubin_runs_on,
    cuda_version,
    loadable_cubins,
    pack_params,
    read_safetensors,
    select_target,
)
from .paged_kv import BatchLayout, batch_layout
from .q_planes import planar_q

log = logging.getLogger("zlc.runtime.cuda")


def _i32_view(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(addr))


def _f32_view(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_float * n).from_address(addr))


def _host_address(arr: np.ndarray) -> int:
    return int(arr.ctypes.data)


class CudaBackend:
    """One bundle on one GPU: a `Backend` for `MegakernelSession`.

    `weights` replaces the bundle's weights.safetensors with host arrays {"W": ..., "P": ...}
    whose raw bytes are the arenas (bf16 as uint16/int16/bfloat16 views); the benchmark uses it
    for models whose weights are generated on the device. `ctrl` is "mapped" (pinned host memory
    the GPU reads directly; default) or "device" (copied in and out each launch).

    With debug builds in the bundle, the first launch of each kernel runs the debug build under
    `first_launch_deadline_s`; `debug` runs every launch with it (and reads the counters back
    after each). `deadline_s` bounds every other launch the same way (None: block until done)."""

    def __init__(self, bundle: str | Path, manifest: Mapping[str, Any] | None = None, *, device: int = 0,
                 debug: bool = False, target: str | None = None, ctrl: str = "mapped",
                 weights: Mapping[str, np.ndarray] | None = None, driver: Driver | None = None,
                 first_launch_deadline_s: float = 30.0, deadline_s: float | None = None,
                 kv_pages: tuple[int, int] | None = None):

        if ctrl not in ("mapped", "device"):
            raise CudaError(f"ctrl must be 'mapped' or 'device', got {ctrl!r}")
        self.bundle = Path(bundle)
        if manifest is None:
            from zlc.bundle import read_manifest

            manifest = read_manifest(self.bundle, check=True)
        self.manifest = manifest
        self.debug = bool(debug)
        self.mapped = ctrl == "mapped"
        self._ptrs: list[int] = []
        self._host: list[int] = []
        self._graphs: dict[tuple[int, str], Any] = {}
        self._stream: Any = None
        self.first_launch_deadline_s, self.deadline_s = first_launch_deadline_s, deadline_s
        self.checked: set[str] = set()  # kernels whose first launch (debug build, deadline) passed
        self.loaded: dict[str, dict[str, Any]] = {}  # "decode/release" -> the cubin entry it runs, and why
        self.stuck = False  # a launch overran its deadline: the context is not usable any more
        self._fns: dict[tuple[str, str], tuple[Any, LaunchConfig, PackedParams]] = {}
        self._labels: dict[int, tuple[list[str], list[str]]] = {}
        self.drv: Driver = driver if driver is not None else CudaDriver()
        self.kv_pages = kv_pages  # (pages, page_size): room in A for batched launches (runtime/paged_kv.py)
        self.batch: BatchLayout | None = None
        try:
            self._setup(device, target, weights)
        except BaseException:
            self.close()
            raise

    def _setup(self, device: int, target: str | None, weights: Mapping[str, np.ndarray] | None) -> None:
        man, drv = self.manifest, self.drv
        self.info = drv.open(device)
        self.driver_version = drv.driver_version()
        if target is None:
            target = select_target(man, self.info.cc, device_name=self.info.name, sms=self.info.sms)
        elif not cubin_runs_on(str(man.get("targets", {}).get(target, {}).get("arch", "")), self.info.cc):
            arch = man.get("targets", {}).get(target, {}).get("arch", "no cubin")
            raise CudaError(f"target '{target}' ({arch}) does not run on this GPU (sm_{self.info.cc}, {self.info.name})")
        # Two kernels of one source: the decode kernel (the target's own fields) and the prefill one,
        # each in its release build and, when the bundle has them, the debug and trace builds.
        self.target = target
        self.config = cfg = LaunchConfig.from_manifest(man, target, sms=self.info.sms)
        self.prefill_config = pcfg = LaunchConfig.from_manifest(man, target, sms=self.info.sms, kernel="prefill")
        self.builds = {(k, b) for k, c in (("decode", cfg), ("prefill", pcfg)) for b in BUILDS
                       if c.has_build(man, b)}
        self.tiling = man["targets"][target]["tiling"]
        tiling = man["tilings"][self.tiling]
        self.layout = lay = tiling["layout"]
        self.chunk = int(lay["chunk"])
        self.fn = self._load(cfg)
        self.prefill_fn = self._load(pcfg)

        ptr: dict[str, int] = {}
        tables = read_safetensors(self.bundle / tiling["tables"])
        self.tasks = np.ascontiguousarray(tables["tasks"][1])  # host copy: diagnoses and traces read it
        for param, key in (("TASKS", "tasks"), ("DI", "desc_int"), ("DF", "desc_float")):
            ptr[param] = self._upload(np.ascontiguousarray(tables[key][1]))
        ptr["W"], ptr["P"] = self._upload_weights(weights)
        if "Q" in man["kernel"].get("signature", {}):  # (a bundle of a zlc before packed Triton weights has none)
            ptr["Q"] = self._upload_q(weights)
        a_floats = int(lay["a_size"])
        if self.kv_pages is not None:  # the batch block and the page pool, past the layout's buffers
            self.batch, self.kv_k, self.kv_v = batch_layout(lay, int(man["model"]["max_seq"]), *self.kv_pages)
            a_floats += self.batch.extra_floats
        ptr["A"] = self._alloc(4 * a_floats)
        drv.memset(ptr["A"], 4 * a_floats)  # as the interpreter's: no stale NaNs in unwritten rows
        self.cnt_words = int(lay["counters_size"])
        # a trace build writes its records after the counters (zlc.runtime.trace)
        self.trace_offset = tr.trace_offset(int(self.tasks[abi.HDR_N_EVENTS]))
        tracing = any(b == "trace" for _, b in self.builds)
        cnt_alloc = self.trace_offset + tr.trace_words(self.tasks, cfg.grid) if tracing else self.cnt_words
        ptr["CNT"] = self._alloc(4 * cnt_alloc)
        drv.memset(ptr["CNT"], 4 * cnt_alloc)  # zeroed once; every launch leaves the counters zero
        self.ctrl_words = int(lay["ctrl_size"])
        host, dev = drv.host_alloc(4 * self.ctrl_words, mapped=self.mapped)
        self._host.append(host)
        self.ctrl = _i32_view(host, self.ctrl_words)
        self.ctrl[:] = 0
        ptr["CTRL"] = dev if self.mapped else self._alloc(4 * self.ctrl_words)
        self.pointers = ptr
        self.params = pack_params(cfg.params, dict(ptr, **self._scratch(cfg)))
        self.prefill_params = pack_params(pcfg.params, dict(ptr, **self._scratch(pcfg)))
        self._fns[("decode", "release")] = (self.fn, cfg, self.params)
        self._fns[("prefill", "release")] = (self.prefill_fn, pcfg, self.prefill_params)
        lg = lay["logits"]
        self.logits_offset, self.logits_rows, self.logits_cols = int(lg["offset"]), int(lg["rows"]), int(lg["cols"])
        out_host, _ = drv.host_alloc(4 * self.logits_rows * self.logits_cols, mapped=False)
        self._host.append(out_host)
        self._logits_host = _f32_view(out_host, self.logits_rows * self.logits_cols)
        hist_host, _ = drv.host_alloc(4 * int(man["model"]["max_seq"]) + 4, mapped=False)
        self._host.append(hist_host)
        self._hist_host = _i32_view(hist_host, int(man["model"]["max_seq"]) + 1)
        self._hist = self._alloc(4 * (int(man["model"]["max_seq"]) + 1))
        self._stream = drv.stream()

    # -- memory helpers
    def _scratch(self, cfg: LaunchConfig) -> dict[str, int]:
        """Triton's hidden scratch buffers of one kernel (each kernel gets its own)."""
        out = {}
        for name, sc in (("global_scratch", cfg.global_scratch), ("profile_scratch", cfg.profile_scratch)):
            nbytes = sc.nbytes(cfg.grid, cfg.num_ctas)
            out[name] = align_up(self._alloc(nbytes + sc.align), sc.align) if nbytes else 0
        return out

    def _load(self, cfg: LaunchConfig) -> Any:
        """Loads the first of `cfg`'s cubins the driver takes: those whose min_driver it meets, in
        the bundle's order, moving on when the driver refuses one as too new or not for this GPU."""
        what = f"target {cfg.target}'s {cfg.kernel} kernel ({cfg.build} build)"
        tried: list[str] = []
        for c in loadable_cubins(cfg.cubins, self.driver_version, what):
            name = f"{c['cubin']} (toolkit {c.get('toolkit', '?')}, PTX ISA {c.get('ptx_isa', '?')})"
            path = self.bundle / str(c["cubin"])
            if not path.is_file():
                tried.append(f"{name}: not in the bundle")
                continue
            try:
                fn = self.drv.load_function(path.read_bytes(), cfg.function, cfg.shared)
            except CudaLoadError as e:
                if e.code not in LOAD_FALLBACK_ERRORS:
                    raise
                tried.append(f"{name}: {e.name}")
                log.warning("%s: the driver (CUDA %s) refused %s: %s", what, cuda_version(self.driver_version),
                            name, e.name)
                continue
            self.loaded[f"{cfg.kernel}/{cfg.build}"] = dict(c, refused=list(tried))
            log.info("%s: loaded %s on a driver for CUDA %s", what, name, cuda_version(self.driver_version))
            return fn
        raise CudaError(f"the driver (CUDA {cuda_version(self.driver_version)}) loads no cubin of {what}: "
                        + "; ".join(tried))

    def _function(self, kind: str, build: str) -> tuple[Any, LaunchConfig, PackedParams]:
        """The loaded function, launch config and parameters of one kernel's build (loaded once)."""
        if (kind, build) not in self._fns:
            if (kind, build) not in self.builds:
                raise CudaError(f"the bundle has no {build} build of the {kind} kernel (compile with --debug-waits)")
            cfg = LaunchConfig.from_manifest(self.manifest, self.target, sms=self.info.sms, kernel=kind, build=build)
            fn = self._load(cfg)
            self._fns[(kind, build)] = (fn, cfg, pack_params(cfg.params, dict(self.pointers, **self._scratch(cfg))))
        return self._fns[(kind, build)]

    def _build_for(self, kind: str) -> str:
        """The debug build for a kernel's first launch (and every launch with `debug`), if shipped."""
        if (kind, "debug") in self.builds and (self.debug or kind not in self.checked):
            return "debug"
        return "release"

    def _alloc(self, nbytes: int) -> int:
        p = self.drv.alloc(nbytes)
        self._ptrs.append(p)
        return p

    def _upload(self, arr: np.ndarray) -> int:
        arr = np.ascontiguousarray(arr)
        p = self._alloc(arr.nbytes)
        if arr.nbytes:
            self.drv.htod(p, _host_address(arr), arr.nbytes)
        return p

    def _upload_weights(self, weights: Mapping[str, np.ndarray] | None) -> tuple[int, int]:
        man = self.manifest
        if weights is None:
            st = read_safetensors(self.bundle / man["weights"]["file"])
            weights = {k: st[k][1] for k in ("W", "P") if k in st}
        out = []
        for arena in ("W", "P"):
            if arena not in weights:
                raise CudaError(f"the weights have no {arena} arena")
            arr = np.ascontiguousarray(weights[arena])
            want = arena_bytes(man, arena)
            # the bundle stores max(elements, 1): an empty arena is one element
            if arr.nbytes != want and not (want == 0 and arr.nbytes <= 4):
                raise CudaError(f"{arena} arena is {arr.nbytes} bytes; the manifest says {want} "
                                f"({man['weights'][arena]['elements']} x {man['weights'][arena]['dtype']})")
            out.append(self._upload(arr))
        return out[0], out[1]

    def _upload_q(self, weights: Mapping[str, np.ndarray] | None) -> int:
        """The packed weights (the Q arena) as the Triton kernel reads them (q_planes.py); a
        bundle without any gets one 64-byte line (the kernel's Q parameter is never read then)."""
        man = self.manifest
        if weights is None:
            st = read_safetensors(self.bundle / man["weights"]["file"])
            weights = {"Q": st["Q"][1]} if "Q" in st else {}
        if "Q" not in weights:
            if man["weights"].get("Q"):
                raise CudaError("the weights have no Q arena, but the manifest places packed weights in it")
            return self._upload(np.zeros(64, dtype=np.uint8))
        return self._upload(planar_q(np.asarray(weights["Q"]), man["weights"]["placement"]))

    # -- the control block
    def _write_ctrl(self, mode: int, ids: Sequence[int], past: int, all_logits: bool, auto_advance: bool) -> None:
        c = self.ctrl
        if not 1 <= len(ids) <= self.chunk:
            raise CudaError(f"a launch takes 1..{self.chunk} tokens, got {len(ids)}")
        c[fmt.CTRL_MODE], c[fmt.CTRL_T], c[fmt.CTRL_PAST] = mode, len(ids), past
        c[fmt.CTRL_ALL_LOGITS], c[fmt.CTRL_AUTO_ADVANCE], c[fmt.CTRL_ERROR] = int(all_logits), int(auto_advance), 0
        c[fmt.CTRL_ERR_EVENT:fmt.CTRL_ERR_ROW + 1] = 0  # the debug build's record of a timed-out wait
        c[fmt.CTRL_OUT_TOKEN] = -1
        c[fmt.CTRL_TOKENS:fmt.CTRL_TOKENS + len(ids)] = np.asarray(ids, dtype=np.int32)
        if not self.mapped:
            self.drv.htod(self.pointers["CTRL"], _host_address(c), 4 * (fmt.CTRL_TOKENS + len(ids)), self._stream)

    def _read_ctrl_back(self) -> None:
        """ctrl="device": queue the copy of the kernel's CTRL words back to the host view."""
        if not self.mapped:
            self.drv.dtoh(_host_address(self.ctrl), self.pointers["CTRL"], 4 * fmt.CTRL_TOKENS + 4, self._stream)

    def _launch_kernel(self, mode: int = fmt.MODE_DECODE, build: str = "release") -> None:
        fn, cfg, params = self._function("decode" if mode == fmt.MODE_DECODE else "prefill", build)
        self.drv.launch(fn, cfg.grid, cfg.block, cfg.shared, self._stream, params.address)

    def _wait(self, mode: int, build: str) -> None:
        """Until the stream's work is done: blocking, or polling against a deadline (the debug and
        trace builds, or `deadline_s`) so that a launch that never finishes is reported, not waited for."""
        deadline = self.first_launch_deadline_s if build != "release" else self.deadline_s
        if deadline is None:
            self.drv.sync(self._stream)
            return
        end, pause = time.monotonic() + deadline, 20e-6
        while not self.drv.query(self._stream):
            if time.monotonic() >= end:
                self.stuck = True
                kind = "decode" if mode == fmt.MODE_DECODE else "prefill"
                raise CudaTimeout(f"the {kind} kernel ({build} build) did not finish within {deadline:g} s: "
                                  f"{self._stuck_report(mode)}")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _stuck_report(self, mode: int) -> str:
        """What CTRL and the counters say about a launch that is still running. Device memory is
        read with synchronous copies on the default stream (the launch's stream is non-blocking,
        so they do not queue behind it), from a helper thread given a few seconds."""
        ctrl = self.ctrl.copy()
        cnt = np.zeros(self.cnt_words, dtype=np.int32)
        done: dict[str, bool] = {}

        def read() -> None:
            if not self.mapped:
                self.drv.dtoh(_host_address(ctrl), self.pointers["CTRL"], 4 * fmt.CTRL_TOKENS)
            self.drv.dtoh(_host_address(cnt), self.pointers["CNT"], cnt.nbytes)
            done["ok"] = True

        th = threading.Thread(target=read, daemon=True, name="zlc-cuda-stuck-report")
        th.start()
        th.join(5.0)
        labels, events = self._readable(mode)
        parts = [f"error flags {int(ctrl[fmt.CTRL_ERROR])}"]
        first = tr.describe_timeout(ctrl, self.tasks, mode, self.pointers["TASKS"], labels=labels,
                                    event_labels=events)
        if first:
            parts.append(f"first timed-out wait: {first}")
        if done.get("ok"):
            parts.append(tr.diagnose_stuck(self.tasks, mode, cnt, grid=self.config.grid, labels=labels,
                                           event_labels=events))
        else:
            parts.append("the counters could not be read back (the copy did not return)")
        return "; ".join(parts)

    def _readable(self, mode: int) -> tuple[list[str] | None, list[str] | None]:
        """Task and event labels from tables/<tiling>.json, when the bundle has it."""
        if mode not in self._labels:
            path = self.bundle / "tables" / f"{self.tiling}.json"
            try:
                self._labels[mode] = tr.readable_labels(json.loads(path.read_text()), mode)
            except (OSError, ValueError):
                self._labels[mode] = ([], [])
        labels, events = self._labels[mode]
        return labels or None, events or None

    def _check(self, mode: int = fmt.MODE_DECODE) -> None:
        err = int(self.ctrl[fmt.CTRL_ERROR])
        if err:
            labels, events = self._readable(mode)
            first = tr.describe_timeout(self.ctrl, self.tasks, mode, self.pointers["TASKS"], labels=labels,
                                        event_labels=events)
            raise CudaError(f"the megakernel raised error flags {err} (a wait timed out)"
                            + (f": {first}" if first else ""))
        if self.debug:
            cnt = np.zeros(self.cnt_words, dtype=np.int32)
            self.drv.dtoh(_host_address(cnt), self.pointers["CNT"], cnt.nbytes)
            if cnt.any():
                raise CudaError("the megakernel did not reset its counters "
                                f"(nonzero at {np.flatnonzero(cnt)[:8].tolist()})")

    # -- Backend protocol
    def launch(self, mode: int, ids: list[int], past: int, all_logits: bool,
               want_logits: bool) -> tuple[int, np.ndarray | None]:
        self._usable()
        self.drv.activate()  # sessions may be driven from another thread than the one that opened them
        kind = "decode" if mode == fmt.MODE_DECODE else "prefill"
        build = self._build_for(kind)
        self._write_ctrl(mode, ids, past, all_logits, auto_advance=False)
        self._launch_kernel(mode, build)
        self._read_ctrl_back()
        rows = 0
        if want_logits:
            first = 0 if all_logits else len(ids) - 1
            rows = len(ids) - first
            src = self.pointers["A"] + 4 * (self.logits_offset + first * self.logits_cols)
            self.drv.dtoh(_host_address(self._logits_host), src, 4 * rows * self.logits_cols, self._stream)
        self._wait(mode, build)
        self._check(mode)
        self.checked.add(kind)
        tok = int(self.ctrl[fmt.CTRL_OUT_TOKEN])
        if not want_logits:
            return tok, None
        return tok, self._logits_host[:rows * self.logits_cols].reshape(rows, self.logits_cols).copy()

    def batch_launch(self, kv: object, page_size: int, tokens: np.ndarray, pos: np.ndarray, pt: np.ndarray,
                     pages: np.ndarray, lrows: np.ndarray) -> np.ndarray:
        """One batched launch (NativeBackend.batch_launch's protocol; runtime/paged_kv.py): the
        batch block is copied into A on the launch's stream, CTRL_BATCH names it, the prefill
        kernel runs the prefill table over the rows, and the logits of rows `lrows` come back
        ([len(lrows), vocab]). The pages live in A (`kv` is unused; `kv_pages` sized them)."""
        del kv
        if self.batch is None or page_size != self.batch.page_size:
            raise CudaError("this CUDA session has no page pool of that page size (kv_pages)")
        self._usable()
        self.drv.activate()
        words = self.batch.words(self.kv_k, self.kv_v, pos, pt, pages, lrows)
        self._batch_words = words  # kept alive until the copy has run (the wait below)
        build = self._build_for("prefill")
        self.ctrl[fmt.CTRL_BATCH] = self.batch.block  # before _write_ctrl: ctrl="device" copies it then
        self._write_ctrl(fmt.MODE_PREFILL, [int(t) for t in tokens], 0, False, auto_advance=False)
        self.drv.htod(self.pointers["A"] + 4 * self.batch.block, _host_address(words), words.nbytes, self._stream)
        self._launch_kernel(fmt.MODE_PREFILL, build)
        self._read_ctrl_back()
        n = len(lrows)
        if n:
            self.drv.dtoh(_host_address(self._logits_host), self.pointers["A"] + 4 * self.logits_offset,
                          4 * n * self.logits_cols, self._stream)
        try:
            self._wait(fmt.MODE_PREFILL, build)
        finally:
            self.ctrl[fmt.CTRL_BATCH] = 0
        self._check(fmt.MODE_PREFILL)
        self.checked.add("prefill")
        return self._logits_host[:n * self.logits_cols].reshape(n, self.logits_cols).copy()

    def decode_chain(self, token: int, past: int, n: int, *, graph: bool = False) -> list[int]:
        """n greedy decode steps from `token` at cache position `past`, one host synchronisation.
        Returns the n new tokens (the caller checks past + n <= max_seq; eos is not checked).
        `graph=True` replays a CUDA graph of the n launches (captured on first use per n)."""
        max_seq = int(self.manifest["model"]["max_seq"])
        if n < 1 or past + n > max_seq:
            raise CudaError(f"decode_chain: {n} steps from position {past} exceed max_seq={max_seq}")
        self._usable()
        if self._build_for("decode") == "debug" and not self.debug:
            # the decode kernel's first launch, checked: this same step, which the chain then
            # recomputes (the same token at the same position writes the same cache row)
            self.launch(fmt.MODE_DECODE, [token], past, False, False)
        build = self._build_for("decode")
        self.drv.activate()
        self._write_ctrl(fmt.MODE_DECODE, [token], past, False, auto_advance=True)
        out_token = self.pointers["CTRL"] + 4 * fmt.CTRL_OUT_TOKEN
        if graph:
            g = self._graphs.get((n, build))
            if g is None:
                self.drv.begin_capture(self._stream)
                try:
                    self._enqueue_chain(n, out_token, build)
                except BaseException:
                    try:  # leave capture mode; the partial graph is discarded
                        self.drv.graph_free(self.drv.end_capture(self._stream))
                    except CudaError:
                        pass
                    raise
                g = self.drv.end_capture(self._stream)
                self._graphs[(n, build)] = g
            self.drv.graph_launch(g, self._stream)
        else:
            self._enqueue_chain(n, out_token, build)
        self.drv.dtoh(_host_address(self._hist_host), self._hist, 4 * n, self._stream)
        self._read_ctrl_back()
        self._wait(fmt.MODE_DECODE, build)
        self.ctrl[fmt.CTRL_AUTO_ADVANCE] = 0
        self._check()  # the next launch rewrites CTRL (auto-advance off) in either ctrl mode
        return [int(t) for t in self._hist_host[:n]]

    def _enqueue_chain(self, n: int, out_token: int, build: str = "release") -> None:
        for i in range(n):
            self._launch_kernel(fmt.MODE_DECODE, build)
            self.drv.dtod(self._hist + 4 * i, out_token, 4, self._stream)

    def trace_launch(self, mode: int, ids: list[int], past: int, *, all_logits: bool = False) -> tuple[int, tr.Trace]:
        """One launch with the kernel's trace build: the same computation as `launch` (it writes the
        cache rows at `past..`), plus, per task, its SM and %globaltimer start/end. Returns the
        greedy token and the trace (analyse it with `zlc.runtime.trace.analyze`)."""
        self._usable()
        kind = "decode" if mode == fmt.MODE_DECODE else "prefill"
        _, cfg, _ = self._function(kind, "trace")
        words = tr.trace_words(self.tasks, cfg.grid)
        region = self.pointers["CNT"] + 4 * self.trace_offset
        self.drv.activate()
        self.drv.memset(region, 4 * words)
        self._write_ctrl(mode, ids, past, all_logits, auto_advance=False)
        self._launch_kernel(mode, "trace")
        self._read_ctrl_back()
        self._wait(mode, "trace")
        self._check(mode)
        out = np.zeros(words, dtype=np.int32)
        self.drv.dtoh(_host_address(out), region, out.nbytes)
        return int(self.ctrl[fmt.CTRL_OUT_TOKEN]), tr.read_trace(out, self.tasks, mode, cfg.grid)

    def _usable(self) -> None:
        if self.stuck:
            raise CudaError("a launch of this CUDA session overran its deadline and may still be running; "
                            "the session cannot launch again (end the process to free the GPU)")

    def close(self) -> None:
        drv = getattr(self, "drv", None)
        if drv is None:
            return
        if getattr(self, "stuck", False):
            # a kernel may still be running: synchronising or freeing would wait for it forever.
            # Leave everything to the process's exit, which ends the context and the kernel.
            self.drv = None  # type: ignore[assignment]
            return
        try:
            if self._stream is not None:
                drv.activate()
                drv.sync(self._stream)
        except CudaError:
            pass
        for g in self._graphs.values():
            try:
                drv.graph_free(g)
            except CudaError:
                pass
        self._graphs.clear()
        for p in reversed(self._ptrs):
            try:
                drv.free(p)
            except CudaError:
                pass
        self._ptrs.clear()
        for h in self._host:
            try:
                drv.host_free(h)
            except CudaError:
                pass
        self._host.clear()
        self._stream = None
        try:
            drv.close()
        except CudaError:
            pass
        self.drv = None  # type: ignore[assignment]

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
