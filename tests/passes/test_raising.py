"""Raising rules on op-level subgraphs built with random shapes (Hypothesis): the raised op must
appear, and the reference executor must give the same result before and after raising."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.ir import DType, Graph, TensorType, verify_graph
from zlc.passes.kv_cache import synthesize_kv_cache
from zlc.passes.raise_all import raise_graph
from zlc.reference.executor import ReferenceExecutor, run_graph

F32 = DType.f32


def _c(g: Graph, x: float) -> object:
    return g.add_const("c", np.array(x, dtype=np.float32), unique=True)


def _i(g: Graph, xs: list[int]) -> object:
    return g.add_const("i", np.array(xs, dtype=np.int64), unique=True)


def _rmsnorm_graph(hidden: int, seq: int, eps: float, rng: np.random.Generator) -> Graph:
    g = Graph("rms")
    x = g.add_input("x", TensorType(F32, (1, seq, hidden)))
    w = g.add_const("w", rng.standard_normal(hidden).astype(np.float32))
    ms = g.op("ReduceMean", g.op("Pow", x, _c(g, 2.0)), axes=[-1], keepdims=1)
    inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, _c(g, eps))))
    g.outputs = [g.op("Mul", w, g.op("Mul", x, inv))]
    return g


@settings(max_examples=25, deadline=None)
@given(hidden=st.integers(1, 64), seq=st.integers(1, 9), eps=st.sampled_from([1e-5, 1e-6]), seed=st.integers(0, 99))
def test_rmsnorm_raises_and_matches(hidden: int, seq: int, eps: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = _rmsnorm_graph(hidden, seq, eps, rng)
    x = rng.standard_normal((1, seq, hidden)).astype(np.float32)
    before = run_graph(g, {"x": x})
    raise_graph(g)
    verify_graph(g)
    assert g.op_histogram() == {"RMSNorm": 1}
    after = run_graph(g, {"x": x})
    np.testing.assert_allclose(next(iter(after.values())), next(iter(before.values())), atol=1e-5, rtol=1e-5)


def _attention_graph(hq: int, hkv: int, d: int, rng: np.random.Generator, mask_style: str) -> Graph:
    """Decomposed causal GQA attention as exporters write it, from token ids (for a seq axis)."""
    g = Graph("attn")
    ids = g.add_input("input_ids", TensorType(DType.i64, (1, "seq")))
    hid = hq * d
    emb = g.add_const("emb", rng.standard_normal((50, hid)).astype(np.float32))
    wq = g.add_const("wq", (rng.standard_normal((hid, hq * d)) / math.sqrt(hid)).astype(np.float32))
    wk = g.add_const("wk", (rng.standard_normal((hid, hkv * d)) / math.sqrt(hid)).astype(np.float32))
    wv = g.add_const("wv", (rng.standard_normal((hid, hkv * d)) / math.sqrt(hid)).astype(np.float32))
    x = g.op("Gather", emb, ids, axis=0)

    def heads(w: object, h: int) -> object:
        return g.op("Transpose", g.op("Reshape", g.op("MatMul", x, w), _i(g, [1, -1, h, d])), perm=[0, 2, 1, 3])

    q, k, v = heads(wq, hq), heads(wk, hkv), heads(wv, hkv)
    if hq != hkv:
        rep = hq // hkv
        seq = g.op("Gather", g.op("Shape", ids), _i(g, [1]), axis=0)

        def repeat(t: object) -> object:
            shape = g.op("Concat", _i(g, [1, hkv, rep]), seq, _i(g, [d]), axis=0)
            out = g.op("Concat", _i(g, [1, hq]), seq, _i(g, [d]), axis=0)
            return g.op("Reshape", g.op("Expand", g.op("Unsqueeze", t, axes=[2]), shape), out)

        k, v = repeat(k), repeat(v)
    s = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), _c(g, 1 / math.sqrt(d)))
    n = g.op("Squeeze", g.op("Shape", ids, start=1, end=2), axes=[0])
    ar = g.op("Range", g.add_const("z", np.array(0, dtype=np.int64), unique=True), n,
              g.add_const("o", np.array(1, dtype=np.int64), unique=True))
    if mask_style == "trilu":
        ones = g.op("ConstantOfShape", g.op("Concat", g.op("Unsqueeze", n, axes=[0]), g.op("Unsqueeze", n, axes=[0]), axis=0),
                    value=float("-inf"), dtype="f32")
        mask = g.op("Trilu", ones, g.add_const("k1", np.array(1, dtype=np.int64), unique=True), upper=1)
        s = g.op("Add", s, mask)
    else:
        keep = g.op("LessOrEqual", g.op("Unsqueeze", ar, axes=[0]), g.op("Unsqueeze", ar, axes=[1]))
        s = g.op("Where", keep, s, _c(g, -3.4e38))
    o = g.op("MatMul", g.op("Softmax", s, axis=-1), v)
    g.outputs = [g.op("Reshape", g.op("Transpose", o, perm=[0, 2, 1, 3]), _i(g, [1, -1, hid]))]
    return g


@settings(max_examples=12, deadline=None)
@given(hkv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2, 3]), d=st.sampled_from([4, 8]),
       seq=st.integers(1, 7), mask=st.sampled_from(["trilu", "where"]), seed=st.integers(0, 99))
def test_attention_raises_and_matches(hkv: int, rep: int, d: int, seq: int, mask: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = _attention_graph(hkv * rep, hkv, d, rng, mask)
    g.metadata["max_seq"] = 16
    ids = rng.integers(0, 50, (1, seq))
    before = next(iter(run_graph(g, {"input_ids": ids}).values()))
    stats = raise_graph(g)
    verify_graph(g)
    assert stats.applied.get("attention") == 1, stats.refused
    att = [n for n in g.nodes if n.op == "Attention"][0]
    assert att.attrs["causal"] == 1
    assert att.inputs[1].shape[1] == hkv  # GQA repeat stripped
    after = next(iter(run_graph(g, {"input_ids": ids}).values()))
    np.testing.assert_allclose(after, before, atol=1e-5, rtol=1e-4)


def test_non_causal_mask_is_refused_with_reason() -> None:
    rng = np.random.default_rng(0)
    g = _attention_graph(2, 2, 4, rng, "trilu")
    for n in g.nodes:  # make the mask strictly lower-triangular-masked: no longer causal
        if n.op == "Trilu":
            n.attrs["upper"] = 0
    stats = raise_graph(g)
    assert "attention" not in stats.applied
    assert any("not causal" in r for r in stats.refused["attention"])


@settings(max_examples=8, deadline=None)
@given(hkv=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), prompt=st.integers(1, 6), steps=st.integers(1, 5),
       seed=st.integers(0, 99))
def test_kv_cache_decode_equals_stateless(hkv: int, rep: int, prompt: int, steps: int, seed: int) -> None:
    """Prefill + decode steps over the synthesized cache equal the stateless graph on the full
    sequence at every position."""
    rng = np.random.default_rng(seed)
    g = _attention_graph(hkv * rep, hkv, 4, rng, "where")
    g.metadata["max_seq"] = 16
    raise_graph(g)
    cm = synthesize_kv_cache(g, 16)
    verify_graph(cm.prefill)
    verify_graph(cm.decode)
    assert [v.name for v in cm.decode.inputs] == ["input_ids", "past_len"]
    assert cm.decode.inputs[0].shape == (1, 1)
    ids = [int(t) for t in rng.integers(0, 50, prompt + steps)]
    full = next(iter(run_graph(g, {"input_ids": np.array([ids])}).values()))[0]
    pre = ReferenceExecutor(cm.prefill)
    dec = ReferenceExecutor(cm.decode, state=pre.state)
    out = next(iter(pre.run({"input_ids": np.array([ids[:prompt]]), "past_len": np.array(0)}).values()))[0]
    torch.testing.assert_close(out, full[:prompt], atol=1e-5, rtol=1e-4)
    for i in range(prompt, prompt + steps):
        out = next(iter(dec.run({"input_ids": np.array([[ids[i]]]), "past_len": np.array(i)}).values()))[0]
        torch.testing.assert_close(out[0], full[i], atol=1e-5, rtol=1e-4)


def _rope_graph(h: int, d: int, theta: float, rng: np.random.Generator) -> Graph:
    """HF-style rotary: inv_freq x positions -> cat(freqs, freqs) -> cos/sin; x*cos + rot(x)*sin."""
    g = Graph("rope")
    ids = g.add_input("input_ids", TensorType(DType.i64, (1, "seq")))
    x = g.add_input("x", TensorType(F32, (1, h, "seq", d)))
    n = g.op("Squeeze", g.op("Shape", ids, start=1, end=2), axes=[0])
    pos = g.op("Cast", g.op("Range", g.add_const("z", np.array(0, dtype=np.int64), unique=True), n,
                            g.add_const("o", np.array(1, dtype=np.int64), unique=True)), to="f32")
    inv = g.add_const("inv_freq", (1.0 / theta ** (np.arange(0, d, 2) / d)).astype(np.float32))
    freqs = g.op("Mul", g.op("Unsqueeze", pos, axes=[1]), inv)
    emb = g.op("Unsqueeze", g.op("Concat", freqs, freqs, axis=-1), axes=[0, 1])
    cos, sin = g.op("Cos", emb), g.op("Sin", emb)
    big = 2**62
    x1 = g.op("Slice", x, _i(g, [0]), _i(g, [d // 2]), _i(g, [3]), _i(g, [1]))
    x2 = g.op("Slice", x, _i(g, [d // 2]), _i(g, [big]), _i(g, [3]), _i(g, [1]))
    rot = g.op("Concat", g.op("Neg", x2), x1, axis=-1)
    g.outputs = [g.op("Add", g.op("Mul", x, cos), g.op("Mul", rot, sin))]
    return g


@settings(max_examples=15, deadline=None)
@given(h=st.integers(1, 4), half=st.integers(1, 16), seq=st.integers(1, 9),
       theta=st.sampled_from([10000.0, 500000.0]), seed=st.integers(0, 99))
def test_rope_raises_to_position_tables(h: int, half: int, seq: int, theta: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = 2 * half
    g = _rope_graph(h, d, theta, rng)
    g.metadata["max_seq"] = 32
    feeds = {"input_ids": np.zeros((1, seq), dtype=np.int64),
             "x": rng.standard_normal((1, h, seq, d)).astype(np.float32)}
    before = next(iter(run_graph(g, feeds).values()))
    stats = raise_graph(g)
    verify_graph(g)
    assert stats.applied.get("rope") == 1, stats.refused
    rope = [n for n in g.nodes if n.op == "RoPE"][0]
    assert rope.inputs[1].shape == (32, half)  # a [max_seq, D/2] table
    assert rope.inputs[3].producer.op == "Positions"
    after = next(iter(run_graph(g, feeds).values()))
    np.testing.assert_allclose(after, before, atol=1e-5, rtol=1e-4)


def _mlp_graph(hid: int, f: int, act: str, gated: bool, rng: np.random.Generator) -> Graph:
    g = Graph("mlp")
    x = g.add_input("x", TensorType(F32, (1, "seq", hid)))

    def w(shape: tuple[int, int]) -> object:
        return g.add_const("w", (rng.standard_normal(shape) / math.sqrt(shape[0])).astype(np.float32), unique=True)

    a = g.op("MatMul", x, w((hid, f)))
    if act == "silu":
        y = g.op("Mul", a, g.op("Sigmoid", a))
    elif act == "gelu":  # erf form
        y = g.op("Mul", g.op("Mul", a, _c(g, 0.5)),
                 g.op("Add", g.op("Erf", g.op("Div", a, _c(g, math.sqrt(2.0)))), _c(g, 1.0)))
    else:  # gelu_tanh, GPT-2's "gelu_new"
        inner = g.op("Mul", g.op("Add", a, g.op("Mul", g.op("Pow", a, _c(g, 3.0)), _c(g, 0.044715))),
                     _c(g, math.sqrt(2 / math.pi)))
        y = g.op("Mul", g.op("Mul", a, _c(g, 0.5)), g.op("Add", g.op("Tanh", inner), _c(g, 1.0)))
    if gated:
        y = g.op("Mul", y, g.op("MatMul", x, w((hid, f))))
    g.outputs = [g.op("MatMul", y, w((f, hid)))]
    return g


@settings(max_examples=15, deadline=None)
@given(hid=st.integers(2, 24), f=st.integers(2, 40), act=st.sampled_from(["silu", "gelu", "gelu_tanh"]),
       gated=st.booleans(), seq=st.integers(1, 5), seed=st.integers(0, 99))
def test_mlp_raises_with_the_right_activation(hid: int, f: int, act: str, gated: bool, seq: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    g = _mlp_graph(hid, f, act, gated, rng)
    x = rng.standard_normal((1, seq, hid)).astype(np.float32)
    before = next(iter(run_graph(g, {"x": x}).values()))
    raise_graph(g)
    verify_graph(g)
    op = "GatedMLP" if gated else "MLP"
    nodes = [n for n in g.nodes if n.op == op]
    assert len(nodes) == 1 and len(g.nodes) == 1, g.op_histogram()
    assert nodes[0].attrs["activation"] == act
    after = next(iter(run_graph(g, {"x": x}).values()))
    np.testing.assert_allclose(after, before, atol=1e-5, rtol=1e-4)
