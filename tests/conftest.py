"""Fixtures shared across the test tree: the bundled example's tiny model, exported once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_onnx() -> Path:
    """The example's random-weight tiny Llama (2 layers, vocab 256) as a stateless opset-20 ONNX
    file, from the zoo's cache ($ZLC_CACHE_DIR; exported on first use, ~45 s). Read-only."""
    pytest.importorskip("transformers", reason="exporting the tiny model needs the 'hf' extra")
    from zlc import zoo

    return zoo.cached("stateless", "llama", 20)


@pytest.fixture(scope="session")
def tiny_lowered(tiny_onnx: Path) -> Any:
    """The tiny model through the whole pipeline (read-only: tests must not mutate it)."""
    import zlc

    return zlc.lower(tiny_onnx, options=zlc.CompileOptions(max_seq=64))
