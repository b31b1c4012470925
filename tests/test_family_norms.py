"""q/k norms and post-norms through the megakernel: Qwen3 (per-head q/k RMSNorm before RoPE),
OLMo 2 (q/k RMSNorm over the whole projections; post-norms and no pre-norms), Gemma 2 and Gemma 3
with their sandwich norms ((1 + w) RMSNorm before and after attention and the MLP; Gemma 3 with
per-head q/k norms and a local rope theta on its sliding layer), windows at the positions' length
and no soft-capping (those are features of their own).

Oracles: `zlc.verify` against ONNX Runtime (ok and compilable), the bundle's greedy tokens in the
Triton interpreter and on the native C kernel against Hugging Face `generate`, the torch.export
route, and the GPU tiling's fusions (decode attention normalizing the step's keys itself) in the
interpreter against the reference executor.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

from zlc.testing import zoo  # noqa: E402
from zlc.verifier import verify  # noqa: E402

FAMILIES = ["qwen3", "olmo2", "gemma2_nowin", "gemma3_nowin"]
PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8


def _hf_greedy(family: str) -> list[int]:
    return zoo.hf_greedy(family, PROMPT, NEW_TOKENS)


# ---- raising ------------------------------------------------------------------------------------

def _heads_norm_graph(gains: np.ndarray) -> object:
    """x[1, T, 64] -> Reshape [1, T, 4, 16] -> RMSNorm(gains) -> Transpose [0, 2, 1, 3]: Qwen3's q norm."""
    from zlc.ir import DType, Graph, TensorType

    g = Graph("heads_norm")
    x = g.add_input("x", TensorType(DType.f32, (1, 5, 64)))
    r = g.op("Reshape", x, g.add_const("shape", np.array([1, -1, 4, 16], dtype=np.int64)))
    n = g.op("RMSNorm", r, g.add_const("w", gains), eps=1e-6)
    g.outputs = [g.op("Transpose", n, perm=[0, 2, 1, 3])]
    return g


def test_a_per_head_norm_before_the_heads_transpose_is_raised_onto_split_heads() -> None:
    """Qwen3 writes its q/k norm on [B, T, H, D] before the transpose: raise-rows makes it
    RMSNorm(SplitHeads(x)) with the norm's gains and eps (the form Gemma 3's export already has),
    and the numbers stay those of the op-level graph."""
    from zlc.ir import verify_graph
    from zlc.passes.raise_all import RAISING
    from zlc.reference.executor import run_graph

    rng = np.random.default_rng(0)
    g = _heads_norm_graph((1 + 0.1 * rng.standard_normal(16)).astype(np.float32))
    x = rng.standard_normal((1, 5, 64)).astype(np.float32)
    before = run_graph(g, {"x": x})
    stats = dict(RAISING)["raise-rows"].apply(g)
    verify_graph(g)
    assert stats.applied.get("heads_norm") == 1, stats
    assert [nd.op for nd in g.nodes] == ["SplitHeads", "RMSNorm"]
    split, norm = g.nodes
    assert split.attrs["heads"] == 4 and norm.inputs[0] is split.output and norm.attrs["eps"] == 1e-6
    after = run_graph(g, {"x": x})
    np.testing.assert_allclose(next(iter(after.values())), next(iter(before.values())), rtol=1e-6, atol=1e-6)


def test_a_norm_over_more_than_one_head_is_not_raised_onto_the_heads() -> None:
    """The same pattern with gains over all H*D features ([4, 16]) is no per-head norm: refused."""
    from zlc.passes.raise_all import RAISING

    g = _heads_norm_graph(np.linspace(0.5, 1.5, 64, dtype=np.float32).reshape(4, 16))
    stats = dict(RAISING)["raise-rows"].apply(g)
    assert not stats.applied.get("heads_norm")
    assert "Transpose" in [nd.op for nd in g.nodes]


# ---- the families -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_verifies_and_fits_the_megakernel(family: str) -> None:
    rep = verify(zoo.cached("stateless", family, 20), steps=4, max_seq=64)
    assert rep.ok and rep.compilable and rep.compilable_line() == "compilable: yes", (rep.summary(), rep.megakernel)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_bundle_gives_hugging_faces_greedy_tokens(family: str, tmp_path: Path) -> None:
    """`zlc compile` (verified against ONNX Runtime), then the bundle's Triton kernel in the
    interpreter and its native C kernel: both print Hugging Face's greedy tokens. (The tiny Gemmas
    repeat the prompt's last token, so for them the logits check of
    tests/codegen/test_megakernel_norms.py is the discriminating one.)"""
    pytest.importorskip("triton")
    from bundle_checks import DEVICES, bundle_greedy, compile_bundle

    out = tmp_path / f"{family}.zlc"
    compile_bundle(zoo.cached("stateless", family, 20), out, "--max-seq", "64")
    assert bundle_greedy(out, PROMPT, NEW_TOKENS) == dict.fromkeys(DEVICES, _hf_greedy(family))


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])  # the Gemmas pass too (CI time)
def test_the_torch_export_route_gives_hugging_faces_greedy_tokens(family: str) -> None:
    import torch

    import zlc
    from zlc.reference.session import ReferenceSession
    from zlc.verifier import megakernel_fit

    lowered = zlc.lower(zoo.hf_model(family), (torch.tensor([PROMPT]),), options=zlc.CompileOptions(max_seq=32))
    assert ReferenceSession.from_lowered(lowered).generate(PROMPT, NEW_TOKENS) == _hf_greedy(family)
    assert megakernel_fit(lowered.decode, lowered.max_seq).compilable


def test_q_and_k_norms_with_different_eps_are_refused_in_one_line() -> None:
    """The attention descriptor holds one eps for its q and k norms; a model whose two differ is
    refused, naming the attention node, rather than run with the wrong one."""
    import zlc
    from zlc.codegen.schedule import schedule, tiling_for
    from zlc.codegen.tasks import ScheduleError
    from zlc.targets import get_target

    lowered = zlc.lower(zoo.cached("stateless", "qwen3", 20), options=zlc.CompileOptions(max_seq=64))
    g = lowered.decode
    k_norms = [n for n in g.nodes if n.op == "RMSNorm" and len(n.output.shape or ()) == 4 and n.output.shape[1] == 2]
    assert len(k_norms) == 2  # one per layer, on the 2 KV heads
    k_norms[0].attrs["eps"] = 1e-3
    with pytest.raises(ScheduleError) as e:
        schedule(g, tiling_for(get_target("cpu"), 64), 64)
    msg = str(e.value)
    assert "different eps" in msg and "(Attention)" in msg and "\n" not in msg, msg
