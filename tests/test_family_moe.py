"""Mixture of experts: Mixtral (top-2 of 4, renormalised) and Qwen3-MoE (top-2 of 4, not
renormalised, per-head q/k norms), exported with transformers' "batched_mm" experts (the one
torch.onnx and torch.export trace; zlc.testing.families). The TopK op against torch, the raised
MoE against ONNX Runtime (`zlc verify`), the torch.export route against Hugging Face's greedy
tokens, and what the megakernel says about it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

from zlc.ir import Node  # noqa: E402
from zlc.reference.kernels import KERNELS  # noqa: E402
from zlc.testing import zoo  # noqa: E402
from zlc.verifier import megakernel_fit, verify  # noqa: E402

# prompts whose 8 greedy tokens hold no EOS (2), so the comparison runs all 8 steps
PROMPTS = {"mixtral": [5, 9, 14, 20, 33], "qwen3_moe": [100, 50, 25, 12, 6]}
NEW_TOKENS = 8


def _hf_greedy(family: str) -> list[int]:
    return zoo.hf_greedy(family, PROMPTS[family], NEW_TOKENS)


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
    assert megakernel_fit(lowered.decode, lowered.max_seq).compilable


def _run(bundle: Path, prompt: list[int], device: str) -> list[int]:
    from bundle_checks import run_greedy

    return run_greedy(bundle, prompt, NEW_TOKENS, device)


@pytest.fixture(scope="module")
def mixtral_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bundle_checks import compile_bundle

    out = tmp_path_factory.mktemp("moe") / "mixtral.zlc"
    compile_bundle(zoo.cached("stateless", "mixtral", 20), out, "--max-seq", "64")
    return out


@pytest.mark.slow
def test_bundle_gives_hugging_faces_greedy_tokens(mixtral_bundle: Path) -> None:
    """`zlc compile`, then the bundle's Triton kernel in the interpreter and its native C kernel:
    both print Hugging Face's greedy tokens (a 5-token prefill runs every expert on every row,
    decode only the selected ones)."""
    pytest.importorskip("triton")
    want = _hf_greedy("mixtral")
    for device in ("interpret", "cpu"):
        assert _run(mixtral_bundle, PROMPTS["mixtral"], device) == want, device


@pytest.mark.slow
def test_one_row_steps_never_read_the_weights_of_experts_they_do_not_select(mixtral_bundle: Path,
                                                                            tmp_path: Path) -> None:
    """With a one-token prompt every launch is one row (the decode path). The experts that Hugging
    Face's router never selects over those rows get NaN weights in the bundle; the kernels still
    print HF's tokens, so they never read them (a dense MoE would spread the NaN: 0 * NaN)."""
    pytest.importorskip("triton")
    import numpy as np
    from safetensors.numpy import load_file, save

    import zlc
    from zlc.bundle import add_files

    prompt = [9]
    model = zoo.hf_model("mixtral")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
        picked: dict[int, torch.Tensor] = {}
        hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o, li=li: picked.__setitem__(li, o[2]))
                 for li, layer in enumerate(model.model.layers)]
        model(out[:, :len(prompt) + NEW_TOKENS - 1])  # the rows the launches run
        for hk in hooks:
            hk.remove()
    want = [int(t) for t in out[0, len(prompt):]]
    lowered = zlc.lower(zoo.cached("stateless", "mixtral", 20), options=zlc.CompileOptions(max_seq=64))
    moes = [n for n in lowered.decode.nodes if n.op == "MoE"]
    bundle = tmp_path / "poisoned.zlc"
    shutil.copytree(mixtral_bundle, bundle)
    arenas = load_file(str(bundle / "weights.safetensors"))
    where = {p["value"]: p for p in json.loads((bundle / "manifest.json").read_text())["weights"]["placement"]}
    poisoned = 0
    for li, node in enumerate(moes):
        for e in sorted(set(range(4)) - set(picked[li].flatten().tolist())):
            for v in node.inputs[2:5]:  # w_gate, w_up, w_down: [E, ., .]
                assert v is not None and v.shape is not None
                size = int(v.shape[1]) * int(v.shape[2])
                at = where[v.name]["offset"] + e * size
                arenas["W"][at:at + size] = np.nan
            poisoned += 1
    assert poisoned, "the prompt should leave an expert unselected"
    add_files(bundle, {"weights.safetensors": save(arenas)})
    for device in ("interpret", "cpu"):
        assert _run(bundle, prompt, device) == want, device
    # the control: poisoning an expert the first row does select changes the tokens
    e = int(picked[0][0, 0])
    v = moes[0].inputs[4]
    assert v is not None and v.shape is not None
    size = int(v.shape[1]) * int(v.shape[2])
    at = where[v.name]["offset"] + e * size
    arenas["W"][at:at + size] = np.nan
    add_files(bundle, {"weights.safetensors": save(arenas)})
    assert _run(bundle, prompt, "cpu") != want


@pytest.mark.slow
def test_qwen3_moe_bundle_or_only_its_q_k_norm_refused(tmp_path: Path) -> None:
    """Qwen3-MoE's MoE (not renormalised) lowers like Mixtral's; its per-head q/k RMSNorm is a
    feature of its own. While that does not lower, `zlc compile` refuses in one line that names
    the reshape around it and not the MoE; once it does, the bundle gives HF's greedy tokens."""
    from click.testing import CliRunner

    import zlc
    from zlc.cli import cli

    path = zoo.cached("stateless", "qwen3_moe", 20)
    lowered = zlc.lower(path, options=zlc.CompileOptions(max_seq=64))
    fit = megakernel_fit(lowered.decode, lowered.max_seq)
    out = tmp_path / "qwen3_moe.zlc"
    res = CliRunner().invoke(cli, ["compile", str(path), "-o", str(out), "--max-seq", "64"])
    if not fit.compilable:
        assert res.exit_code != 0
        err = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert len(err) == 1 and "Reshape" in err[0] and "MoE" not in err[0], res.output
        return
    assert res.exit_code == 0, res.output
    want = _hf_greedy("qwen3_moe")
    for device in ("interpret", "cpu"):
        assert _run(out, PROMPTS["qwen3_moe"], device) == want, device
