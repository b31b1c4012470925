"""The ingress side of one engine process: starts it, owns the ring region and the two eventfds,
submits requests and routes each result to the handler of its request id, from the asyncio loop
(results are drained when the engine's eventfd becomes readable: no polling thread).

One EngineClient is one engine's life: when that engine exits or hangs, the supervisor
(supervisor.py) ends its requests, closes it and starts a new client with fresh rings, so nothing
an engine left half-written in its rings can reach the next one.

Admission is counted here, against the capacity the server states (``--max-batch`` +
``--max-queue`` requests per engine, counting in flight and cancelled ones the engine has not let
go yet, ``held``): a request beyond it is refused at once, and the
request ring is sized so that it holds that many requests with the longest prompt, a CANCEL for
each and a PING (``request_ring_slots``): a burst arriving during one long engine step can never
fill it below capacity (it did, when the ring held what one step's arrivals happened to be).

The client keeps the engine's load as the router sees it (pool.py): requests in flight and the
prompt tokens sent whose first result has not come back (``queued_tokens``), and what the
supervisor's watchdog needs: when the engine last produced
anything (``last_progress``) and since when something has been owed (``owed_since``).
"""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Protocol

from zlc.errors import ZlcError

from ..engine_stats import EngineStats
from ..protocol import MAX_GRAMMAR_BYTES, RequestFlag, ResultFlag
from ..rings import DEFAULT_CHUNK_TOKENS, Request, RingRegion

PING_ID = 0  # request ids start at 1: results for id 0 are the engine's PONGs


def request_ring_slots(capacity: int, max_prompt: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Request-ring slots (a power of two) for `capacity` requests in flight: each with a prompt of
    up to `max_prompt` tokens (the ingress refuses longer ones) and a CANCEL, plus one PING."""
    per_prompt = max(1, -(-max_prompt // chunk_tokens))
    need = capacity * (per_prompt + 1) + 1
    return 1 << (need - 1).bit_length()


class ResultHandler(Protocol):
    def on_result(self, token: int, flags: int, t_ns: int, logprob: float = 0.0) -> None: ...


class EngineClient:
    def __init__(self, bundle: str, device: str = "cpu", *, max_queue: int = 32, max_prompt: int = 4096,
                 result_capacity: int = 8192, spin_us: float = 0.0, threads: int = 1, max_batch: int = 8,
                 kv_pages: int | None = None, prefill_chunk: int = 64, prefix_cache_pages: int | None = None,
                 cpus: frozenset[int] | None = None, env: dict[str, str] | None = None):
        """`max_prompt`: the longest prompt the ingress submits (the bundle's max_seq); `cpus`: the
        cores the engine process is confined to (None: this process's); `env`: variables it adds to
        its environment (CUDA_VISIBLE_DEVICES for one GPU of several)."""
        self.bundle, self.device = bundle, device
        self.capacity = max_batch + max_queue  # requests in flight before new ones are refused
        self.cpus, self.env = cpus, env or {}
        self.max_queue, self.spin_us, self.threads = max_queue, spin_us, threads
        self.max_batch, self.kv_pages, self.prefill_chunk = max_batch, kv_pages, prefill_chunk
        self.prefix_cache_pages = prefix_cache_pages
        self.stats = EngineStats()  # the engine writes its counters here (/metrics reads them)
        # a GRAMMAR request's grammar rides in front of its prompt (rings.Request): room for the longest
        self.region = RingRegion.create(None, request_ring_slots(self.capacity, max_prompt + 1 + MAX_GRAMMAR_BYTES // 4),
                                        result_capacity)
        flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
        self.request_fd, self.result_fd = os.eventfd(0, flags), os.eventfd(0, flags)
        self.handlers: dict[int, ResultHandler] = {}
        # Cancelled requests whose LAST has not come back: the engine still holds them until it
        # reads the CANCEL, so they count against the capacity (and the ring's room) until then.
        self.cancelling: set[int] = set()
        # Prompt tokens of requests with no result yet, per request (the router's queued work).
        self.unstarted: dict[int, int] = {}
        self.queued_tokens = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._pidfd = -1  # readable when the engine exits (pidfd_open): no SIGCHLD handler, no polling
        self.exited = False
        self.closed = False
        self.last_progress = time.monotonic()  # the engine's last result of any kind
        self.owed_since: float | None = None  # when the oldest unanswered request or ping was sent
        self.ping_pending = False
        self._on_exit: Callable[[int | None], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifetime

    def start(self, timeout_s: float = 600.0) -> None:
        """Starts the engine and waits until it has loaded the bundle (blocking: run it off the loop)."""
        r, w = os.pipe()
        cmd = [sys.executable, "-m", "zlc.runtime.serve.engine.loop", self.bundle, "--device", self.device,
               "--region", str(self.region.name), "--request-fd", str(self.request_fd),
               "--result-fd", str(self.result_fd), "--ready-fd", str(w), "--max-queue", str(self.max_queue),
               "--spin-us", str(self.spin_us), "--threads", str(self.threads), "--max-batch", str(self.max_batch),
               "--prefill-chunk", str(self.prefill_chunk), "--stats-fd", str(self.stats.fd)]
        if self.kv_pages is not None:
            cmd += ["--kv-pages", str(self.kv_pages)]
        if self.prefix_cache_pages is not None:
            cmd += ["--prefix-cache-pages", str(self.prefix_cache_pages)]
        if self.cpus is not None:
            cmd += ["--cpus", ",".join(map(str, sorted(self.cpus)))]
        # Its own process group: killing a hung engine takes the executor's worker processes along.
        self.proc = subprocess.Popen(cmd, pass_fds=(self.request_fd, self.result_fd, w, self.stats.fd), stdin=subprocess.DEVNULL,
                                     process_group=0, env={**os.environ, **self.env} if self.env else None)
        os.close(w)
        self._pidfd = os.pidfd_open(self.proc.pid)
        try:
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
        finally:
            os.close(r)
        text = line.decode(errors="replace").strip()
        if text != "ready":
            self.close()
            raise ZlcError(f"the engine failed to start: {text.removeprefix('error: ') or 'it exited'}")
        self.last_progress = time.monotonic()

    def attach(self, loop: asyncio.AbstractEventLoop, on_exit: Callable[[int | None], None]) -> None:
        """Routes results on `loop`; `on_exit(status)` runs once the engine has exited (reaped)."""
        self._loop, self._on_exit = loop, on_exit
        loop.add_reader(self.result_fd, self._drain)
        loop.add_reader(self._pidfd, self._engine_exited)

    def kill(self) -> None:
        """SIGKILL the engine's process group (a hung engine: SIGKILL also ends a stopped one)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self, grace_s: float = 10.0) -> None:
        """Stops the engine (SIGTERM, then SIGKILL after `grace_s`), reaps it, frees the rings. The
        handlers still registered hear nothing more: end them first (fail_all). Blocks up to
        `grace_s`; from another thread, detach() first. Idempotent."""
        if self.closed:
            return
        self.closed = True
        self.detach()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped engine must run to see its SIGTERM
            except ProcessLookupError:
                pass
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
                proc.wait()
        for fd in (self.request_fd, self.result_fd, self._pidfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.request_fd = self.result_fd = self._pidfd = -1
        self.handlers.clear()
        self.region.close()
        self.stats.close()

    def detach(self) -> None:
        """Stops watching the engine from the loop (on the loop's thread: before close() runs in
        another thread)."""
        if self._loop is not None and not self._loop.is_closed():
            for fd in (self.result_fd, self._pidfd):
                if fd >= 0:
                    self._loop.remove_reader(fd)
            self._loop = None

    # -- requests

    @property
    def usable(self) -> bool:
        return not (self.exited or self.closed)

    def submit(self, request: Request, handler: ResultHandler) -> bool:
        """Queues the request; False when `capacity` requests are in flight already or the engine is
        gone (the caller answers "overloaded" / "unavailable"). The ring, sized for the capacity,
        refuses only a prompt longer than the `max_prompt` it was sized for."""
        if not self.usable or self.held >= self.capacity or not self.region.requests.push(request):
            return False
        if self.owed_since is None:
            self.owed_since = time.monotonic()
        self.handlers[request.request_id] = handler
        if request.tokens:
            self.unstarted[request.request_id] = len(request.tokens)
            self.queued_tokens += len(request.tokens)
        os.eventfd_write(self.request_fd, 1)
        return True

    def cancel(self, request_id: int) -> bool:
        """Frees the request's slot in the engine; its handler hears nothing more. False when this
        engine does not hold the request (not submitted here, finished, or the engine is gone)."""
        if not self.usable or self.handlers.pop(request_id, None) is None:
            return False
        self.queued_tokens -= self.unstarted.pop(request_id, 0)
        self.cancelling.add(request_id)
        self._owed_changed()
        if self.region.requests.push(Request(request_id, [], 0, flags=RequestFlag.CANCEL)):
            os.eventfd_write(self.request_fd, 1)
        # else the ring is full: the engine is far behind; the request finishes, its results dropped
        return True

    def ping(self) -> None:
        """Asks the engine for a PONG (liveness of an idle engine); one at a time."""
        if self.ping_pending or not self.usable:
            return
        if self.region.requests.push(Request(PING_ID, [], 0, flags=RequestFlag.PING)):
            self.ping_pending = True
            if self.owed_since is None:
                self.owed_since = time.monotonic()
            os.eventfd_write(self.request_fd, 1)

    def fail_all(self, code: int) -> int:
        """Ends every request in flight with an ERROR|LAST result carrying `code`; returns how many."""
        pending, self.handlers = self.handlers, {}
        self.cancelling.clear()
        self.unstarted.clear()
        self.queued_tokens = 0
        for h in pending.values():
            h.on_result(int(code), ResultFlag.ERROR | ResultFlag.LAST, 0)
        self._owed_changed()
        return len(pending)

    @property
    def in_flight(self) -> int:
        return len(self.handlers)

    @property
    def held(self) -> int:
        """Requests the engine holds or will: in flight, and cancelled ones it has not let go yet."""
        return len(self.handlers) + len(self.cancelling)

    def _owed_changed(self) -> None:
        if not self.handlers and not self.ping_pending:
            self.owed_since = None

    def _drain(self) -> None:
        try:
            os.eventfd_read(self.result_fd)  # reset first: results pushed after this wake us again
        except BlockingIOError:
            pass
        handlers, unstarted = self.handlers, self.unstarted
        raw = self.region.results.raw
        while True:
            batch = raw.pop_many(1024)
            if batch:
                self.last_progress = time.monotonic()
                if self.owed_since is not None:
                    self.owed_since = self.last_progress  # what is still owed is owed from now on
            for rid, token, flags, t_ns, logprob in batch:
                if rid == PING_ID and flags & ResultFlag.PONG:
                    self.ping_pending = False
                    continue
                h = handlers.get(rid)
                if h is None:  # cancelled: dropped; its LAST says the engine let it go
                    if flags & ResultFlag.LAST:
                        self.cancelling.discard(rid)
                    continue
                if unstarted:  # its first result: its prompt is no longer queued work
                    self.queued_tokens -= unstarted.pop(rid, 0)
                if flags & ResultFlag.LAST:
                    del handlers[rid]
                h.on_result(token, flags, t_ns, logprob)
            if len(batch) < 1024:
                self._owed_changed()
                return

    def _engine_exited(self) -> None:
        self._drain()  # what it produced before it went
        self.exited = True
        self.detach()
        status = self.proc.wait() if self.proc is not None else None  # reaped: no zombie
        if self._on_exit is not None:
            self._on_exit(status)
