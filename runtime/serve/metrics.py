"""`GET /metrics`: Prometheus text format through prometheus_client, in a registry of the server's
own (two servers in one process never mix their numbers). Gauges that describe the present (queue
depth, ring occupancy, tokens per second) are computed when scraped, not on the hot path."""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# 50 µs .. 60 s: loopback overheads at the bottom, interpreter-speed tokens at the top
_LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
                    10.0, 30.0, 60.0)


class TokenRate:
    """Tokens per second over the last ``window`` seconds (one counter per second)."""

    def __init__(self, window: int = 10):
        self.window = window
        self.buckets: collections.deque[list[int]] = collections.deque()  # [second, count]

    def add(self, n: int = 1) -> None:
        now = int(time.monotonic())
        if self.buckets and self.buckets[-1][0] == now:
            self.buckets[-1][1] += n
        else:
            self.buckets.append([now, n])
            while self.buckets and self.buckets[0][0] <= now - self.window:
                self.buckets.popleft()

    def rate(self) -> float:
        now = int(time.monotonic())
        return sum(c for s, c in self.buckets if s > now - self.window) / self.window


@dataclass(slots=True)
class ApiMetrics:
    """One API's labelled children, resolved once (a labels() lookup costs microseconds)."""

    ttft: Any
    itl: Any
    ok: Any


class ServerMetrics:
    def __init__(self, queue_depth: Callable[[], float], request_ring: Callable[[], float],
                 result_ring: Callable[[], float], engine_up: Callable[[], float] = lambda: 1.0):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("zlc_requests", "Requests answered, by API and outcome", ["api", "outcome"], registry=r)
        self.ttft = Histogram("zlc_time_to_first_token_seconds",
                              "From the request's last byte in to its first token written out", ["api"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("zlc_inter_token_latency_seconds", "Between consecutive tokens of one reply", ["api"],
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("zlc_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.tokens = Counter("zlc_generated_tokens", "Tokens generated", registry=r)
        self.frames = Counter("zlc_frames", "Binary token frames received, by transport and outcome",
                              ["transport", "outcome"], registry=r)
        self.rate = TokenRate()
        Gauge("zlc_tokens_per_second", "Tokens generated per second over the last 10 s",
              registry=r).set_function(self.rate.rate)
        Gauge("zlc_queue_depth", "Requests submitted to the engine and not finished (running + waiting)",
              registry=r).set_function(queue_depth)
        self.engine_restarts = Counter("zlc_engine_restarts", "Engine restarts after it was lost, by why "
                                       "(exited: it died; hung: no progress within --step-deadline)", ["reason"],
                                       registry=r)
        for reason in ("exited", "hung"):
            self.engine_restarts.labels(reason)  # present (at 0) from the start, for rate() and alerts
        Gauge("zlc_engine_up", "1 while the engine takes requests, 0 while it is being restarted or has failed",
              registry=r).set_function(lambda: float(engine_up()))
        ring = Gauge("zlc_ring_occupancy", "Slots in use in the shared-memory rings", ["ring"], registry=r)
        ring.labels("request").set_function(request_ring)
        ring.labels("result").set_function(result_ring)

    def watch_engine(self, stat: Callable[[str], float]) -> None:
        """Exports the engine's scheduler counters (EngineStats, read when scraped). They restart
        from 0 with a restarted engine."""
        r = self.registry
        for name, doc in (("steps", "Batched steps the engine has run"),
                          ("rows", "Rows (decode tokens + prefill tokens) those steps carried"),
                          ("host_seconds", "Engine time per step outside the executor (taking requests, admission, row building, "
                           "sampling, results), summed"),
                          ("backend_seconds", "Engine time inside the executor's step, summed"),
                          ("preemptions", "Sequences preempted for KV pages (recomputed later)"),
                          ("prefix_hits", "Sequences that found the first pages of their context in the prefix cache"),
                          ("prefix_tokens", "Context tokens found in the prefix cache, not prefilled")):
            Gauge(f"zlc_engine_{name}", doc + " (since the engine started)",
                  registry=r).set_function(functools.partial(stat, name))
        for name, doc in (("running", "Sequences in the batch now"),
                          ("waiting", "Requests waiting for the batch now"),
                          ("pages_free", "KV pages a step may take (free, or cached and evictable)"),
                          ("pages_total", "The KV budget in pages"),
                          ("pages_cached", "KV pages no sequence holds, kept for the prefix cache (in pages_free)"),
                          ("last_host_seconds", "The last step's engine time outside the executor"),
                          ("last_backend_seconds", "The last step's time inside the executor")):
            Gauge(f"zlc_engine_{name}", doc, registry=r).set_function(functools.partial(stat, name))

    def for_api(self, api: str) -> ApiMetrics:
        return ApiMetrics(self.ttft.labels(api), self.itl.labels(api), self.requests.labels(api, "ok"))

    def watch_xdp(self, stats: Callable[[], dict[str, int]]) -> None:
        """Exports the XDP program's own counters (read from its per-CPU map when scraped)."""
        g = Gauge("zlc_xdp_program_frames", "Frames the XDP program saw on the serving port, by outcome "
                  "(accepted into the BPF ring, or passed to the UDP socket: malformed, ring_full, too_long)",
                  ["outcome"], registry=self.registry)
        for name in ("accepted", "malformed", "ring_full", "too_long"):
            g.labels(name).set_function(functools.partial(_stat, stats, name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _stat(stats: Callable[[], dict[str, int]], name: str) -> float:
    return float(stats()[name])
