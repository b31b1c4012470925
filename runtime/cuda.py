"""The `cuda` executor: the bundle's AOT cubin launched through the CUDA driver API.

No Triton and no nvcc at serve time: the cubin compiled by `zlc compile --target ...` is loaded
with `cuModuleLoadData` and launched with `cuLaunchKernel`, following the recipe in
docs/artifact.md ("Launching the cubin", "The control block protocol").

Layout of this module:

- pure functions that need no GPU and are unit-tested on CPU-only machines: `select_target`
  (which of the bundle's cubins runs on this GPU), `LaunchConfig.from_manifest` (grid, block,
  shared memory, scratch buffers), `pack_params` (the kernel parameter array, checked against the
  manifest), `read_safetensors` (raw arena bytes without torch);
- a thin driver layer (`Driver`) with the dozen driver calls the backend needs. `CudaDriver`
  implements it with `cuda.bindings.driver` (PyPI `cuda-python` / `cuda-bindings`, imported
  lazily). Why cuda.bindings and not ctypes on libcuda.so: the bindings are the supported API,
  the wheel is small (8.4 MB, carriable) and the H200 device image already has it; the interface
  is small enough that a ctypes implementation could be slotted in behind `Driver` if a
  deployment cannot install the wheel. Tests substitute a fake driver (host memory, a fake kernel)
  to exercise the host protocol without a GPU;
- `CudaBackend`, the `Backend` of runtime/megakernel.py: uploads tables and weights once,
  allocates A (activations + KV cache), CNT (zeroed once; the kernel leaves it zero) and CTRL,
  and launches one kernel per prefill chunk / decode step on its own stream.

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
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from zlc import bundle as fmt
from zlc.errors import ZlcError


class CudaError(ZlcError):
    """The CUDA executor cannot run here (no driver / GPU / cubin) or a driver call failed."""


# ---- pure part: target selection ------------------------------------------------------------------


def arch_cc(arch: str) -> int | None:
    """`sm_86` -> 86, `sm_90a` -> 90; None for anything else (`interpreter`)."""
    if not arch.startswith("sm_"):
        return None
    digits = arch[3:].rstrip("af")
    return int(digits) if digits.isdigit() else None


def cubin_runs_on(arch: str, cc: int) -> bool:
    """Whether a cubin built for `arch` runs on a GPU of compute capability `cc`.

    cubins are binary compatible with later minor versions of the same major (an sm_80 cubin runs
    on sm_86 and sm_89), except arch-specific ones: Triton builds capability 9.0 and later as
    `sm_90a` / `sm_100a` (wgmma, TMA), which run only on exactly that capability."""
    built = arch_cc(arch)
    if built is None:
        return False
    if built >= 90 or arch.endswith(("a", "f")):
        return built == cc
    return built // 10 == cc // 10 and built % 10 <= cc % 10


def gpu_targets(manifest: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The bundle's targets that carry a cubin, by name."""
    return {name: t for name, t in manifest.get("targets", {}).items() if t.get("cubin")}


def suggest_target(cc: int, sms: int | None = None, device_name: str | None = None) -> str | None:
    """The name of a known `--target` for compute capability `cc`: preferably the one named in
    the device name ("NVIDIA H200" -> h200), else one with `sms` SMs, else any of that capability
    (all targets of one capability share the cubin; only the default grid differs)."""
    from zlc.targets import TARGETS

    same = [t for t in TARGETS.values() if t.compute_capability == cc]
    squashed = "".join(ch for ch in (device_name or "").lower() if ch.isalnum())
    named = [t for t in same if t.name in squashed]
    exact = [t for t in same if sms is not None and t.sms == sms]
    picks = named or exact or same
    return picks[0].name if picks else None


def select_target(manifest: Mapping[str, Any], cc: int, *, device_name: str | None = None,
                  sms: int | None = None) -> str:
    """The bundle target whose cubin runs on a GPU of compute capability `cc` (86 for sm_86).

    Preference: an exact capability match over an older minor of the same major; among equals,
    the target whose grid equals this GPU's SM count (`sms`). Raises CudaError naming this GPU,
    the architectures the bundle has, and the `--target` to recompile with."""
    tgs = gpu_targets(manifest)
    fits = [(name, t) for name, t in tgs.items() if cubin_runs_on(str(t["arch"]), cc)]
    if fits:
        def rank(item: tuple[str, dict[str, Any]]) -> tuple[int, int]:
            built = arch_cc(str(item[1]["arch"])) or 0
            return (-built, 0 if sms is not None and int(item[1].get("grid", 0)) == sms else 1)

        return sorted(fits, key=rank)[0][0]
    here = f"sm_{cc}" + (f" ({device_name})" if device_name else "")
    have = ", ".join(f"{t['arch']} ({name})" for name, t in tgs.items())
    hint = suggest_target(cc, sms, device_name)
    fix = (f"recompile with --target {hint}" if hint
           else f"zlc has no compile target for sm_{cc} yet (known: see `zlc compile --help`)")
    if not have:
        raise CudaError(f"this GPU is {here}; the bundle has no GPU cubins (it was compiled for the CPU "
                        f"interpreter only); {fix}")
    raise CudaError(f"this GPU is {here}; the bundle has cubins for {have}; {fix}")


# ---- pure part: launch configuration and parameters ----------------------------------------------


@dataclass(frozen=True)
class Scratch:
    """A hidden scratch buffer Triton's launcher would allocate: `size` bytes per CTA."""

    size: int
    align: int

    def nbytes(self, grid: int, num_ctas: int = 1) -> int:
        """Bytes to allocate for the whole grid (0: pass NULL)."""
        return self.size * grid * num_ctas if self.size > 0 else 0


@dataclass(frozen=True)
class LaunchConfig:
    target: str
    arch: str
    cubin: str  # path inside the bundle
    function: str
    grid: int
    block: int  # threads per CTA: 32 * num_warps
    shared: int  # dynamic shared memory bytes
    num_ctas: int
    params: tuple[dict[str, Any], ...]
    global_scratch: Scratch
    profile_scratch: Scratch

    #: dynamic shared memory above this needs cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)
    DEFAULT_SHARED_LIMIT = 48 * 1024

    @property
    def needs_shared_opt_in(self) -> bool:
        return self.shared > self.DEFAULT_SHARED_LIMIT

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], target: str, *, sms: int | None = None) -> LaunchConfig:
        """The launch of `targets.<target>`; `sms` (this GPU's SM count) replaces the target's grid:
        the kernel completes for any grid >= 1, and one program per SM is what it is tuned for."""
        t = manifest.get("targets", {}).get(target)
        if t is None or not t.get("cubin"):
            raise CudaError(f"the bundle has no GPU target '{target}' "
                            f"(GPU targets: {', '.join(gpu_targets(manifest)) or 'none'})")
        md = t["metadata"]
        if md.get("launch_cooperative_grid") or md.get("launch_pdl"):
            raise CudaError(f"target '{target}': the cubin asks for a cooperative/PDL launch, which this "
                            "executor does not do (recompile with this zlc)")
        num_ctas = int(md.get("num_ctas", 1) or 1)
        if num_ctas != 1:
            raise CudaError(f"target '{target}': num_ctas={num_ctas} (thread-block clusters) is not supported")
        grid = int(sms) if sms else int(t["grid"])
        if grid < 1:
            raise CudaError(f"target '{target}': grid must be >= 1, got {grid}")
        return cls(target=target, arch=str(t["arch"]), cubin=str(t["cubin"]), function=str(md["name"]),
                   grid=grid, block=32 * int(md["num_warps"]), shared=int(md.get("shared", 0) or 0),
                   num_ctas=num_ctas, params=tuple(dict(p) for p in t["params"]),
                   global_scratch=Scratch(int(md.get("global_scratch_size", 0) or 0),
                                          int(md.get("global_scratch_align", 1) or 1)),
                   profile_scratch=Scratch(int(md.get("profile_scratch_size", 0) or 0),
                                           int(md.get("profile_scratch_align", 1) or 1)))


class PackedParams:
    """`kernelParams` for cuLaunchKernel: an array of pointers, each to one 8-byte parameter value.
    Keep the object alive until the launch call returns (the driver copies the values then)."""

    def __init__(self, names: Sequence[str], values: Sequence[int]):
        self.names = tuple(names)
        self.values = (ctypes.c_uint64 * len(values))(*[int(v) for v in values])
        base = ctypes.addressof(self.values)
        self.pointers = (ctypes.c_void_p * len(values))(*[base + 8 * i for i in range(len(values))])

    @property
    def address(self) -> int:
        """What cuLaunchKernel's `kernelParams` takes (void**)."""
        return ctypes.addressof(self.pointers)

    def __len__(self) -> int:
        return len(self.names)

    def as_dict(self) -> dict[str, int]:
        return dict(zip(self.names, (int(v) for v in self.values), strict=True))


def pack_params(params: Sequence[Mapping[str, Any]], pointers: Mapping[str, int]) -> PackedParams:
    """The manifest's `targets.<t>.params` (ordered; all pointers) filled from `pointers` by name.

    Every parameter must be given, hidden ones (`global_scratch`, `profile_scratch`: 0 for NULL)
    included, and nothing else: a bundle whose kernel takes other parameters than this executor
    allocates fails here instead of launching with shifted arguments."""
    names = [str(p["name"]) for p in params]
    if len(set(names)) != len(names):
        raise CudaError(f"the manifest lists a kernel parameter twice: {names}")
    bad_type = [f"{p['name']} ({p.get('type')})" for p in params if not str(p.get("type", "*")).startswith("*")]
    if bad_type:
        raise CudaError(f"kernel parameters that are not pointers: {', '.join(bad_type)}; this executor "
                        "passes only pointers (recompile the bundle with this zlc)")
    missing = [n for n in names if n not in pointers]
    extra = [n for n in pointers if n not in names]
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unknown {', '.join(extra)}"] if extra else [])
        raise CudaError(f"kernel parameters do not match the manifest ({', '.join(names)}): {'; '.join(parts)}")
    values = [int(pointers[n]) for n in names]
    neg = [n for n, v in zip(names, values, strict=True) if v < 0 or v >= 1 << 64]
    if neg:
        raise CudaError(f"invalid pointer value for {', '.join(neg)}")
    return PackedParams(names, values)


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a if a > 1 else x


# ---- pure part: safetensors without torch -------------------------------------------------------

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32,
              "I16": np.int16, "I8": np.int8, "U8": np.uint8, "F64": np.float64}


def read_safetensors(path: str | Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (safetensors dtype, array over the file's bytes; bf16 as uint16), memory-mapped.
    The executor uploads raw bytes, so it needs neither torch nor the safetensors package."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise CudaError(f"{path}: unreadable safetensors file ({e})") from e
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, tuple[str, np.ndarray]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise CudaError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        lo, hi = info["data_offsets"]
        raw = mm[8 + n + lo:8 + n + hi]
        out[name] = (info["dtype"], raw.view(dt).reshape(info["shape"]))
    return out


_ARENA_ITEMSIZE = {"bf16": 2, "fp32": 4}


def arena_bytes(manifest: Mapping[str, Any], arena: str) -> int:
    """Bytes of the `W` or `P` arena as the kernel reads it."""
    w = manifest["weights"][arena]
    return int(w["elements"]) * _ARENA_ITEMSIZE[str(w["dtype"])]


# ---- driver layer -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    name: str
    cc: int  # 90 for compute capability 9.0
    sms: int


class Driver(Protocol):
    """The driver calls CudaBackend makes. Pointers and host addresses are ints; other handles
    are opaque. Every method raises CudaError on failure."""

    def open(self, index: int) -> DeviceInfo: ...
    def activate(self) -> None: ...  # make the device's context current on the calling thread
    def load_function(self, image: bytes, name: str, shared: int) -> Any: ...
    def alloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int, mapped: bool) -> tuple[int, int]: ...  # (host address, device ptr or 0)
    def host_free(self, addr: int) -> None: ...
    def stream(self) -> Any: ...
    def htod(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None: ...
    def dtoh(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None: ...
    def dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None: ...
    def memset(self, dst: int, nbytes: int) -> None: ...
    def launch(self, fn: Any, grid: int, block: int, shared: int, stream: Any, params: int) -> None: ...
    def sync(self, stream: Any) -> None: ...
    def begin_capture(self, stream: Any) -> None: ...
    def end_capture(self, stream: Any) -> Any: ...
    def graph_launch(self, graph: Any, stream: Any) -> None: ...
    def graph_free(self, graph: Any) -> None: ...
    def close(self) -> None: ...


def _import_driver() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError:
        try:  # cuda-python < 12.6 spells it `cuda.cuda`
            from cuda import cuda as driver  # type: ignore[no-redef]
        except ImportError as e:
            raise CudaError("device 'cuda' needs NVIDIA's driver bindings: pip install cuda-python "
                            "(or run with --device cpu)") from e
    return driver


class CudaDriver:
    """`Driver` over cuda.bindings.driver: the primary context of one device, current on the
    calling thread."""

    def __init__(self) -> None:
        self.cu = _import_driver()
        self._dev: Any = None
        self._ctx: Any = None
        self._modules: list[Any] = []
        self._streams: list[Any] = []

    # every cuda.bindings call returns (CUresult, *values)
    def _ok(self, what: str, res: Any) -> Any:
        err, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
        if int(err) != 0:
            raise CudaError(f"{what} failed: {self._name(err)}")
        return rest[0] if len(rest) == 1 else (rest or None)

    def _name(self, err: Any) -> str:
        try:
            e2, name = self.cu.cuGetErrorName(err)
            if int(e2) == 0:
                return f"{name.decode() if isinstance(name, bytes) else name} ({int(err)})"
        except Exception:  # noqa: BLE001 - best effort: the code alone still says what failed
            pass
        return f"CUresult {int(err)}"

    def open(self, index: int) -> DeviceInfo:
        cu = self.cu
        try:
            res = cu.cuInit(0)
        except Exception as e:  # noqa: BLE001 - cuda.pathfinder raises when libcuda.so is missing
            raise CudaError(f"no CUDA driver/GPU: the NVIDIA driver library (libcuda.so) cannot be loaded "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); run with "
                            "--device cpu") from None
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            raise CudaError(f"no CUDA driver/GPU: cuInit failed with {self._name(err)}; run with --device cpu")
        count = self._ok("cuDeviceGetCount", cu.cuDeviceGetCount())
        if int(count) == 0:
            raise CudaError("no CUDA driver/GPU: the driver sees no device; run with --device cpu")
        if not 0 <= index < int(count):
            raise CudaError(f"CUDA device {index} does not exist (this machine has {int(count)})")
        self._dev = self._ok("cuDeviceGet", cu.cuDeviceGet(index))
        A = cu.CUdevice_attribute

        def attr(a: Any) -> int:
            return int(self._ok("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(a, self._dev)))

        major = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        sms = attr(A.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        raw = self._ok("cuDeviceGetName", cu.cuDeviceGetName(256, self._dev))
        name = (raw.split(b"\0")[0].decode(errors="replace") if isinstance(raw, bytes) else str(raw)).strip()
        self._ctx = self._ok("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._dev))
        self._ok("cuCtxSetCurrent", cu.cuCtxSetCurrent(self._ctx))
        return DeviceInfo(index, name, 10 * major + minor, sms)

    def activate(self) -> None:
        self._ok("cuCtxSetCurrent", self.cu.cuCtxSetCurrent(self._ctx))

    def load_function(self, image: bytes, name: str, shared: int) -> Any:
        cu = self.cu
        buf = np.frombuffer(image, dtype=np.uint8)
        mod = self._ok("cuModuleLoadData", cu.cuModuleLoadData(buf.ctypes.data))
        self._modules.append(mod)
        fn = self._ok("cuModuleGetFunction", cu.cuModuleGetFunction(mod, name.encode()))
        if shared > LaunchConfig.DEFAULT_SHARED_LIMIT:
            self._ok("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", cu.cuFuncSetAttribute(
                fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared))
        return fn

    def alloc(self, nbytes: int) -> int:
        return int(self._ok(f"cuMemAlloc({nbytes} bytes)", self.cu.cuMemAlloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        self._ok("cuMemFree", self.cu.cuMemFree(ptr))

    def host_alloc(self, nbytes: int, mapped: bool) -> tuple[int, int]:
        cu = self.cu
        flags = int(cu.CU_MEMHOSTALLOC_DEVICEMAP) if mapped else 0
        addr = int(self._ok(f"cuMemHostAlloc({nbytes} bytes)", cu.cuMemHostAlloc(max(nbytes, 1), flags)))
        dev = int(self._ok("cuMemHostGetDevicePointer", cu.cuMemHostGetDevicePointer(addr, 0))) if mapped else 0
        return addr, dev

    def host_free(self, addr: int) -> None:
        self._ok("cuMemFreeHost", self.cu.cuMemFreeHost(addr))

    def stream(self) -> Any:
        cu = self.cu
        st = self._ok("cuStreamCreate", cu.cuStreamCreate(int(cu.CUstream_flags.CU_STREAM_NON_BLOCKING)))
        self._streams.append(st)
        return st

    def htod(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            self._ok("cuMemcpyHtoD", self.cu.cuMemcpyHtoD(dst, src, nbytes))
        else:
            self._ok("cuMemcpyHtoDAsync", self.cu.cuMemcpyHtoDAsync(dst, src, nbytes, stream))

    def dtoh(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None:
        if stream is None:
            self._ok("cuMemcpyDtoH", self.cu.cuMemcpyDtoH(dst, src, nbytes))
        else:
            self._ok("cuMemcpyDtoHAsync", self.cu.cuMemcpyDtoHAsync(dst, src, nbytes, stream))

    def dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._ok("cuMemcpyDtoDAsync", self.cu.cuMemcpyDtoDAsync(dst, src, nbytes, stream))

    def memset(self, dst: int, nbytes: int) -> None:
        self._ok("cuMemsetD8", self.cu.cuMemsetD8(dst, 0, nbytes))

    def launch(self, fn: Any, grid: int, block: int, shared: int, stream: Any, params: int) -> None:
        self._ok("cuLaunchKernel", self.cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, shared, stream, params, 0))

    def sync(self, stream: Any) -> None:
        self._ok("cuStreamSynchronize (the megakernel failed)", self.cu.cuStreamSynchronize(stream))

    def begin_capture(self, stream: Any) -> None:
        cu = self.cu
        self._ok("cuStreamBeginCapture", cu.cuStreamBeginCapture(
            stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))

    def end_capture(self, stream: Any) -> Any:
        graph = self._ok("cuStreamEndCapture", self.cu.cuStreamEndCapture(stream))
        exe = self._ok("cuGraphInstantiate", self.cu.cuGraphInstantiate(graph, 0))
        return (graph, exe)

    def graph_launch(self, graph: Any, stream: Any) -> None:
        self._ok("cuGraphLaunch", self.cu.cuGraphLaunch(graph[1], stream))

    def graph_free(self, graph: Any) -> None:
        self._ok("cuGraphExecDestroy", self.cu.cuGraphExecDestroy(graph[1]))
        self._ok("cuGraphDestroy", self.cu.cuGraphDestroy(graph[0]))

    def close(self) -> None:
        """Destroys what this driver created (streams, modules) and releases the primary context;
        failures are ignored (the context may already be gone at interpreter exit)."""
        cu = self.cu
        if self._ctx is not None:
            cu.cuCtxSetCurrent(self._ctx)
        for st in self._streams:
            cu.cuStreamDestroy(st)
        self._streams.clear()
        for mod in self._modules:
            cu.cuModuleUnload(mod)
        self._modules.clear()
        if self._ctx is not None:
            cu.cuDevicePrimaryCtxRelease(self._dev)
            self._ctx = None


# ---- the backend ------------------------------------------------------------------------------------


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
        self.config = cfg = LaunchConfig.from_manifest(man, target, sms=self.info.sms)
        tiling = man["tilings"][man["targets"][target]["tiling"]]
        self.layout = lay = tiling["layout"]
        self.chunk = int(lay["chunk"])
        self.fn = drv.load_function((self.bundle / cfg.cubin).read_bytes(), cfg.function, cfg.shared)

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
        for name, sc in (("global_scratch", cfg.global_scratch), ("profile_scratch", cfg.profile_scratch)):
            nbytes = sc.nbytes(cfg.grid, cfg.num_ctas)
            ptr[name] = align_up(self._alloc(nbytes + sc.align), sc.align) if nbytes else 0
        self.pointers = ptr
        self.params = pack_params(cfg.params, ptr)
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

    def _launch_kernel(self) -> None:
        cfg = self.config
        self.drv.launch(self.fn, cfg.grid, cfg.block, cfg.shared, self._stream, self.params.address)

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
        self._launch_kernel()
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
