"""Real exporter output through the ONNX frontend, against ONNX Runtime: onnxruntime-genai graphs
(GroupQueryAttention, RotaryEmbedding, MultiHeadAttention, (Skip)SimplifiedLayerNormalization,
MatMulNBits, GatherBlockQuantized) in prefill and decode, and a dynamo opset-23 export (Attention, RotaryEmbedding,
RMSNormalization). The graphs come from the model zoo's cache (exported on first use)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from zlc.frontend.onnx import import_onnx, sanitize
from zlc.reference.executor import ReferenceExecutor

zoo = pytest.importorskip("zlc.testing.zoo")
pytest.importorskip("transformers", reason="exporting zoo models needs the 'hf' extra")

pytestmark = pytest.mark.slow
TOL = 1e-4


def _feeds(model: onnx.ModelProto, ids: np.ndarray, past: dict[str, np.ndarray], past_len: int
           ) -> dict[str, np.ndarray]:
    names = {i.name for i in model.graph.input}
    n = ids.shape[1]
    feeds = {"input_ids": ids, **past}
    if "attention_mask" in names:
        feeds["attention_mask"] = np.ones((1, past_len + n), np.int64)
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(past_len, past_len + n, dtype=np.int64)[None]
    return feeds


def _empty_past(model: onnx.ModelProto, family: str) -> dict[str, np.ndarray]:
    spec = zoo.kv_spec(family)
    return {vi.name: np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)
            for vi in model.graph.input if vi.name.startswith("past_key_values.")}


def _compare(ort_model: onnx.ModelProto, zlc_path: Path, family: str, *, steps: list[int]) -> None:
    """Prefill then decode steps, feeding each step's presents back; zlc must match ORT throughout."""
    import onnxruntime as ort

    sess = ort.InferenceSession(ort_model.SerializeToString(), providers=["CPUExecutionProvider"])
    graph = import_onnx(zlc_path)
    ex = ReferenceExecutor(graph)
    out_names = [o.name for o in sess.get_outputs()]
    past = _empty_past(ort_model, family)
    rng = np.random.default_rng(0)
    past_len = 0
    for n in steps:
        ids = rng.integers(1, 200, (1, n)).astype(np.int64)
        feeds = _feeds(ort_model, ids, past, past_len)
        want = dict(zip(out_names, sess.run(None, feeds), strict=True))
        got = ex.run({sanitize(k): v for k, v in feeds.items()})
        for name, w in want.items():
            np.testing.assert_allclose(got[sanitize(name)].numpy(), w, rtol=TOL, atol=TOL, err_msg=name)
        past = {k.replace("present", "past_key_values"): v for k, v in want.items() if k.startswith("present")}
        past_len += n


GENAI = [("genai", "llama"), ("genai_rope", "llama"), ("genai_mha", "llama")]


@pytest.mark.parametrize(("kind", "family"), GENAI)
def test_genai_graphs(kind: str, family: str) -> None:
    if not zoo.genai_available():
        pytest.skip("pip install onnxruntime-genai")
    path = zoo.cached(kind, family)
    _compare(onnx.load(str(path)), path, family, steps=[6, 1, 1])


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_genai_int4_graph(family: str) -> None:
    """MatMulNBits is dequantized exactly (kept packed, its data the exact dequantization); ORT's
    accuracy_level=4 would also quantize activations to int8, so ORT runs the same graph at
    accuracy_level 0 for the comparison. Gemma ties its embedding: GatherBlockQuantized reads the
    LM head's int4 blocks."""
    if not zoo.genai_available():
        pytest.skip("pip install onnxruntime-genai")
    path = zoo.cached("genai_int4", family)
    model = onnx.load(str(path))
    assert ("GatherBlockQuantized" in {n.op_type for n in model.graph.node}) == (family == "gemma")
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                a.i = 0
    _compare(model, path, family, steps=[6, 1])


def test_dynamo_opset23_export() -> None:
    path = zoo.cached("stateless_sdpa", "llama", 23)
    model = onnx.load(str(path))
    ops = {n.op_type for n in model.graph.node}
    assert {"Attention", "RotaryEmbedding", "RMSNormalization"} <= ops, ops
    _compare(model, path, "llama", steps=[7])
