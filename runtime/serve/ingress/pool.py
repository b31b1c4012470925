"""The server's engines: one EngineSupervisor per device (`--devices`; one without it), and the one
place every request passes through to an engine: submit, cancel, in_flight, fail_all, the
engines' counters and ring occupancy, for one engine or many alike (no path of its own for one).

Each engine has its own process, rings, eventfds and supervisor: one that exits or hangs ends its
own requests with an error and is restarted, while the others serve on. The supervisors only keep
their engines alive; a request goes from here straight to the live EngineClient (engine_client.py)
that router.py picks (least loaded, prefix affinity) among those that are up; if that engine
holds its capacity the next best is tried. Results go from the client straight to the request's
handler (the client keeps the load the router reads: in flight, queued prompt tokens). A cancel
goes to the engine that holds the request. The server is "up" while any engine is; if one engine
fails past the restart limit the server gives up (the service manager restarts it whole).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any

from zlc.errors import ZlcError
from zlc.runtime.kv_manager import DEFAULT_PAGE_SIZE

from ..protocol import EngineError
from ..rings import Request
from .devices import Device
from .engine_client import EngineClient, ResultHandler
from .router import HOWS, Load, PrefixRouter, page_keys
from .supervisor import EngineSupervisor

RESTART_KINDS = ("exited", "hung")
# Stats that are a moment's value per engine, not a sum: the total is the largest engine's.
_MAX_STATS = frozenset({"last_host_seconds", "last_backend_seconds"})


class EnginePool:
    def __init__(self, devices: Sequence[Device], supervisors: Sequence[EngineSupervisor],
                 page_size: int = DEFAULT_PAGE_SIZE):
        """Each engine's capacity (the requests it holds: its batch and its queue) is its client's,
        which refuses more: an engine with that many in flight keeps no request by affinity."""
        assert len(devices) == len(supervisors) >= 1
        self.devices, self.engines = list(devices), list(supervisors)
        self.router = PrefixRouter(page_size)
        self.routed = [dict.fromkeys(HOWS, 0) for _ in self.engines]  # requests sent, by how chosen
        self.restarts_by = [dict.fromkeys(RESTART_KINDS, 0) for _ in self.engines]
        self._next_id = 1

    def count_restart(self, engine: int, kind: str) -> None:
        """The supervisor's on_restart for engine `engine`."""
        self.restarts_by[engine][kind] = self.restarts_by[engine].get(kind, 0) + 1

    # -- lifetime

    async def start(self) -> None:
        """Every engine, loaded side by side; ZlcError (the first failure) if any does not start,
        after closing the others."""
        results = await asyncio.gather(*(e.start() for e in self.engines), return_exceptions=True)
        failed = [(d, r) for d, r in zip(self.devices, results, strict=True) if isinstance(r, BaseException)]
        if failed:
            await self.close()
            device, error = failed[0]
            if len(self.engines) > 1 and isinstance(error, ZlcError):
                raise ZlcError(f"{device.label}: {error}") from None
            raise error

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))

    @property
    def restart_enabled(self) -> bool:
        return all(e.restart_enabled for e in self.engines)

    @restart_enabled.setter
    def restart_enabled(self, on: bool) -> None:
        for e in self.engines:
            e.restart_enabled = on

    # -- state, for /health and the 503s

    @property
    def up(self) -> bool:
        return any(e.up for e in self.engines)

    @property
    def state(self) -> str:
        """up (any engine takes requests), failed (one gave up), stopped, or restarting."""
        states = {e.state for e in self.engines}
        for s in ("up", "failed", "stopped"):
            if s in states:
                return s
        return "restarting"

    @property
    def reason(self) -> str:
        """Why requests may fail now: the engines that are not up, and why ('' when all are)."""
        if len(self.engines) == 1:
            return self.engines[0].reason
        return "; ".join(f"{d.label}: {e.reason}" for d, e in zip(self.devices, self.engines, strict=True)
                         if not e.up and e.reason)

    @property
    def restarts(self) -> int:
        return sum(e.restarts for e in self.engines)

    def retry_after_s(self) -> int:
        return min(e.retry_after_s() for e in self.engines)

    @property
    def capacity(self) -> int:
        """Requests the engines take in flight together (each: --max-batch + --max-queue, as its
        client counts them; 0 for one that has none now)."""
        return sum(e.client.capacity for e in self.engines if e.client is not None)

    @property
    def max_prompt_tokens(self) -> int:
        return min(e.max_prompt_tokens for e in self.engines)

    # -- requests

    def new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def _live(self) -> Iterator[EngineClient]:
        """The clients of the engines that can take requests and cancels now."""
        for e in self.engines:
            if (c := e.live) is not None:
                yield c

    def _client(self, engine: int) -> EngineClient | None:
        """Engine `engine`'s current client while it is open (its counters and rings readable)."""
        c = self.engines[engine].client
        return None if c is None or c.closed else c

    def loads(self) -> list[Load | None]:
        """What the router knows of each engine: None for one that takes no requests now."""
        out: list[Load | None] = []
        for e in self.engines:
            c = e.live if e.up else None
            out.append(None if c is None else Load(c.in_flight, c.queued_tokens, e.restarts, c.held >= c.capacity))
        return out

    def submit(self, request: Request, handler: ResultHandler) -> bool:
        """Sends the request to the engine router.py picks, or the next best when that one holds
        its capacity; False when no engine is up or every one holds its capacity."""
        loads = self.loads()
        if not any(ld is not None for ld in loads):
            return False
        keys = page_keys(request.tokens, self.router.page_size)
        route = self.router.choose(keys, loads)
        others = sorted((i for i, ld in enumerate(loads) if ld is not None and i != route.engine),
                        key=lambda i: (loads[i].in_flight, loads[i].queued_tokens, i))  # type: ignore[union-attr]
        for i, how in [(route.engine, route.how), *((i, "rebalanced") for i in others)]:
            c = self.engines[i].live
            if c is not None and c.submit(request, handler):  # else it holds its capacity
                self.routed[i][how] += 1
                self.router.served(keys, i, self.engines[i].restarts)
                return True
        return False

    def cancel(self, request_id: int) -> None:
        """Frees the request in the engine that holds it (request ids are unique over the pool)."""
        for c in self._live():
            if c.cancel(request_id):
                return

    def fail_all(self, code: int = EngineError.UNAVAILABLE) -> int:
        """Ends every request in flight with an error result (the drain deadline); how many."""
        return sum(c.fail_all(code) for c in self._live())

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self._live())

    # -- numbers, for /metrics and error messages

    def engine_stat(self, name: str, engine: int | None = None) -> float:
        """An EngineStats counter of one engine (0 while it has none), or over all (summed; the
        largest for last_*)."""
        if engine is None:
            values = [self.engine_stat(name, i) for i in range(len(self.engines))]
            return max(values) if name in _MAX_STATS else sum(values)
        c = self._client(engine)
        return 0.0 if c is None else c.stats.get(name)

    def kv_pages(self) -> int:
        """One engine's KV budget in pages (each engine has the --kv-pages budget of its own)."""
        return int(max(self.engine_stat("pages_total", i) for i in range(len(self.engines))))

    def _in_flight(self, engine: int) -> int:
        c = self.engines[engine].live
        return 0 if c is None else c.in_flight

    def in_flight_of(self, engine: int | None) -> float:
        return float(self.in_flight if engine is None else self._in_flight(engine))

    def up_of(self, engine: int | None) -> float:
        return float(all(e.up for e in self.engines) if engine is None else self.engines[engine].up)

    def occupancy(self, ring: str, engine: int | None = None) -> float:
        """Slots in use in one engine's request or result ring, or summed over all."""
        if engine is None:
            return sum(self.occupancy(ring, i) for i in range(len(self.engines)))
        c = self._client(engine)
        if c is None:
            return 0.0
        return float((c.region.requests if ring == "request" else c.region.results).occupancy())

    def engine_health(self) -> list[dict[str, Any]]:
        """Each engine's line in /health."""
        return [{"device": d.label, "status": e.state, "in_flight": self._in_flight(i), "restarts": e.restarts,
                 **({"reason": e.reason} if e.reason else {})}
                for i, (d, e) in enumerate(zip(self.devices, self.engines, strict=True))]
