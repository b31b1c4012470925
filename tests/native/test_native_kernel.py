"""The native CPU megakernel against the oracle: every architecture switch of the zoo, every ISA
level this host runs, f32 and bf16 weights, prompts longer than a chunk, split-KV through a
rewritten tiling, decode equal to prefill of the same sequence. Real threads throughout (the
thread count is part of each case); the reference executor on the lowered model, or on the
bundle's own packed weights for bf16, is the oracle: logits within the tolerance derived from the
f64 reference (megakernel_cases.derived_tolerance), equal greedy tokens."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from native_helpers import (
    ATOL,
    MODELS,
    PROMPT,
    Built,
    assert_matches,
    bundle_reference,
    run_both,
    write_native_bundle,
)

import zlc
from zlc import bundle as fmt
from zlc.codegen.native import find_compiler
from zlc.codegen.schedule import tiling_for
from zlc.codegen.validate import validate_program
from zlc.reference.session import ReferenceSession
from zlc.runtime.native import host_cpu_flags

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")


@pytest.mark.parametrize("name", list(MODELS))
def test_native_matches_reference(built: Callable[..., Built], name: str) -> None:
    b = built(name)
    assert b.manifest["native"]["levels"] and "native" in b.manifest["tilings"]
    with b.session(threads=2) as s:
        r = run_both(s, ReferenceSession.from_lowered(b.lowered), PROMPT, steps=4,
                     exact=ReferenceSession.from_lowered(b.lowered, f64=True))
        assert s.launches == 5
    assert_matches(r)


def test_every_isa_level_and_thread_count(built: Callable[..., Built]) -> None:
    """The scalar/SSE fallback, AVX2 and AVX-512 builds compute the same numbers, with one thread
    (the table order) and with more threads than cores, each within the derived tolerance of the
    f64 reference (megakernel_cases.derived_tolerance: their summation orders differ)."""
    b = built("llama")
    flags = host_cpu_flags()
    levels = [n for n, info in b.manifest["native"]["levels"].items() if set(info["requires"]) <= flags]
    assert levels, "the host runs none of the levels it compiled"
    for level in levels:
        for threads in (1, 3):
            with b.session(threads=threads, level=level) as s:
                assert s.backend.level == level
                assert_matches(run_both(s, ReferenceSession.from_lowered(b.lowered), PROMPT, steps=3,
                                        exact=ReferenceSession.from_lowered(b.lowered, f64=True)))


def test_bf16_weights_match_the_reference_on_the_same_weights(built: Callable[..., Built]) -> None:
    b = built("llama", dtype="bf16")
    assert b.manifest["dtype"]["weights"] == "bf16"
    ref = zlc.load(b.path).session("reference")
    with b.session(threads=2) as s, ref, bundle_reference(b.path, f64=True) as exact:
        assert_matches(run_both(s, ref, PROMPT, steps=4, exact=exact))


def test_prompt_longer_than_a_chunk(built: Callable[..., Built]) -> None:
    b = built("llama", max_seq=256)
    chunk = int(b.manifest["tilings"]["native"]["layout"]["chunk"])
    assert chunk == 128
    prompt = [(7 * i + 3) % b.vocab for i in range(chunk + 6)]
    with b.session(threads=2) as s:
        r = run_both(s, ReferenceSession.from_lowered(b.lowered), prompt, steps=2,
                     exact=ReferenceSession.from_lowered(b.lowered, f64=True))
        assert s.launches == 2 + 2  # the prompt in two launches, then the steps
    assert_matches(r)


def test_decode_equals_prefill_of_the_same_sequence(built: Callable[..., Built]) -> None:
    """Each decode step's logits equal the prefill logits of the whole sequence at that row."""
    b = built("gemma")
    with b.session(threads=2) as s:
        tok, _ = s.prefill(PROMPT)
        seq, steps = [*PROMPT, tok], []
        for _ in range(5):
            tok, lg = s.step(seq[-1], want_logits=True)
            steps.append(lg[0])
            seq.append(tok)
        s.reset()
        _, whole = s.prefill(seq[:-1], all_logits=True, want_logits=True)
    assert whole is not None
    for i, lg in enumerate(steps):
        np.testing.assert_allclose(lg, whole[len(PROMPT) + i], rtol=0, atol=ATOL)


@pytest.mark.parametrize("name", ["llama", "bloom"])
def test_split_kv_and_narrow_tasks(built: Callable[..., Built], tmp_path: Path, name: str) -> None:
    """A tiling the bundles do not use: 4 KV splits of 16 keys (decode at positions 37..40 uses
    three and leaves one empty; the combine task merges them) and 16-column Linear tasks (they
    start inside the 32-column weight panels of AVX-512). BLOOM: each split adds its keys' ALiBi
    bias at their absolute positions."""
    b = built(name)
    t = replace(tiling_for(None, 64, native=True), kv_splits=4, block_kv=16, block_n=16)
    p = b.program(t)
    validate_program(p)
    assert sum(x.op == fmt.OP_ATTN_COMBINE for x in p.tables["decode"]) == 2 * 4  # layers x heads
    path = write_native_bundle(b.path, tmp_path / "split.zlc", p)
    prompt = [(11 * i + 5) % b.vocab for i in range(37)]
    with Built(path, b.lowered).session(threads=3) as s:
        assert_matches(run_both(s, ReferenceSession.from_lowered(b.lowered), prompt, steps=3))


def test_generate_and_auto_device(built: Callable[..., Built]) -> None:
    """`auto` is the native kernel on a host without a GPU; greedy generation equals the oracle's."""
    b = built("llama")
    bundle = zlc.load(b.path)
    want = ReferenceSession.from_lowered(b.lowered).generate(PROMPT, 8)
    assert bundle.generate(PROMPT, 8, device="cpu", threads=2) == want
    from zlc.runtime.loader import cuda_device

    if cuda_device() is None:
        assert bundle.resolve_device("auto") == "cpu"
        assert bundle.generate(PROMPT, 8) == want


def test_a_wrong_kernel_fails_the_derived_tolerance(built: Callable[..., Built], tmp_path: Path) -> None:
    """The negative control of the derived tolerance: the same C kernel with one plausible bug (the
    Linear's fused RMSNorm averaging over K - 1 columns, a 1/K change of its mean square) is beyond
    it on every launch, while the kernel as built is within it."""
    import platform

    from zlc.codegen.native import compile_library
    from zlc.targets import isa_levels_for

    b = built("llama")
    src = (b.path / b.manifest["native"]["source"]).read_text()
    right = "float rstd = 1.0f / sqrtf(ss / (float)K + L->eps);"
    assert src.count(right) == 1
    (tmp_path / "wrong.c").write_text(src.replace(right, "float rstd = 1.0f / sqrtf(ss / (float)(K - 1) + L->eps);"))
    level = isa_levels_for(platform.machine())[-1]  # any level: the bug is in the math, not the ISA
    compile_library(tmp_path / "wrong.c", tmp_path / "wrong.so", level, find_compiler()[0] or "cc")
    ref = ReferenceSession.from_lowered(b.lowered)
    exact = ReferenceSession.from_lowered(b.lowered, f64=True)
    with b.session(threads=2, library=tmp_path / "wrong.so", level=level.name) as s:
        r = run_both(s, ref, PROMPT, steps=3, exact=exact)
    assert all(e > t for e, t in zip(r["exact_errors"], r["tolerances"], strict=True)), r
    print("wrong kernel: distance from f64 / derived tolerance per launch",
          [f"{e:.1e}/{t:.1e}" for e, t in zip(r["exact_errors"], r["tolerances"], strict=True)])
    ref.reset()
    exact.reset()
    with b.session(threads=2) as s:
        assert_matches(run_both(s, ref, PROMPT, steps=3, exact=exact))
