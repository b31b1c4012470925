"""`zlc.load(path)`: a checked bundle, its tokenizer, and sessions on an executor.

    b = zlc.load("smollm2.zlc")
    new_ids = b.generate([1, 2, 3], max_new_tokens=8)            # greedy; auto: GPU, else native CPU
    with b.session(device="cpu", threads=2) as s: s.prefill(ids); s.step(tok)   # the native kernel
    b.generate(ids, 8, device="interpret")                       # the Triton source, interpreted
    b.generate(ids, 8, device="reference")                       # the bundle's IR in torch

Devices: `auto` (the default) is `cuda` when this host has a GPU and the bundle a cubin that runs on
it, else `cpu` (the native C kernel), else a one-line error naming both reasons.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zlc.bundle import read_manifest
from zlc.errors import ZlcError

from .megakernel import MegakernelSession

DEVICES = ("auto", "cpu", "interpret", "cuda", "reference")
_CU_CC_MAJOR, _CU_CC_MINOR = 75, 76  # CUdevice_attribute values


def cuda_device() -> tuple[int, str] | None:
    """(compute capability, name) of GPU 0 through the CUDA driver library, or None when this host
    has no usable GPU (no libcuda, no device, or the driver refuses to initialize)."""
    try:
        cu = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    n, dev, major, minor = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0)
    if cu.cuInit(0) != 0 or cu.cuDeviceGetCount(ctypes.byref(n)) != 0 or n.value < 1:
        return None
    if cu.cuDeviceGet(ctypes.byref(dev), 0) != 0:
        return None
    cu.cuDeviceGetAttribute(ctypes.byref(major), _CU_CC_MAJOR, dev)
    cu.cuDeviceGetAttribute(ctypes.byref(minor), _CU_CC_MINOR, dev)
    name = ctypes.create_string_buffer(256)
    cu.cuDeviceGetName(name, 256, dev)
    return major.value * 10 + minor.value, name.value.decode(errors="replace")


class Bundle:
    def __init__(self, path: str | Path, *, full_check: bool = False):
        self.path = Path(path)
        # the quick check (sizes, small files hashed, weights sampled: compiler/bundle.py); the full
        # one hashes every byte (SmolLM2 bf16: ~0.8 s, several times a whole session start)
        self.manifest = read_manifest(self.path, check=True, full=full_check)
        self._tokenizer: Any = None
        # generate()'s sessions, one per (device, threads), kept between calls: a native session
        # starts worker threads and scratch (and lays out every weight when the bundle has no mapped
        # layout for this host), which costs more than a short answer.
        self._sessions: dict[tuple[str, int | None], MegakernelSession] = {}
        self._lock = threading.Lock()  # one generate() at a time per session

    def close(self) -> None:
        """Ends the sessions generate() kept (their threads and memory). The bundle stays usable."""
        with self._lock:
            sessions, self._sessions = self._sessions, {}
        for s in sessions.values():
            s.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def name(self) -> str:
        return str(self.manifest["model"]["name"])

    @property
    def max_seq(self) -> int:
        return int(self.manifest["model"]["max_seq"])

    @property
    def vocab(self) -> int:
        return int(self.manifest["model"]["vocab"])

    @property
    def verified(self) -> bool:
        return self.manifest.get("verification", {}).get("status") == "passed"

    @property
    def tokenizer(self) -> Any:
        """The bundled `BundleTokenizer`, or None when the bundle has none."""
        info = self.manifest.get("tokenizer")
        if info is None:
            return None
        if self._tokenizer is None:
            from .tokenizer import BundleTokenizer

            self._tokenizer = BundleTokenizer(self.path / info["dir"])
        return self._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        info = self.manifest.get("tokenizer") or {}
        return [int(i) for i in info.get("eos_token_ids", [])]

    def resolve_device(self, device: str = "auto") -> str:
        """The executor `device` names here: `auto` becomes `cuda` or `cpu` (see the module doc)."""
        if device != "auto":
            return device
        gpu = cuda_device()
        why_not_gpu = "no GPU"
        if gpu is not None:
            from .cuda_launch import CudaError, select_target

            try:
                select_target(self.manifest, gpu[0], device_name=gpu[1])
                return "cuda"
            except CudaError as e:
                why_not_gpu = str(e)
        from .native import NativeError, native_entry, select_level

        try:
            select_level(native_entry(self.path, self.manifest))
            return "cpu"
        except NativeError as e:
            raise ZlcError(f"no executor for {self.path} on this host: {why_not_gpu}; and {e}") from e

    def session(self, device: str = "auto", *, threads: int | None = None, pin: bool | Sequence[int] = False,
                debug: bool | None = None) -> MegakernelSession:
        """A session on `device`: `auto`, `cpu` (the native C kernel on this process's cores:
        `threads`, default one per CPU it may use; `pin` pins them), `interpret` (the Triton kernel
        in Triton's interpreter: slow, the check of the Triton source), `cuda[:N]` (its cubin), or
        `reference` (the bundle's IR on its packed weights, torch on the CPU; not the kernel).
        `debug` (default: as compiled, `--debug-waits`) makes waits time out into an error
        instead of hanging."""
        if debug is None:
            debug = bool(self.manifest["kernel"].get("debug_waits", False))
        device = self.resolve_device(device)
        if device == "cpu":
            from .native import NativeBackend

            native = NativeBackend(self.path, self.manifest, threads=threads, pin=pin, debug=debug)
            return MegakernelSession(native, chunk=native.chunk, max_seq=self.max_seq, vocab=self.vocab)
        if device == "interpret":
            _need_compiler(device, ("torch", "triton"))
            from .interpret import InterpretBackend

            tiling = self.manifest["tilings"]["cpu"]
            backend = InterpretBackend(self.path, "cpu", debug=debug)
            return MegakernelSession(backend, chunk=int(tiling["layout"]["chunk"]), max_seq=self.max_seq,
                                     vocab=self.vocab)
        if device == "reference":
            _need_compiler(device, ("torch",))
            from .reference_backend import ReferenceBackend

            # One launch per prompt (chunk = max_seq): the graphs have no fixed activation
            # buffers, and fewer launches is less per-launch Python on a serving path.
            ref = ReferenceBackend(self.path, self.manifest)
            return MegakernelSession(ref, chunk=ref.chunk, max_seq=self.max_seq, vocab=self.vocab)
        if device in ("cuda", "gpu") or device.startswith("cuda:"):
            from .cuda import CudaBackend

            index = device.partition(":")[2]
            if index and not index.isdigit():
                raise ZlcError(f"bad device '{device}'; use cuda or cuda:N")
            gpu = CudaBackend(self.path, self.manifest, device=int(index or 0), debug=debug)
            return MegakernelSession(gpu, chunk=gpu.chunk, max_seq=self.max_seq, vocab=self.vocab)
        raise ZlcError(f"unknown device '{device}'; choose one of {', '.join(DEVICES)}")

    def generate(self, prompt_ids: list[int], max_new_tokens: int, device: str = "auto", *,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 eos: int | list[int] | None = None, threads: int | None = None) -> list[int]:
        """New token ids after `prompt_ids` (greedy by default). The session is kept for the next
        call with the same device and threads (`close()` ends it); calls from several threads take
        turns on it."""
        key = (self.resolve_device(device), threads)
        with self._lock:
            s = self._sessions.get(key)
            if s is None:
                s = self._sessions[key] = self.session(key[0], threads=threads)
            return s.generate(list(prompt_ids), max_new_tokens, eos=eos, temperature=temperature,
                              top_p=top_p, seed=seed)


def _need_compiler(device: str, modules: tuple[str, ...]) -> None:
    """The `interpret` and `reference` executors run on the compiler's packages (torch, Triton), which
    a runtime-only install (`pip install zlc`, no `[compile]` extra) does not have: one line then."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ZlcError(f"device '{device}' needs {' and '.join(missing)} (the compiler's extra): "
                       "pip install 'zlc[compile]' (or run with --device cpu)")


def load(path: str | Path, *, full_check: bool = False) -> Bundle:
    """Opens a bundle; refuses unknown format versions and files that fail their checksums: their
    sizes, small files' sha256 and a sample of large files' blocks, or (`full_check`) every file's
    sha256 (`zlc inspect BUNDLE` does that too)."""
    return Bundle(path, full_check=full_check)
