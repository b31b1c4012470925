"""The `cpu` executor: the bundle's megakernel under Triton's interpreter, in a worker process.

Triton reads TRITON_INTERPRET when `@triton.jit` decorates a function, so the interpreter must be
switched on before the kernel module is imported and must not leak into a process that compiles
cubins: the kernel runs in a spawned child that sets the flag first. The parent talks to it over
a pipe, one message per launch.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from zlc import bundle as fmt
from zlc.errors import ZlcError

from .paged_kv import BatchLayout, batch_layout
from .q_planes import planar_q


class InterpretBackend:
    def __init__(self, bundle: Path, tiling: str, *, debug: bool = False, tables: Path | None = None,
                 kv_pages: tuple[int, int] | None = None):
        """`tables` replaces the bundle's task tables for `tiling` (a safetensors file with tasks,
        desc_int, desc_float): tests run shuffled or deliberately broken tables this way.
        `kv_pages` = (pages, page_size) makes room in A for batched launches' page pool
        (runtime/paged_kv.py; `batch_launch`)."""
        _check_frontend(Path(bundle), tiling, debug)  # a kernel no GPU could build does not run here either
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, str(bundle), tiling, debug,
                                                       str(tables) if tables else None, kv_pages), daemon=True,
                                 name="zlc-interpret")
        self._proc.start()
        child.close()
        self._call(("ping",))

    def _call(self, msg: tuple[Any, ...]) -> Any:
        try:
            self._conn.send(msg)
            status, payload = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError) as e:
            code = self._proc.exitcode
            raise ZlcError(f"the interpreter worker died (exit code {code})") from e
        if status == "error":
            raise ZlcError(payload)
        return payload

    def launch(self, mode: int, ids: list[int], past: int, all_logits: bool,
               want_logits: bool) -> tuple[int, np.ndarray | None]:
        return self._call(("launch", mode, ids, past, all_logits, want_logits))  # type: ignore[no-any-return]

    def batch_launch(self, kv: object, page_size: int, tokens: np.ndarray, pos: np.ndarray, pt: np.ndarray,
                     pages: np.ndarray, lrows: np.ndarray) -> np.ndarray:
        """One batched launch (NativeBackend.batch_launch's protocol): row r is token tokens[r] at
        position pos[r] of the sequence whose page table starts at pages[pt[r]]; the pages live in
        this worker's A (`kv` is unused: the pool was sized by `kv_pages`, its page_size must
        match). Returns the logits of rows `lrows` ([len(lrows), vocab])."""
        del kv
        return self._call(("batch", page_size, tokens, pos, pt, pages, lrows))  # type: ignore[no-any-return]

    def close(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("exit",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()

    def __del__(self) -> None:  # a forgotten session must not leave a worker behind
        try:
            if self._proc.is_alive():
                self._proc.kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _fast_device_calls() -> None:
    """Triton's interpreter re-patches `triton.language` on every call of a @triton.jit helper
    (~1 ms each, most of a task's time). A launch patches the language modules visible from the
    kernel's globals, and `_KernelState` makes both `triton.language` and its `core` (which
    Triton's own jit helpers use) visible there, so device calls can skip the re-patch. Only
    touches Triton when its internals look as expected; otherwise it runs unchanged, slower."""
    from triton.runtime import interpreter as ti

    cls = getattr(ti, "InterpretedFunction", None)
    if cls is None or not hasattr(cls, "rewrite") or getattr(cls, "_zlc_fast", False):
        return

    def device_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    cls.__call__ = device_call
    cls._zlc_fast = True


def _check_frontend(bundle: Path, tiling: str, debug: bool) -> None:
    """Triton's compiler frontend over the kernel, for both launch kinds, with the constants this
    session launches it with (runtime/triton_frontend.py: the interpreter runs what the compiler
    may reject). Raises KernelFrontendError, a ZlcError, in one line."""
    from zlc.bundle import read_manifest

    from .triton_frontend import check_kernel

    man = read_manifest(bundle)
    k, tl = man["kernel"], man["tilings"][tiling]
    if not k.get("signature"):
        return  # a bundle from before the manifest recorded the kernel's parameter types
    check_kernel(bundle / k["source"], k["entry"], k["signature"], dict(tl["constexprs"], DEBUG=int(debug)),
                 [fmt.MODE_PREFILL, fmt.MODE_DECODE])


def _worker(conn: Connection, bundle: str, tiling: str, debug: bool, tables: str | None,
            kv_pages: tuple[int, int] | None) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _fast_device_calls()
        state = _KernelState(Path(bundle), tiling, debug, Path(tables) if tables else None, kv_pages)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.recv()
        conn.send(("error", f"cannot load the kernel: {type(e).__name__}: {e}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "exit":
            return
        try:
            if msg[0] == "ping":
                conn.send(("ok", None))
            elif msg[0] == "launch":
                conn.send(("ok", state.launch(*msg[1:])))
            elif msg[0] == "batch":
                conn.send(("ok", state.batch_launch(*msg[1:])))
            else:
                conn.send(("error", f"unknown request {msg[0]!r}"))
        except ZlcError as e:
            conn.send(("error", str(e)))
        except Exception as e:  # noqa: BLE001
            conn.send(("error", f"kernel launch failed: {type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}"))


class _KernelState:
    """Arenas and tables of one bundle as CPU tensors, and the kernel function."""

    def __init__(self, bundle: Path, tiling: str, debug: bool, tables: Path | None,
                 kv_pages: tuple[int, int] | None = None):
        import torch
        from safetensors.torch import load_file

        from zlc.bundle import read_manifest

        man = read_manifest(bundle)
        k = man["kernel"]
        spec = importlib.util.spec_from_file_location("zlc_bundle_kernel", bundle / k["source"])
        if spec is None or spec.loader is None:
            raise ZlcError(f"cannot import {bundle / k['source']}")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        import triton.language

        mod.__dict__.setdefault("_zlc_tl_core", triton.language.core)  # see _fast_device_calls
        self.fn = getattr(mod, k["entry"])
        tl = man["tilings"][tiling]
        self.constexprs = dict(tl["constexprs"], DEBUG=int(debug))
        self.grid = int(tl["grid"])
        w = load_file(str(bundle / man["weights"]["file"]))
        self.W = w["W"].float()  # bf16 is exact in f32; the interpreter computes in numpy
        self.P = w["P"]
        self.has_q = "Q" in k.get("signature", {})
        # packed weights: the GGUF blocks as the Triton kernel reads them (q_planes.py); none: one unread line
        self.Q = (torch.from_numpy(planar_q(w["Q"].numpy(), man["weights"]["placement"])) if "Q" in w
                  else torch.zeros(64, dtype=torch.uint8))
        t = load_file(str(tables or bundle / tl["tables"]))
        self.TASKS, self.DI, self.DF = t["tasks"], t["desc_int"], t["desc_float"]
        lay = tl["layout"]
        self.batch: BatchLayout | None = None
        extra = 0
        if kv_pages is not None:
            self.batch, self.kv_k, self.kv_v = batch_layout(lay, int(man["model"]["max_seq"]), *kv_pages)
            extra = self.batch.extra_floats
        self.A = torch.zeros(lay["a_size"] + extra, dtype=torch.float32)
        self.CTRL = torch.zeros(lay["ctrl_size"], dtype=torch.int32)
        self.CNT = torch.zeros(lay["counters_size"], dtype=torch.int32)
        self.logits = lay["logits"]

    def batch_launch(self, page_size: int, tokens: np.ndarray, pos: np.ndarray, pt: np.ndarray, pages: np.ndarray,
                     lrows: np.ndarray) -> np.ndarray:
        import torch

        if self.batch is None or page_size != self.batch.page_size:
            raise ZlcError("this interpreter session has no page pool of that page size (kv_pages)")
        words = self.batch.words(self.kv_k, self.kv_v, pos, pt, pages, lrows)
        blk = self.batch.block
        self.A.view(torch.int32)[blk:blk + len(words)] = torch.from_numpy(words)
        self.CTRL[fmt.CTRL_BATCH] = blk
        try:
            self.launch(fmt.MODE_PREFILL, [int(t) for t in tokens], 0, False, False)
        finally:
            self.CTRL[fmt.CTRL_BATCH] = 0
        lg = self.logits
        n = len(lrows)
        return self.A[lg["offset"]:lg["offset"] + n * lg["cols"]].view(n, lg["cols"]).numpy().copy()

    def launch(self, mode: int, ids: list[int], past: int, all_logits: bool,
               want_logits: bool) -> tuple[int, np.ndarray | None]:
        import torch

        c = self.CTRL
        c[fmt.CTRL_MODE], c[fmt.CTRL_T], c[fmt.CTRL_PAST] = mode, len(ids), past
        c[fmt.CTRL_ALL_LOGITS], c[fmt.CTRL_ERROR] = int(all_logits), 0
        c[fmt.CTRL_TOKENS:fmt.CTRL_TOKENS + len(ids)] = torch.tensor(ids, dtype=torch.int32)
        # STEP: the launch's mode picks the kernel (prefill or decode), as on a GPU
        qs = (self.Q,) if self.has_q else ()  # (a bundle of a zlc before packed Triton weights has no Q)
        self.fn[(self.grid,)](self.TASKS, self.DI, self.DF, self.CTRL, self.CNT, self.W, *qs, self.P, self.A,
                              **self.constexprs, STEP=mode)
        if int(c[fmt.CTRL_ERROR]):
            raise ZlcError(f"the megakernel raised error flags {int(c[fmt.CTRL_ERROR])} (a wait timed out)")
        if int(self.CNT.abs().sum()):
            raise ZlcError("the megakernel did not reset its counters")
        tok = int(c[fmt.CTRL_OUT_TOKEN])
        if not want_logits:
            return tok, None
        lg = self.logits
        rows = self.A[lg["offset"]:lg["offset"] + lg["rows"] * lg["cols"]].view(lg["rows"], lg["cols"])
        sel = rows[:len(ids)] if all_logits else rows[len(ids) - 1:len(ids)]
        return tok, sel.numpy().copy()
