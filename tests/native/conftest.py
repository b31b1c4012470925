"""Fixtures for the native CPU kernel's tests: zoo bundles compiled once per session (helpers in
native_helpers.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from native_helpers import MODELS, Built


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Built]:
    """`built(name, max_seq=64, dtype="fp32")`: the zoo model compiled for the CPU (cached)."""
    pytest.importorskip("transformers", reason="the zoo's exports need the 'hf' extra")
    import zlc
    from zlc.testing import zoo

    cache: dict[tuple[str, int, str], Built] = {}

    def get(name: str, max_seq: int = 64, dtype: str = "fp32") -> Built:
        key = (name, max_seq, dtype)
        if key not in cache:
            src = zoo.cached(*MODELS[name])  # type: ignore[arg-type]
            out = tmp_path_factory.mktemp("native") / f"{name}-{max_seq}-{dtype}.zlc"
            zlc.compile(src, targets=["cpu"], out=out, max_seq=max_seq, dtype=dtype, verify=False)
            cache[key] = Built(out, zlc.lower(src, options=zlc.CompileOptions(max_seq=max_seq)))
        return cache[key]

    return get
