"""Socket, process and client helpers shared by the serve tests (a module, not a conftest: plain
functions; the fixtures are in conftest.py)."""

from __future__ import annotations

import glob
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """True if the peer closes `sock` within `seconds` (whatever it sends before is dropped)."""
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(65536):
                return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return False


def engine_pid(server: Any) -> int:
    """The pid of the server's engine process (a child of the ingress, started from a thread)."""
    for children in glob.glob(f"/proc/{server.proc.pid}/task/*/children"):
        for pid in open(children).read().split():
            try:
                cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
            except FileNotFoundError:
                continue
            if b"zlc.runtime.serve.engine.loop" in cmdline:
                return int(pid)
    raise AssertionError("the server has no engine process")


def process_state(pid: int) -> str | None:
    """The state letter of a process (R, S, T, Z...), None if it is gone (reaped)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def get(server: Any, path: str, headers: dict[str, str] | None = None, timeout: float = 10.0) -> tuple[int, Any]:
    """(status, body: parsed JSON when it is JSON) of GET `path`."""
    req = urllib.request.Request(server.base_url + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, body, ctype = r.status, r.read(), r.headers.get("content-type", "")
    except urllib.error.HTTPError as e:
        status, body, ctype = e.code, e.read(), e.headers.get("content-type", "")
    return status, json.loads(body) if ctype.startswith("application/json") else body.decode()


def health(server: Any) -> tuple[int, dict[str, Any]]:
    status, body = get(server, "/health")
    return status, dict(body)


def wait_for(what: str, cond: Callable[[], bool], timeout: float = 120.0, every: float = 0.05) -> None:
    """Polls `cond` until it holds; AssertionError naming `what` after `timeout` (a bound on hangs,
    not a speed requirement)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(every)


def metric(server: Any, name: str, headers: dict[str, str] | None = None, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`, from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    status, text = get(server, "/metrics", headers)
    assert status == 200, (status, text)
    return sum(s.value for f in text_string_to_metric_families(str(text)) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def openai_client(server: Any, key: str = "k", timeout: float = 120.0) -> Any:
    """The official OpenAI SDK against `server` (no retries: a refused request must fail the test)."""
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def anthropic_client(server: Any, key: str = "k", timeout: float = 120.0) -> Any:
    """The official Anthropic SDK against `server` (no retries)."""
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=timeout)


def sdk_clients(server: Any, key: str = "k", timeout: float = 120.0) -> tuple[Any, Any]:
    """(anthropic, openai) clients of `server`."""
    return anthropic_client(server, key, timeout), openai_client(server, key, timeout)


def serve_refused(bundle: Path, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """`zlc serve BUNDLE --port 0 ARGS` expected to refuse its options and exit (no listening line to
    wait for): the finished process, stdout and stderr as text."""
    return subprocess.run([sys.executable, "-m", "zlc.cli", "serve", str(bundle), "--port", "0", *args],
                          capture_output=True, text=True, timeout=timeout)
