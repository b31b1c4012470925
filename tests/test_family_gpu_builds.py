"""The zoo's windowed families compile for a GPU target (a10: sm_86), decode and prefill kernels,
through `zlc compile` as a user runs it. The interpreter tests run these families' kernels, but the
interpreter is dynamically typed, and the windowed prefill kernel once failed Triton's compiler for
every GPU target while every interpreter test passed (issue 37). The every-feature kernel's sm_86
and sm_90 builds are tests/codegen/test_gpu_every_feature.py's. Slow: ~1-2 min a family on 2 cores."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")
pytest.importorskip("triton")

from zlc.testing import zoo  # noqa: E402

pytestmark = pytest.mark.slow

# Mistral and Qwen2 with a sliding window, Gemma 2 (window + both soft-caps) and Gemma 3 (window,
# q/k norms): every family whose kernel compiles the window in
FAMILIES = ["mistral_win", "qwen2_win", "gemma2", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_family_compiles_for_a10(family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bundle_checks import compile_bundle

    monkeypatch.setenv("ZLC_CC", "none")  # the GPU kernels only: no native CPU kernel for this test
    out = tmp_path / f"{family}.zlc"
    compile_bundle(zoo.cached("stateless", family, 20), out, "--target", "a10", "--max-seq", "64", "--skip-verify")
    man = json.loads((out / "manifest.json").read_text())
    assert "window" in man["kernel"]["features"]
    a10 = man["targets"]["a10"]
    for kernel in (a10, a10["prefill"]):  # the decode kernel's fields, then the prefill kernel's
        assert (out / kernel["cubin"]).read_bytes()[:4] == b"\x7fELF"
        assert kernel["resources"]["registers"] <= 255
