"""The server's engines: one EngineSupervisor per device (`--devices`; one without it), behind the
one interface the request paths (generate.py, frame_ingress.py) and the server use.

Each engine has its own process, rings, eventfds and supervisor: one that exits or hangs ends its
own requests with the error a lone engine's get and is restarted, while the others serve on. A
request goes to the engine router.py picks (least loaded, prefix affinity) among those that are
up; if that engine holds its capacity the next best is tried. Cancels go to the engine that
has the request. The server is "up" while any engine is; if one engine fails past the restart
limit the server gives up as a single-engine server does (the service manager restarts it whole).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from zlc.errors import ZlcError
from zlc.runtime.kv_manager import DEFAULT_PAGE_SIZE

from ..protocol import EngineError, ResultFlag
from ..rings import Request
from .devices import Device
from .engine_client import ResultHandler
from .router import HOWS, Load, PrefixRouter, page_keys
from .supervisor import EngineSupervisor

RESTART_KINDS = ("exited", "hung")
# Stats that are a moment's value per engine, not a sum: the total is the largest engine's.
_MAX_STATS = frozenset({"last_host_seconds", "last_backend_seconds"})


class _Routed:
    """A request's handler, seen through the pool: it keeps the engine's load account (queued
    prompt tokens until the first result; the route until the last)."""

    __slots__ = ("pool", "handler", "rid", "engine", "prompt", "waiting")

    def __init__(self, pool: EnginePool, handler: ResultHandler, rid: int, engine: int, prompt: int):
        self.pool, self.handler, self.rid, self.engine, self.prompt = pool, handler, rid, engine, prompt
        self.waiting = True  # no result yet: its prompt is still queued work of its engine

    def settle(self) -> None:
        if self.waiting:
            self.waiting = False
            self.pool.queued_tokens[self.engine] -= self.prompt

    def on_result(self, token: int, flags: int, t_ns: int, logprob: float = 0.0) -> None:
        self.settle()
        if flags & ResultFlag.LAST:
            self.pool.routes.pop(self.rid, None)
        self.handler.on_result(token, flags, t_ns, logprob)


class EnginePool:
    def __init__(self, devices: Sequence[Device], supervisors: Sequence[EngineSupervisor],
                 page_size: int = DEFAULT_PAGE_SIZE):
        """Each engine's capacity (the requests it holds: its batch and its queue) is its client's,
        which refuses more: an engine with that many in flight keeps no request by affinity."""
        assert len(devices) == len(supervisors) >= 1
        self.devices, self.engines = list(devices), list(supervisors)
        self.router = PrefixRouter(page_size)
        self.routes: dict[int, _Routed] = {}  # request id -> its engine, while in flight
        self.queued_tokens = [0] * len(self.engines)
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
        """Requests the engines take in flight together (each: --max-batch + --max-queue)."""
        return sum(e.capacity for e in self.engines)

    @property
    def max_prompt_tokens(self) -> int:
        return min(e.max_prompt_tokens for e in self.engines)

    # -- requests

    def new_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def loads(self) -> list[Load | None]:
        return [Load(e.in_flight, self.queued_tokens[i], e.restarts, e.held >= e.capacity)
                if e.up else None for i, e in enumerate(self.engines)]

    def submit(self, request: Request, handler: ResultHandler) -> bool:
        """Sends the request to its engine (router.py), or the next best when that one holds its
        capacity; False when no engine is up or every one holds its capacity."""
        if len(self.engines) == 1:  # nothing to choose: today's path, no wrapper on the token path
            return self.engines[0].submit(request, handler)
        loads = self.loads()
        if not any(ld is not None for ld in loads):
            return False
        keys = page_keys(request.tokens, self.router.page_size)
        route = self.router.choose(keys, loads)
        others = sorted((i for i, ld in enumerate(loads) if ld is not None and i != route.engine),
                        key=lambda i: (loads[i].in_flight, loads[i].queued_tokens, i))  # type: ignore[union-attr]
        for i, how in [(route.engine, route.how), *((i, "rebalanced") for i in others)]:
            if self._submit_to(i, request, handler, how):
                self.router.served(keys, i, self.engines[i].restarts)
                return True
        return False

    def _submit_to(self, engine: int, request: Request, handler: ResultHandler, how: str) -> bool:
        routed = _Routed(self, handler, request.request_id, engine, len(request.tokens))
        self.routes[request.request_id] = routed
        self.queued_tokens[engine] += routed.prompt
        if not self.engines[engine].submit(request, routed):  # not up, or it holds its capacity
            routed.settle()
            del self.routes[request.request_id]
            return False
        self.routed[engine][how] += 1
        return True

    def cancel(self, request_id: int) -> None:
        if len(self.engines) == 1:
            return self.engines[0].cancel(request_id)
        routed = self.routes.pop(request_id, None)
        if routed is not None:
            routed.settle()
            self.engines[routed.engine].cancel(request_id)

    def fail_all(self, code: int = EngineError.UNAVAILABLE) -> int:
        return sum(e.fail_all(code) for e in self.engines)

    @property
    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.engines)

    # -- numbers, for /metrics and error messages

    def engine_stat(self, name: str, engine: int | None = None) -> float:
        """An EngineStats counter of one engine, or over all (summed; the largest for last_*)."""
        if engine is not None:
            return self.engines[engine].engine_stat(name)
        values = [e.engine_stat(name) for e in self.engines]
        return max(values) if name in _MAX_STATS else sum(values)

    def kv_pages(self) -> int:
        """One engine's KV budget in pages (each engine has the --kv-pages budget of its own)."""
        return int(max(e.engine_stat("pages_total") for e in self.engines))

    def in_flight_of(self, engine: int | None) -> float:
        return float(self.in_flight if engine is None else self.engines[engine].in_flight)

    def up_of(self, engine: int | None) -> float:
        return float(all(e.up for e in self.engines) if engine is None else self.engines[engine].up)

    def occupancy(self, ring: str, engine: int | None = None) -> float:
        if engine is not None:
            return self.engines[engine].occupancy(ring)
        return sum(e.occupancy(ring) for e in self.engines)

    def engine_health(self) -> list[dict[str, Any]]:
        """Each engine's line in /health."""
        return [{"device": d.label, "status": e.state, "in_flight": e.in_flight, "restarts": e.restarts,
                 **({"reason": e.reason} if e.reason else {})} for d, e in zip(self.devices, self.engines, strict=True)]
