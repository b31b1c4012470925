"""bench/serve_load.py's measuring client against a real `zlc serve` (tiny chat model, reference
executor): what it counts agrees with the server's own /metrics counters (tokens generated,
requests answered) in a closed and an open loop, the engine counters it reads per case are there,
and a refused request is counted as an error, not as a sample."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve_load.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("serve_load", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_load"] = mod  # dataclasses resolve the module's annotations through it
    spec.loader.exec_module(mod)
    return mod


def _counter(bench: ModuleType, port: int, name: str) -> float:
    status, text = bench._get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_the_bench_counts_what_the_server_served(bench: ModuleType, start_server: Any) -> None:
    s = start_server("--device", "reference", "--max-batch", "4")
    model = bench.served_model(s.port)
    tokens0 = _counter(bench, s.port, "zlc_generated_tokens_total")
    ok0 = _counter(bench, s.port, 'zlc_requests_total{api="openai",outcome="ok"}')
    engine0 = bench.zlc_engine_counters(s.port)

    closed, wall = asyncio.run(bench.closed_loop(s.host, s.port, model, 3, 0.3, 6))
    row = bench.summarize(closed, wall)
    assert len(closed) >= 3 and row["requests"] == len(closed) and row["errors"] == {}
    engine = bench.engine_share(engine0, bench.zlc_engine_counters(s.port))
    assert engine["steps"] > 0 and 0.0 < engine["host_share"] < 1.0 and engine["rows_per_step"] >= 1.0

    opened, _ = asyncio.run(bench.open_loop(s.host, s.port, model, 20.0, 0.3, 6, seed=1))
    assert opened and all(x.error is None for x in opened)

    done = closed + opened
    assert all(1 <= x.tokens <= 6 for x in done)  # the usage chunk's completion_tokens
    assert sum(x.tokens for x in done) == _counter(bench, s.port, "zlc_generated_tokens_total") - tokens0
    assert len(done) == _counter(bench, s.port, 'zlc_requests_total{api="openai",outcome="ok"}') - ok0
    for x in done:  # a gap between every two content deltas after the first
        assert (x.ttft is None and not x.gaps) or (x.ttft is not None and 0 < x.ttft < x.t_end - x.t_start)

    conn = bench.Connection(s.host, s.port)
    refused = asyncio.run(conn.request(bench.chat_body("no-such-model", "Hi", 4)))
    conn.close()
    assert refused.error is not None and refused.error.startswith("HTTP 4")
    assert bench.summarize([refused, *closed], wall)["errors"] == {refused.error: 1}
