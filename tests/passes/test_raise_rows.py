"""`raise-rows` (passes/raise_rows.py): constant scales folded into the projection before them (or,
on the logits, into the norm before the head), and token rows an export flattened put back into
[1, T, H]. Each rewrite is checked against the reference executor on graphs built here (random
shapes and data), and on the real OPT export, where the two together let the megakernel run it
(Granite's bundle test is in tests/test_verify_models.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zlc
from zlc.ir import DType, Graph, TensorType, Value, verify_graph
from zlc.passes.raise_rows import CENTRED_RMSNORM, LINEAR_DIVIDE, LINEAR_SCALE, UNFLATTEN_ROWS
from zlc.passes.raising import raising_rules
from zlc.reference.executor import run_graph

F32 = DType.f32
ROWS = raising_rules("raise-rows", [LINEAR_SCALE, LINEAR_DIVIDE, CENTRED_RMSNORM, UNFLATTEN_ROWS])


def _w(g: Graph, rng: np.random.Generator, *shape: int) -> Value:
    return g.add_const("w", (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32), unique=True)


def _flat_block(hidden: int, seq: int, rng: np.random.Generator, *, mix: str = "") -> Graph:
    """x[1, T, H] -> Reshape [T, H] -> LayerNorm -> MLP (relu) -> + residual -> * s -> Reshape [1, T, H],
    OPT's feed-forward block; `mix="transpose"` puts a non-row-wise op in it, `mix="outside"` adds
    a value from outside the flattened region."""
    g = Graph("flat")
    x = g.add_input("x", TensorType(F32, (1, seq, hidden)))
    flat = g.op("Reshape", x, g.add_const("s", np.array([-1, hidden], dtype=np.int64), unique=True))
    ln = g.op("LayerNorm", flat, g.add_const("g", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)),
              g.add_const("b", (0.1 * rng.standard_normal(hidden)).astype(np.float32)), eps=1e-5)
    mlp = g.op("MLP", ln, _w(g, rng, 2 * hidden, hidden), _w(g, rng, 2 * hidden),
               _w(g, rng, hidden, 2 * hidden), _w(g, rng, hidden), activation="relu")
    y = g.op("Add", flat, mlp)
    if mix == "transpose":
        y = g.op("Transpose", y, perm=[1, 0])
        y = g.op("Transpose", y, perm=[1, 0])
    elif mix == "outside":
        y = g.op("Add", y, g.op("Reshape", g.op("Relu", x), g.add_const("s2", np.array([-1, hidden], dtype=np.int64))))
    y = g.op("Mul", y, g.const_scalar(0.5, F32))
    g.outputs = [g.op("Reshape", y, g.add_const("s3", np.array([1, -1, hidden], dtype=np.int64)))]
    return g


@settings(max_examples=15, deadline=None)
@given(hidden=st.integers(2, 24), seq=st.integers(1, 7), seed=st.integers(0, 99))
def test_unflatten_rows_keeps_the_numbers(hidden: int, seq: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = _flat_block(hidden, seq, rng)
    x = rng.standard_normal((1, seq, hidden)).astype(np.float32)
    before = run_graph(g, {"x": x})
    stats = ROWS.apply(g).applied
    verify_graph(g)
    assert stats["unflatten_rows"] == 1 and "Reshape" not in g.op_histogram()
    assert all(len(n.output.shape) == 3 for n in g.nodes)  # every op runs on [1, T, H]
    after = run_graph(g, {"x": x})
    np.testing.assert_allclose(next(iter(after.values())), next(iter(before.values())), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("mix", "reason"), [("transpose", "Transpose '"), ("outside", "a value from outside")])
def test_unflatten_rows_refuses_what_is_not_row_wise(mix: str, reason: str) -> None:
    g = _flat_block(8, 3, np.random.default_rng(0), mix=mix)
    res = ROWS.apply(g)
    assert "unflatten_rows" not in res.applied and g.op_histogram()["Reshape"] >= 2
    assert any(reason in r for r in res.refused.get("unflatten_rows", {})), res.refused


def _scaled(op: str, hidden: int, seq: int, rng: np.random.Generator, *, div: bool = False,
            to_output: bool = False, norm: str | None = None) -> Graph:
    """x -> [norm] -> op (Linear with bias, MLP, GatedMLP) -> * 0.3 (or / 2.5) -> [Relu]."""
    g = Graph("scaled")
    x = g.add_input("x", TensorType(F32, (1, seq, hidden)))
    if norm == "RMSNorm":
        x = g.op("RMSNorm", x, g.add_const("g", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)), eps=1e-6)
    elif norm == "LayerNorm":
        x = g.op("LayerNorm", x, g.add_const("g", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)),
                 g.add_const("b", (0.1 * rng.standard_normal(hidden)).astype(np.float32)), eps=1e-5)
    if op == "Linear":
        y = g.op("Linear", x, _w(g, rng, hidden, hidden), _w(g, rng, hidden))
    elif op == "MLP":
        y = g.op("MLP", x, _w(g, rng, 2 * hidden, hidden), _w(g, rng, 2 * hidden), _w(g, rng, hidden, 2 * hidden),
                 _w(g, rng, hidden), activation="relu")
    else:
        y = g.op("GatedMLP", x, _w(g, rng, 2 * hidden, hidden), _w(g, rng, 2 * hidden, hidden),
                 _w(g, rng, hidden, 2 * hidden), activation="silu")
    y = g.op("Div", y, g.const_scalar(2.5, F32)) if div else g.op("Mul", g.const_scalar(0.3, F32), y)
    g.outputs = [y if to_output else g.op("Relu", y)]
    return g


def _same_numbers(g: Graph, rule: str, want_ops: dict[str, int], seq: int = 5, hidden: int = 16) -> None:
    x = np.random.default_rng(7).standard_normal((1, seq, hidden)).astype(np.float32)
    before = run_graph(g, {"x": x})
    assert ROWS.apply(g).applied.get(rule) == 1
    verify_graph(g)
    assert g.op_histogram() == want_ops
    np.testing.assert_allclose(next(iter(run_graph(g, {"x": x}).values())), next(iter(before.values())),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("op", ["Linear", "MLP", "GatedMLP"])
@pytest.mark.parametrize("div", [False, True])
def test_a_scale_folds_into_the_projection(op: str, div: bool) -> None:
    g = _scaled(op, 16, 5, np.random.default_rng(1), div=div)
    _same_numbers(g, "linear_divide" if div else "linear_scale", {op: 1, "Relu": 1})


@pytest.mark.parametrize("norm", ["RMSNorm", "LayerNorm"])
def test_a_scale_on_the_logits_goes_into_the_norm_before_the_head(norm: str) -> None:
    """Granite's logits / logits_scaling: the head's weights (maybe a tied table) stay as they are."""
    g = _scaled("Linear", 16, 5, np.random.default_rng(3), div=True, to_output=True, norm=norm)
    head_w = next(n for n in g.nodes if n.op == "Linear").inputs[1]
    _same_numbers(g, "linear_divide", {norm: 1, "Linear": 1})
    assert next(n for n in g.nodes if n.op == "Linear").inputs[1] is head_w


def test_a_scale_on_the_logits_without_a_norm_stays() -> None:
    g = _scaled("Linear", 16, 5, np.random.default_rng(2), to_output=True)
    res = ROWS.apply(g)
    assert "linear_scale" not in res.applied and g.op_histogram() == {"Linear": 1, "Mul": 1}
    assert any("scales the logits" in r for r in res.refused.get("linear_scale", {}))


# ---- on the real export -------------------------------------------------------------------------

def test_opt_raises_to_the_megakernel_form() -> None:
    """OPT: the q scale is in the q projection, the feed-forward block runs on [1, T, H], and the
    lowered model equals the one without raise-rows (stopped after raise-heads) on the reference."""
    pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")
    from zlc.testing import zoo

    path = zoo.cached("stateless", "opt", 20)
    opts = zlc.CompileOptions(max_seq=64)
    full = zlc.lower(path, options=opts)
    assert full.stages[[s.name for s in full.stages].index("raise")].stats["linear_scale"] == 2
    hist = full.decode.op_histogram()
    assert "Reshape" not in hist and "Mul" not in hist
    before = zlc.lower(path, options=opts, stop_after="raise-heads").graph
    ids = np.array([[3, 14, 15, 92, 65, 35]], dtype=np.int64)
    want = next(iter(run_graph(before, {"input_ids": ids}).values()))
    got = zlc.lower(path, options=opts, stop_after="cleanup").graph
    np.testing.assert_allclose(next(iter(run_graph(got, {"input_ids": ids}).values())), want, atol=1e-5, rtol=1e-5)


# ---- mean-centred RMSNorm ---------------------------------------------------------------------------

def _centred(hidden: int, seq: int, rng: np.random.Generator, axis: int = -1) -> Graph:
    g = Graph("centred")
    x = g.add_input("x", TensorType(F32, (1, seq, hidden)))
    c = g.op("Sub", x, g.op("ReduceMean", x, axes=[axis], keepdims=1))
    w = g.add_const("w", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    g.outputs = [g.op("Relu", g.op("RMSNorm", c, w, eps=1e-5))]
    return g


@settings(max_examples=15, deadline=None)
@given(hidden=st.integers(2, 40), seq=st.integers(1, 7), seed=st.integers(0, 99))
def test_centred_rmsnorm_is_layernorm_without_bias(hidden: int, seq: int, seed: int) -> None:
    """Cohere's LayerNorm without bias, as raising first sees it: RMSNorm(x - mean(x))."""
    rng = np.random.default_rng(seed)
    g = _centred(hidden, seq, rng)
    x = (3 + rng.standard_normal((1, seq, hidden))).astype(np.float32)  # a mean far from 0
    before = run_graph(g, {"x": x})
    assert ROWS.apply(g).applied.get("centred_rmsnorm") == 1
    verify_graph(g)
    assert g.op_histogram() == {"LayerNorm": 1, "Relu": 1}
    ln = next(n for n in g.nodes if n.op == "LayerNorm")
    assert len([v for v in ln.inputs if v is not None]) == 2 and ln.attrs["eps"] == 1e-5
    np.testing.assert_allclose(next(iter(run_graph(g, {"x": x}).values())), next(iter(before.values())),
                               atol=1e-4, rtol=1e-4)


def test_centred_rmsnorm_needs_the_mean_over_the_last_axis() -> None:
    g = _centred(8, 4, np.random.default_rng(0), axis=1)
    res = ROWS.apply(g)
    assert "centred_rmsnorm" not in res.applied and "RMSNorm" in g.op_histogram()
    assert "not centred by the keepdims mean over the last axis" in res.refused.get("centred_rmsnorm", {})
