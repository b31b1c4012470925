"""passes.base.weight_rows: the row views the raising passes cut out of a Linear's matrix (fused QKV
split, heads regrouped, gate/up halves) keep a packed matrix's blocks, exactly those rows'."""

from __future__ import annotations

import numpy as np
import pytest

from zlc.ir import Graph
from zlc.ir.quant import pack_nbits4, quantize
from zlc.passes.base import weight_rows


@pytest.mark.parametrize("fmt", ["nbits4_b16", "q4_1"])
@pytest.mark.parametrize("rows", [slice(8, 24), np.array([5, 0, 17, 3, 29])])
def test_rows_of_a_packed_matrix_are_its_rows_blocks(fmt: str, rows: slice | np.ndarray) -> None:
    rng = np.random.default_rng(0)
    n, k = 32, 64
    if fmt == "q4_1":
        q = quantize(rng.standard_normal((n, k)).astype(np.float32), fmt)
    else:
        b = rng.integers(0, 256, (n, k // 16, 8), dtype=np.uint8)
        q = pack_nbits4(b, rng.standard_normal(n * k // 16).astype(np.float32),
                        rng.integers(0, 256, (n, k // 32), dtype=np.uint8), n=n, k=k, block=16)
    g = Graph("g")
    w = g.add_const("w", q.dequantize())
    w.quant = q
    v = weight_rows(g, "w.part", w, rows)
    assert v.quant is not None and v.quant.format == q.format and v.quant.k == k
    assert np.array_equal(v.quant.blocks, q.blocks[rows])
    assert np.array_equal(v.quant.dequantize(), np.asarray(v.data)) and np.array_equal(np.asarray(v.data), q.dequantize()[rows])
    dense = weight_rows(g, "d.part", g.add_const("d", np.ones((n, k), np.float32)), rows)
    assert dense.quant is None and dense.name != "w.part"
