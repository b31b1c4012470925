"""q/k norms and post-norms in the Triton interpreter against the reference executor, logits of
every launch within 1e-4: Qwen3's per-head q/k norm, OLMo 2's whole-projection q/k norm and
post-norms, Gemma 3's sandwich norms with per-head q/k norm; on the cpu tiling and on a tiling
with the GPU's fusions (decode attention normalizes and rotates the step's key itself and appends
it; split-KV partials merged by the output projection; one block of columns per Linear task).
The bundles' greedy tokens against Hugging Face are in tests/test_family_norms.py."""

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


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "olmo2", "gemma3_nowin"])
@pytest.mark.parametrize("fused", [False, True], ids=["cpu", "gpu-fusions"])
def test_norms_in_the_interpreter(family: str, fused: bool, tmp_path: Path, program_bundle: Any) -> None:
    src = zoo.cached("stateless", family, 20)
    out = tmp_path / f"{family}.zlc"
    zlc.compile(src, targets=["cpu"], out=out, max_seq=MAX_SEQ, verify=False)
    lowered = zlc.lower(src, options=zlc.CompileOptions(max_seq=MAX_SEQ))
    path = out
    t = tiling_for(get_target("cpu"), MAX_SEQ)
    if fused:
        t = replace(t, block_n=16, max_linear_tasks=0, kv_splits=2, block_kv=16, fuse_kv_append=True,
                    fuse_combine=True)
        p = schedule(lowered.decode, t, MAX_SEQ)
        validate_program(p)
        assert not any(x.op == fmt.OP_CACHE_APPEND for x in p.tables["decode"])  # attention appends
        path = program_bundle(out, tmp_path / f"{family}-fused.zlc", p)
    p = schedule(lowered.decode, t, MAX_SEQ)
    post_norms = sum(x.op == fmt.OP_ROW_NORM for x in p.tables["decode"])
    assert post_norms == (2 * 2 if family != "qwen3" else 0)  # two per layer, one task each in decode
    man = zlc.load(out).manifest
    chunk, vocab = int(man["tilings"]["cpu"]["layout"]["chunk"]), int(man["model"]["vocab"])
    prompt = [(11 * i + 5) % vocab for i in range(37)]  # decode at 37.. spans both KV splits
    with MegakernelSession(InterpretBackend(path, "cpu"), chunk=chunk, max_seq=MAX_SEQ, vocab=vocab) as s:
        errs, got, exp = _run_both(s, lowered, prompt, steps=3)
    assert max(errs) <= ATOL, errs
    assert got == exp
