"""The library API (`import zlc`): the named pipeline, its options, observers and early stops,
`zlc.verify`, and generation with the reference session, on the bundled tiny model."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import onnx
import pytest

import zlc
import zlc.driver
from zlc.ir import Graph, verify_graph


def test_public_api_names() -> None:
    from zlc.driver import CompileOptions, load_model, lower
    from zlc.reference.session import ReferenceSession
    from zlc.verifier import verify

    assert zlc.lower is lower and zlc.load_model is load_model and zlc.CompileOptions is CompileOptions
    assert zlc.verify is verify and zlc.ReferenceSession is ReferenceSession
    assert issubclass(zlc.ModelFormatError, zlc.ZlcError) and issubclass(zlc.VerificationError, zlc.ZlcError)
    assert set(zlc.__all__) <= set(dir(zlc))
    with pytest.raises(AttributeError):
        zlc.compile_to_cubin  # noqa: B018 - not a public name (yet)


def test_verify_stays_a_function_after_importing_its_module() -> None:
    code = "import zlc.verifier, zlc; assert callable(zlc.verify) and zlc.verify.__name__ == 'verify'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_import_zlc_is_light() -> None:
    code = "import sys, zlc; heavy = {'torch', 'onnx', 'onnxruntime', 'numpy'} & set(sys.modules); assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the pipeline ---------------------------------------------------------------------------------

def test_stages_run_in_order_and_the_observer_sees_each(tiny_onnx: Path) -> None:
    seen: list[tuple[str, int]] = []

    def observer(stage: str, g: Graph) -> None:
        verify_graph(g)
        seen.append((stage, len(g.nodes)))

    lowered = zlc.lower(tiny_onnx, options=zlc.CompileOptions(max_seq=32), observer=observer)
    assert [s for s, _ in seen] == list(zlc.STAGES)
    assert [s.name for s in lowered.stages] == list(zlc.STAGES)
    assert all(s.seconds >= 0 and s.nodes > 0 for s in lowered.stages)
    assert lowered.decode is not None and seen[-1][1] == len(lowered.decode.nodes)
    assert lowered.max_seq == 32


@pytest.mark.parametrize("stage", zlc.STAGES)
def test_stop_after_each_stage(tiny_onnx: Path, stage: str) -> None:
    lowered = zlc.lower(tiny_onnx, options=zlc.CompileOptions(max_seq=32), stop_after=stage)
    assert lowered.stages[-1].name == stage
    assert (lowered.decode is not None) == (stage == "kv-cache")
    verify_graph(lowered.graph)
    raised = zlc.STAGES.index(stage) >= zlc.STAGES.index("raise")
    assert ("Attention" in lowered.graph.op_histogram()) == raised


@pytest.mark.parametrize("rule_set", zlc.driver.RAISE_STAGES)
def test_stop_after_each_raising_rule_set(tiny_onnx: Path, rule_set: str) -> None:
    """Every raising rule set is a dump point: the pipeline ends right after its first application,
    the raise stage reports each set that ran, and what the set raises is in the graph from then on."""
    lowered = zlc.lower(tiny_onnx, options=zlc.CompileOptions(max_seq=32), stop_after=rule_set)
    raise_report = lowered.stages[-1]
    assert raise_report.name == "raise" and lowered.decode is None
    names = [p.name for p in raise_report.parts]
    assert names == list(zlc.driver.RAISE_STAGES[:names.index(rule_set) + 1])
    verify_graph(lowered.graph)
    hist = lowered.graph.op_histogram()
    i = zlc.driver.RAISE_STAGES.index
    assert ("RMSNorm" in hist) == (i(rule_set) >= i("raise-norms"))
    assert ("Attention" in hist) == (i(rule_set) >= i("raise-attention"))
    assert ("LMHead" in hist) == (i(rule_set) >= i("raise-lm-head"))


def test_raise_stage_reports_its_rule_sets(tiny_lowered: Any) -> None:
    raised = tiny_lowered.stages[zlc.STAGES.index("raise")]
    assert {p.name for p in raised.parts} == set(zlc.driver.RAISE_STAGES)
    total: dict[str, int] = {}
    for part in raised.parts:
        assert part.seconds >= 0 and part.nodes > 0
        for rule, n in part.stats.items():
            total[rule] = total.get(rule, 0) + n
    assert total == raised.stats  # the parts add up to the stage


def test_unknown_raising_rule_set(tiny_onnx: Path) -> None:
    with pytest.raises(zlc.ZlcError, match="unknown raising rule set 'raise-nope'; rule sets: raise-norms"):
        zlc.lower(tiny_onnx, stop_after="raise-nope")


def test_unknown_stage(tiny_onnx: Path) -> None:
    with pytest.raises(zlc.ZlcError, match="unknown stage 'nope'"):
        zlc.lower(tiny_onnx, stop_after="nope")


def test_raising_leaves_no_op_level_attention_norm_or_mlp(tiny_lowered: Any) -> None:
    after = tiny_lowered.histogram_after
    assert after["Attention"] == 2 and after["GatedMLP"] == 2 and after["RMSNorm"] == 5
    assert after["Embedding"] == 1 and after["LMHead"] == 1
    for op in ("Softmax", "MatMul", "Pow", "ReduceMean", "Sqrt", "Sigmoid", "Where", "Trilu"):
        assert op not in after, op
    assert sum(tiny_lowered.histogram_before.values()) > 3 * sum(after.values())
    assert tiny_lowered.stages[zlc.STAGES.index("raise")].stats["attention"] == 2


def test_refusals_are_rule_reason_count(tiny_lowered: Any) -> None:
    for rule, reasons in tiny_lowered.refused.items():
        assert isinstance(rule, str) and reasons
        assert all(isinstance(r, str) and r and isinstance(n, int) and n > 0 for r, n in reasons.items())


def test_kv_cache_buffers(tiny_lowered: Any) -> None:
    assert tiny_lowered.prefill is not None and tiny_lowered.decode is not None
    names = [n for n, _ in tiny_lowered.cache]
    assert names == [v.name for v in tiny_lowered.decode.state]
    assert len(names) == 4  # key and value for 2 layers
    assert all(t.shape == (1, 2, 64, 16) for _, t in tiny_lowered.cache)  # [batch, kv heads, max_seq, dim]


def test_options_are_frozen_and_keyed() -> None:
    a, b = zlc.CompileOptions(max_seq=64), zlc.CompileOptions(max_seq=64)
    assert a == b and hash(a) == hash(b) and a.key() == b.key()
    assert a.key() != zlc.CompileOptions(max_seq=128).key()
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_seq = 1  # type: ignore[misc]


def test_without_raising_there_is_no_cache(tiny_onnx: Path) -> None:
    plain = zlc.lower(tiny_onnx, options=zlc.CompileOptions(raise_ops=False, kv_cache=False))
    assert plain.prefill is None and "Attention" not in plain.histogram_after
    with pytest.raises(zlc.ZlcError, match="without a KV cache"):
        zlc.ReferenceSession.from_lowered(plain)
    with pytest.raises(zlc.PassError, match="needs raising"):
        zlc.lower(tiny_onnx, options=zlc.CompileOptions(raise_ops=False))


# ---- inputs ---------------------------------------------------------------------------------------

def test_load_model_accepts_a_model_proto(tiny_onnx: Path) -> None:
    g = zlc.load_model(onnx.load(str(tiny_onnx)))
    assert not g.inputs[0].dtype.is_float and len(g.outputs[0].shape or ()) == 3


@pytest.mark.parametrize("model, match", [
    ("/nonexistent/model.onnx", "not found"),
    (42, "cannot compile an object of type int"),
])
def test_load_model_errors(model: Any, match: str) -> None:
    with pytest.raises(zlc.ZlcError, match=match):
        zlc.load_model(model)


# ---- verify and generate --------------------------------------------------------------------------

def test_verify_api(tiny_onnx: Path) -> None:
    rep = zlc.verify(tiny_onnx, prompt_len=5, steps=6, seed=3)
    assert rep.ok and rep.tokens_equal and len(rep.prompt) == 5
    assert len(rep.tokens_ref) == 6 and len(rep.decode_max_abs) == 5
    assert rep.summary().endswith("PASS (atol 0.001; oracle: ONNX Runtime)")


def test_verify_rejects_out_of_vocabulary_prompt(tiny_onnx: Path, tiny_lowered: Any) -> None:
    vocab = tiny_lowered.graph.outputs[0].shape[-1]
    with pytest.raises(zlc.ZlcError, match=rf"\[{vocab}\] outside the vocabulary \[0, {vocab}\)"):
        zlc.verify(tiny_onnx, prompt_ids=[1, vocab], steps=2)


def test_verify_rejects_max_seq_below_prompt_plus_steps(tiny_onnx: Path) -> None:
    with pytest.raises(zlc.ZlcError, match="exceed max_seq=10"):
        zlc.verify(tiny_onnx, prompt_len=8, steps=4, max_seq=10)


def test_session_generate(tiny_lowered: Any) -> None:
    sess = zlc.ReferenceSession.from_lowered(tiny_lowered)
    greedy = sess.generate([1, 2, 3], 10)
    assert len(greedy) == 10 and greedy == sess.generate([1, 2, 3], 10)  # reset between runs
    sampled = sess.generate([1, 2, 3], 10, temperature=1.0, seed=7)
    assert sampled == sess.generate([1, 2, 3], 10, temperature=1.0, seed=7)
    with pytest.raises(zlc.ZlcError, match="exceed max_seq"):
        sess.generate(list(range(60)), 10)


# ---- the decode-vs-prefill invariant and the torch module's reference ----------------------------

def test_every_lowering_checks_decode_against_prefill(tiny_lowered: Any) -> None:
    stats = tiny_lowered.stages[-1].stats
    assert tiny_lowered.stages[-1].name == "kv-cache"
    assert stats["decode_checked"] == 4 and stats["decode_max_abs"] < 1e-4 and stats["decode_check_ms"] >= 0


def test_compile_of_a_module_checks_decode_steps_against_it(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch

    from zlc.testing import zoo

    model = zoo.hf_model("llama")
    res = zlc.compile(model, example_inputs=(torch.tensor([[3, 14, 15, 92, 65]]),), out=tmp_path / "m",
                      max_seq=32, stop_after="verify")
    assert res.build is not None
    v = res.build.verification
    assert v["reference"] == "torch module" and v["ok"] and v["tokens_equal"]
    assert "4 decode steps" in v["summary"]


def test_compile_of_a_module_that_does_not_fit_names_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-J with its rotary refused by raising (every zoo family compiles) stands for a model whose
    rotary raising does not recognise."""
    pytest.importorskip("transformers")
    import torch

    from zlc.passes import raise_rope_forms
    from zlc.testing import zoo
    from zlc.verifier import NotCompilableError

    monkeypatch.setattr(raise_rope_forms, "rotary_tables", lambda *a, **k: "refused for the test")
    with pytest.raises(NotCompilableError, match="rotary embedding that raising did not recognise"):
        zlc.compile(zoo.hf_model("gptj"), example_inputs=(torch.tensor([[3, 14, 15]]),), out=tmp_path / "c",
                    max_seq=32)
