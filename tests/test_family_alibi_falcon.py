"""Falcon (multi-query and the "new decoder architecture" with GQA) and the ALiBi families (BLOOM,
MPT) through verify, the megakernel bundle (Triton interpreter and native C) and torch.export, with
Hugging Face's own greedy generation as the oracle.

Falcon's fused query_key_value is split by data movement (Slice of the query heads, GatherND of the
KV head(s), Expand to every query head in the new architecture): raise-blocks' heads_gather finds
each part's rows by probing the chain with column indices (passes/raise_blocks.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

from zlc.testing import zoo  # noqa: E402
from zlc.verifier import verify  # noqa: E402

PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8
FAMILIES = ["falcon", "falcon_new", "mpt", "bloom"]


def _hf_greedy(family: str) -> list[int]:
    return zoo.hf_greedy(family, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("family", FAMILIES)
def test_verifies_and_fits_the_megakernel(family: str) -> None:
    rep = verify(zoo.cached("stateless", family, 20), steps=4, max_seq=64)
    assert rep.ok and rep.compilable and rep.compilable_line() == "compilable: yes", (rep.summary(), rep.megakernel)
    assert rep.histogram_after.get("Attention") == 2 and "GatherND" not in rep.histogram_after


def test_falcon_kv_heads_are_its_own() -> None:
    """Multi-query Falcon attends with one KV head, the new architecture with its 2 KV groups (not
    the broadcast copies the export makes for every query head)."""
    import zlc

    for family, kv in (("falcon", 1), ("falcon_new", 2)):
        low = zlc.lower(zoo.cached("stateless", family, 20), options=zlc.CompileOptions(max_seq=64))
        atts = [n for n in low.decode.nodes if n.op == "Attention"]
        assert [n.inputs[1].shape[1] for n in atts] == [kv, kv], family
        assert kv == zoo.kv_spec(family).num_kv_heads


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bundle_gives_hugging_faces_greedy_tokens(family: str, tmp_path: Path) -> None:
    """`zlc compile` (verified against ONNX Runtime), then the bundle's Triton kernel in the
    interpreter and its native C kernel: both print Hugging Face's greedy tokens."""
    pytest.importorskip("triton")
    from bundle_checks import DEVICES, bundle_greedy, compile_bundle

    out = tmp_path / f"{family}.zlc"
    compile_bundle(zoo.cached("stateless", family, 20), out, "--max-seq", "64")
    assert bundle_greedy(out, PROMPT, NEW_TOKENS) == dict.fromkeys(DEVICES, _hf_greedy(family))


@pytest.mark.parametrize("family", ["falcon"])
def test_the_torch_export_route_gives_hugging_faces_greedy_tokens(family: str) -> None:
    import torch

    import zlc
    from zlc.reference.session import ReferenceSession
    from zlc.verifier import megakernel_fit

    lowered = zlc.lower(zoo.hf_model(family), (torch.tensor([PROMPT]),), options=zlc.CompileOptions(max_seq=32))
    assert ReferenceSession.from_lowered(lowered).generate(PROMPT, NEW_TOKENS) == _hf_greedy(family)
    assert megakernel_fit(lowered.decode, lowered.max_seq).compilable


@pytest.mark.parametrize("family", ["mpt", "bloom"])
def test_alibi_through_torch_export_gives_hugging_faces_greedy_tokens(family: str) -> None:
    """The slopes raising reads off the bias are the ALiBi slopes 2^(-8 h / H) (both families'
    formula for 4 heads); the lowered model generates Hugging Face's tokens and fits the kernel."""
    import torch

    import zlc
    from zlc.reference.session import ReferenceSession
    from zlc.verifier import megakernel_fit

    lowered = zlc.lower(zoo.hf_model(family), (torch.tensor([PROMPT]),), options=zlc.CompileOptions(max_seq=32))
    atts = [n for n in lowered.decode.nodes if n.op == "Attention"]
    assert [n.attrs["alibi"] for n in atts] == [[2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]] * 2
    assert ReferenceSession.from_lowered(lowered).generate(PROMPT, NEW_TOKENS) == _hf_greedy(family)
    assert megakernel_fit(lowered.decode, lowered.max_seq).compilable


def test_a_bias_that_is_not_alibi_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPT with its ALiBi bias squared (still position-only, not linear in the key position): raising
    leaves the attention op-level and lowering says so in one line, naming the bias node."""
    import torch
    from transformers.models.mpt import modeling_mpt

    import zlc
    from zlc.errors import ZlcError

    real = modeling_mpt.build_mpt_alibi_tensor
    monkeypatch.setattr(modeling_mpt, "build_mpt_alibi_tensor", lambda *a, **k: -real(*a, **k) ** 2)
    with pytest.raises(ZlcError) as e:
        zlc.lower(zoo.hf_model("mpt"), (torch.tensor([PROMPT]),), options=zlc.CompileOptions(max_seq=32))
    msg = str(e.value)
    assert "\n" not in msg and "not a linear bias in the key position per head (ALiBi)" in msg, msg

