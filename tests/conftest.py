"""Fixtures shared across the test tree: the bundled example's tiny model, exported once; the tiny chat
model and `zlc serve` processes for the serving and deployment tests."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_onnx() -> Path:
    """The example's random-weight tiny Llama (2 layers, vocab 256) as a stateless opset-20 ONNX
    file, from the zoo's cache ($ZLC_CACHE_DIR; exported on first use, ~45 s). Read-only."""
    pytest.importorskip("transformers", reason="exporting the tiny model needs the 'hf' extra")
    from zlc.testing import zoo

    return zoo.cached("stateless", "llama", 20)


@pytest.fixture(scope="session")
def tiny_lowered(tiny_onnx: Path) -> Any:
    """The tiny model through the whole pipeline (read-only: tests must not mutate it)."""
    import zlc

    return zlc.lower(tiny_onnx, options=zlc.CompileOptions(max_seq=64))


# --------------------------------------------------------------------------------------------------
# zlc serve: the tiny chat model and real server processes (tests/serve, tests/deploy)

MODEL = "llama-chat"


@pytest.fixture(scope="session")
def chat_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers", reason="exporting the tiny model needs the 'hf' extra")
    import zlc
    from zlc.testing import zoo

    onnx_path = zoo.cached("stateless", "llama-chat", 20)
    root = tmp_path_factory.mktemp("serve")
    tok = zoo.save_chat_tokenizer(root / "tokenizer")
    out = root / "llama-chat.zlc"
    zlc.compile(onnx_path, targets=["cpu"], out=out, max_seq=128, tokenizer=tok, name=MODEL)
    return out


class ServerProcess:
    """`zlc serve BUNDLE --port 0 ...` in a subprocess; ports from its "listening" line."""

    def __init__(self, bundle: Path, *args: str, startup_s: float = 120.0, prefix: tuple[str, ...] = (),
                 ports: tuple[str, ...] = ("--port", "0", "--frame-port", "0", "--udp-port", "0")):
        """`prefix` runs it under another command (e.g. `ip netns exec NS`); `ports` replaces the
        default free-port options."""
        cmd = [*prefix, sys.executable, "-m", "zlc.cli", "serve", str(bundle), *ports, *args]
        # stderr to a file, not a pipe: a server logging more than a pipe holds must not block
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, start_new_session=True)
        self.info = self._wait_listening(startup_s)
        self.host, self.port = self.info["http"]
        self.frame_port = self.info.get("frames_tcp", [None, None])[1]
        self.udp_port = self.info.get("frames_udp", [None, None])[1]
        self.base_url = f"http://{self.host}:{self.port}"

    def _wait_listening(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, left))
            if not ready:
                self.stop()
                raise TimeoutError(f"zlc serve did not start in {timeout_s} s")
            chunk = os.read(self.proc.stdout.fileno(), 4096)
            if not chunk:
                self.proc.wait(10)
                raise RuntimeError(f"zlc serve exited: {self._read_stderr()}")
            line += chunk
        return dict(json.loads(line))

    def rss_kib(self) -> int:
        """Resident memory of the server process (ingress), from /proc."""
        for row in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if row.startswith("VmRSS:"):
                return int(row.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self) -> str:
        """SIGTERM, wait, and return what it wrote to stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self._read_stderr()

    def _read_stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")


@pytest.fixture
def start_server(chat_bundle: Path) -> Iterator[Any]:
    """A factory: start_server(*zlc_serve_args) -> ServerProcess, stopped after the test."""
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        s = ServerProcess(chat_bundle, *args)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def server_process() -> type[ServerProcess]:
    """The ServerProcess class, for tests that manage a server's lifetime themselves."""
    return ServerProcess
