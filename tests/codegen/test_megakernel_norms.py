"""q/k norms and post-norms in the megakernel against the reference executor, logits of every
launch within 1e-4: Qwen3's per-head q/k norm, OLMo 2's whole-projection q/k norm and post-norms,
Gemma 2's and Gemma 3's sandwich norms (Gemma 3 with per-head q/k norm); the Triton kernel in the
interpreter on a tiling with the GPU's fusions (the cpu tiling runs in tests/test_family_norms.py's
bundle test), and the native C kernel. The bundles' greedy tokens against Hugging Face are in
tests/test_family_norms.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from megakernel_checks import assert_matches, gpu_like, run_both

from zlc import bundle as fmt
from zlc.codegen.validate import validate_program
from zlc.runtime.megakernel import MegakernelSession

pytest.importorskip("triton")
pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

MAX_SEQ = 64
FAMILIES = ["qwen3", "olmo2", "gemma2_nowin", "gemma3_nowin"]
PROMPT = [(11 * i + 5) % 256 for i in range(37)]  # decode at 37.. spans both KV splits of the fused tiling


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_norms_on_the_gpu_fusions_in_the_interpreter(family: str, built: Any, tmp_path: Path,
                                                     program_bundle: Any) -> None:
    """The Triton kernel on a tiling with the GPU's fusions (one block of 16 columns per Linear task,
    2 KV splits merged by the o projection, decode attention appending the step's normed, rotated
    key itself): every launch's logits within 1e-4 of the reference executor's."""
    b = built(family, MAX_SEQ)
    p = b.program(gpu_like(MAX_SEQ))
    validate_program(p)
    assert not any(x.op == fmt.OP_CACHE_APPEND for x in p.tables["decode"])  # attention appends
    post_norms = sum(x.op == fmt.OP_ROW_NORM for x in p.tables["decode"])
    assert post_norms == (0 if family == "qwen3" else 2 * 2)  # two per layer, one task each in decode
    path = program_bundle(b.path, tmp_path / f"{family}-fused.zlc", p)
    with b.session(path) as s:
        r = run_both(s, b.lowered, PROMPT, steps=3)
    assert_matches(r)


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_on_the_native_kernel(family: str, built: Any) -> None:
    """The bundle's C kernel (its native tiling): every launch's logits within 1e-4 of the reference
    executor's (Gemma's tiny models repeat one token, so their greedy tokens alone say little)."""
    pytest.importorskip("zlc.runtime.native")
    from zlc.runtime.native import NativeBackend

    b = built(family, MAX_SEQ)
    if "skipped" in b.manifest.get("native", {}):
        pytest.skip(f"no native kernel in the bundle: {b.manifest['native']['skipped']}")
    nb = NativeBackend(b.path, b.manifest)
    with MegakernelSession(nb, chunk=nb.chunk, max_seq=b.max_seq, vocab=b.vocab) as s:
        r = run_both(s, b.lowered, PROMPT, steps=3)
    assert_matches(r)
