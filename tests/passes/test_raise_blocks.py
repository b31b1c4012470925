"""Partial rotary (passes/raise_rope_forms.py `rope_partial`) and the GPT-NeoX lineage's block layouts
(passes/raise_blocks.py: `heads_qkv`, `parallel_residual`), each checked against the reference
executor on graphs built here (random shapes and data), with the IR they leave. The real StableLM,
Phi-2 and GPT-NeoX exports through the megakernel are in tests/test_verify_models.py."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.ir import DType, Graph, TensorType, Value, verify_graph
from zlc.passes.raise_blocks import HEADS_QKV, PARALLEL_RESIDUAL
from zlc.passes.raise_rope_forms import ROPE_PARTIAL
from zlc.passes.raising import raising_rules
from zlc.reference.executor import run_graph

F32 = DType.f32
RULES = raising_rules("raise-blocks", [ROPE_PARTIAL, HEADS_QKV, PARALLEL_RESIDUAL])


def _i64(g: Graph, *xs: int) -> Value:
    return g.add_const("i", np.array(xs, dtype=np.int64), unique=True)


def _w(g: Graph, rng: np.random.Generator, *shape: int) -> Value:
    return g.add_const("w", (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32), unique=True)


def _same(g: Graph, feeds: dict[str, np.ndarray], fired: str) -> Graph:
    before = run_graph(g, feeds)
    stats = RULES.apply(g).applied
    verify_graph(g)
    assert stats.get(fired, 0) >= 1, stats
    after = run_graph(g, feeds)
    for k, v in before.items():
        np.testing.assert_allclose(np.asarray(after[k]), np.asarray(v), atol=1e-5, rtol=1e-5)
    return g


def _partial_rope(heads: int, seq: int, dim: int, rot: int, interleaved: int, *, end: int | None = None) -> Graph:
    g = Graph("partial")
    x = g.add_input("x", TensorType(F32, (1, heads, seq, dim)))
    pos = g.add_input("pos", TensorType(DType.i64, (1, seq)))
    inv = 1.0 / (10000 ** (np.arange(rot // 2) / (rot // 2)))
    ang = np.arange(64)[:, None] * inv[None, :]
    cos, sin = (g.add_const(n, f(ang).astype(np.float32)) for n, f in (("cos", np.cos), ("sin", np.sin)))
    head = g.op("Slice", x, _i64(g, 0), _i64(g, rot), _i64(g, -1))
    tail = g.op("Slice", x, _i64(g, rot), _i64(g, end if end is not None else 2**62), _i64(g, -1))
    g.outputs = [g.op("Concat", g.op("RoPE", head, cos, sin, pos, interleaved=interleaved), tail, axis=-1)]
    return g


@settings(max_examples=12, deadline=None)
@given(heads=st.integers(1, 3), seq=st.integers(1, 6), half=st.integers(1, 4), extra=st.integers(1, 6),
       interleaved=st.sampled_from([0, 1]), seed=st.integers(0, 99))
def test_partial_rope_is_one_rope_over_the_head(heads: int, seq: int, half: int, extra: int, interleaved: int,
                                                seed: int) -> None:
    rot, dim = 2 * half, 2 * half + extra
    rng = np.random.default_rng(seed)
    g = _partial_rope(heads, seq, dim, rot, interleaved)
    feeds = {"x": rng.standard_normal((1, heads, seq, dim)).astype(np.float32),
             "pos": np.arange(3, 3 + seq, dtype=np.int64)[None]}
    _same(g, feeds, "rope_partial")
    (rope,) = [n for n in g.nodes if n.op == "RoPE"]
    assert g.op_histogram() == {"RoPE": 1} and rope.inputs[0] is g.inputs[0]  # the whole head
    assert rope.attrs["interleaved"] == interleaved


def test_partial_rope_refuses_a_pass_through_that_drops_features() -> None:
    g = _partial_rope(2, 3, 12, 4, 0, end=10)  # x[..., 4:10]: two features lost, not a RoPE
    res = RULES.apply(g)
    assert "rope_partial" not in res.applied and "Concat" in g.op_histogram()
    assert any("not Concat(RoPE" in r for r in res.refused.get("rope_partial", {})), res.refused


def _neox_qkv(heads: int, dim: int, hidden: int, seq: int, rng: np.random.Generator) -> Graph:
    """Linear -> SplitHeads(heads, 3*dim each) -> Split into q, k, v per head: GPT-NeoX's layout."""
    g = Graph("neox")
    x = g.add_input("x", TensorType(F32, (1, seq, hidden)))
    lin = g.op("Linear", x, _w(g, rng, 3 * heads * dim, hidden), _w(g, rng, 3 * heads * dim))
    q, k, v = g.add_node("Split", [g.op("SplitHeads", lin, heads=heads)], {"axis": 3, "split": [dim] * 3},
                         n_outputs=3).outputs
    g.outputs = [g.op("Attention", q, k, v, causal=1)]
    return g


@settings(max_examples=10, deadline=None)
@given(heads=st.integers(1, 4), dim=st.integers(1, 6), hidden=st.integers(2, 12), seq=st.integers(1, 5),
       seed=st.integers(0, 99))
def test_per_head_fused_qkv_becomes_three_projections(heads: int, dim: int, hidden: int, seq: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = _neox_qkv(heads, dim, hidden, seq, rng)
    _same(g, {"x": rng.standard_normal((1, seq, hidden)).astype(np.float32)}, "heads_qkv")
    assert g.op_histogram() == {"Linear": 3, "SplitHeads": 3, "Attention": 1}
    att = next(n for n in g.nodes if n.op == "Attention")
    for v in att.inputs[:3]:
        assert v is not None and v.producer is not None and v.producer.op == "SplitHeads"
        assert v.producer.inputs[0].shape == (1, seq, heads * dim)  # type: ignore[union-attr]


def _parallel(order: str, hidden: int, seq: int, rng: np.random.Generator) -> Graph:
    """x + attn_out + mlp_out in `order` (the terms' names, summed left to right), as the exporter
    wrote it: GPT-NeoX "mab", Phi-2 and GPT-J "amx", Cohere "xam"."""
    g = Graph("parallel")
    x = g.add_input("x", TensorType(F32, (1, seq, hidden)))
    attn = g.op("Linear", g.op("Relu", x), _w(g, rng, hidden, hidden), _w(g, rng, hidden))
    mlp = g.op("MLP", g.op("Tanh", x), _w(g, rng, 2 * hidden, hidden), _w(g, rng, 2 * hidden),
               _w(g, rng, hidden, 2 * hidden), _w(g, rng, hidden), activation="gelu")
    terms = {"x": x, "a": attn, "m": mlp}
    g.outputs = [g.op("Add", g.op("Add", terms[order[0]], terms[order[1]]), terms[order[2]])]
    return g


@pytest.mark.parametrize("order", ["max", "amx", "xam", "mxa", "xma"])
@settings(max_examples=5, deadline=None)
@given(hidden=st.integers(2, 16), seq=st.integers(1, 5), seed=st.integers(0, 99))
def test_parallel_residual_sum_is_x_plus_first_then_second(order: str, hidden: int, seq: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = _parallel(order.replace("b", "x"), hidden, seq, rng)
    feeds = {"x": rng.standard_normal((1, seq, hidden)).astype(np.float32)}
    before = run_graph(g, feeds)
    res = RULES.apply(g)
    verify_graph(g)
    after = run_graph(g, feeds)
    np.testing.assert_allclose(next(iter(after.values())), next(iter(before.values())), atol=1e-5, rtol=1e-5)
    # the golden form: Add(Add(x, Linear), MLP) -- the attention projection is computed first here
    out = g.outputs[0].producer
    assert out is not None and out.op == "Add"
    inner, second = out.inputs
    assert second is not None and second.producer is not None and second.producer.op == "MLP"
    assert inner is not None and inner.producer is not None and inner.producer.op == "Add"
    x, first = inner.producer.inputs
    assert x is g.inputs[0] and first is not None and first.producer is not None and first.producer.op == "Linear"
    assert res.applied.get("parallel_residual", 0) == (0 if order == "xam" else 1)


def test_sequential_residuals_are_left_alone() -> None:
    """(x + attn) feeds the next norm too: not a 3-way sum, nothing to re-associate."""
    rng = np.random.default_rng(0)
    g = Graph("sequential")
    x = g.add_input("x", TensorType(F32, (1, 3, 8)))
    h = g.op("Add", x, g.op("Linear", g.op("Relu", x), _w(g, rng, 8, 8)))
    g.outputs = [g.op("Add", h, g.op("Linear", g.op("Tanh", h), _w(g, rng, 8, 8)))]
    res = RULES.apply(g)
    assert "parallel_residual" not in res.applied
    assert any("other uses" in r or "not a sum" in r for r in res.refused.get("parallel_residual", {})), res.refused
