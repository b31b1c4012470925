"""The model zoo's exports run in ONNX Runtime and match the torch models they came from.

Exports are cached in ``$ZLC_CACHE_DIR`` (default ``~/.cache/zlc/zoo``); with a warm cache this file
takes well under a minute on 2 cores. A cold cache exports ~30 graphs (several minutes).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from zlc.testing import zoo  # noqa: E402
from zlc.testing.families import CORE_FAMILIES, EXTRA_FAMILIES, POSITION_FAMILIES  # noqa: E402

TOL = 1e-4

needs_genai = pytest.mark.skipif(not zoo.genai_available(), reason="pip install onnxruntime-genai==0.18.0")


@pytest.fixture(scope="module", autouse=True)
def _few_threads():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


_MODELS: dict[str, torch.nn.Module] = {}


def model_of(family: str) -> torch.nn.Module:
    if family not in _MODELS:
        _MODELS[family] = zoo.hf_model(family)
    return _MODELS[family]


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(1, n), dtype=np.int64)


def full_logits(family: str, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model_of(family)(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()


def max_err(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


# ------------------------------------------------------------------------------------------------
# stateless input_ids -> logits


def check_stateless(kind: str, family: str, opset: int) -> dict[str, int]:
    path = zoo.cached(kind, family, opset)
    sess = zoo.ort_session(path)
    assert [i.name for i in sess.get_inputs()] == ["input_ids"]
    assert [o.name for o in sess.get_outputs()] == ["logits"]
    for n, seed in ((1, 0), (6, 1), (19, 2)):
        ids = tokens(n, seed)
        (got,) = sess.run(None, {"input_ids": ids})
        assert max_err(got, full_logits(family, ids)) < TOL, (kind, family, opset, n)
    return zoo.op_histogram(path)


@pytest.mark.parametrize("family", sorted(CORE_FAMILIES))
def test_stateless_opset20(family: str) -> None:
    hist = check_stateless("stateless", family, 20)
    assert "Softmax" in hist and "MatMul" in hist
    if family != "gpt2":
        assert "Pow" in hist and "ReduceMean" in hist  # decomposed RMSNorm
        assert "RMSNormalization" not in hist and "RotaryEmbedding" not in hist


@pytest.mark.parametrize("family", POSITION_FAMILIES)
def test_stateless_position_families(family: str) -> None:
    """OPT, GPT-J, CodeGen, Cohere: the export equals torch, and shows the position arithmetic the
    KV cache must rebase (OPT: CumSum of the mask; the others: Range over the tokens)."""
    hist = check_stateless("stateless", family, 20)
    assert "Softmax" in hist and "MatMul" in hist
    assert ("CumSum" if family == "opt" else "Range") in hist


@pytest.mark.parametrize("family", EXTRA_FAMILIES)
def test_stateless_extra_families(family: str) -> None:
    """The export equals torch; Granite's four multipliers are in it (Mul/Div by constants)."""
    hist = check_stateless("stateless", family, 20)
    assert "Softmax" in hist and "MatMul" in hist
    if family == "granite":
        assert hist.get("Mul", 0) >= 5 and "Div" in hist


@pytest.mark.parametrize("family", ["opt", "gptj", "codegen"])  # cohere: the TorchScript exporter fails
def test_optimum_kv_position_families(family: str) -> None:
    test_optimum_kv("optimum_kv", family)


def test_every_family_is_perturbed_away_from_defaults() -> None:
    """Norm gains and biases are not their HF init (1 and 0), so a dropped norm or bias shows."""
    for family in sorted(set(zoo.FAMILIES) - {"olmo"}):  # OLMo's norms have no parameters
        vectors = [p for _, p in zoo.hf_model(family).named_parameters() if p.dim() == 1]
        assert vectors and all(float((p - p.round()).abs().max()) > 0.01 for p in vectors), family


@pytest.mark.parametrize(
    ("family", "opset"),
    [("llama", 18), ("gemma", 18), ("gpt2", 18), ("llama", 23), ("qwen2", 23), ("gemma", 23), ("gpt2", 23)],
)
def test_stateless_other_opsets(family: str, opset: int) -> None:
    hist = check_stateless("stateless", family, opset)
    if opset >= 23 and family != "gpt2":
        assert hist.get("RMSNormalization") == 5  # 2 per layer + final norm
        assert hist.get("RotaryEmbedding") == 4  # q and k per layer
    if family == "gemma" and opset == 18:
        assert "Gelu" not in hist  # Gelu is opset 20


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stateless_sdpa_opset23_emits_attention(family: str) -> None:
    hist = check_stateless("stateless_sdpa", family, 23)
    assert hist.get("Attention") == 2


# ------------------------------------------------------------------------------------------------
# Optimum-style KV cache


def run_kv(sess, ids: np.ndarray, past: list[np.ndarray], past_len: int) -> dict[str, np.ndarray]:
    spec_names = [i.name for i in sess.get_inputs()]
    n = ids.shape[1]
    feeds = {
        "input_ids": ids,
        "attention_mask": np.ones((1, past_len + n), np.int64),
        "position_ids": np.arange(past_len, past_len + n, dtype=np.int64)[None],
    }
    feeds.update({name: t for name, t in zip(spec_names[3:], past, strict=True)})
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


@pytest.mark.parametrize(
    ("kind", "family"),
    [("optimum_kv", f) for f in sorted(CORE_FAMILIES)]
    + [("optimum_kv_dynamo", "llama"), ("optimum_kv_dynamo", "phi3")],
)
def test_optimum_kv(kind: str, family: str) -> None:
    spec = zoo.kv_spec(family)
    path = zoo.cached(kind, family, 20)
    sess = zoo.ort_session(path)
    ins, outs = zoo.kv_io_names(spec.num_layers)
    assert [i.name for i in sess.get_inputs()] == ins
    assert [o.name for o in sess.get_outputs()] == outs
    wrapper = zoo.kv_wrapper(model_of(family))

    prompt, step, chunk = tokens(7, 10), tokens(1, 11), tokens(3, 12)
    full = np.concatenate([prompt, step, chunk], axis=1)
    ref = full_logits(family, full)

    # prefill, past length 0
    empty = [np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)] * (2 * spec.num_layers)
    o = run_kv(sess, prompt, empty, 0)
    assert max_err(o["logits"], ref[:, :7]) < TOL
    assert o["present.0.key"].shape == (1, spec.num_kv_heads, 7, spec.head_dim)
    # presents equal torch + DynamicCache
    with torch.no_grad():
        t_out = wrapper(
            torch.from_numpy(prompt),
            torch.ones(1, 7, dtype=torch.int64),
            torch.arange(7)[None],
            *[torch.from_numpy(e) for e in empty],
        )
    for name, t in zip(outs[1:], t_out[1:], strict=True):
        assert max_err(o[name], t.numpy()) < TOL, name

    # decode one token, then a 3-token chunk, on top of the cache (past length > 0)
    past = [o[n] for n in outs[1:]]
    o = run_kv(sess, step, past, 7)
    assert max_err(o["logits"], ref[:, 7:8]) < TOL
    past = [o[n] for n in outs[1:]]
    o = run_kv(sess, chunk, past, 8)
    assert max_err(o["logits"], ref[:, 8:11]) < TOL
    assert o["present.1.value"].shape[2] == 11


def test_optimum_kv_random_past_matches_torch() -> None:
    """Arbitrary (not self-produced) past tensors: the graph is the torch function, not just a replay."""
    family = "qwen2"
    spec = zoo.kv_spec(family)
    sess = zoo.ort_session(zoo.cached("optimum_kv", family, 20))
    rng = np.random.default_rng(5)
    past = [
        rng.standard_normal((1, spec.num_kv_heads, 5, spec.head_dim)).astype(np.float32) for _ in range(4)
    ]
    ids = tokens(2, 13)
    o = run_kv(sess, ids, past, 5)
    with torch.no_grad():
        t_out = zoo.kv_wrapper(model_of(family))(
            torch.from_numpy(ids),
            torch.ones(1, 7, dtype=torch.int64),
            torch.arange(5, 7)[None],
            *[torch.from_numpy(p) for p in past],
        )
    assert max_err(o["logits"], t_out[0].numpy()) < TOL


# ------------------------------------------------------------------------------------------------
# onnxruntime-genai graphs (com.microsoft contrib ops)


def run_genai(sess, ids: np.ndarray, past: dict[str, np.ndarray], past_len: int) -> dict[str, np.ndarray]:
    n = ids.shape[1]
    feeds = {"input_ids": ids, "attention_mask": np.ones((1, past_len + n), np.int64), **past}
    if "position_ids" in {i.name for i in sess.get_inputs()}:
        feeds["position_ids"] = np.arange(past_len, past_len + n, dtype=np.int64)[None]
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))


GENAI_CASES = [("genai", f) for f in zoo.GENAI_FAMILIES] + [("genai_rope", "llama"), ("genai_mha", "llama")]
GENAI_OPS = {
    "genai": {
        "com.microsoft::GroupQueryAttention",
        "com.microsoft::SkipSimplifiedLayerNormalization",
        "SimplifiedLayerNormalization",
    },
    "genai_rope": {"com.microsoft::GroupQueryAttention", "com.microsoft::RotaryEmbedding"},
    "genai_mha": {"com.microsoft::MultiHeadAttention", "com.microsoft::RotaryEmbedding"},
    "genai_int4": {"com.microsoft::MatMulNBits", "com.microsoft::GroupQueryAttention"},
}


def check_genai(kind: str, family: str, tol: float) -> None:
    spec = zoo.kv_spec(family)
    path = zoo.cached(kind, family)
    hist = zoo.op_histogram(path)
    assert GENAI_OPS[kind] <= set(hist), hist
    sess = zoo.ort_session(path)
    prompt, step = tokens(9, 20), tokens(1, 21)
    ref = full_logits(family, np.concatenate([prompt, step], axis=1))
    past = {}
    for i in range(spec.num_layers):
        for kv in ("key", "value"):
            past[f"past_key_values.{i}.{kv}"] = np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)
    o = run_genai(sess, prompt, past, 0)  # prefill
    assert max_err(o["logits"], ref[:, :9]) < tol
    past = {
        f"past_key_values.{i}.{kv}": o[f"present.{i}.{kv}"]
        for i in range(spec.num_layers)
        for kv in ("key", "value")
    }
    o = run_genai(sess, step, past, 9)  # one decode step
    assert max_err(o["logits"], ref[:, 9:10]) < tol
    assert o["present.0.key"].shape == (1, spec.num_kv_heads, 10, spec.head_dim)


@needs_genai
@pytest.mark.parametrize(("kind", "family"), GENAI_CASES)
def test_genai(kind: str, family: str) -> None:
    check_genai(kind, family, TOL)


@needs_genai
def test_genai_int4_matmulnbits() -> None:
    """4-bit weights: the graph equals its own dequantized fp32 twin (not the fp32 torch model)."""
    import onnx
    import onnxruntime as ort

    path = zoo.cached("genai_int4", "llama")
    assert GENAI_OPS["genai_int4"] <= set(zoo.op_histogram(path))
    model = onnx.load(str(path))
    exact = onnx.ModelProto()
    exact.CopyFrom(model)
    for node in exact.graph.node:  # accuracy_level 4 also quantizes activations to int8 on CPU
        for a in node.attribute:
            if a.name == "accuracy_level":
                a.i = 0
    dq = zoo.dequantize_matmul_nbits(model)
    assert "com.microsoft::MatMulNBits" not in {f"{n.domain}::{n.op_type}" for n in dq.graph.node}
    spec = zoo.kv_spec("llama")
    feeds = {"input_ids": tokens(9, 20), "attention_mask": np.ones((1, 9), np.int64)}
    for i in range(spec.num_layers):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{i}.{kv}"] = np.zeros(
                (1, spec.num_kv_heads, 0, spec.head_dim), np.float32
            )
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    got, got_exact, want = (
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
            ["logits"], feeds
        )[0]
        for m in (model, exact, dq)
    )
    assert max_err(got_exact, want) < TOL
    assert max_err(got, want) < 0.25
    # and the quantized model is still recognisably the fp32 one
    ref = full_logits("llama", feeds["input_ids"])
    assert np.corrcoef(got.ravel(), ref.ravel())[0, 1] > 0.9


def test_genai_rejects_gpt2(tmp_path) -> None:
    with pytest.raises(ValueError, match="does not support"):
        zoo.build_genai("gpt2", tmp_path / "x.onnx")


# ------------------------------------------------------------------------------------------------
# the zoo itself


def test_hf_model_deterministic_and_rng_neutral() -> None:
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = zoo.hf_model("llama", seed=0)
    after = torch.rand(1)
    assert torch.equal(before, after)  # global RNG untouched
    b = zoo.hf_model("llama", seed=0)
    c = zoo.hf_model("llama", seed=1)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    cfg = a.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        2,
        64,
        4,
        2,
    )
    assert cfg.vocab_size == 256 and cfg.intermediate_size == 128 and cfg.max_position_embeddings == 256


def test_cache_reuses_and_is_keyed(tmp_path, monkeypatch) -> None:
    path = zoo.cached("stateless", "llama", 20)  # warm (other tests) or exported here
    assert path.parent == zoo.cache_dir() and path.exists()
    t = time.perf_counter()
    assert zoo.cached("stateless", "llama", 20) == path
    assert time.perf_counter() - t < 1.0
    import transformers

    key = zoo.cache_key("stateless", "llama", 20)
    assert torch.__version__.replace("+", "_") in key and transformers.__version__ in key
    assert zoo.cache_key("stateless", "llama", 18) != key
    assert not [p for p in os.listdir(zoo.cache_dir()) if p.endswith(".tmp")]
    monkeypatch.setenv("ZLC_CACHE_DIR", str(tmp_path / "c"))
    assert zoo.cache_dir() == tmp_path / "c"
    with pytest.raises(KeyError):
        zoo.cached("nope", "llama")


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct, real weights


@pytest.mark.slow
def test_smollm2_export(tmp_path) -> None:
    try:
        zoo.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    pytest.importorskip("gguf")
    model, tok = zoo.load_smollm2()
    path = zoo.export_smollm2(tmp_path, model=model, tokenizer=tok)
    assert path.exists() and (tmp_path / "tokenizer.json").exists()
    ids = zoo.smollm2_prompt_ids(tok)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.numpy()
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    (got,) = zoo.ort_session(path, threads=2).run(None, {"input_ids": ids.numpy()})
    # logits reach ~38: 1e-4 absolute plus 1e-4 relative (measured max abs error 1.1e-4)
    np.testing.assert_allclose(got, ref, rtol=zoo.SMOLLM2_RTOL, atol=zoo.SMOLLM2_ATOL)
    text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    assert zoo.SMOLLM2_ANSWER in text
