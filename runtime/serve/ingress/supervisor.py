"""Engine supervision: the ingress keeps its engine process alive, or exits so that systemd or
Kubernetes replace the whole server.

    up ──exit / no progress past the step deadline──▶ restarting ──started──▶ up
                                                         │ N failures in the window
                                                         ▼
                                                       failed: on_give_up (the server exits 1)

- **Lost engine.** When the engine exits (its pidfd becomes readable; it is reaped at once) or
  makes no progress for ``step_deadline_s`` while something is owed to a client, every request
  in flight ends at once with an error result (``EngineError.UNAVAILABLE``: the API's error event
  or body, an ERROR frame): nothing is cut silently. A hung engine is killed (SIGKILL to its
  process group, which also ends a stopped one). Until a new engine is up, the server answers 503
  and /health says so.
- **Hang detection.** The deadline runs from the oldest thing owed (a request, or the PING an idle
  engine is sent every few seconds) and restarts with every result: a step that takes longer than
  the deadline is a hang. It is per executor (DEFAULT_STEP_DEADLINE_S), generous for the
  interpreter, whose steps take seconds.
- **Restarts** start a new engine (new rings, the executor loaded again) after a backoff that
  doubles with each recent failure. Exits, hangs and failed starts all count as failures; ``limit``
  of them within ``window_s`` and the supervisor gives up (like systemd's StartLimitBurst).
"""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from zlc.errors import ZlcError

from ..protocol import EngineError
from .engine_client import EngineClient

# Seconds one engine step (a prefill or a token) may take before the engine counts as hung: a GPU
# step that takes half a minute is stuck; on CPU cores a big model's long prefill can take minutes,
# and Triton's interpreter takes seconds a token even on a small model.
DEFAULT_STEP_DEADLINE_S = {"cuda": 30.0, "cpu": 300.0, "reference": 300.0, "interpret": 600.0}


def step_deadline_s(device: str) -> float:
    """The default deadline of a (resolved) device name."""
    return DEFAULT_STEP_DEADLINE_S.get(device, 300.0)


MAX_PING_INTERVAL_S = 5.0


@dataclass
class RestartPolicy:
    limit: int = 5  # failures (exits, hangs, failed starts) within window_s before giving up
    window_s: float = 60.0
    backoff_s: float = 0.5  # the first restart's delay; doubles with each failure in the window
    max_backoff_s: float = 10.0


def _log(msg: str, name: str | None = None) -> None:
    print(f"zlc serve: {f'[{name}] ' if name else ''}{msg}", file=sys.stderr, flush=True)


class EngineSupervisor:
    """One engine kept alive: its current client (``live``), replaced when it is lost. It carries
    no requests itself: they pass through pool.py to the live client. ``up`` says whether
    requests can be submitted now; ``reason`` why not."""

    def __init__(self, make_client: Callable[[], EngineClient], *, step_deadline_s: float,
                 policy: RestartPolicy | None = None, on_give_up: Callable[[str], None] = lambda why: None,
                 on_restart: Callable[[str], None] = lambda kind: None, name: str | None = None):
        """`name`: the engine's device, in its log lines, when the server runs several."""
        self.make_client = make_client
        self.name = name
        self.step_deadline_s = step_deadline_s
        self.policy = policy or RestartPolicy()
        self.on_give_up, self.on_restart = on_give_up, on_restart
        self.client: EngineClient | None = None
        self.state = "starting"  # starting | up | restarting | stopped | failed
        self.reason = "the engine is starting"
        self.restart_enabled = True
        self.restarts = 0
        self.max_prompt_tokens = 0
        self._failures: collections.deque[float] = collections.deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task[None] | None = None
        self._starting = False  # _replace is waiting for a new engine to load
        self.retry_at = 0.0  # monotonic time the next engine is expected (for Retry-After)

    # -- lifetime

    async def start(self) -> None:
        """The first engine; ZlcError if it does not start (the server does not start either)."""
        self._loop = asyncio.get_running_loop()
        client = self.make_client()
        await self._loop.run_in_executor(None, client.start)
        self._adopt(client)

    def _adopt(self, client: EngineClient) -> None:
        assert self._loop is not None
        client.attach(self._loop, lambda status: self._lost("exited", f"the engine exited (status {status})"))
        self.client = client
        self.max_prompt_tokens = client.region.requests.max_prompt_tokens
        self.state, self.reason = "up", ""
        self._arm()

    async def close(self) -> None:
        """Stops the engine for good (no restart); requests still in flight hear nothing more."""
        self.restart_enabled = False
        if self.state not in ("failed",):
            self.state = "stopped"
            self.reason = "the server is shutting down"
        self._disarm()
        if self._task is not None and not self._task.done():
            if self._starting:
                await self._task  # it closes the engine it is starting (restart_enabled is off)
            else:
                self._task.cancel()
        client, self.client = self.client, None
        if client is not None:
            client.detach()
            assert self._loop is not None
            await self._loop.run_in_executor(None, client.close)

    # -- what the pool reads (requests pass through pool.py, straight to the live client)

    @property
    def up(self) -> bool:
        return self.state == "up"

    @property
    def live(self) -> EngineClient | None:
        """The current engine's client while it can take requests and cancels (None when there
        is none: restarting, stopped, failed, or it has just exited)."""
        c = self.client
        return c if c is not None and c.usable else None

    def retry_after_s(self) -> int:
        """Seconds a client should wait before trying again (Retry-After)."""
        return max(1, int(self.retry_at - time.monotonic() + 0.999))

    # -- the watchdog

    def _arm(self) -> None:
        assert self._loop is not None
        tick = min(1.0, self.step_deadline_s / 4)
        self._timer = self._loop.call_later(tick, self._tick)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self) -> None:
        self._timer = None
        c = self.client
        if self.state != "up" or c is None:
            return
        now = time.monotonic()
        if c.owed_since is not None and now - c.owed_since > self.step_deadline_s:
            return self._lost("hung", f"the engine made no progress for {self.step_deadline_s:g} s "
                              "(--step-deadline)")
        if c.owed_since is None and now - c.last_progress >= min(MAX_PING_INTERVAL_S, self.step_deadline_s / 2):
            c.ping()
        self._arm()

    # -- losing and restarting the engine

    def _lost(self, kind: str, why: str) -> None:
        client = self.client
        if self.state != "up" or client is None:
            return
        self._disarm()
        self.state, self.reason = "restarting", why
        ended = client.fail_all(EngineError.UNAVAILABLE)
        if kind == "hung":
            client.kill()
        client.detach()
        self.client = None
        restart = self.restart_enabled
        _log(f"{why}{'; killed it' if kind == 'hung' else ''}; {ended} request(s) in flight ended with an error"
             + ("; restarting it" if restart else ""), self.name)
        if not restart:
            self.state = "stopped"
        else:
            self.on_restart(kind)
        assert self._loop is not None
        self._task = self._loop.create_task(self._replace(client, restart))

    def _failed_too_often(self, why: str) -> bool:
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and self._failures[0] < now - self.policy.window_s:
            self._failures.popleft()
        if len(self._failures) < self.policy.limit:
            return False
        self.state = "failed"
        self.reason = (f"the engine failed {len(self._failures)} times within {self.policy.window_s:g} s "
                       f"(last: {why})")
        _log(f"{self.reason}; giving up", self.name)
        self.on_give_up(self.reason)
        return True

    async def _replace(self, old: EngineClient, restart: bool) -> None:
        assert self._loop is not None
        await self._loop.run_in_executor(None, old.close, 1.0)  # reaps it (already, if it exited)
        why = self.reason
        while restart and self.restart_enabled:
            if self._failed_too_often(why):
                return
            p = self.policy
            delay = min(p.max_backoff_s, p.backoff_s * 2 ** (len(self._failures) - 1))
            self.retry_at = time.monotonic() + delay
            await asyncio.sleep(delay)
            if not self.restart_enabled:
                return
            client = self.make_client()
            self._starting = True
            try:
                await self._loop.run_in_executor(None, client.start)
            except (ZlcError, OSError) as e:
                client.close()  # (its rings and eventfds; the process is gone)
                why = f"the engine did not restart: {e}"
                _log(why, self.name)
                self.reason = why
                continue
            finally:
                self._starting = False
            if not self.restart_enabled:
                await self._loop.run_in_executor(None, client.close)
                return
            self.restarts += 1
            self._adopt(client)
            _log(f"the engine is back (restart {self.restarts})", self.name)
            return
