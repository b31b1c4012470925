"""The interpret executor takes each kernel through Triton's compiler frontend before it runs it
(runtime/triton_frontend.py): a kernel the interpreter would run but no GPU could build is refused
in one line. The control is issue 37's regression itself: the windowed prefill kernel rebinding
an int32 to an int64 inside a constexpr feature branch, which the interpreter ran for days."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")
pytest.importorskip("triton")

import zlc  # noqa: E402
from zlc import bundle as fmt  # noqa: E402
from zlc.errors import ZlcError  # noqa: E402
from zlc.runtime.triton_frontend import KernelFrontendError, check_kernel  # noqa: E402
from zlc.testing import zoo  # noqa: E402

FIXED = "k_lo = tl.maximum(k_lo, pos - window.to(tl.int32) + 1)"
REGRESSION = "k_lo = tl.maximum(k_lo, pos - window + 1)"


@pytest.fixture(scope="module")
def windowed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("frontend") / "mistral_win.zlc"
    zlc.compile(zoo.cached("stateless", "mistral_win", 20), targets=["cpu"], out=out, max_seq=64, verify=False)
    return out


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty marker cache, so the check really runs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("ZLC_TRITON_FRONTEND", raising=False)
    return tmp_path / "cache" / "zlc" / "frontend"


def _check(bundle: Path, source: Path) -> None:
    man = fmt.read_manifest(bundle)
    tl = man["tilings"]["cpu"]
    check_kernel(source, man["kernel"]["entry"], man["kernel"]["signature"], dict(tl["constexprs"], DEBUG=0),
                 [fmt.MODE_PREFILL, fmt.MODE_DECODE])


def test_the_windowed_kernel_passes_and_is_remembered(windowed: Path, fresh_cache: Path) -> None:
    src = windowed / "kernel.py"
    assert FIXED in src.read_text()
    _check(windowed, src)
    markers = sorted(p.name for p in fresh_cache.iterdir())
    assert len(markers) == 2  # one per launch kind
    _check(windowed, src)  # remembered: nothing new checked or written
    assert sorted(p.name for p in fresh_cache.iterdir()) == markers


def test_the_window_regression_is_refused_before_it_runs(windowed: Path, fresh_cache: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.zlc"
    shutil.copytree(windowed, bad)
    text = (bad / "kernel.py").read_text().replace(FIXED, REGRESSION)
    assert REGRESSION in text
    fmt.add_files(bad, {"kernel.py": text.encode()})
    with pytest.raises(KernelFrontendError, match=r"k_lo.*int32.*int64"):
        _check(bad, bad / "kernel.py")
    # through the executor as a user runs it: one error, before any launch
    with pytest.raises(ZlcError, match=r"Triton's compiler rejects kernel\.py \(STEP=0\).*k_lo"):
        zlc.load(bad).session("interpret")
    assert not fresh_cache.exists() or not any(fresh_cache.iterdir())  # nothing remembered as good
