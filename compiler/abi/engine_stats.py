"""The engine's stats record: the f64 slots the engine process writes after every step into a file
the ingress maps (runtime/serve/engine_stats.py), by name on both sides."""

from __future__ import annotations

from collections.abc import Mapping

# slot i holds ENGINE_STATS[i]; a new counter is one name here (appended: a running ingress and
# engine of one zlc agree on it)
ENGINE_STATS = ("steps", "rows", "host_seconds", "backend_seconds", "preemptions", "running", "waiting",
                "pages_free", "pages_total", "last_host_seconds", "last_backend_seconds", "prefix_hits",
                "prefix_tokens", "pages_cached")
ENGINE_SLOT = {name: i for i, name in enumerate(ENGINE_STATS)}


def engine_record(values: Mapping[str, float]) -> list[float]:
    """The record's slots from {name: value}: every name exactly once (a missing or unknown one is
    an error, so the writer and the record cannot drift apart)."""
    if set(values) != set(ENGINE_STATS):
        missing, extra = set(ENGINE_STATS) - set(values), set(values) - set(ENGINE_STATS)
        raise KeyError(f"engine stats: missing {sorted(missing)}, unknown {sorted(extra)}")
    return [float(values[n]) for n in ENGINE_STATS]
