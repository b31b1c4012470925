"""Micro-benchmark of the request/result rings (zlc.runtime.serve.rings) against the peer measured in the
same run: multiprocessing.Queue, which is what a Python server would otherwise put between
processes.

    python bench/rings.py                 # default sizes (~20 s on 2 cores)
    python bench/rings.py --n 2000000     # more entries per measurement

Rows (ns per entry, median of --repeat runs; the ratio is Queue / ring, so > 1 means the ring
is faster):
- same process, push then pop of one result (raw C API: tuples), through the dataclass API, and
  in bursts (push_many / pop_many of 64); a request of 16 prompt tokens (dataclass API);
  the peer: Queue.put then Queue.get of the same tuple;
- cross-process throughput: a spawned producer pushes results in bursts of 64 as fast as the ring
  takes them, this process pops in bursts; the peer: a spawned process put()s the tuples, this
  process get()s them (Queue batches through a feeder thread and a pipe);
- cross-process round trip: ping-pong of one entry each way, pop_wait / push_wait (spin, then
  back off) on the rings, blocking get/put on a pair of Queues.
Output is markdown, ready for docs/rings.md.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from zlc.runtime.serve.rings import Request, Result, RingRegion

SPAWN = mp.get_context("spawn")


def _median_ns(fn: Callable[[int], float], n: int, repeat: int) -> float:
    fn(min(n, 10_000))  # warm up
    return statistics.median(fn(n) for _ in range(repeat))


# -- same process --


def ring_raw(n: int) -> float:
    with RingRegion.anonymous(64, 1024, 16) as r:
        push, pop = r.results.raw.push, r.results.raw.pop
        t = time.perf_counter_ns()
        for i in range(n):
            push(i, 7, 0, 1)
            pop()
        return (time.perf_counter_ns() - t) / n


def ring_dataclass(n: int) -> float:
    with RingRegion.anonymous(64, 1024, 16) as r:
        res = r.results
        item = Result(1, 7, 0, 1)
        t = time.perf_counter_ns()
        for _ in range(n):
            res.push(item)
            res.pop()
        return (time.perf_counter_ns() - t) / n


def ring_burst(n: int) -> float:
    with RingRegion.anonymous(64, 1024, 16) as r:
        raw = r.results.raw
        batch = [(i, 7, 0, 1) for i in range(64)]
        t = time.perf_counter_ns()
        for _ in range(n // 64):
            raw.push_many(batch)
            raw.pop_many(64)
        return (time.perf_counter_ns() - t) / (n // 64 * 64)


def ring_request(n: int) -> float:
    with RingRegion.anonymous(64, 1024, 16) as r:
        req = r.requests
        item = Request(1, list(range(16)), 32, 0.7, 0.9, 1)
        t = time.perf_counter_ns()
        for _ in range(n):
            req.push(item)
            req.pop()
        return (time.perf_counter_ns() - t) / n


def queue_same(n: int) -> float:
    q: Any = SPAWN.Queue()
    item = (1, 7, 0, 1)
    t = time.perf_counter_ns()
    for _ in range(n):
        q.put(item)
        q.get()
    dt = (time.perf_counter_ns() - t) / n
    q.close()
    q.join_thread()
    return dt


# -- cross-process --


def _ring_producer(name: str, n: int) -> None:
    r = RingRegion.attach(name)
    raw = r.results.raw
    i = 0
    while i < n:
        batch = [(j, 7, 0, 1) for j in range(i, min(n, i + 64))]
        while batch:
            k = raw.push_many(batch)
            batch = batch[k:]
            i += k
    r.close()


def ring_cross(n: int) -> float:
    with RingRegion.create(None, 64, 1024, 16) as r:
        assert r.name is not None
        p = SPAWN.Process(target=_ring_producer, args=(r.name, n))
        p.start()
        raw, got = r.results.raw, 0
        while raw.occupancy() == 0:  # the clock starts at the first entry (not at process start)
            time.sleep(0)
        t = time.perf_counter_ns()
        while got < n:
            got += len(raw.pop_many(1024))
        dt = (time.perf_counter_ns() - t) / n
        p.join()
        return dt


def _queue_producer(q: Any, n: int) -> None:
    for i in range(n):
        q.put((i, 7, 0, 1))
    q.close()
    q.join_thread()


def queue_cross(n: int) -> float:
    q: Any = SPAWN.Queue()
    p = SPAWN.Process(target=_queue_producer, args=(q, n))
    p.start()
    q.get()
    t = time.perf_counter_ns()
    for _ in range(n - 1):
        q.get()
    dt = (time.perf_counter_ns() - t) / (n - 1)
    p.join()
    return dt


def _ring_ponger(name: str, n: int) -> None:
    r = RingRegion.attach(name)
    for _ in range(n):
        q = r.requests.pop_wait()
        assert q is not None
        r.results.push_wait(Result(q.request_id, 1))
    r.close()


def ring_rtt(n: int) -> float:
    with RingRegion.create(None, 4, 4, 16) as r:
        assert r.name is not None
        p = SPAWN.Process(target=_ring_ponger, args=(r.name, n + 1))
        p.start()
        r.requests.push_wait(Request(0, [1], 1))
        r.results.pop_wait()
        t = time.perf_counter_ns()
        for i in range(n):
            r.requests.push_wait(Request(i, [1], 1))
            r.results.pop_wait()
        dt = (time.perf_counter_ns() - t) / n
        p.join()
        return dt


def _queue_ponger(a: Any, b: Any, n: int) -> None:
    for _ in range(n):
        b.put(a.get())


def queue_rtt(n: int) -> float:
    a: Any = SPAWN.Queue()
    b: Any = SPAWN.Queue()
    p = SPAWN.Process(target=_queue_ponger, args=(a, b, n + 1))
    p.start()
    a.put((0, (1,), 1))
    b.get()
    t = time.perf_counter_ns()
    for i in range(n):
        a.put((i, (1,), 1))
        b.get()
    dt = (time.perf_counter_ns() - t) / n
    p.join()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500_000, help="entries per same-process / throughput run")
    ap.add_argument("--rtt", type=int, default=5_000, help="round trips per latency run")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    n, rtt, rep = args.n, args.rtt, args.repeat
    qn = max(10_000, n // 5)  # the Queue is slow; fewer entries give the same precision
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{platform.machine()}, {cpus} CPUs, Python {platform.python_version()} ({sys.platform})\n")
    print("| measurement | zlc ring ns/entry | multiprocessing.Queue ns/entry | Queue / ring |")
    print("|---|---|---|---|")

    def row(label: str, ring_ns: float, queue_ns: float) -> None:
        print(f"| {label} | {ring_ns:,.0f} | {queue_ns:,.0f} | {queue_ns / ring_ns:.1f}x |", flush=True)

    q_same = _median_ns(queue_same, qn, rep)
    row("same process, push+pop one result (raw tuples)", _median_ns(ring_raw, n, rep), q_same)
    row("same process, push+pop one result (Result dataclass)", _median_ns(ring_dataclass, n, rep), q_same)
    row("same process, push_many+pop_many of 64 results, per result", _median_ns(ring_burst, n, rep), q_same)
    row("same process, push+pop one 16-token Request (dataclass)", _median_ns(ring_request, n, rep), q_same)
    row("cross-process throughput, results (bursts of 64 / 1024)", _median_ns(ring_cross, n, rep),
        _median_ns(queue_cross, qn, rep))
    row("cross-process round trip (request there, result back)", _median_ns(ring_rtt, rtt, rep),
        _median_ns(queue_rtt, rtt, rep))


if __name__ == "__main__":
    main()
