"""The engine: the one process that owns the executor. It drains the request ring, runs batched
steps through the scheduler, and pushes every token to the result ring the moment it exists.

    ingress ──push──▶ request ring ──▶ engine (scheduler.py over a batch.BatchBackend)
    ingress ◀──pop─── result ring  ◀──┘

Requests run side by side (continuous batching, scheduler.py): at every step waiting requests are
admitted first come first served while the batch has room, each running sequence gets its next
token, a new prompt is prefilled in chunks between them, and finished or cancelled sequences leave
at once. The backend is NativeBatch (one kernel launch per step) where runtime/batch.py has a
batched kernel for the device, else SequentialBatch (one session per sequence, rows one after
another). A request that finds ``max_batch + max_queue`` requests running and waiting (the
capacity the server states; its ingress refuses beyond that already) is answered at once with an
OVERLOADED error result instead of growing a queue without limit: counted against running +
waiting, not waiting alone, since requests taken in one turn wait until that turn's step admits
them (counting the queue alone refused a burst of arrivals during one long step below capacity). A CANCEL request (client gone, stop sequence
matched) drops a waiting request or closes the running one's sequence before the next step. A PING
request is answered with a PONG result at the start of the next step: the ingress's supervisor
(supervisor.py) pings an idle engine so that a stopped or wedged one is noticed even when no
request is running.

Wake-ups go through two eventfds next to the rings (ingress → engine after a push, engine → ingress
after results): the idle side sleeps in the kernel instead of spinning on a 2-core machine, and
the busy side pays one write() per step. ``spin_us`` trades a core for lower wake-up latency.

The scheduler's counters (steps, rows, host and backend time, preemptions, batch occupancy) go to a
small shared file (``EngineStats``) that the ingress reads when /metrics is scraped.

Result flags: EOS on an end-of-sequence token, LAST on the final result of a request, ERROR with the
error code (``EngineError``) in the token field; flags and codes are protocol.py's, which the
ingress imports too (it never imports this module).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import time
from typing import Any

from ..constraints import Grammars
from ..engine_stats import EngineStats
from ..protocol import EngineError, RequestFlag, ResultFlag
from ..rings import RingRegion
from .scheduler import Scheduler


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
    """The serving loop over one BatchBackend. ``request_fd``/``result_fd``: eventfds (or None to
    poll without sleeping, for tests in one thread)."""

    def __init__(self, backend: Any, region: RingRegion, *, eos: list[int], vocab: int, max_queue: int = 64,
                 max_batch: int = 8, prefill_chunk: int = 64, request_fd: int | None = None,
                 result_fd: int | None = None, spin_us: float = 0.0, stats: EngineStats | None = None,
                 grammars: Grammars | None = None):
        """`grammars`: a constraints.Grammars for GRAMMAR requests (None: they are refused)."""
        self.backend = backend
        self.region = region
        self.max_queue = max_queue
        self.capacity = max_batch + max_queue  # requests running + waiting
        self.request_fd, self.result_fd = request_fd, result_fd
        self.spin_ns = int(spin_us * 1000)
        self.scheduler = Scheduler(backend, self._emit, eos=frozenset(eos), vocab=vocab, max_batch=max_batch,
                                   prefill_chunk=prefill_chunk, log=self._log, grammars=grammars)
        self.stats = stats
        self.host_ns = self.last_host_ns = 0  # the engine's time outside the executor's steps
        self.stopping = False

    @property
    def idle(self) -> bool:
        return self.scheduler.idle

    @property
    def served(self) -> int:
        return self.scheduler.served

    @staticmethod
    def _log(msg: str) -> None:
        print(f"zlc engine: {msg}", file=sys.stderr, flush=True)

    # -- results

    def _emit(self, request_id: int, token: int, flags: int, logprob: float = 0.0) -> None:
        results = self.region.results
        while not results.raw.push(request_id, token, flags, 0, logprob):
            # Ingress drains continuously; a full ring means it is momentarily behind: wake it.
            if self.result_fd is not None:
                _notify(self.result_fd)
            time.sleep(20e-6)

    def _flush(self) -> None:
        if self.result_fd is not None:
            _notify(self.result_fd)

    # -- requests

    def _take_requests(self) -> int:
        got = self.region.requests.pop_many(256)
        sched = self.scheduler
        for r in got:
            if r.flags & RequestFlag.PING:
                self._emit(r.request_id, 0, ResultFlag.PONG | ResultFlag.LAST)
            elif r.flags & RequestFlag.CANCEL:
                sched.cancel(r.request_id)  # already finished: its LAST is out, nothing to free
            elif len(sched.running) + len(sched.waiting) >= self.capacity:
                self._emit(r.request_id, int(EngineError.OVERLOADED), ResultFlag.ERROR | ResultFlag.LAST)
            else:
                sched.submit(r)
        return len(got)

    # -- loop

    def step(self) -> bool:
        """One turn: take new requests, then one batched step. False when there was nothing to do."""
        t0 = time.perf_counter_ns()
        st = self.scheduler.stats
        backend_before = st.backend_ns
        took = self._take_requests()
        ran = self.scheduler.step()
        if ran or took:
            self._flush()  # tokens, or errors (overload, cancel, bad prompts)
            # The engine's own cost of this turn: everything but the executor's step (taking
            # requests, the scheduler's work, result pushes, the wake-up write).
            self.last_host_ns = time.perf_counter_ns() - t0 - (st.backend_ns - backend_before)
            self.host_ns += self.last_host_ns
            self._publish()
        return ran or took > 0

    def _publish(self) -> None:
        if self.stats is None:
            return
        s, b, st = self.scheduler, self.backend, self.scheduler.stats
        self.stats.put(steps=st.steps, rows=st.rows, host_seconds=self.host_ns * 1e-9,
                       backend_seconds=st.backend_ns * 1e-9, preemptions=st.preemptions, running=len(s.running),
                       waiting=len(s.waiting), pages_free=b.pages_free(), pages_total=b.pages_total,
                       last_host_seconds=self.last_host_ns * 1e-9, last_backend_seconds=st.last_backend_ns * 1e-9,
                       prefix_hits=st.prefix_hits, prefix_tokens=st.prefix_tokens, pages_cached=b.pages_cached())

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
# the engine process: `python -m zlc.runtime.serve.engine.loop ...`, started by `zlc serve`


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (so an engine never outlives a
    crashed server and keeps a GPU busy)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _confine(cpus: set[int]) -> None:
    """Runs this process on `cpus` only (zlc serve --devices cpu:0-1): every thread it has now
    (imports start some, e.g. a BLAS pool) and, since threads inherit the mask, every thread the
    executor starts later, so that engines on disjoint cores never share one."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:  # a thread that has ended since
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zlc.runtime.serve.engine.loop", description=__doc__.split("\n")[0])
    ap.add_argument("bundle")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--region", required=True, help="shared-memory name of the ring region")
    ap.add_argument("--request-fd", type=int, required=True)
    ap.add_argument("--result-fd", type=int, required=True)
    ap.add_argument("--ready-fd", type=int, required=True, help="pipe: 'ready' or an error line, then closed")
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--spin-us", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads for the executor's torch/numpy work")
    ap.add_argument("--max-batch", type=int, default=8, help="sequences running side by side")
    ap.add_argument("--kv-pages", type=int, default=None, help="KV budget in pages (default: max-batch full contexts)")
    ap.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens prefilled per step")
    ap.add_argument("--prefix-cache-pages", type=int, default=None,
                    help="most KV pages the prefix cache keeps (default: the backend's; 0: off)")
    ap.add_argument("--stats-fd", type=int, default=None, help="memfd for EngineStats (the ingress reads it)")
    ap.add_argument("--cpus", default=None, help="comma-separated cores this process (and its executor's threads) "
                    "runs on (zlc serve --devices cpu:0-1)")
    args = ap.parse_args(argv)
    if args.cpus:
        _confine({int(c) for c in args.cpus.split(",")})
    parent = os.getppid()
    _die_with_parent()
    ready = os.fdopen(args.ready_fd, "w")
    # One thread by default: a batch-1 step of a small model gains little from a pool, and a pool
    # spinning on every core steals them from ingress (p99 doubled on 2 cores). Set before torch
    # loads; the interpreter's worker process inherits it.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(args.threads)
    try:
        from zlc.runtime.batch import batch_backend
        from zlc.runtime.loader import load

        bundle = load(args.bundle)
        backend = batch_backend(bundle, args.device, threads=args.threads, max_seqs=args.max_batch,
                                prefill_chunk=args.prefill_chunk, pages_total=args.kv_pages,
                                cache_pages=args.prefix_cache_pages)
        region = RingRegion.attach(args.region)
        # The first sequence's session now, not on the first request (a native session starts
        # threads; the interpreter's first launch imports and traces).
        seq = backend.open()
        backend.step([(seq, [0])], [False])
        backend.close(seq)
        stats = EngineStats(args.stats_fd) if args.stats_fd is not None else None
        try:  # now: building it holds the GIL (0.7-1.7 s for a 49k vocabulary)
            grammars = Grammars.of_bundle(bundle)
        except Exception as e:  # the engine serves without constrained decoding
            Engine._log(f"no constrained decoding: llguidance cannot load the tokenizer: {e}")
            grammars = None
    except Exception as e:
        ready.write(f"error: {e}\n")
        ready.close()
        return 1
    engine = Engine(backend, region, eos=bundle.eos_token_ids, vocab=bundle.vocab, max_queue=args.max_queue,
                    max_batch=args.max_batch, prefill_chunk=args.prefill_chunk, request_fd=args.request_fd,
                    result_fd=args.result_fd, spin_us=args.spin_us, stats=stats, grammars=grammars)
    engine._publish()
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
        engine.scheduler.close()
        backend.close_all()
        region.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
