"""The runtime-only install (`pip install zlc`, no extras): the wheel built from this tree, installed
alone into a fresh venv (its dependencies as pip resolves them, through the lock), serves a bundle
compiled by the full install through the Anthropic and OpenAI APIs (their official SDKs as the
clients), with neither torch, Triton, ONNX nor ONNX Runtime installed and no C compiler on PATH (the
native kernel is the bundle's prebuilt library); `zlc compile` there is one line naming the extra.
Prints the installed size (site-packages without bytecode). ~1.5 min on 2 cores: slow."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / ".ci" / "constraints.txt"
MODEL = "llama-chat"
PROMPT = "Hello there"
HEAVY = ("torch", "triton", "onnx", "onnxruntime", "onnx-ir", "gguf", "transformers", "safetensors")


def _pip(venv: Path, *args: str) -> None:
    """The test venv's pip drives the new venv (--python): the new one needs no pip of its own."""
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--quiet",
                    "--disable-pip-version-check", "--no-compile", *args], check=True, timeout=900)


def _lock_args() -> list[str]:
    """The lock as constraints, as .ci/setup-venv uses it: only for the interpreter it was resolved for."""
    want = next((ln.removeprefix("# resolved for: ") for ln in LOCK.read_text().splitlines()
                 if ln.startswith("# resolved for: ")), None)
    have = subprocess.run([sys.executable, str(ROOT / ".ci" / "interpreter.py")], capture_output=True,
                          text=True, check=True).stdout.strip()
    return ["-c", str(LOCK)] if want == have else []


@pytest.fixture(scope="module")
def slim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel of this tree and only its base dependencies."""
    d = tmp_path_factory.mktemp("slim")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--disable-pip-version-check", "--no-deps",
                    str(ROOT), "-w", str(d / "wheel")], check=True, timeout=600, capture_output=True)
    wheel = next((d / "wheel").glob("zlc-*.whl"))
    venv = d / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    _pip(venv, *_lock_args(), str(wheel))
    return venv


def _site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def _slim_env(venv: Path) -> dict[str, str]:
    """Only the venv on PATH (no cc, gcc or clang), no PYTHONPATH into the test venv."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = str(venv / "bin")
    return env


def _zlc(venv: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "zlc"), *args], capture_output=True, text=True, timeout=300,
                          env=_slim_env(venv))


def test_installs_no_compiler_packages(slim: Path) -> None:
    code = "import importlib.metadata as m; print('\\n'.join(sorted(d.metadata['Name'].lower() for d in m.distributions())))"
    names = set(subprocess.run([str(slim / "bin" / "python"), "-c", code], capture_output=True, text=True,
                               check=True, env=_slim_env(slim)).stdout.split())
    assert "zlc" in names and "numpy" in names
    assert not names & set(HEAVY), sorted(names & set(HEAVY))
    site = _site_packages(slim)
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file() and "__pycache__" not in f.parts)
    print(f"\nruntime-only install: {len(names)} distributions, {size / 1e6:.1f} MB in {site} (no bytecode)")
    assert size < 250e6, f"{size / 1e6:.0f} MB: a heavy package came in ({sorted(names)})"


def test_compiler_commands_say_which_extra(slim: Path, tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    model.write_bytes(b"\0")
    for args in (["compile", str(model), "-o", str(tmp_path / "m.zlc")], ["verify", str(model)]):
        r = _zlc(slim, *args)
        assert r.returncode == 1, r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
        assert f"zlc {args[0]} needs the compiler: pip install 'zlc[compile]'" in r.stderr


class _Server:
    """`zlc serve BUNDLE --port 0` from the slim venv; the port from its "listening" line."""

    def __init__(self, venv: Path, bundle: Path):
        self.proc = subprocess.Popen([str(venv / "bin" / "zlc"), "serve", str(bundle), "--port", "0",
                                      "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=_slim_env(venv), start_new_session=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else b""
        if not line:
            self.stop()
            raise RuntimeError(f"zlc serve did not start: {self.stderr}")
        host, port = json.loads(line)["http"]
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read().decode(errors="replace")


@pytest.fixture(scope="module")
def served(slim: Path, chat_bundle: Path) -> Iterator[_Server]:
    s = _Server(slim, chat_bundle)
    yield s
    s.stop()
    assert "Traceback" not in s.stderr, s.stderr


@pytest.fixture(scope="module")
def reference(slim: Path, chat_bundle: Path) -> dict[str, Any]:
    """`zlc run`'s greedy reply in the slim venv (`zlc inspect BUNDLE` checks the bundle there first)."""
    r = _zlc(slim, "inspect", str(chat_bundle))
    assert r.returncode == 0 and "checksums:" in r.stdout, r.stderr
    r = _zlc(slim, "run", str(chat_bundle), "--prompt", PROMPT, "--max-new-tokens", "12", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_serves_both_apis_without_the_compiler(served: _Server, reference: dict[str, Any]) -> None:
    a = anthropic.Anthropic(base_url=served.url, api_key="k", max_retries=0, timeout=60)
    o = openai.OpenAI(base_url=served.url + "/v1", api_key="k", max_retries=0, timeout=60)
    msgs: Any = [{"role": "user", "content": PROMPT}]
    m = a.messages.create(model=MODEL, max_tokens=12, messages=msgs)
    assert m.content[0].text == reference["text"]  # type: ignore[union-attr]
    assert m.usage.output_tokens == len(reference["generated"])
    r = o.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=msgs)
    assert r.choices[0].message.content == reference["text"]
    # sampling (the OpenAI API's default temperature 1) runs on numpy: a seed gives one reply
    sampled = [o.chat.completions.create(model=MODEL, max_tokens=8, seed=5, top_p=0.9, extra_body={"top_k": 20},
                                         messages=msgs).choices[0].message.content for _ in range(2)]
    assert sampled[0] == sampled[1] and sampled[0]
    with a.messages.stream(model=MODEL, max_tokens=12, messages=msgs) as s:
        assert "".join(s.text_stream) == reference["text"]
