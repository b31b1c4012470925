"""`GET /metrics`: Prometheus text format through prometheus_client, in a registry of the server's
own (two servers in one process never mix their numbers). Gauges that describe the present (queue
depth, ring occupancy, tokens per second, the engines' counters) are computed when scraped, not on
the hot path; with several engines (--devices) each engine's are labelled (EngineCollector)."""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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


class EngineView(Protocol):
    """What /metrics reads of the server's engines (pool.EnginePool): totals with `engine` None,
    else engine i's."""

    @property
    def devices(self) -> Sequence[Any]:
        """devices.Device, one per engine (its .label names it)."""

    @property
    def routed(self) -> Sequence[dict[str, int]]:
        """Per engine: requests sent to it, by how the router chose it."""

    @property
    def restarts_by(self) -> Sequence[dict[str, int]]:
        """Per engine: restarts by kind (exited, hung)."""

    def in_flight_of(self, engine: int | None) -> float: ...
    def up_of(self, engine: int | None) -> float: ...
    def occupancy(self, ring: str, engine: int | None = None) -> float: ...
    def engine_stat(self, name: str, engine: int | None = None) -> float: ...


# The engine's scheduler counters (EngineStats, written by the engine after every step)
_ENGINE_STATS = (
    ("steps", "Batched steps the engine has run (since the engine started)"),
    ("rows", "Rows (decode tokens + prefill tokens) those steps carried (since the engine started)"),
    ("host_seconds", "Engine time per step outside the executor (taking requests, admission, row building, "
     "sampling, results), summed (since the engine started)"),
    ("backend_seconds", "Engine time inside the executor's step, summed (since the engine started)"),
    ("preemptions", "Sequences preempted for KV pages (recomputed later) (since the engine started)"),
    ("prefix_hits", "Sequences that found the first pages of their context in the prefix cache "
     "(since the engine started)"),
    ("prefix_tokens", "Context tokens found in the prefix cache, not prefilled (since the engine started)"),
    ("running", "Sequences in the batch now"),
    ("waiting", "Requests waiting for the batch now"),
    ("pages_free", "KV pages a step may take (free, or cached and evictable)"),
    ("pages_total", "The KV budget in pages"),
    ("pages_cached", "KV pages no sequence holds, kept for the prefix cache (in pages_free)"),
    ("last_host_seconds", "The last step's engine time outside the executor"),
    ("last_backend_seconds", "The last step's time inside the executor"))


class EngineCollector(Collector):
    """Every per-engine family, read when scraped. The sample without an `engine` label is the
    server's total (with one engine, the only sample: the exposition is the same as before
    --devices existed); with several engines each also has samples labelled `engine` (its index)
    and `device` (its --devices part). `sum` over the labelled samples gives the total again,
    except for zlc_engine_up (total: 1 while every engine is up) and the last-step times (the
    largest)."""

    def __init__(self, view: EngineView):
        self.view = view

    def describe(self) -> Iterable[Metric]:
        return []  # no up-front description: families are built when scraped

    def collect(self) -> Iterable[Metric]:
        v = self.view
        n = len(v.devices)
        each = [(str(i), d.label) for i, d in enumerate(v.devices)] if n > 1 else []
        per = ["engine", "device"]

        def gauge(name: str, doc: str, read: Callable[[int | None], float]) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=per)
            g.add_metric([], read(None))
            for i, (idx, label) in enumerate(each):
                g.add_metric([idx, label], read(i))
            return g

        yield gauge("zlc_queue_depth", "Requests submitted to the engine and not finished (running + waiting)",
                    v.in_flight_of)
        yield gauge("zlc_engine_up", "1 while the engine takes requests, 0 while it is being restarted or has "
                    "failed (the total: 1 while every engine does)", v.up_of)
        ring = GaugeMetricFamily("zlc_ring_occupancy", "Slots in use in the shared-memory rings",
                                 labels=["ring", *per])
        for name in ("request", "result"):
            ring.add_metric([name], v.occupancy(name))
            for i, (idx, label) in enumerate(each):
                ring.add_metric([name, idx, label], v.occupancy(name, i))
        yield ring
        restarts = CounterMetricFamily("zlc_engine_restarts", "Engine restarts after it was lost, by why "
                                       "(exited: it died; hung: no progress within --step-deadline)",
                                       labels=["reason", *per])
        for reason in ("exited", "hung"):  # present (at 0) from the start, for rate() and alerts
            restarts.add_metric([reason], sum(r.get(reason, 0) for r in v.restarts_by))
            for i, (idx, label) in enumerate(each):
                restarts.add_metric([reason, idx, label], v.restarts_by[i].get(reason, 0))
        yield restarts
        for name, doc in _ENGINE_STATS:
            yield gauge(f"zlc_engine_{name}", doc, functools.partial(_engine_stat, v, name))
        if n > 1:
            routed = CounterMetricFamily("zlc_routed", "Requests sent to each engine, by how the router chose it "
                                         "(least_loaded: no engine held its prefix; affinity: the engine that "
                                         "last served its prefix; rebalanced: that engine was too busy, or its "
                                         "ring full)", labels=[*per, "how"])
            for i, (idx, label) in enumerate(each):
                for how, count in v.routed[i].items():
                    routed.add_metric([idx, label, how], count)
            yield routed


def _engine_stat(view: EngineView, name: str, engine: int | None) -> float:
    return view.engine_stat(name, engine)


class ServerMetrics:
    def __init__(self, engines: EngineView):
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
        r.register(EngineCollector(engines))

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
