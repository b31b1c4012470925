"""CodeGen's fused QKV with several heads per mp_num group (passes/raise_blocks.py `heads_qkv`), and
`Positions` as a shape-only read of the token ids (passes/probe.py `value_inputs`), on graphs built
here and checked against the reference executor. The real exports: tests/test_family_torch_rotary.py."""

from __future__ import annotations

import numpy as np
import pytest

from zlc.ir import DType, Graph, TensorType, Value, verify_graph
from zlc.passes import probe
from zlc.passes.raise_blocks import HEADS_QKV
from zlc.passes.raising import raising_rules
from zlc.reference.executor import run_graph

F32 = DType.f32
RULES = raising_rules("raise-blocks", [HEADS_QKV])


def _i64(g: Graph, *xs: int) -> Value:
    return g.add_const("i", np.array(xs, dtype=np.int64), unique=True)


def _codegen_qkv(groups: int, heads: int, dim: int, seq: int, rng: np.random.Generator) -> Graph:
    """Linear -> Reshape [1, T, G, 3 * local] -> Split into q, v, k -> each Reshape [1, T, H, D]."""
    hidden = heads * dim
    local = hidden // groups
    g = Graph("codegen")
    x = g.add_input("x", TensorType(F32, (1, seq, hidden)))
    w = g.add_const("w", (rng.standard_normal((3 * hidden, hidden)) / np.sqrt(hidden)).astype(np.float32))
    lin = g.op("Linear", x, w)
    grouped = g.op("Reshape", lin, _i64(g, 1, -1, groups, 3 * local))
    parts = g.add_node("Split", [grouped], {"axis": 3, "split": [local] * 3}, n_outputs=3).outputs
    g.outputs = [g.op("Reshape", p, _i64(g, 1, -1, heads, dim)) for p in parts]
    return g


@pytest.mark.parametrize(("groups", "heads", "dim"), [(4, 8, 8), (4, 16, 4), (2, 6, 4), (4, 4, 8)])
def test_grouped_qkv_becomes_three_projections_reshaped_to_heads(groups: int, heads: int, dim: int) -> None:
    rng = np.random.default_rng(groups * 100 + heads)
    g = _codegen_qkv(groups, heads, dim, 5, rng)
    feeds = {"x": rng.standard_normal((1, 5, heads * dim)).astype(np.float32)}
    before = run_graph(g, feeds)
    stats = RULES.apply(g).applied
    verify_graph(g)
    assert stats.get("heads_qkv") == 1, stats
    after = run_graph(g, feeds)
    for k, v in before.items():
        np.testing.assert_allclose(np.asarray(after[k]), np.asarray(v), atol=1e-5, rtol=1e-5)
    # three Linears, each reshaped straight to [1, T, H, D] when a group holds several heads; with
    # one head per group the graph's own [1, T, H, D] reshape stays (canonicalize drops it as a no-op)
    assert g.op_histogram() == {"Linear": 3, "Reshape": 3 if heads > groups else 6}, g.op_histogram()
    if heads > groups:
        for out in g.outputs:
            assert out.producer is not None and out.producer.inputs[0].producer.op == "Linear"  # type: ignore[union-attr]


def test_positions_reads_the_ids_extent_only() -> None:
    """A table gathered at Positions(ids) depends on the ids through their shape alone."""
    g = Graph("positions")
    ids = g.add_input("input_ids", TensorType(DType.i64, (1, "seq")))
    past = g.add_input("past_len", TensorType(DType.i64, ()))
    table = g.add_const("table", np.arange(64, dtype=np.float32).reshape(32, 2))
    stateless = g.op("Embedding", table, g.op("Positions", ids))
    cached = g.op("Embedding", table, g.op("Positions", ids, past))
    g.outputs = [stateless, cached]
    assert probe.value_inputs(g, [stateless]) == (set(), {"input_ids"})
    assert probe.value_inputs(g, [cached]) == ({"past_len"}, {"input_ids"})
    assert probe.is_position_only(g, [stateless]) is None
    assert probe.is_position_only(g, [g.op("Embedding", table, ids)]) is not None  # the ids' values
