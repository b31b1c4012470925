"""Launch preparation for the `cuda` executor: everything that needs no GPU and no driver.

These are pure functions over the bundle's manifest and files, unit-tested on CPU-only machines:
`select_target` (which of the bundle's cubins runs on this GPU), `LaunchConfig.from_manifest`
(grid, block, shared memory, scratch buffers, per kernel and build), `loadable_cubins` (which
toolkit's cubins this driver may load, in order), `pack_params` (the kernel parameter array,
checked against the manifest), `read_safetensors` (raw arena bytes without torch) and
`arena_bytes`.
`CudaError`, the executor's one error type, lives here because this is the module the driver
binding (cuda_driver.py) and the backend (cuda.py) both build on.
"""

from __future__ import annotations

import ctypes
import json
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from zlc.errors import ZlcError


class CudaError(ZlcError):
    """The CUDA executor cannot run here (no driver / GPU / cubin) or a driver call failed."""


class CudaLoadError(CudaError):
    """cuModuleLoadData refused a cubin; `name` is the CUresult's name (CUDA_ERROR_...)."""

    def __init__(self, message: str, *, code: int, name: str):
        super().__init__(message)
        self.code, self.name = code, name


class CudaTimeout(CudaError):
    """A launch did not finish before its host-side deadline (it may still be running)."""


# cuModuleLoadData's answers that mean "not this cubin, maybe another": a toolchain newer than
# the driver (222), no SASS for this GPU (209), an ELF it cannot read (200). Codes from cuda.h.
LOAD_FALLBACK_ERRORS = {222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", 209: "CUDA_ERROR_NO_BINARY_FOR_GPU",
                        200: "CUDA_ERROR_INVALID_IMAGE"}
KERNELS = ("decode", "prefill")
BUILDS = ("release", "debug", "trace")


def cuda_version(v: int) -> str:
    """cuDriverGetVersion's encoding as a release: 13000 -> "13.0", 12090 -> "12.9"."""
    return f"{v // 1000}.{v % 1000 // 10}"


def loadable_cubins(cubins: Sequence[Mapping[str, Any]], driver: int, what: str) -> list[Mapping[str, Any]]:
    """The entries of a kernel's `cubins` (preferred first) whose `min_driver` this driver
    (cuDriverGetVersion) meets, in the bundle's order; an entry without one (older bundles) is
    kept. None left: one CudaError naming the driver's version and the oldest the cubins need."""
    ok = [c for c in cubins if int(c.get("min_driver") or 0) <= driver]
    if ok:
        return ok
    need = min(cubins, key=lambda c: int(c["min_driver"]))
    have = ", ".join(f"CUDA {cuda_version(int(c['min_driver']))} (toolkit {c.get('toolkit', '?')} cubin)"
                     for c in cubins)
    raise CudaError(f"the NVIDIA driver supports CUDA {cuda_version(driver)} but {what} needs a driver for "
                    f"CUDA {cuda_version(int(need['min_driver']))} or newer (its cubins: {have}); upgrade the "
                    "driver (CUDA 12.x needs >= 525, 13.x >= 580)")


# ---- target selection -----------------------------------------------------------------------------


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


# ---- launch configuration and parameters ----------------------------------------------------------


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
    kernel: str = "decode"
    build: str = "release"
    #: every toolkit's cubin of this kernel and build, preferred first (`cubin` is the first)
    cubins: tuple[dict[str, Any], ...] = ()

    #: dynamic shared memory above this needs cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)
    DEFAULT_SHARED_LIMIT = 48 * 1024

    @property
    def needs_shared_opt_in(self) -> bool:
        return self.shared > self.DEFAULT_SHARED_LIMIT

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any], target: str, *, sms: int | None = None,
                      kernel: str = "decode", build: str = "release") -> LaunchConfig:
        """The launch of `targets.<target>`'s decode kernel (its own fields) or prefill kernel (its
        `prefill` entry), in its `release` build or the `debug` / `trace` one (their entries
        inside); `sms` (this GPU's SM count) replaces the target's grid: the kernel completes for
        any grid >= 1, and one program per SM is what it is tuned for."""
        top = manifest.get("targets", {}).get(target)
        if top is None or not top.get("cubin"):
            raise CudaError(f"the bundle has no GPU target '{target}' "
                            f"(GPU targets: {', '.join(gpu_targets(manifest)) or 'none'})")
        if kernel not in KERNELS or build not in BUILDS:
            raise ValueError(f"kernel must be decode or prefill and build one of {BUILDS}, not {kernel!r}/{build!r}")
        if kernel == "prefill" and "prefill" not in top:
            raise CudaError(f"target '{target}' has no prefill kernel (a bundle of format 1? recompile it)")
        own = top if kernel == "decode" else top["prefill"]
        if build != "release" and not isinstance(own.get(build), Mapping):
            raise CudaError(f"target '{target}' has no {build} build of its {kernel} kernel "
                            "(compile with --debug-waits)")
        entry = own if build == "release" else own[build]
        t = {k: v for k, v in top.items() if k not in BUILDS[1:] and k != "prefill"}
        t.update({k: v for k, v in entry.items() if k not in BUILDS[1:]})
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
        cubins = tuple(dict(c) for c in t.get("cubins") or [{"cubin": t["cubin"]}])  # older bundles: one
        return cls(target=target, arch=str(t["arch"]), cubin=str(t["cubin"]), function=str(md["name"]),
                   grid=grid, block=32 * int(md["num_warps"]), shared=int(md.get("shared", 0) or 0),
                   num_ctas=num_ctas, params=tuple(dict(p) for p in t["params"]),
                   global_scratch=Scratch(int(md.get("global_scratch_size", 0) or 0),
                                          int(md.get("global_scratch_align", 1) or 1)),
                   profile_scratch=Scratch(int(md.get("profile_scratch_size", 0) or 0),
                                           int(md.get("profile_scratch_align", 1) or 1)),
                   kernel=kernel, build=build, cubins=cubins)

    def has_build(self, manifest: Mapping[str, Any], build: str) -> bool:
        """Whether this config's target and kernel have a `build` entry in `manifest`."""
        top = manifest["targets"][self.target]
        own = top if self.kernel == "decode" else top.get("prefill", {})
        return build == "release" or isinstance(own.get(build), Mapping)


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


POINTER_ALIGN = 16  # what codegen/aot.py promises Triton about every pointer parameter


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
    # The cubin was compiled for 16-byte aligned pointers (128-bit loads; codegen/aot.py).
    odd = [f"{n} (0x{v:x})" for n, v in zip(names, values, strict=True) if v % POINTER_ALIGN]
    if odd:
        raise CudaError(f"kernel pointers must be {POINTER_ALIGN}-byte aligned: {', '.join(odd)}")
    return PackedParams(names, values)


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a if a > 1 else x


# ---- safetensors without torch --------------------------------------------------------------------

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
