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
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from zlc import bundle as fmt

from .cuda_driver import CudaDriver, Driver
from .cuda_launch import (
    CudaError,
    LaunchConfig,
    align_up,
    arena_bytes,
    cubin_runs_on,
    pack_params,
    read_safetensors,
    select_target,
)


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
    the GPU reads directly; default) or "device" (copied in and out each launch)."""

    def __init__(self, bundle: str | Path, manifest: Mapping[str, Any] | None = None, *, device: int = 0,
                 debug: bool = False, target: str | None = None, ctrl: str = "mapped",
                 weights: Mapping[str, np.ndarray] | None = None, driver: Driver | None = None):

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
        self._graphs: dict[int, Any] = {}
        self._stream: Any = None
        self.drv: Driver = driver if driver is not None else CudaDriver()
        try:
            self._setup(device, target, weights)
        except BaseException:
            self.close()
            raise

    def _setup(self, device: int, target: str | None, weights: Mapping[str, np.ndarray] | None) -> None:
        man, drv = self.manifest, self.drv
        self.info = drv.open(device)
        if target is None:
            target = select_target(man, self.info.cc, device_name=self.info.name, sms=self.info.sms)
        elif not cubin_runs_on(str(man.get("targets", {}).get(target, {}).get("arch", "")), self.info.cc):
            arch = man.get("targets", {}).get(target, {}).get("arch", "no cubin")
            raise CudaError(f"target '{target}' ({arch}) does not run on this GPU (sm_{self.info.cc}, {self.info.name})")
        # Two kernels of one source: the decode kernel (the target's own fields) and the prefill one.
        self.config = cfg = LaunchConfig.from_manifest(man, target, sms=self.info.sms)
        self.prefill_config = pcfg = LaunchConfig.from_manifest(man, target, sms=self.info.sms, kernel="prefill")
        tiling = man["tilings"][man["targets"][target]["tiling"]]
        self.layout = lay = tiling["layout"]
        self.chunk = int(lay["chunk"])
        self.fn = drv.load_function((self.bundle / cfg.cubin).read_bytes(), cfg.function, cfg.shared)
        self.prefill_fn = drv.load_function((self.bundle / pcfg.cubin).read_bytes(), pcfg.function, pcfg.shared)

        ptr: dict[str, int] = {}
        tables = read_safetensors(self.bundle / tiling["tables"])
        for param, key in (("TASKS", "tasks"), ("DI", "desc_int"), ("DF", "desc_float")):
            ptr[param] = self._upload(np.ascontiguousarray(tables[key][1]))
        ptr["W"], ptr["P"] = self._upload_weights(weights)
        ptr["A"] = self._alloc(4 * int(lay["a_size"]))
        drv.memset(ptr["A"], 4 * int(lay["a_size"]))  # as the interpreter's: no stale NaNs in unwritten rows
        self.cnt_words = int(lay["counters_size"])
        ptr["CNT"] = self._alloc(4 * self.cnt_words)
        drv.memset(ptr["CNT"], 4 * self.cnt_words)  # zeroed once; every launch leaves it zero
        self.ctrl_words = int(lay["ctrl_size"])
        host, dev = drv.host_alloc(4 * self.ctrl_words, mapped=self.mapped)
        self._host.append(host)
        self.ctrl = _i32_view(host, self.ctrl_words)
        self.ctrl[:] = 0
        ptr["CTRL"] = dev if self.mapped else self._alloc(4 * self.ctrl_words)
        self.pointers = ptr
        self.params = pack_params(cfg.params, dict(ptr, **self._scratch(cfg)))
        self.prefill_params = pack_params(pcfg.params, dict(ptr, **self._scratch(pcfg)))
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

    # -- the control block
    def _write_ctrl(self, mode: int, ids: Sequence[int], past: int, all_logits: bool, auto_advance: bool) -> None:
        c = self.ctrl
        if not 1 <= len(ids) <= self.chunk:
            raise CudaError(f"a launch takes 1..{self.chunk} tokens, got {len(ids)}")
        c[fmt.CTRL_MODE], c[fmt.CTRL_T], c[fmt.CTRL_PAST] = mode, len(ids), past
        c[fmt.CTRL_ALL_LOGITS], c[fmt.CTRL_AUTO_ADVANCE], c[fmt.CTRL_ERROR] = int(all_logits), int(auto_advance), 0
        c[fmt.CTRL_OUT_TOKEN] = -1
        c[fmt.CTRL_TOKENS:fmt.CTRL_TOKENS + len(ids)] = np.asarray(ids, dtype=np.int32)
        if not self.mapped:
            self.drv.htod(self.pointers["CTRL"], _host_address(c), 4 * (fmt.CTRL_TOKENS + len(ids)), self._stream)

    def _read_ctrl_back(self) -> None:
        """ctrl="device": queue the copy of the kernel's CTRL words back to the host view."""
        if not self.mapped:
            self.drv.dtoh(_host_address(self.ctrl), self.pointers["CTRL"], 4 * fmt.CTRL_TOKENS + 4, self._stream)

    def _launch_kernel(self, mode: int = fmt.MODE_DECODE) -> None:
        if mode == fmt.MODE_DECODE:
            fn, cfg, params = self.fn, self.config, self.params
        else:
            fn, cfg, params = self.prefill_fn, self.prefill_config, self.prefill_params
        self.drv.launch(fn, cfg.grid, cfg.block, cfg.shared, self._stream, params.address)

    def _check(self) -> None:
        err = int(self.ctrl[fmt.CTRL_ERROR])
        if err:
            raise CudaError(f"the megakernel raised error flags {err} (a wait timed out)")
        if self.debug:
            cnt = np.zeros(self.cnt_words, dtype=np.int32)
            self.drv.dtoh(_host_address(cnt), self.pointers["CNT"], cnt.nbytes)
            if cnt.any():
                raise CudaError("the megakernel did not reset its counters "
                                f"(nonzero at {np.flatnonzero(cnt)[:8].tolist()})")

    # -- Backend protocol
    def launch(self, mode: int, ids: list[int], past: int, all_logits: bool,
               want_logits: bool) -> tuple[int, np.ndarray | None]:
        self.drv.activate()  # sessions may be driven from another thread than the one that opened them
        self._write_ctrl(mode, ids, past, all_logits, auto_advance=False)
        self._launch_kernel(mode)
        self._read_ctrl_back()
        rows = 0
        if want_logits:
            first = 0 if all_logits else len(ids) - 1
            rows = len(ids) - first
            src = self.pointers["A"] + 4 * (self.logits_offset + first * self.logits_cols)
            self.drv.dtoh(_host_address(self._logits_host), src, 4 * rows * self.logits_cols, self._stream)
        self.drv.sync(self._stream)
        self._check()
        tok = int(self.ctrl[fmt.CTRL_OUT_TOKEN])
        if not want_logits:
            return tok, None
        return tok, self._logits_host[:rows * self.logits_cols].reshape(rows, self.logits_cols).copy()

    def decode_chain(self, token: int, past: int, n: int, *, graph: bool = False) -> list[int]:
        """n greedy decode steps from `token` at cache position `past`, one host synchronisation.
        Returns the n new tokens (the caller checks past + n <= max_seq; eos is not checked).
        `graph=True` replays a CUDA graph of the n launches (captured on first use per n)."""
        max_seq = int(self.manifest["model"]["max_seq"])
        if n < 1 or past + n > max_seq:
            raise CudaError(f"decode_chain: {n} steps from position {past} exceed max_seq={max_seq}")
        self.drv.activate()
        self._write_ctrl(fmt.MODE_DECODE, [token], past, False, auto_advance=True)
        out_token = self.pointers["CTRL"] + 4 * fmt.CTRL_OUT_TOKEN
        if graph:
            g = self._graphs.get(n)
            if g is None:
                self.drv.begin_capture(self._stream)
                try:
                    self._enqueue_chain(n, out_token)
                except BaseException:
                    try:  # leave capture mode; the partial graph is discarded
                        self.drv.graph_free(self.drv.end_capture(self._stream))
                    except CudaError:
                        pass
                    raise
                g = self.drv.end_capture(self._stream)
                self._graphs[n] = g
            self.drv.graph_launch(g, self._stream)
        else:
            self._enqueue_chain(n, out_token)
        self.drv.dtoh(_host_address(self._hist_host), self._hist, 4 * n, self._stream)
        self._read_ctrl_back()
        self.drv.sync(self._stream)
        self.ctrl[fmt.CTRL_AUTO_ADVANCE] = 0
        self._check()  # the next launch rewrites CTRL (auto-advance off) in either ctrl mode
        return [int(t) for t in self._hist_host[:n]]

    def _enqueue_chain(self, n: int, out_token: int) -> None:
        for i in range(n):
            self._launch_kernel()
            self.drv.dtod(self._hist + 4 * i, out_token, 4, self._stream)

    def close(self) -> None:
        drv = getattr(self, "drv", None)
        if drv is None:
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
