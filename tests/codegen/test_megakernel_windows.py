"""The Triton megakernel's sliding-window attention in the interpreter against the reference:
the prefill body (a prompt of exactly the window, then one longer than it) and the decode body
with the GPU tiling's fusions -- 4 KV splits of 16 keys, the step's k/v appended by attention,
partials merged by the o projection -- at positions 37..40, where the windowed layer's first two
splits lie wholly before its window of 4 and read no key (Qwen2's layer 0 has no window)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from megakernel_checks import Built, assert_matches, run_both

import zlc
from zlc.codegen.schedule import schedule, tiling_for
from zlc.codegen.validate import validate_program
from zlc.targets import get_target
from zlc.testing import zoo

pytest.importorskip("triton")


@pytest.mark.parametrize("prompt_len", [4, 9])
def test_window_boundary(built: Callable[..., Built], prompt_len: int) -> None:
    b = built("qwen2_win")
    with b.session() as s:
        assert_matches(run_both(s, b.lowered, [(11 * i + 5) % 256 for i in range(prompt_len)], steps=2))


@pytest.mark.slow
def test_fused_split_kv_skips_splits_before_the_window(built: Callable[..., Built], program_bundle: Any,
                                                      tmp_path: Path) -> None:
    b = built("qwen2_win")
    t = replace(tiling_for(get_target("cpu"), 64), kv_splits=4, block_kv=16, fuse_kv_append=True, fuse_combine=True)
    p = b.program(t)
    validate_program(p)
    with b.session(program_bundle(b.path, tmp_path / "split.zlc", p)) as s:
        assert_matches(run_both(s, b.lowered, [(11 * i + 5) % 256 for i in range(37)], steps=3))


@pytest.mark.parametrize("op", ["Attention", "LMHead"])
def test_softcap_matches_the_reference(built: Callable[..., Built], program_bundle: Any, tmp_path: Path,
                                       op: str) -> None:
    """Soft-capping (softcap * tanh(x / softcap), Gemma 2's) in the prefill and decode bodies: the
    qwen2_win graph with a cap of 0.5 on both layers' attention scores, or of 2 on the logits
    (the prefill's tl.dot rows, its last row's and decode's matrix-vector bodies)."""
    b = built("qwen2_win")
    lowered = zlc.lower(zoo.cached("stateless", "qwen2_win", 20), options=zlc.CompileOptions(max_seq=64))
    for g in (lowered.prefill, lowered.decode):
        for n in g.nodes:
            if n.op == op:
                n.attrs["softcap"] = 0.5 if op == "Attention" else 2.0
    p = schedule(lowered.decode, tiling_for(get_target("cpu"), 64), 64)
    with b.session(program_bundle(b.path, tmp_path / "softcap.zlc", p)) as s:
        assert_matches(run_both(s, lowered, [(11 * i + 5) % 256 for i in range(9)], steps=2))
