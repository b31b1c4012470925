"""Which engine a request goes to, when the server runs several (`zlc serve --devices`).

The rule (docs/serving.md, "Several devices"):

1. **Least loaded.** An engine's load is its requests in flight (submitted, not finished: running
   or waiting in its queue), ties broken by the prompt tokens it has been sent and not yet
   answered (prefill still ahead of it), then by its index.
2. **Prefix affinity.** The prompt's full KV pages (``page_size`` tokens each) are keyed by their
   content and everything before them (page k's key chains page k-1's), as an engine's prefix
   cache keys them: the keys and the page size are the KV manager's (runtime/kv_manager.py
   ``page_keys``, ``DEFAULT_PAGE_SIZE``), the one place the engines' pages are defined. The request goes to the engine that last served the longest run of those
   pages, unless that engine is too much busier than the least-loaded one: it keeps the request
   while its in-flight count exceeds the least loaded's by at most ``slack = min(pages //
   PAGES_PER_EXTRA_REQUEST, MAX_SLACK)``: every 4 pages (64 tokens) it already holds are worth one
   more request waiting there, up to 8. A match of 1-3 pages (a chat template's opening, which every
   request shares) only breaks ties, so it never herds all traffic onto one engine. An engine whose
   batch and queue are full (it would answer "overloaded") keeps nothing.
3. Whatever engine serves a request becomes the one that "last served" each of its pages. An
   engine that is restarted has an empty cache: its entries stop counting (``epoch``).

The table is bounded (``capacity`` page keys, least recently used dropped first). The router never
talks to an engine: it needs only the prompt's token ids, the page size and the loads, so a
wrong guess (a page the engine has evicted since) costs a prefill, never a wrong answer.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from zlc.runtime.kv_manager import DEFAULT_PAGE_SIZE, page_keys

__all__ = ["HOWS", "MAX_SLACK", "PAGES_PER_EXTRA_REQUEST", "Load", "PrefixRouter", "Route", "page_keys"]

PAGES_PER_EXTRA_REQUEST = 4
MAX_SLACK = 8
DEFAULT_CAPACITY = 1 << 16  # page keys remembered (a 4,000-token prompt has 250)


@dataclass(frozen=True, slots=True)
class Load:
    """What the router knows of one engine that takes requests now."""

    in_flight: int  # requests submitted and not finished
    queued_tokens: int = 0  # prompt tokens sent whose first token has not come back
    epoch: int = 0  # changes when the engine is replaced (its prefix cache is then empty)
    full: bool = False  # its batch and queue are full: a request sent there would be refused


@dataclass(frozen=True, slots=True)
class Route:
    engine: int
    how: str  # "least_loaded" (no page held anywhere), "affinity", "rebalanced" (its engine was too busy)
    pages: int  # full pages of the prompt its affinity engine held (0: none)


HOWS = ("least_loaded", "affinity", "rebalanced")


class PrefixRouter:
    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE, capacity: int = DEFAULT_CAPACITY):
        self.page_size = page_size
        self.capacity = capacity
        self.last: collections.OrderedDict[int, tuple[int, int]] = collections.OrderedDict()  # key -> (engine, epoch)

    def choose(self, keys: Sequence[int], loads: Sequence[Load | None]) -> Route:
        """The engine for a prompt with page `keys`; `loads[i]` is None for an engine that takes no
        requests now. At least one must take them."""
        up = [i for i, ld in enumerate(loads) if ld is not None]
        least = min(up, key=lambda i: (loads[i].in_flight, loads[i].queued_tokens, i))  # type: ignore[union-attr]
        held, pages = self._holder(keys, loads)
        if held is None:
            return Route(least, "least_loaded", 0)
        slack = min(pages // PAGES_PER_EXTRA_REQUEST, MAX_SLACK)
        busy, free = loads[held], loads[least]
        assert busy is not None and free is not None
        if not busy.full and busy.in_flight <= free.in_flight + slack:
            return Route(held, "affinity", pages)
        return Route(least, "rebalanced", pages)

    def _holder(self, keys: Sequence[int], loads: Sequence[Load | None]) -> tuple[int | None, int]:
        """The engine that last served the longest run of these pages and still has them (its
        epoch unchanged, it takes requests), and that run's length."""
        last = self.last
        for n in range(len(keys), 0, -1):
            got = last.get(keys[n - 1])
            if got is None:
                continue
            engine, epoch = got
            ld = loads[engine] if engine < len(loads) else None
            if ld is not None and ld.epoch == epoch:
                return engine, n
        return None, 0

    def served(self, keys: Sequence[int], engine: int, epoch: int) -> None:
        """`engine` (at `epoch`) now holds these pages: the last to serve each."""
        last = self.last
        for k in keys:
            last[k] = (engine, epoch)
            last.move_to_end(k)
        while len(last) > self.capacity:
            last.popitem(last=False)
