"""The engine: the one process that owns the executor. It drains the request ring, runs prefill and
decode steps, and pushes every token to the result ring the moment it exists.

    ingress ──push──▶ request ring ──▶ engine (executor: cuda | cpu: the native kernel | interpret | reference)
    ingress ◀──pop─── result ring  ◀──┘

The kernel is batch 1 (one sequence, one KV cache), so requests run one at a time, first come first
served: FIFO is the fair order when nothing can run side by side, and no request waits behind one
that arrived later. Requests waiting beyond ``max_queue`` are answered at once with an OVERLOADED
error result instead of growing a queue without limit. A CANCEL request (client gone, stop sequence
matched) drops a waiting request or stops the running one between two tokens. A PING request is
answered with a PONG result at the start of the next step: the ingress's supervisor (supervisor.py)
pings an idle engine so that a stopped or wedged one is noticed even when no request is running.

Wake-ups go through two eventfds next to the rings (ingress → engine after a push, engine → ingress
after results): the idle side sleeps in the kernel instead of spinning on a 2-core machine, and
the busy side pays one write() per batch. ``spin_us`` trades a core for lower wake-up latency.

Result flags: EOS on an end-of-sequence token, LAST on the final result of a request, ERROR with the
error code (``EngineError``) in the token field; flags and codes are protocol.py's, which the
ingress imports too (it never imports this module).
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .protocol import EngineError, RequestFlag, ResultFlag
from .rings import Request, RingRegion


@dataclass
class _Running:
    request: Request
    tokens: Iterator[int]
    produced: int = 0
    stops: frozenset[int] = field(default_factory=frozenset)


def _notify(fd: int) -> None:
    try:
        os.eventfd_write(fd, 1)
    except BlockingIOError:  # counter saturated: the reader is already due to wake
        pass


def _drain_eventfd(fd: int) -> None:
    try:
        os.eventfd_read(fd)
    except BlockingIOError:
        pass


class Engine:
    """The serving loop over one session (anything with ``stream(ids, n, eos=, temperature=,
    top_p=, seed=)`` yielding tokens, and ``max_seq``). ``request_fd``/``result_fd``: eventfds (or
    None to poll without sleeping, for tests in one thread)."""

    def __init__(self, session: Any, region: RingRegion, *, eos: list[int], max_queue: int = 64,
                 request_fd: int | None = None, result_fd: int | None = None, spin_us: float = 0.0):
        self.session = session
        self.region = region
        self.eos = frozenset(eos)
        self.max_queue = max_queue
        self.request_fd, self.result_fd = request_fd, result_fd
        self.spin_ns = int(spin_us * 1000)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: _Running | None = None
        self.stopping = False
        self.served = 0

    # -- results

    def _emit(self, request_id: int, token: int, flags: int) -> None:
        results = self.region.results
        while not results.raw.push(request_id, token, flags, 0):
            # Ingress drains continuously; a full ring means it is momentarily behind: wake it.
            if self.result_fd is not None:
                _notify(self.result_fd)
            time.sleep(20e-6)

    def _flush(self) -> None:
        if self.result_fd is not None:
            _notify(self.result_fd)

    def _fail(self, request_id: int, code: EngineError) -> None:
        self._emit(request_id, int(code), ResultFlag.ERROR | ResultFlag.LAST)

    # -- requests

    def _take_requests(self) -> int:
        got = self.region.requests.pop_many(256)
        for r in got:
            if r.flags & RequestFlag.PING:
                self._emit(r.request_id, 0, ResultFlag.PONG | ResultFlag.LAST)
            elif r.flags & RequestFlag.CANCEL:
                self._cancel(r.request_id)
            elif len(self.waiting) >= self.max_queue:
                self._fail(r.request_id, EngineError.OVERLOADED)
            else:
                self.waiting.append(r)
        return len(got)

    def _cancel(self, request_id: int) -> None:
        if self.running is not None and self.running.request.request_id == request_id:
            self.running = None
            self._fail(request_id, EngineError.CANCELLED)
            return
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                self._fail(request_id, EngineError.CANCELLED)
                return
        # Already finished: its LAST result is out; nothing to free.

    def _start(self, r: Request) -> None:
        stops = self.eos
        # top_p 0 keeps only the most likely token: greedy (a nucleus of no mass would be empty). The
        # slot's f32 also turns a tiny top_p into 0.
        temperature = r.temperature if r.top_p > 0.0 else 0.0
        tokens = self.session.stream(list(r.tokens), r.max_tokens, eos=sorted(stops), temperature=temperature,
                                     top_p=r.top_p, seed=r.seed)
        self.running = _Running(r, tokens, stops=stops)

    def _advance(self) -> None:
        """One token of the running request (its prefill on the first call)."""
        run = self.running
        assert run is not None
        rid = run.request.request_id
        try:
            tok = next(run.tokens)
        except StopIteration:  # max_tokens 0
            self.running = None
            self._emit(rid, 0, ResultFlag.LAST)
            return
        except Exception as e:
            self.running = None
            from zlc.errors import ZlcError

            code = EngineError.BAD_REQUEST if isinstance(e, ZlcError) else EngineError.INTERNAL
            if code is EngineError.INTERNAL:
                traceback.print_exc(file=sys.stderr)
            else:
                print(f"zlc engine: request {rid}: {e}", file=sys.stderr)
            self._fail(rid, code)
            return
        run.produced += 1
        flags = 0
        if tok in run.stops:
            flags |= ResultFlag.EOS
        if flags or run.produced >= run.request.max_tokens:
            flags |= ResultFlag.LAST
            self.running = None
            self.served += 1
        self._emit(rid, tok, flags)

    # -- loop

    def step(self) -> bool:
        """One turn: take new requests, then produce one token. False when there was nothing to do."""
        took = self._take_requests()
        if self.running is None and self.waiting:
            self._start(self.waiting.popleft())
        if self.running is not None:
            self._advance()
            self._flush()
            return True
        if took:
            self._flush()  # errors (overload, cancel) went out
        return took > 0

    def run(self, idle_check: Any = None) -> None:
        """Serves until ``stop()``; sleeps on the request eventfd when idle. ``idle_check`` is
        called about once a second while idle (the process entry checks its parent there)."""
        while not self.stopping:
            if self.step():
                continue
            if self.spin_ns:
                deadline = time.monotonic_ns() + self.spin_ns
                while time.monotonic_ns() < deadline and not self.region.requests.occupancy():
                    pass
                if self.region.requests.occupancy():
                    continue
            if self.request_fd is None:
                time.sleep(1e-4)
                continue
            ready, _, _ = select.select([self.request_fd], [], [], 1.0)
            if ready:
                _drain_eventfd(self.request_fd)
            elif idle_check is not None:
                idle_check()

    def stop(self) -> None:
        self.stopping = True


# --------------------------------------------------------------------------------------------------
# the engine process: `python -m zlc.runtime.serve.engine ...`, started by `zlc serve`


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (so an engine never outlives a
    crashed server and keeps a GPU busy)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zlc.runtime.serve.engine", description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--region", required=True, help="shared-memory name of the ring region")
    ap.add_argument("--request-fd", type=int, required=True)
    ap.add_argument("--result-fd", type=int, required=True)
    ap.add_argument("--ready-fd", type=int, required=True, help="pipe: 'ready' or an error line, then closed")
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--spin-us", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for the executor's torch/numpy work")
    args = ap.parse_args(argv)
    parent = os.getppid()
    _die_with_parent()
    ready = os.fdopen(args.ready_fd, "w")
    # One thread by default: a batch-1 step of a small model gains little from a pool, and a pool
    # spinning on every core steals them from ingress (p99 doubled on 2 cores). Set before torch
    # loads; the interpreter's worker process inherits it.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    try:
        from zlc.runtime.loader import load

        bundle = load(args.bundle)
        session = bundle.session(args.device, threads=args.threads)
        region = RingRegion.attach(args.region)
        if args.device == "interpret":  # warm the interpreter (first launch imports and traces)
            list(session.stream([0], 1))
    except Exception as e:
        ready.write(f"error: {e}\n")
        ready.close()
        return 1
    engine = Engine(session, region, eos=bundle.eos_token_ids, max_queue=args.max_queue,
                    request_fd=args.request_fd, result_fd=args.result_fd, spin_us=args.spin_us)
    def on_term(*_: object) -> None:
        engine.stop()
        _notify(args.request_fd)  # wake the select() (PEP 475 would otherwise resume it)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server stops us (Ctrl-C reaches the whole group)
    ready.write("ready\n")
    ready.close()  # the server watches this process through a pidfd, not this pipe

    def parent_alive() -> None:
        if os.getppid() != parent:
            engine.stop()

    try:
        engine.run(idle_check=parent_alive)
    finally:
        session.close()
        region.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
