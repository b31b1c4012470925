"""The decode-vs-prefill invariant (passes/kv_check.py) and the rebasing of position arithmetic on
the cache's past length (passes/positions.py), on real exports from the zoo.

Every lowering runs the invariant: these tests check that it passes on every zoo family and export
route, that it fails loudly (naming the step and the node) on planted position bugs, and that the
rebasing leaves no position arithmetic counting from 0 in a decode graph.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

import zlc  # noqa: E402
from zlc.passes import positions  # noqa: E402
from zlc.passes.kv_cache import synthesize_kv_cache  # noqa: E402
from zlc.passes.kv_check import DecodeMismatchError, check_decode_matches_prefill  # noqa: E402
from zlc.testing import zoo  # noqa: E402
from zlc.testing.families import CORE_FAMILIES, POSITION_FAMILIES  # noqa: E402

OPTS = zlc.CompileOptions(max_seq=64)
ROUTES = ([("stateless", f) for f in sorted(CORE_FAMILIES)] + [("stateless", f) for f in POSITION_FAMILIES]
          + [("stateless", "llama", 23), ("stateless_sdpa", "gpt2", 23)]
          + [("optimum_kv", f) for f in ("llama", "gpt2", "opt", "gptj")] + [("optimum_kv_dynamo", "qwen2")])


def _path(route: tuple[Any, ...]) -> Path:
    kind, family, *opset = route
    return zoo.cached(kind, family, opset[0] if opset else 20)


def _kv_stats(lowered: Any) -> dict[str, Any]:
    assert lowered.stages[-1].name == "kv-cache"
    return dict(lowered.stages[-1].stats)


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: "-".join(map(str, r)))
def test_the_invariant_holds_on_every_zoo_family(route: tuple[Any, ...]) -> None:
    stats = _kv_stats(zlc.lower(_path(route), options=OPTS))
    assert stats["decode_checked"] == 4  # a step, a 2-token chunk on the cache, a step past it
    assert stats["decode_max_abs"] < 1e-4


@pytest.mark.parametrize("kind", ["genai", "genai_mha"])
def test_the_invariant_holds_on_genai_graphs(kind: str) -> None:
    if not zoo.genai_available():
        pytest.skip("onnxruntime-genai's model builder is not installed")
    assert _kv_stats(zlc.lower(zoo.cached(kind, "llama"), options=OPTS))["decode_checked"] == 4


def test_planted_position_bug_names_the_step_and_the_node(tiny_lowered: Any) -> None:
    """Negative control: decode positions made to start at 0 (Positions without past_len)."""
    cm = synthesize_kv_cache(tiny_lowered.graph, 64)
    assert check_decode_matches_prefill(cm) is not None  # as synthesized: exact
    planted = [n for n in cm.decode.nodes if n.op == "Positions"]
    assert planted
    for n in planted:
        n.inputs = n.inputs[:1]
    with pytest.raises(DecodeMismatchError) as e:
        check_decode_matches_prefill(cm)
    msg = str(e.value)
    assert e.value.exit_code == zlc.VerificationError.exit_code == 3
    assert "decode step at position 3 (past_len 3)" in msg
    assert f"Positions '{planted[0].name}'" in msg and "reaches RoPE" in msg


def _keep_rotary_op_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-J's, CodeGen's and Cohere's interleaved rotary raises into RoPE over Positions, which
    absorbs their Range; with that rule refused, their own position arithmetic stays in the graph
    (a model whose rotary raising does not recognise) and only the rebasing can make decode right."""
    from zlc.passes import raise_rope_forms

    monkeypatch.setattr(raise_rope_forms, "rotary_tables", lambda *a, **k: "refused for the test")


@pytest.mark.parametrize(("family", "root"), [("gptj", "Range"), ("opt", "CumSum"), ("cohere", "Range")])
def test_unrebased_position_arithmetic_is_an_error_naming_it(family: str, root: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: without the rebasing, the families' own position arithmetic (GPT-J's sin/cos
    rows gathered at Range(0, T), OPT's CumSum of the mask, Cohere's Range times frequencies)
    counts from 0 in decode, and lowering refuses the model instead of returning it."""
    monkeypatch.setattr(positions, "rebase_positions", lambda g, ids, past_len, pos: ([], pos))
    _keep_rotary_op_level(monkeypatch)
    with pytest.raises(DecodeMismatchError, match=rf"decode step at position 3 .* {root} '[^']+' \(reaches "):
        zlc.lower(zoo.cached("stateless", family, 20), options=OPTS)


def test_the_torch_export_route_is_checked_too(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    model = zoo.hf_model("opt")
    monkeypatch.setattr(positions, "rebase_positions", lambda g, ids, past_len, pos: ([], pos))
    with pytest.raises(DecodeMismatchError, match="CumSum"):
        zlc.lower(model, (torch.tensor([[3, 14, 15, 92, 65]]),), options=OPTS)


# ---- what the rebasing leaves -------------------------------------------------------------------

def _ops_reading(g: Any, op: str) -> list[Any]:
    return [n for n in g.nodes if n.op == op]


def test_opt_learned_positions_become_a_table_from_row_2() -> None:
    """OPT: Embedding(W[258, H], CumSum(mask) - 1 + 2) -> Embedding(W[2:], Positions(ids, past_len)),
    the form the megakernel's embedding task reads (GPT-2's, with the table's first rows dropped)."""
    lowered = zlc.lower(zoo.cached("stateless", "opt", 20), options=OPTS)
    assert _kv_stats(lowered)["positions_rebased"] == 1
    for g in (lowered.prefill, lowered.decode):
        assert not {"CumSum", "Range", "Cast", "Sub"} & set(g.op_histogram())
        pos_emb = [n for n in _ops_reading(g, "Embedding") if n.inputs[1].producer is not None]
        assert len(pos_emb) == 1
        table, idx = pos_emb[0].inputs
        assert idx.producer.op == "Positions" and idx.producer.inputs[1].name == "past_len"
        assert table.shape == (256, 64)  # max_position_embeddings rows: 258 - the offset of 2


def test_optimum_opt_position_ids_plus_2_fold_into_the_table() -> None:
    lowered = zlc.lower(zoo.cached("optimum_kv", "opt", 20), options=OPTS)
    emb = [n for n in _ops_reading(lowered.decode, "Embedding") if n.inputs[1].producer is not None]
    assert [n.inputs[1].producer.op for n in emb] == ["Positions"] and emb[0].inputs[0].shape[0] == 256


@pytest.mark.parametrize("family", ["gptj", "codegen", "cohere"])
def test_rotary_positions_are_rebased(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-J/CodeGen gather sin/cos rows at Range(0, T), Cohere multiplies frequencies by it: with
    their rotary left op-level, in the decode graph that Range is Positions(ids, past_len),
    reshaped (and cast) like it."""
    _keep_rotary_op_level(monkeypatch)
    lowered = zlc.lower(zoo.cached("stateless", family, 20), options=OPTS)
    assert _kv_stats(lowered)["positions_rebased"] == 1
    for g in (lowered.prefill, lowered.decode):
        assert "Range" not in g.op_histogram()
        (pos,) = _ops_reading(g, "Positions")
        assert pos.inputs[1].name == "past_len"
    assert positions.unabsorbed_positions(lowered.prefill, lowered.decode) == []


def test_llama_needs_no_rebasing(tiny_lowered: Any) -> None:
    assert "positions_rebased" not in _kv_stats(tiny_lowered)
    assert positions.unabsorbed_positions(tiny_lowered.prefill, tiny_lowered.decode) == []


def test_find_aranges_reports_offsets() -> None:
    """The probe sees OPT's position index as arange + 2 along the token axis of a [1, T] value."""
    g = zlc.lower(zoo.cached("stateless", "opt", 20), options=OPTS, stop_after="cleanup").graph
    found = positions.find_aranges(g, positions.shape_only_nodes(g))
    assert {(a.offset, a.rank, a.axis) for a in found if a.value.dtype.value == "i64"} >= {(2, 2, 1)}
    assert all(re.fullmatch(r"[\w.]+", a.value.name) for a in found)


def test_probe_ids_stay_in_the_vocabulary() -> None:
    from zlc.passes.kv_check import probe_ids

    ids = probe_ids(7, 5)
    assert len(ids) == 7 and all(0 <= i < 5 for i in ids) and len(set(probe_ids(7, 256))) == 7


# ---- half precision: the tolerance follows the logits' type, and still catches position bugs -----

@pytest.mark.parametrize("kind", ["stateless_f16", "stateless_bf16"])
def test_the_invariant_holds_in_half_precision_and_still_catches_bugs(kind: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-J cast to f16 / bf16: rebased, decode equals prefill within the half type's rounding; with
    the rebasing disabled (and the rotary left op-level) the same check fails (a position bug is off by the logits' own size, far
    beyond even bf16's 8-ulp tolerance)."""
    path = zoo.cached(kind, "gptj", 20)
    lowered = zlc.lower(path, options=OPTS)
    assert lowered.decode.outputs[0].dtype.value == kind.removeprefix("stateless_")
    assert _kv_stats(lowered)["decode_checked"] == 4
    monkeypatch.setattr(positions, "rebase_positions", lambda g, ids, past_len, pos: ([], pos))
    _keep_rotary_op_level(monkeypatch)
    with pytest.raises(DecodeMismatchError, match=r"decode step at position 3 .* Range '"):
        zlc.lower(path, options=OPTS)
