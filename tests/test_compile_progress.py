"""`zlc compile`'s progress: bars inside the long stages on a terminal (rich's Console forced to
one, and the real command in a pseudo-terminal), none under --json or when stdout is a pipe."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner
from rich.console import Console

from zlc.cli import cli
from zlc.cli.compile import CompileProgress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def test_bars_on_a_terminal_console() -> None:
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=100, color_system=None)
    with CompileProgress(console=con, live=True) as p:
        p.begin("weights")
        p("weights", "bf16 arenas")
        p.count("weights packed", 7, 20)
        assert p.bars is not None
        p.bars.refresh()
        p.begin("native")
        p.count("libraries and cubins built", 1, 5)
        p.bars.refresh()
        p.done()
    text = ANSI.sub("", buf.getvalue())
    assert re.search(r"weights: bf16 arenas", text)
    assert re.search(r"weights packed\s.*7/20", text) and re.search(r"libraries and cubins built\s.*1/5", text)
    assert re.search(r"✓ weights\s+\d+\.\d\d s", text) and re.search(r"✓ native\s+\d+\.\d\d s", text)


def test_no_bars_when_not_live() -> None:
    buf = io.StringIO()
    con = Console(file=buf, force_terminal=True, width=100, color_system=None)
    with CompileProgress(console=con, live=False) as p:
        p.begin("weights")
        p.count("weights packed", 7, 20)
        p.done()
    text = ANSI.sub("", buf.getvalue())
    assert "weights packed" not in text and "✓ weights" in text


def _run_in_pty(cmd: list[str], timeout: float) -> tuple[int, str]:
    """Runs `cmd` with stdin, stdout and stderr on a new pseudo-terminal; (exit code, output)."""
    main, sub = pty.openpty()
    env = {**os.environ, "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen(cmd, stdin=sub, stdout=sub, stderr=sub, env=env, close_fds=True)
    os.close(sub)
    out = bytearray()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([main], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal closed: the process exited
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    if proc.poll() is None:
        proc.kill()
    rc = proc.wait()
    os.close(main)
    return rc, ANSI.sub("", out.decode(errors="replace"))


def test_compile_in_a_pseudo_terminal_shows_bars_and_a_pipe_does_not(tiny_onnx: Path, tmp_path: Path) -> None:
    args = ["compile", str(tiny_onnx), "--max-seq", "64", "--skip-verify"]
    rc, text = _run_in_pty([sys.executable, "-m", "zlc.cli", *args, "-o", str(tmp_path / "tty.zlc")], 600)
    assert rc == 0, text
    assert re.search(r"lowering passes\s.*\d+/\d+", text), text  # the lowering's bar (seconds long)
    assert "✓ lower" in text and "✓ manifest" in text
    for flag in ((), ("--json",)):  # CliRunner: stdout is not a terminal
        r = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / f"pipe{len(flag)}.zlc"), *flag])
        assert r.exit_code == 0, r.output
        assert "lowering passes" not in r.output and "✓ lower" in r.output
