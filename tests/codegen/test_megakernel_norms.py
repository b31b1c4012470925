"""q/k norms and post-norms in the megakernel against the reference executor, logits of every
launch within 1e-4: Qwen3's per-head q/k norm, OLMo 2's whole-projection q/k norm and post-norms,
Gemma 2's and Gemma 3's sandwich norms (Gemma 3 with per-head q/k norm); the Triton kernel in the
interpreter on a tiling with the GPU's fusions (the cpu tiling runs in tests/test_family_norms.py's
bundle test), and the native C kernel. The bundles' greedy tokens against Hugging Face are in
tests/test_family_norms.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zlc
from zlc import bundle as fmt
from zlc.codegen.schedule import schedule, tiling_for
from zlc.codegen.validate import validate_program
from zlc.reference.session import ReferenceSession
from zlc.runtime.interpret import InterpretBackend
from zlc.runtime.megakernel import MegakernelSession
from zlc.targets import get_target

pytest.importorskip("triton")
pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

from zlc.testing import zoo  # noqa: E402

ATOL = 1e-4
MAX_SEQ = 64


def _run_both(s: MegakernelSession, lowered: Any, prompt: list[int], steps: int) -> tuple[list[float], list[int], list[int]]:
    ref = ReferenceSession.from_lowered(lowered)
    tok, lg = s.prefill(prompt, all_logits=True, want_logits=True)
    want = ref.prefill(prompt).numpy()
    assert lg is not None and lg.shape == want.shape
    errs, got, exp = [float(np.abs(lg - want).max())], [tok], [int(want[-1].argmax())]
    for _ in range(steps):
        tok, lg = s.step(exp[-1], want_logits=True)
        want = ref.step(exp[-1]).numpy()
        assert lg is not None
        errs.append(float(np.abs(lg[0] - want).max()))
        got.append(tok)
        exp.append(int(want.argmax()))
    return errs, got, exp


FAMILIES = ["qwen3", "olmo2", "gemma2_nowin", "gemma3_nowin"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[str, tuple[Path, Any]] = {}

    def get(family: str) -> tuple[Path, Any]:
        if family not in cache:
            src = zoo.cached("stateless", family, 20)
            out = tmp_path_factory.mktemp("bundles") / f"{family}.zlc"
            zlc.compile(src, targets=["cpu"], out=out, max_seq=MAX_SEQ, verify=False)
            cache[family] = (out, zlc.lower(src, options=zlc.CompileOptions(max_seq=MAX_SEQ)))
        return cache[family]

    return get


PROMPT = [(11 * i + 5) % 256 for i in range(37)]  # decode at 37.. spans both KV splits of the fused tiling


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_norms_on_the_gpu_fusions_in_the_interpreter(family: str, built: Any, tmp_path: Path,
                                                     program_bundle: Any) -> None:
    """The Triton kernel on a tiling with the GPU's fusions (one block of 16 columns per Linear task,
    2 KV splits merged by the o projection, decode attention appending the step's normed, rotated
    key itself): every launch's logits within 1e-4 of the reference executor's."""
    out, lowered = built(family)
    t = replace(tiling_for(get_target("cpu"), MAX_SEQ), block_n=16, max_linear_tasks=0, kv_splits=2, block_kv=16,
                fuse_kv_append=True, fuse_combine=True)
    p = schedule(lowered.decode, t, MAX_SEQ)
    validate_program(p)
    assert not any(x.op == fmt.OP_CACHE_APPEND for x in p.tables["decode"])  # attention appends
    post_norms = sum(x.op == fmt.OP_ROW_NORM for x in p.tables["decode"])
    assert post_norms == (0 if family == "qwen3" else 2 * 2)  # two per layer, one task each in decode
    path = program_bundle(out, tmp_path / f"{family}-fused.zlc", p)
    man = zlc.load(out).manifest
    chunk, vocab = int(man["tilings"]["cpu"]["layout"]["chunk"]), int(man["model"]["vocab"])
    with MegakernelSession(InterpretBackend(path, "cpu"), chunk=chunk, max_seq=MAX_SEQ, vocab=vocab) as s:
        errs, got, exp = _run_both(s, lowered, PROMPT, steps=3)
    assert max(errs) <= ATOL, errs
    assert got == exp


@pytest.mark.parametrize("family", FAMILIES)
def test_norms_on_the_native_kernel(family: str, built: Any) -> None:
    """The bundle's C kernel (its native tiling): every launch's logits within 1e-4 of the reference
    executor's (Gemma's tiny models repeat one token, so their greedy tokens alone say little)."""
    pytest.importorskip("zlc.runtime.native")
    from zlc.runtime.native import NativeBackend

    out, lowered = built(family)
    man = zlc.load(out).manifest
    if "skipped" in man.get("native", {}):
        pytest.skip(f"no native kernel in the bundle: {man['native']['skipped']}")
    nb = NativeBackend(out, man)
    with MegakernelSession(nb, chunk=nb.chunk, max_seq=MAX_SEQ, vocab=int(man["model"]["vocab"])) as s:
        errs, got, exp = _run_both(s, lowered, PROMPT, steps=3)
    assert max(errs) <= ATOL, errs
    assert got == exp
