"""The native kernel's sliding-window attention against the oracle at the window's boundary: a
prompt of exactly the window (4 keys), then steps whose windows drop key 0, 1, ...; and, with 4
KV splits of 16 keys, decode at positions 37..40 where the windowed layer's first two splits lie
wholly before the window (they contribute nothing) while Qwen2's full layer 0 reads them all."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from native_helpers import Built, assert_matches, run_both, write_native_bundle

from zlc.codegen.native import find_compiler
from zlc.codegen.schedule import tiling_for
from zlc.codegen.validate import validate_program
from zlc.reference.session import ReferenceSession

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")


@pytest.fixture(scope="module")
def qwen2_win(tmp_path_factory: pytest.TempPathFactory) -> Built:
    pytest.importorskip("transformers", reason="the zoo's exports need the 'hf' extra")
    import zlc
    from zlc.testing import zoo

    src = zoo.cached("stateless", "qwen2_win", 20)
    out = tmp_path_factory.mktemp("native-win") / "qwen2_win.zlc"
    zlc.compile(src, targets=["cpu"], out=out, max_seq=64, verify=False)
    b = Built(out, zlc.lower(src, options=zlc.CompileOptions(max_seq=64)))
    assert [n.attrs.get("window", 0) for n in b.lowered.decode.nodes if n.op == "Attention"] == [0, 4]
    return b


@pytest.mark.parametrize("prompt_len", [4, 5])
def test_window_boundary(qwen2_win: Built, prompt_len: int) -> None:
    prompt = [(11 * i + 5) % qwen2_win.vocab for i in range(prompt_len)]
    with qwen2_win.session(threads=2) as s:
        assert_matches(run_both(s, ReferenceSession.from_lowered(qwen2_win.lowered), prompt, steps=3))


def test_split_kv_skips_splits_before_the_window(qwen2_win: Built, tmp_path: Path) -> None:
    b = qwen2_win
    p = b.program(replace(tiling_for(None, 64, native=True), kv_splits=4, block_kv=16))
    validate_program(p)
    path = write_native_bundle(b.path, tmp_path / "split.zlc", p)
    prompt = [(11 * i + 5) % b.vocab for i in range(37)]
    with Built(path, b.lowered).session(threads=3) as s:
        assert_matches(run_both(s, ReferenceSession.from_lowered(b.lowered), prompt, steps=3))


@pytest.mark.parametrize("op", ["Attention", "LMHead"])
def test_softcap_matches_the_reference(qwen2_win: Built, tmp_path: Path, op: str) -> None:
    """Soft-capping (softcap * tanh(x / softcap), Gemma 2's) on the native kernel: the qwen2_win
    graph with a cap of 0.5 on both layers' attention scores (small enough to change every score),
    or of 2 on the logits (all rows' logits compared, and the greedy tokens)."""
    import zlc
    from zlc.testing import zoo

    lowered = zlc.lower(zoo.cached("stateless", "qwen2_win", 20), options=zlc.CompileOptions(max_seq=64))
    for g in (lowered.prefill, lowered.decode):
        for n in g.nodes:
            if n.op == op:
                n.attrs["softcap"] = 0.5 if op == "Attention" else 2.0
    ref, plain = ReferenceSession.from_lowered(lowered), ReferenceSession.from_lowered(qwen2_win.lowered)
    prompt = [(11 * i + 5) % qwen2_win.vocab for i in range(9)]
    assert float((ref.prefill(prompt) - plain.prefill(prompt)).abs().max()) > 1e-2  # the cap bites
    path = write_native_bundle(qwen2_win.path, tmp_path / "softcap.zlc", Built(qwen2_win.path, lowered).program())
    with Built(path, lowered).session(threads=2) as s:
        assert_matches(run_both(s, ReferenceSession.from_lowered(lowered), prompt, steps=3))
