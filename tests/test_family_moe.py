"""Mixture of experts: Mixtral (top-2 of 4, renormalised) and Qwen3-MoE (top-2 of 4, not
renormalised, per-head q/k norms), exported with transformers' "batched_mm" experts (the one
torch.onnx and torch.export trace; zlc.testing.families). The TopK op against torch, the raised
MoE against ONNX Runtime (`zlc verify`), the torch.export route against Hugging Face's greedy
tokens, and what the megakernel says about it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

from zlc.ir import Node  # noqa: E402
from zlc.reference.kernels import KERNELS  # noqa: E402
from zlc.testing import zoo  # noqa: E402
from zlc.verifier import verify  # noqa: E402

# prompts whose 8 greedy tokens hold no EOS (2), so the comparison runs all 8 steps
PROMPTS = {"mixtral": [5, 9, 14, 20, 33], "qwen3_moe": [100, 50, 25, 12, 6]}
NEW_TOKENS = 8


def _hf_greedy(family: str) -> list[int]:
    model = zoo.hf_model(family)
    ids = torch.tensor([PROMPTS[family]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, ids.shape[1]:]]


def test_topk_reference_equals_torch_and_breaks_ties_to_the_lower_index() -> None:
    x = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(0))
    for axis in (-1, 1):
        node = Node("TopK", [], [], {"k": 3, "axis": axis, "largest": 1, "sorted": 1}, "t")
        vals, idx = KERNELS["TopK"](node, [x])
        want = torch.topk(x, 3, dim=axis)
        assert torch.equal(vals, want.values) and torch.equal(idx, want.indices)
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    node = Node("TopK", [], [], {"k": 2, "axis": -1}, "t")
    assert KERNELS["TopK"](node, [ties])[1].tolist() == [[1, 2]]


def test_moe_reference_is_the_routed_sum_of_the_selected_experts() -> None:
    """The MoE kernel against a dense formula: every expert computed, weighted by its routing
    weight where selected and 0 elsewhere; both normalize settings."""
    g = torch.Generator().manual_seed(1)
    e, f, h = 4, 6, 8
    x, wr = torch.randn(2, 3, h, generator=g), torch.randn(e, h, generator=g)
    wg, wu, wd = torch.randn(e, f, h, generator=g), torch.randn(e, f, h, generator=g), torch.randn(e, h, f, generator=g)
    for normalize in (0, 1):
        node = Node("MoE", [], [], {"top_k": 2, "normalize": normalize, "activation": "silu"}, "m")
        got = KERNELS["MoE"](node, [x, wr, wg, wu, wd])[0]
        p = torch.softmax(x @ wr.T, -1)
        top = torch.topk(p, 2, -1)
        w = top.values / top.values.sum(-1, keepdim=True) if normalize else top.values
        dense = torch.zeros_like(p).scatter(-1, top.indices, w)
        ys = torch.stack([torch.nn.functional.silu(x @ wg[i].T) * (x @ wu[i].T) @ wd[i].T for i in range(e)], -1)
        assert torch.allclose(got, (ys * dense[..., None, :]).sum(-1), atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_verify_raises_one_moe_per_layer_and_matches_onnx_runtime(family: str) -> None:
    rep = verify(zoo.cached("stateless", family, 20), prompt_ids=PROMPTS[family], steps=8, max_seq=64)
    assert rep.ok, rep.summary()
    assert rep.histogram_after.get("MoE") == 2, rep.histogram_after
    assert not {"TopK", "Softmax", "GatherND", "MatMul"} & set(rep.histogram_after), rep.histogram_after
    assert rep.tokens_zlc == rep.tokens_ref


def test_the_torch_export_route_gives_hugging_faces_greedy_tokens() -> None:
    import zlc
    from zlc.reference.session import ReferenceSession

    prompt = PROMPTS["mixtral"]
    lowered = zlc.lower(zoo.hf_model("mixtral"), (torch.tensor([prompt]),), options=zlc.CompileOptions(max_seq=32))
    assert sum(n.op == "MoE" for n in lowered.graph.nodes) == 2
    assert ReferenceSession.from_lowered(lowered).generate(prompt, NEW_TOKENS) == _hf_greedy("mixtral")


def test_compile_refuses_mixtral_in_one_line_naming_the_moe(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from click.testing import CliRunner

    from zlc.cli import cli

    res = CliRunner().invoke(cli, ["compile", str(zoo.cached("stateless", "mixtral", 20)), "-o",
                                   str(tmp_path / "m.zlc"), "--max-seq", "64"])
    assert res.exit_code != 0
    err = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "mixture of experts" in err[0] and "'moe'" in err[0], res.output
