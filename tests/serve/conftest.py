"""Fixtures for `zlc serve` tests: a tiny chat model (the zoo's "llama-chat": the tiny random Llama
with a 264-token vocabulary, plus a byte-level ChatML tokenizer) compiled once per session, and
`zlc serve` started as a real subprocess on free loopback ports."""

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

MODEL = "llama-chat"


@pytest.fixture(scope="session")
def chat_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers", reason="exporting the tiny model needs the 'hf' extra")
    import zlc
    from zlc import zoo

    onnx_path = zoo.cached("stateless", "llama-chat", 20)
    root = tmp_path_factory.mktemp("serve")
    tok = zoo.save_chat_tokenizer(root / "tokenizer")
    out = root / "llama-chat.zlc"
    zlc.compile(onnx_path, targets=["cpu"], out=out, max_seq=128, tokenizer=tok, name=MODEL)
    return out


class ServerProcess:
    """`zlc serve BUNDLE --port 0 ...` in a subprocess; ports from its "listening" line."""

    def __init__(self, bundle: Path, *args: str, startup_s: float = 120.0):
        cmd = [sys.executable, "-m", "zlc.cli", "serve", str(bundle), "--port", "0", "--frame-port", "0",
               "--udp-port", "0", *args]
        # stderr to a file, not a pipe: a server logging more than a pipe holds must not block
        self._stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._stderr, start_new_session=True)
        self.info = self._wait_listening(startup_s)
        self.host, self.port = self.info["http"]
        self.frame_port = self.info["frames_tcp"][1]
        self.udp_port = self.info["frames_udp"][1]
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


@pytest.fixture(scope="module")
def server(chat_bundle: Path) -> Iterator[ServerProcess]:
    """A server on the fast CPU executor (the bundle's IR with torch), shared by a test module."""
    s = ServerProcess(chat_bundle, "--device", "reference", "--request-timeout", "2")
    yield s
    s.stop()


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
