"""Weights mapped, not copied: `zlc compile --target cpu` writes native/<level>.weights (W and Q in
the native kernel's panel layout) and a session maps it read-only instead of laying the weights
out. Oracles: the reference executor (max abs 1e-4, equal greedy tokens), decode equals prefill,
and the session that copies (the same bytes, so bit-equal logits). A truncated or altered layout is
a one-line error; sessions of one process share one mapping; a second process adds no private copy
(its /proc/<pid>/smaps)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from native_helpers import PROMPT, Built, assert_matches, run_both

import zlc
from zlc import bundle as fmt
from zlc.codegen.native import find_compiler
from zlc.runtime.native import NativeBackend, NativeError, select_level

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")


def layout_of(b: Built) -> tuple[str, dict[str, Any]]:
    """(the level this host runs, its manifest `weights` entry)."""
    level = select_level(b.manifest["native"])
    entry = b.manifest["native"]["levels"][level].get("weights")
    assert entry is not None, "a --target cpu bundle holds the host level's layout"
    return level, entry


@pytest.mark.parametrize("dtype,quantize", [("fp32", None), ("bf16", None), ("fp32", "int4:q4_1")])
def test_mapped_session_matches_the_reference_and_the_copy(built: Callable[..., Built], dtype: str,
                                                           quantize: str | None) -> None:
    b = built("llama", dtype=dtype, quantize=quantize)
    _, entry = layout_of(b)
    # (W keeps one placeholder element when every matrix, the embedding table too, is packed)
    assert entry["w"]["bytes"] == max(b.manifest["weights"]["W"]["elements"], 1) * (2 if dtype == "bf16" else 4)
    assert entry["q"]["bytes"] == (b.manifest["weights"]["Q"]["bytes"] if quantize else 0)
    ref = zlc.load(b.path).session("reference")
    prompt = [(5 * i + 2) % b.vocab for i in range(9)]
    with b.session(threads=2) as s, b.session(threads=2, mapped=False) as copied:
        assert s.backend.weights is not None and copied.backend.weights is None
        assert_matches(run_both(s, ref, prompt, steps=4))
        # the copying session lays the weights out with the same code: bit-equal logits
        s.reset()
        _, mapped_lg = s.prefill(prompt, all_logits=True, want_logits=True)
        _, copied_lg = copied.prefill(prompt, all_logits=True, want_logits=True)
        assert mapped_lg is not None and np.array_equal(mapped_lg, copied_lg)
        # decode equals prefill on the mapped weights
        s.reset()
        s.prefill(prompt[:4])
        for i, t in enumerate(prompt[4:]):
            _, lg = s.step(t, want_logits=True)
            assert lg is not None and np.abs(lg[0] - mapped_lg[4 + i]).max() <= 1e-4


def test_sessions_of_one_process_share_one_mapping(built: Callable[..., Built]) -> None:
    b = built("llama")
    one = NativeBackend(b.path, b.manifest, threads=2)
    two = NativeBackend(b.path, b.manifest, threads=1)
    assert one.weights is two.weights and one.weights is not None
    address = one.weights.address
    tok_one, _ = one.launch(0, PROMPT, 0, False, False)
    one.close()  # the other session still reads the mapping
    tok_two, _ = two.launch(0, PROMPT, 0, False, False)
    assert tok_one == tok_two
    three = NativeBackend(b.path, b.manifest, threads=1)
    assert three.weights is two.weights and three.weights.address == address
    two.close()
    three.close()


def test_a_level_without_a_layout_copies(built: Callable[..., Built]) -> None:
    """Only the host's best level gets a layout (each costs W + Q bytes); another level lays the
    weights out at session start, and asking it for the mapped layout is a one-line error."""
    b = built("llama")
    level, _ = layout_of(b)
    others = [n for n, info in b.manifest["native"]["levels"].items()
              if n != level and set(info["requires"]) <= set(b.manifest["native"]["levels"][level]["requires"])]
    if not others:
        pytest.skip("this host runs one ISA level only")
    with pytest.raises(NativeError, match=f"no mapped weight layout for {others[0]}"):
        NativeBackend(b.path, b.manifest, level=others[0], mapped=True)
    ref = zlc.load(b.path).session("reference")
    with b.session(threads=2, level=others[0]) as s:
        assert s.backend.weights is None
        assert_matches(run_both(s, ref, PROMPT, steps=2))


@pytest.fixture
def copy_of(built: Callable[..., Built], tmp_path: Path) -> Callable[..., tuple[Path, Path]]:
    def make(**kw: Any) -> tuple[Path, Path]:
        b = built("llama", **kw)
        dst = tmp_path / "copy.zlc"
        shutil.copytree(b.path, dst)
        _, entry = layout_of(b)
        return dst, dst / entry["file"]
    return make


def one_line(e: pytest.ExceptionInfo[BaseException]) -> str:
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_a_truncated_layout_is_a_one_line_error(copy_of: Callable[..., tuple[Path, Path]]) -> None:
    path, layout = copy_of()
    man = fmt.read_manifest(path)
    with open(layout, "r+b") as f:
        f.truncate(layout.stat().st_size - 4096)
    with pytest.raises(fmt.BundleError) as e:  # the load's size check
        zlc.load(path)
    assert layout.name in one_line(e) and "truncated" in one_line(e)
    with pytest.raises(NativeError) as e2:  # a session given the manifest without the load's check
        NativeBackend(path, man, threads=1)
    assert "truncated" in one_line(e2)


def test_an_altered_layout_is_a_one_line_error(copy_of: Callable[..., tuple[Path, Path]],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A large file is checked at load by its sampled sha256: a change in a sampled block (the first
    and the last are always sampled) fails the load; a change between the samples passes the quick
    check and fails the full one (`full_check=True`, `zlc inspect`). The tiny layout is under
    WHOLE_LIMIT, so the limit (and the samples' size) is lowered to give it samples with gaps
    between them, as SmolLM2's has."""
    path, layout = copy_of()
    monkeypatch.setattr(fmt, "WHOLE_LIMIT", 1 << 16)
    monkeypatch.setattr(fmt, "SAMPLE_BYTES", 1 << 10)
    man = fmt.read_manifest(path)
    fmt.write_manifest(path, {k: v for k, v in man.items() if k not in ("files", "file_bytes", "file_samples")})
    rel = layout.relative_to(path).as_posix()
    assert rel in fmt.read_manifest(path)["file_samples"]
    zlc.load(path)
    size = layout.stat().st_size
    between = (size - fmt.SAMPLE_BYTES) // (fmt.SAMPLES - 1) - 1  # the byte before the second sample
    assert between >= fmt.SAMPLE_BYTES  # a gap after the first sample

    def flip(at: int) -> None:
        with open(layout, "r+b") as f:
            f.seek(at)
            b = f.read(1)
            f.seek(at)
            f.write(bytes([b[0] ^ 0xFF]))

    flip(between)
    zlc.load(path)  # the quick check does not read this byte ...
    with pytest.raises(fmt.BundleError) as e:  # ... the full one does
        zlc.load(path, full_check=True)
    assert rel in one_line(e) and "sha256" in one_line(e)
    flip(between)
    flip(size - 1)
    with pytest.raises(fmt.BundleError) as e:
        zlc.load(path)
    assert rel in one_line(e) and "sampled sha256" in one_line(e)


CHILD = textwrap.dedent("""
    import sys
    from zlc.runtime.loader import load
    b = load(sys.argv[1])
    s = b.session("cpu", threads=1)
    s.prefill([1, 2, 3])
    print("ready", flush=True)
    sys.stdin.readline()
    s.close()
""")


def smaps_of(pid: int, path: Path) -> dict[str, int]:
    """The kB fields of the mapping of `path` in /proc/<pid>/smaps, summed over its entries."""
    out: dict[str, int] = {}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            inside = line.rstrip().endswith(str(path))
        elif inside and len(head) >= 2 and head[0].endswith(":") and head[-1] == "kB":
            out[head[0][:-1]] = out.get(head[0][:-1], 0) + int(head[1])
    return out


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux /proc/<pid>/smaps")
def test_a_second_process_adds_no_private_copy(built: Callable[..., Built]) -> None:
    """Two processes on one bundle (this one and a child), each with a session that ran a prefill:
    the child's mapping of the layout is file pages shared with this process (Shared_* is all of
    its Rss, Pss is half of it), no anonymous or private page."""
    b = built("llama")
    _, entry = layout_of(b)
    layout = (b.path / entry["file"]).resolve()
    with b.session(threads=1) as mine:
        mine.prefill([1, 2, 3])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        child = subprocess.Popen([sys.executable, "-c", CHILD, str(b.path)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            theirs = smaps_of(child.pid, layout)
            ours = smaps_of(os.getpid(), layout)
        finally:
            assert child.stdin is not None
            child.stdin.write("\n")
            child.stdin.flush()
            child.wait(timeout=60)
    size_kb = (entry["bytes"] + 4095) // 4096 * 4
    for m in (theirs, ours):
        assert m["Size"] >= size_kb and m["Rss"] == size_kb  # every page is mapped (MAP_POPULATE)
        assert m["Anonymous"] == 0 and m["Private_Dirty"] == 0 and m["Private_Clean"] == 0
        # shared page-cache pages (Shared_Dirty while a freshly written file awaits writeback)
        assert m["Shared_Clean"] + m["Shared_Dirty"] == m["Rss"] and m["Pss"] <= m["Rss"] // 2 + 4, f"{theirs} {ours}"
