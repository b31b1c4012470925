"""The Triton megakernel's sliding-window attention in the interpreter against the reference:
the prefill body (a prompt of exactly the window, then one longer than it) and the decode body
with the GPU tiling's fusions -- 4 KV splits of 16 keys, the step's k/v appended by attention,
partials merged by the o projection -- at positions 37..40, where the windowed layer's first two
splits lie wholly before its window of 4 and read no key (Qwen2's layer 0 has no window)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zlc
from zlc.codegen.schedule import schedule, tiling_for
from zlc.codegen.validate import validate_program
from zlc.reference.session import ReferenceSession
from zlc.runtime.interpret import InterpretBackend
from zlc.runtime.megakernel import MegakernelSession
from zlc.targets import get_target
from zlc.testing import zoo

pytest.importorskip("triton")
ATOL = 1e-4


@pytest.fixture(scope="module")
def qwen2_win(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    src = zoo.cached("stateless", "qwen2_win", 20)
    out = tmp_path_factory.mktemp("win") / "qwen2_win.zlc"
    zlc.compile(src, targets=["cpu"], out=out, max_seq=64, verify=False)
    return out, zlc.lower(src, options=zlc.CompileOptions(max_seq=64))


def _session(path: Path) -> MegakernelSession:
    man = zlc.load(path).manifest
    return MegakernelSession(InterpretBackend(path, "cpu"), chunk=int(man["tilings"]["cpu"]["layout"]["chunk"]),
                             max_seq=int(man["model"]["max_seq"]), vocab=int(man["model"]["vocab"]))


def _check(s: MegakernelSession, lowered: Any, prompt: list[int], steps: int) -> None:
    ref = ReferenceSession.from_lowered(lowered)
    tok, lg = s.prefill(prompt, all_logits=True, want_logits=True)
    want = ref.prefill(prompt).numpy()
    assert lg is not None and float(np.abs(lg - want).max()) <= ATOL
    assert tok == int(want[-1].argmax())
    for _ in range(steps):
        feed = int(want.reshape(-1, want.shape[-1])[-1].argmax())
        tok, lg = s.step(feed, want_logits=True)
        want = ref.step(feed).numpy()
        assert lg is not None and float(np.abs(lg[0] - want.reshape(-1)).max()) <= ATOL
        assert tok == int(want.argmax())


@pytest.mark.parametrize("prompt_len", [4, 9])
def test_window_boundary(qwen2_win: tuple[Path, Any], prompt_len: int) -> None:
    path, lowered = qwen2_win
    with _session(path) as s:
        _check(s, lowered, [(11 * i + 5) % 256 for i in range(prompt_len)], steps=2)


@pytest.mark.slow
def test_fused_split_kv_skips_splits_before_the_window(qwen2_win: tuple[Path, Any], program_bundle: Any,
                                                      tmp_path: Path) -> None:
    path, lowered = qwen2_win
    t = replace(tiling_for(get_target("cpu"), 64), kv_splits=4, block_kv=16, fuse_kv_append=True, fuse_combine=True)
    p = schedule(lowered.decode, t, 64)
    validate_program(p)
    with _session(program_bundle(path, tmp_path / "split.zlc", p)) as s:
        _check(s, lowered, [(11 * i + 5) % 256 for i in range(37)], steps=3)


@pytest.mark.parametrize("op", ["Attention", "LMHead"])
def test_softcap_matches_the_reference(qwen2_win: tuple[Path, Any], program_bundle: Any, tmp_path: Path,
                                       op: str) -> None:
    """Soft-capping (softcap * tanh(x / softcap), Gemma 2's) in the prefill and decode bodies: the
    qwen2_win graph with a cap of 0.5 on both layers' attention scores, or of 2 on the logits
    (the prefill's tl.dot rows, its last row's and decode's matrix-vector bodies)."""
    path, _ = qwen2_win
    lowered = zlc.lower(zoo.cached("stateless", "qwen2_win", 20), options=zlc.CompileOptions(max_seq=64))
    for g in (lowered.prefill, lowered.decode):
        for n in g.nodes:
            if n.op == op:
                n.attrs["softcap"] = 0.5 if op == "Attention" else 2.0
    p = schedule(lowered.decode, tiling_for(get_target("cpu"), 64), 64)
    with _session(program_bundle(path, tmp_path / "softcap.zlc", p)) as s:
        _check(s, lowered, [(11 * i + 5) % 256 for i in range(9)], steps=2)
