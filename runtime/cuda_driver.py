"""The CUDA driver binding of the `cuda` executor: the `Driver` protocol and `CudaDriver`.

`Driver` is the dozen driver calls the backend (cuda.py) needs. `CudaDriver` implements it with
`cuda.bindings.driver` (PyPI `cuda-python` / `cuda-bindings`, imported lazily). Why cuda.bindings
and not ctypes on libcuda.so: the bindings are the supported API, the wheel is small (8.4 MB,
carriable) and the H200 device image already has it; the interface is small enough that a ctypes
implementation could be slotted in behind `Driver` if a deployment cannot install the wheel.
Tests substitute a fake driver (host memory, a fake kernel) to exercise the host protocol without
a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .cuda_launch import CudaError, CudaLoadError, LaunchConfig


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
    def driver_version(self) -> int: ...  # cuDriverGetVersion: 1000 * major + 10 * minor (13000)
    def activate(self) -> None: ...  # make the device's context current on the calling thread
    # raises CudaLoadError (with the CUresult) when the driver refuses the image
    def load_function(self, image: bytes, name: str, shared: int) -> Any: ...
    def alloc(self, nbytes: int) -> int: ...
    def free(self, ptr: int) -> None: ...
    def host_alloc(self, nbytes: int, mapped: bool) -> tuple[int, int]: ...  # (host address, device ptr or 0)
    def host_free(self, addr: int) -> None: ...
    def stream(self) -> Any: ...
    # without a stream, htod and memset are complete when they return (ordered before any later
    # launch on any stream); dtoh returns with the data, and does not wait for other streams
    def htod(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None: ...
    def dtoh(self, dst: int, src: int, nbytes: int, stream: Any = None) -> None: ...
    def dtod(self, dst: int, src: int, nbytes: int, stream: Any) -> None: ...
    def memset(self, dst: int, nbytes: int) -> None: ...
    def launch(self, fn: Any, grid: int, block: int, shared: int, stream: Any, params: int) -> None: ...
    def sync(self, stream: Any) -> None: ...
    def query(self, stream: Any) -> bool: ...  # cuStreamQuery: True when all its work has finished
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

    def driver_version(self) -> int:
        return int(self._ok("cuDriverGetVersion", self.cu.cuDriverGetVersion()))

    def activate(self) -> None:
        self._ok("cuCtxSetCurrent", self.cu.cuCtxSetCurrent(self._ctx))

    def load_function(self, image: bytes, name: str, shared: int) -> Any:
        cu = self.cu
        buf = np.frombuffer(image, dtype=np.uint8)
        res = cu.cuModuleLoadData(buf.ctypes.data)
        if int(res[0]) != 0:  # the caller may try another toolkit's cubin: say which error
            name_ = self._name(res[0])
            raise CudaLoadError(f"cuModuleLoadData failed: {name_}", code=int(res[0]), name=name_.split(" ")[0])
        mod = res[1]
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
            self._settle("cuMemcpyHtoD")
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
        self._settle("cuMemsetD8")

    def _settle(self, what: str) -> None:
        # cuMemsetD8 may return before the memset ran, and cuMemcpyHtoD from pageable memory
        # before its DMA landed; both run on the legacy default stream, which a launch on the
        # executor's non-blocking stream does not wait for. Waiting here orders them before any
        # later launch (they are only used when no kernel is in flight: setup, a trace's region).
        self._ok(f"cuCtxSynchronize (after {what})", self.cu.cuCtxSynchronize())

    def launch(self, fn: Any, grid: int, block: int, shared: int, stream: Any, params: int) -> None:
        self._ok("cuLaunchKernel", self.cu.cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, shared, stream, params, 0))

    def sync(self, stream: Any) -> None:
        self._ok("cuStreamSynchronize (the megakernel failed)", self.cu.cuStreamSynchronize(stream))

    def query(self, stream: Any) -> bool:
        res = self.cu.cuStreamQuery(stream)
        err = res[0] if isinstance(res, tuple) else res
        if int(err) == int(self.cu.CUresult.CUDA_ERROR_NOT_READY):
            return False
        self._ok("cuStreamQuery (the megakernel failed)", res)
        return True

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
