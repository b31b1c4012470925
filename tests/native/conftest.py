"""Fixtures for the native CPU kernel's tests: zoo bundles compiled once per session (helpers in
native_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from native_helpers import MODELS, Alone, Built, tsan_build


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Built]:
    """`built(name, max_seq=64, dtype="fp32", quantize=None)`: the zoo model compiled for the CPU
    (cached); `quantize` as `zlc compile --quantize` (the lowered model is then the unquantized one)."""
    pytest.importorskip("transformers", reason="the zoo's exports need the 'hf' extra")
    import zlc
    from zlc.testing import zoo

    cache: dict[tuple[str, int, str, str | None], Built] = {}

    def get(name: str, max_seq: int = 64, dtype: str = "fp32", quantize: str | None = None) -> Built:
        key = (name, max_seq, dtype, quantize)
        if key not in cache:
            src = zoo.cached(*MODELS[name])  # type: ignore[arg-type]
            q = "" if quantize is None else "-" + quantize.replace(":", "-")
            out = tmp_path_factory.mktemp("native") / f"{name}-{max_seq}-{dtype}{q}.zlc"
            zlc.compile(src, targets=["cpu"], out=out, max_seq=max_seq, dtype=dtype, verify=False, quantize=quantize)
            cache[key] = Built(out, zlc.lower(src, options=zlc.CompileOptions(max_seq=max_seq)))
        return cache[key]

    return get


@pytest.fixture(scope="session")
def tsan(built: Callable[..., Built], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a ThreadSanitizer build of the tiny Llama's C kernel, gcc's libtsan.so to preload), built
    with gcc once per session (test_native_threads.py, test_native_batch.py)."""
    lib = tmp_path_factory.mktemp("tsan") / "megakernel-tsan.so"
    rt = tsan_build(built("llama"), lib)
    return lib, rt


@pytest.fixture
def llama(built: Callable[..., Built]) -> Iterator[tuple[Built, Alone]]:
    """The tiny Llama and its oracle, each request run alone (test_native_batch, test_native_prefix_cache)."""
    b = built("llama")
    alone = Alone(b)
    yield b, alone
    alone.close()
