"""Property test: random small graphs of elementwise / reshape / transpose ops with random static
shapes compute the same outputs (reference executor) before and after fold + canonicalize + cse +
dce, keep their output names, and stay valid IR."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zlc.ir import DType, Graph, TensorType, Value, verify_graph
from zlc.passes import Canonicalize, CommonSubexpressionElimination, DeadCodeElimination, FoldConstants
from zlc.passes.base import run_passes
from zlc.reference.executor import run_graph

UNARY = ["Neg", "Abs", "Tanh", "Sigmoid", "Relu", "Identity"]
KINDS = ["unary", "neg_neg", "cast", "binary_const", "binary_pool", "reshape", "reshape_shape",
         "transpose", "transpose_pair", "unsqueeze", "expand", "const_subgraph", "dup"]


def _shape(v: Value) -> list[int]:
    return [int(d) for d in v.shape or ()]


def _i64(g: Graph, xs: list[int]) -> Value:
    return g.add_const("s", np.array(xs, np.int64), unique=True)


def _reshape_target(draw: st.DrawFn, shape: list[int]) -> list[int]:
    n = math.prod(shape)
    options = [[n], list(reversed(shape)), shape + [1], [1] + shape, list(shape)]
    t = list(draw(st.sampled_from(options)))
    if t and draw(st.booleans()):
        t[draw(st.integers(0, len(t) - 1))] = -1
    elif len(t) == len(shape) and t and draw(st.booleans()):
        i = draw(st.integers(0, len(t) - 1))
        if t[i] == shape[i]:
            t[i] = 0  # copy the input's dim
    return t


def _step(draw: st.DrawFn, g: Graph, pool: list[Value]) -> None:
    v = draw(st.sampled_from(pool))
    s = _shape(v)
    kind = draw(st.sampled_from(KINDS))
    if kind == "unary":
        pool.append(g.op(draw(st.sampled_from(UNARY)), v))
    elif kind == "neg_neg":
        pool.append(g.op("Neg", g.op("Neg", v)))
    elif kind == "cast":
        if draw(st.booleans()):
            pool.append(g.op("Cast", v, to="f32"))
        else:
            pool.append(g.op("Cast", g.op("Cast", v, to="f64"), to="f32"))
    elif kind == "binary_const":
        op = draw(st.sampled_from(["Add", "Mul", "Sub", "Div"]))
        val = draw(st.sampled_from([0.0, 1.0, 0.5, -2.0]))
        if op == "Div" and val == 0.0:
            val = 1.0
        cshape = draw(st.sampled_from([[], s[-1:], s, [2] + s]))
        c = g.add_const("k", np.full(cshape, val, np.float32), unique=True)
        left = op in ("Add", "Mul") and draw(st.booleans())
        pool.append(g.op(op, c, v) if left else g.op(op, v, c))
    elif kind == "binary_pool":
        same = [w for w in pool if _shape(w) == s]
        w = draw(st.sampled_from(same))
        pool.append(g.op(draw(st.sampled_from(["Add", "Mul", "Sub"])), v, w))
    elif kind == "reshape":
        pool.append(g.op("Reshape", v, _i64(g, _reshape_target(draw, s))))
    elif kind == "reshape_shape":
        # the target comes from shape arithmetic on another value with as many elements
        same_n = [w for w in pool if math.prod(_shape(w)) == math.prod(s)]
        w = draw(st.sampled_from(same_n))
        pool.append(g.op("Reshape", v, g.op("Shape", w)))
    elif kind in ("transpose", "transpose_pair"):
        perm = draw(st.permutations(list(range(len(s)))))
        t = g.op("Transpose", v, perm=list(perm)) if perm or draw(st.booleans()) else g.op("Transpose", v)
        if kind == "transpose_pair":
            perm2 = draw(st.permutations(list(range(len(s)))))
            t = g.op("Transpose", t, perm=list(perm2))
        pool.append(t)
    elif kind == "unsqueeze":
        ax = draw(st.sampled_from([[0], [-1], [0, -1]]))
        u = g.op("Unsqueeze", v, axes=ax)
        pool.append(g.op("Squeeze", u, axes=ax) if draw(st.booleans()) else u)
    elif kind == "expand":
        tgt = draw(st.sampled_from([list(s), [1] * len(s), [3] + s, s[-1:]]))
        pool.append(g.op("Expand", v, _i64(g, tgt)))
    elif kind == "const_subgraph":
        # a weight stored transposed and in f64: folding turns it into one f32 constant
        perm = list(draw(st.permutations(list(range(len(s))))))
        inv = [perm.index(i) for i in range(len(s))]
        data = np.random.default_rng(len(g.nodes)).standard_normal([s[p] for p in perm])
        w = g.add_const("w", data.astype(np.float64), unique=True)
        wt = g.op("Cast", g.op("Transpose", w, perm=inv), to="f32")
        pool.append(g.op("Add", v, wt))
    elif kind == "dup" and g.nodes:
        n = draw(st.sampled_from(g.nodes))
        if len(n.outputs) == 1 and n.output.dtype == DType.f32:
            pool.append(g.add_node(n.op, list(n.inputs), dict(n.attrs)).output)


@st.composite
def graphs(draw: st.DrawFn) -> tuple[Graph, dict[str, torch.Tensor]]:
    g = Graph("random")
    pool: list[Value] = []
    feeds: dict[str, torch.Tensor] = {}
    for i in range(draw(st.integers(1, 2))):
        shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
        pool.append(g.add_input(f"x{i}", TensorType(DType.f32, tuple(shape))))
        feeds[f"x{i}"] = torch.randn(shape, generator=torch.Generator().manual_seed(i))
    for _ in range(draw(st.integers(1, 10))):
        _step(draw, g, pool)
    outs = [pool[-1]] + draw(st.lists(st.sampled_from(pool), max_size=2))
    g.outputs = list({id(v): v for v in outs}.values())
    return g, feeds


PIPELINE = [FoldConstants(), Canonicalize(), CommonSubexpressionElimination(), DeadCodeElimination()]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs())
def test_generic_passes_preserve_semantics(case: tuple[Graph, dict[str, torch.Tensor]]) -> None:
    g, feeds = case
    verify_graph(g)
    names = [v.name for v in g.outputs]
    before = [t.clone() for t in run_graph(g, feeds).values()]
    run_passes(g, PIPELINE, verify=True)
    assert [v.name for v in g.outputs] == names
    after = run_graph(g, feeds)
    for name, want in zip(names, before, strict=True):
        got = after[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True), name
    # a second round finds nothing left to do
    assert not any(r.changed for _, r in run_passes(g, PIPELINE))
