"""GPT-J and CodeGen through the torch.export route, and CodeGen with more heads than mp_num groups.

torch.export traces GPT-J's and CodeGen's position ids as `arange(T) + 0`; raise-embedding turns
the sin/cos table's lookup at them into `Embedding(table, Positions(input_ids))` before raise-rope
sees the rotary. `Positions` reads only the token-axis extent of the ids (passes/probe.py
`value_inputs`), so the tables are position-only and the rotary raises to RoPE, which KV-cache
synthesis binds to `past_len + arange(T)`.

CodeGen's fused qkv_proj is laid out in mp_num = 4 groups of [q_g, v_g, k_g]; with 8 heads each
group's part is 2 consecutive heads ([B, T, 4, 16] reshaped to [B, T, 8, 8]). raise-blocks'
`heads_qkv` gathers each part's rows group by group and reshapes the part straight to its heads.

The oracle is Hugging Face's greedy generation; the bundle runs on the Triton interpreter and the
native C kernel."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

from zlc.testing import zoo  # noqa: E402

PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8


def _hf_greedy(family: str) -> list[int]:
    return zoo.hf_greedy(family, PROMPT, NEW_TOKENS)


def _bundle_tokens(bundle: Path) -> dict[str, list[int]]:
    from zlc.runtime.loader import load

    b = load(bundle)
    return {device: b.generate(PROMPT, NEW_TOKENS, device=device) for device in ("interpret", "cpu")}


@pytest.mark.parametrize("family", ["gptj", "codegen", "codegen_8h"])
def test_the_torch_route_raises_the_rotary_at_positions(family: str) -> None:
    import torch

    import zlc
    from zlc.reference.session import ReferenceSession
    from zlc.verifier import megakernel_fit

    lowered = zlc.lower(zoo.hf_model(family), (torch.tensor([PROMPT]),), options=zlc.CompileOptions(max_seq=32))
    fit = megakernel_fit(lowered.decode, lowered.max_seq)
    assert fit.compilable, fit.lines()
    ops = lowered.decode.op_histogram()
    assert ops.get("RoPE") == 4 and "Gather" not in ops and ops.get("Embedding") == 1, ops
    rope_pos = {n.inputs[3].producer.op for n in lowered.decode.nodes if n.op == "RoPE"}  # type: ignore[union-attr]
    assert rope_pos == {"Positions"}
    assert ReferenceSession.from_lowered(lowered).generate(PROMPT, NEW_TOKENS) == _hf_greedy(family)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gptj", "codegen"])  # codegen_8h's bundle: the ONNX route below
def test_the_torch_route_bundle_gives_hugging_faces_greedy_tokens(family: str, tmp_path: Path) -> None:
    """zlc.compile(module): greedy tokens of the bundle on the interpreter and the C kernel."""
    pytest.importorskip("triton")
    import torch

    import zlc

    want = _hf_greedy(family)
    out = tmp_path / f"{family}.zlc"
    zlc.compile(zoo.hf_model(family), example_inputs=(torch.tensor([PROMPT]),), out=out, max_seq=32)
    assert _bundle_tokens(out) == {"interpret": want, "cpu": want}


def test_codegen_with_two_heads_per_group_verifies_and_fits() -> None:
    import zlc
    from zlc.verifier import verify

    path = zoo.cached("stateless", "codegen_8h", 20)
    rep = verify(path, steps=8, max_seq=64)
    assert rep.ok and rep.compilable, (rep.summary(), rep.megakernel)
    decode = zlc.lower(path, options=zlc.CompileOptions(max_seq=64)).decode
    heads = [n.attrs["heads"] for n in decode.nodes if n.op == "SplitHeads"]
    assert heads == [8] * 6, heads
    assert "Reshape" not in decode.op_histogram()


@pytest.mark.slow
def test_codegen_with_two_heads_per_group_bundle_gives_hugging_faces_greedy_tokens(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from bundle_checks import DEVICES, bundle_greedy, compile_bundle

    out = tmp_path / "codegen_8h.zlc"
    compile_bundle(zoo.cached("stateless", "codegen_8h", 20), out, "--max-seq", "64")
    assert bundle_greedy(out, PROMPT, NEW_TOKENS) == dict.fromkeys(DEVICES, _hf_greedy("codegen_8h"))
