"""Packed weight formats in the IR (ir/quant.py) and `--quantize` (passes/quantize.py): gguf's
quantizer and dequantizer as the oracle, the verifier's and the text form's view of packed
constants, a packed embedding table (one constant with a tied LM head), and the one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zlc
from zlc.errors import IRError
from zlc.ir import verify_graph
from zlc.ir.quant import FORMATS, QuantizedWeight, quantize
from zlc.ir.text import parse_graph, print_graph
from zlc.passes.quantize import QuantizeError, parse_scheme, quantize_graphs

QUANTIZABLE = sorted(f for f, w in FORMATS.items() if w.quantizable)  # the K-quants come only from files


@settings(max_examples=25, deadline=None)
@given(fmt=st.sampled_from(QUANTIZABLE), n=st.integers(1, 5), blocks=st.integers(1, 4),
       seed=st.integers(0, 2**31 - 1), scale=st.sampled_from([1e-3, 1.0, 50.0]))
def test_blocks_are_ggufs_and_dequantize_bit_exactly(fmt: str, n: int, blocks: int, seed: int, scale: float) -> None:
    from gguf import GGMLQuantizationType, quants

    w = (np.random.default_rng(seed).standard_normal((n, 32 * blocks)) * scale).astype(np.float32)
    q = quantize(w, fmt)
    t = getattr(GGMLQuantizationType, fmt.upper())
    assert q.blocks.shape == (n, blocks * FORMATS[fmt].block_bytes)
    assert np.array_equal(q.blocks, quants.quantize(w, t))
    assert np.array_equal(q.dequantize(), quants.dequantize(q.blocks, t))
    # a block's worst error is half a step of its scale (q8_0: amax/127; q4: (max-min)/15 or amax/8)
    step = np.abs(w).max() / (127 if fmt == "q8_0" else 7)
    assert np.abs(q.dequantize() - w).max() <= step * 1.01 + 1e-6


def test_a_bad_matrix_is_refused() -> None:
    with pytest.raises(IRError, match="multiple of 32"):
        quantize(np.zeros((4, 40), np.float32), "q8_0")
    with pytest.raises(IRError, match="unknown weight format"):
        quantize(np.zeros((4, 32), np.float32), "q3_k")
    with pytest.raises(IRError, match="no quantizer"):
        quantize(np.zeros((4, 256), np.float32), "q4_k")
    q = quantize(np.ones((2, 32), np.float32), "q4_0")
    with pytest.raises(IRError, match="expected uint8"):
        QuantizedWeight(q.format, q.blocks[:, :10], 2, 32).check("w")


def _fresh(tiny_onnx: Path) -> Any:
    return zlc.lower(tiny_onnx, options=zlc.CompileOptions(max_seq=32))


def _graphs(lw: Any) -> list[Any]:
    return [g for g in (lw.graph, lw.prefill, lw.decode) if g is not None]


def test_quantize_packs_every_linear_matrix_and_round_trips_as_text(tiny_onnx: Path) -> None:
    lw = _fresh(tiny_onnx)
    s = quantize_graphs(_graphs(lw), "q4_1")
    assert s.packed and not s.dense and s.packed_bytes * 6 < s.dense_bytes
    g = lw.decode
    for v in _graphs(lw):
        verify_graph(v)
    packed = {v.name: v for v in g.consts.values() if v.quant is not None}
    readers = {n.op for n in g.nodes if any(i in packed.values() for i in n.inputs)}
    assert readers == {"Linear", "LMHead", "GatedMLP", "Embedding"}  # the token table too
    text = print_graph(g)
    lines = {ln.split(":")[0].split("%")[1]: ln for ln in text.splitlines() if ln.strip().startswith("const %")}
    assert all(lines[k].endswith(" q4_1") for k in packed)
    weights = {k: v.data for k, v in g.consts.items() if v.quant is None}
    weights.update({k: v.quant for k, v in packed.items()})
    back = parse_graph(text, weights)
    assert print_graph(back) == text
    for k, v in packed.items():
        assert np.array_equal(back.consts[k].const_array(), v.const_array())
    with pytest.raises(IRError, match="is q4_1 but its weight is not"):
        parse_graph(text, {**weights, **{k: v.const_array() for k, v in packed.items()}})


def test_a_packed_weight_read_as_anything_else_is_refused(tiny_onnx: Path) -> None:
    lw = _fresh(tiny_onnx)
    quantize_graphs(_graphs(lw), "q8_0")
    g = lw.decode
    norm = next(n for n in g.nodes if n.op == "RMSNorm")
    head = next(n for n in g.nodes if n.op == "LMHead")
    norm.inputs[1] = head.inputs[1]  # a norm's gains reading the head's packed blocks
    with pytest.raises(IRError, match=r"\(RMSNorm\) reads the q8_0 weight .* as input 1"):
        verify_graph(g)


def test_the_embedding_table_is_packed_and_a_tied_head_reads_the_same_constant(tiny_onnx: Path) -> None:
    lw = _fresh(tiny_onnx)
    for g in _graphs(lw):  # tie them: the LM head reads the embedding's table
        emb = next(n for n in g.nodes if n.op == "Embedding")
        head = next(n for n in g.nodes if n.op == "LMHead")
        head.inputs[1] = emb.inputs[0]
    table = lw.decode.consts[next(n for n in lw.decode.nodes if n.op == "Embedding").inputs[0].name]
    before = table.const_array().copy()
    s = quantize_graphs(_graphs(lw), "q8_0")
    assert s.copies == {} and table.name in s.packed
    assert table.quant is not None and table.quant.format.name == "q8_0"
    assert np.array_equal(table.const_array(), quantize(before, "q8_0").dequantize())
    for g in _graphs(lw):
        verify_graph(g)
        emb = next(n for n in g.nodes if n.op == "Embedding")
        head = next(n for n in g.nodes if n.op == "LMHead")
        assert head.inputs[1] is emb.inputs[0] and emb.inputs[0].quant is not None
        assert f"{table.name}.q8_0" not in g.consts


def test_one_line_errors(tiny_onnx: Path, tmp_path: Path) -> None:
    lw = _fresh(tiny_onnx)
    quantize_graphs(_graphs(lw), "q4_0")
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_graphs(_graphs(lw), "q8_0")
    with pytest.raises(QuantizeError, match="expected one of int8, int4"):
        parse_scheme("int3")
    assert parse_scheme("INT4:q4_1") == "q4_1" and parse_scheme("int4") == "q4_0"
    # every --quantize format is one the Triton kernel streams (Target.weight_formats): a GPU target takes it
    res = zlc.compile(tiny_onnx, targets=["cpu", "a10"], out=tmp_path / "x.zlc", quantize="int8", stop_after="quantize")
    assert res.build.quantization["format"] == "q8_0" and res.build.quantization["packed"]
