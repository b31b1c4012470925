"""The ingress side of the engine: starts the engine process, owns the ring region and the two
eventfds, submits requests and routes each result to the handler of its request id, from the
asyncio loop (results are drained when the engine's eventfd becomes readable: no polling thread).
"""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

from zlc.errors import ZlcError

from .engine import EngineError
from .rings import Request, RequestFlag, ResultFlag, RingRegion


class ResultHandler(Protocol):
    def on_result(self, token: int, flags: int, t_ns: int) -> None: ...


class EngineClient:
    def __init__(self, bundle: str, device: str = "cpu", *, max_queue: int = 32, request_capacity: int = 256,
                 result_capacity: int = 8192, spin_us: float = 0.0, threads: int = 1):
        self.bundle, self.device = bundle, device
        self.max_queue, self.spin_us, self.threads = max_queue, spin_us, threads
        self.region = RingRegion.create(None, request_capacity, result_capacity)
        flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
        self.request_fd, self.result_fd = os.eventfd(0, flags), os.eventfd(0, flags)
        self.handlers: dict[int, ResultHandler] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._life_fd = -1  # read end of a pipe the engine holds open: EOF when it exits
        self._next_id = 1
        self.dead = False
        self._on_dead: Callable[[], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifetime

    def start(self, timeout_s: float = 600.0) -> None:
        """Starts the engine and waits until it has loaded the bundle (blocking)."""
        r, w = os.pipe()
        cmd = [sys.executable, "-m", "zlc.runtime.serve.engine", self.bundle, "--device", self.device,
               "--region", str(self.region.name), "--request-fd", str(self.request_fd),
               "--result-fd", str(self.result_fd), "--ready-fd", str(w), "--max-queue", str(self.max_queue),
               "--spin-us", str(self.spin_us), "--threads", str(self.threads)]
        self.proc = subprocess.Popen(cmd, pass_fds=(self.request_fd, self.result_fd, w), stdin=subprocess.DEVNULL)
        os.close(w)
        line = b""
        deadline = time.monotonic() + timeout_s
        while not line.endswith(b"\n"):
            got, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
            if not got:
                self.close()
                raise ZlcError(f"the engine did not load {self.bundle} within {timeout_s:.0f} s")
            chunk = os.read(r, 4096)
            if not chunk:
                break
            line += chunk
        text = line.decode(errors="replace").strip()
        if text != "ready":
            os.close(r)
            self.close()
            raise ZlcError(f"the engine failed to start: {text.removeprefix('error: ') or 'it exited'}")
        self._life_fd = r

    def attach(self, loop: asyncio.AbstractEventLoop, on_dead: Callable[[], None]) -> None:
        self._loop, self._on_dead = loop, on_dead
        loop.add_reader(self.result_fd, self._drain)
        loop.add_reader(self._life_fd, self._engine_exited)

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            for fd in (self.result_fd, self._life_fd):
                if fd >= 0:
                    self._loop.remove_reader(fd)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fd in (self.request_fd, self.result_fd, self._life_fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.request_fd = self.result_fd = self._life_fd = -1
        self.region.close()

    # -- requests

    def new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def submit(self, request: Request, handler: ResultHandler) -> bool:
        """Queues the request; False when the request ring is full or the engine is gone (the
        caller answers "overloaded" / "unavailable")."""
        if self.dead or not self.region.requests.push(request):
            return False
        self.handlers[request.request_id] = handler
        os.eventfd_write(self.request_fd, 1)
        return True

    def cancel(self, request_id: int) -> None:
        """Frees the request's slot in the engine; its handler hears nothing more."""
        if self.handlers.pop(request_id, None) is None or self.dead:
            return
        if not self.region.requests.push(Request(request_id, [], 0, flags=RequestFlag.CANCEL)):
            # Ring full: the engine is far behind; the request finishes and its results are dropped.
            return
        os.eventfd_write(self.request_fd, 1)

    @property
    def in_flight(self) -> int:
        return len(self.handlers)

    def _drain(self) -> None:
        try:
            os.eventfd_read(self.result_fd)  # reset first: results pushed after this wake us again
        except BlockingIOError:
            pass
        handlers = self.handlers
        raw = self.region.results.raw
        while True:
            batch = raw.pop_many(1024)
            for rid, token, flags, t_ns in batch:
                h = handlers.get(rid)
                if h is None:
                    continue  # cancelled: dropped
                if flags & ResultFlag.LAST:
                    del handlers[rid]
                h.on_result(token, flags, t_ns)
            if len(batch) < 1024:
                return

    def _engine_exited(self) -> None:
        assert self._loop is not None
        self._loop.remove_reader(self._life_fd)
        self._drain()  # what it produced before it went
        self.dead = True
        pending, self.handlers = self.handlers, {}
        for h in pending.values():
            h.on_result(int(EngineError.INTERNAL), ResultFlag.ERROR | ResultFlag.LAST, 0)
        code = self.proc.poll() if self.proc is not None else None
        print(f"zlc serve: the engine exited (status {code}); answering 503 until restarted", file=sys.stderr)
        if self._on_dead is not None:
            self._on_dead()
