"""The GGUF frontend on the Qwen2, Qwen3, Gemma (1, 2, 3) and Phi-3 architectures: tiny random Hugging Face
models written as llama.cpp's converter writes them (zlc.testing.gguf_files), lowered from the
GGUF file alone. Oracle: Hugging Face `generate` on the same weights (dequantized, for the Q8_0
file) against zlc's reference session over the synthesized KV cache, and for Gemma 3 (local and
global layers, two rope bases, q/k norms, sandwich norms) the native C kernel's bundle too.
Bad metadata is a one-line error naming the field or tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from zlc.driver import CompileOptions  # noqa: E402
from zlc.testing.families import CHAT_VOCAB, hf_greedy, hf_model  # noqa: E402

PROMPT = [3, 14, 15, 92, 65, 35]
NEW_TOKENS = 8
#: teacher-forced: prefill of the first 6, then one decode step per token (past Gemma's window of 4)
SEQ = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]
#: zoo family -> what it exercises through the GGUF route
CASES = {
    "qwen2": "q/k/v biases, unpermuted rows",
    "qwen3": "per-head q/k norms (gains as stored: no 1 + w)",
    "gemma": "embedding scale, (1 + w) gains stored by the converter, GELU-tanh MLP, tied head",
    "gemma2": "sandwich norms, window 4 on layer 0 (llama.cpp's default pattern), both soft-caps",
    "gemma3": "q/k norms, the local layer's rope base 10000 by default, the listed layer pattern",
    "phi3": "fused attn_qkv and [gate; up] ffn_up split at import",
}


def _model(family: str, **overrides: Any) -> Any:
    import torch

    model = hf_model(family, vocab_size=CHAT_VOCAB, **overrides)
    if family.startswith("gemma"):  # Gemma scales embeddings by sqrt(hidden) = 8: the zoo's N(0, 1/8)
        with torch.no_grad():  # table would drown every layer and the tied head echo the last token
            model.model.embed_tokens.weight.mul_(0.125)
    return model


def _write(family: str, path: Path, qtype: Any = None, **overrides: Any) -> tuple[Path, list[int]]:
    """The family's GGUF at `path` and Hugging Face's greedy tokens on the same weights (the
    logits of SEQ are saved beside it, `path`.npy)."""
    import numpy as np
    import torch

    from zlc.testing.gguf_files import quantize_model, write_gguf

    model = _model(family, **overrides)
    if qtype is not None:
        quantize_model(model, qtype)
    write_gguf(model, path, qtype=qtype, tokenizer=True)
    with torch.no_grad():
        np.save(path.with_suffix(".npy"), model(torch.tensor([SEQ])).logits[0].numpy())
    return path, hf_greedy(model, PROMPT, NEW_TOKENS)


def _reference_tokens(path: Path) -> list[int]:
    """zlc's greedy tokens on the reference executor (prefill, then decode over the KV cache),
    after checking the logits of SEQ against Hugging Face's (`path`.npy)."""
    import numpy as np
    import torch

    import zlc
    from zlc.reference.session import ReferenceSession

    session = ReferenceSession.from_lowered(zlc.lower(path, options=CompileOptions(max_seq=64)))
    rows = [session.prefill(SEQ[:6]), *(session.step(t)[None] for t in SEQ[6:-1])]
    np.testing.assert_allclose(torch.cat(rows).numpy(), np.load(path.with_suffix(".npy"))[:-1], atol=2e-4, rtol=1e-4)
    return session.generate(PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("family", sorted(CASES))
def test_logits_and_greedy_tokens_equal_hugging_face(family: str, tmp_path: Path) -> None:
    path, expect = _write(family, tmp_path / f"{family}.gguf")
    assert len(set(expect)) > 1  # not a model that echoes its last token (the logits are the finer check)
    assert _reference_tokens(path) == expect


def test_q8_0_gemma2_equals_hugging_face_on_the_dequantized_weights(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType

    path, expect = _write("gemma2", tmp_path / "gemma2-q8.gguf", GGMLQuantizationType.Q8_0)
    assert _reference_tokens(path) == expect


def test_phi3_sliding_window_is_on_every_layer(tmp_path: Path) -> None:
    """Phi-3-mini's window (2047 there, 4 here): llama.cpp windows every phi3 layer, as HF does."""
    path, expect = _write("phi3", tmp_path / "phi3-win.gguf", sliding_window=4)
    assert _reference_tokens(path) == expect


def test_gemma3_linear_rope_scaling_is_on_its_global_layers_only(tmp_path: Path) -> None:
    """Gemma 3 4B+ scale the global layers' positions by 1/8 (`rope.scaling.type` linear); the
    local layers keep base 10000 unscaled, as llama.cpp and Hugging Face do."""
    rope = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    path, expect = _write("gemma3", tmp_path / "gemma3-linear.gguf", rope_parameters=rope)
    assert _reference_tokens(path) == expect


def test_the_gemma3_bundle_on_the_native_kernel_equals_hugging_face(tmp_path: Path) -> None:
    """A Q8_0 file: the kernel gathers the scaled embeddings from the packed table the tied head
    streams (one constant); Hugging Face runs on the dequantized weights."""
    from gguf import GGMLQuantizationType

    import zlc
    from zlc.testing.families import save_chat_tokenizer

    path, expect = _write("gemma3", tmp_path / "gemma3.gguf", GGMLQuantizationType.Q8_0)
    # the same byte-level vocabulary as a tokenizer.json (transformers' GGUF tokenizer converters
    # expect Gemma's own SentencePiece vocabulary, which the tiny file does not have)
    tok = save_chat_tokenizer(tmp_path / "tok")
    res = zlc.compile(path, targets=("cpu",), out=tmp_path / "gemma3.zlc", max_seq=64, tokenizer=tok)
    assert [(p["value"], p["arena"]) for p in res.manifest["weights"]["placement"]
            if p["value"].startswith("token_embd")] == [("token_embd.weight", "Q")]
    with zlc.load(res.path) as b:
        assert b.generate(PROMPT, NEW_TOKENS, device="cpu", eos=[]) == expect
        assert b.generate(PROMPT, NEW_TOKENS, device="reference", eos=[]) == expect


def _rewrite(src: Path, dst: Path, *, drop: tuple[str, ...] = (), extra: dict[str, tuple[Any, ...]] | None = None,
             add_tensors: dict[str, Any] | None = None) -> Path:
    """`src` copied to `dst` with metadata keys dropped or added ((value, type[, element type])),
    f32 tensors added."""
    import gguf
    import numpy as np

    r = gguf.GGUFReader(src)
    arch = str(r.get_field("general.architecture").contents())  # type: ignore[union-attr]
    w = gguf.GGUFWriter(str(dst), arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key in drop or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    for key, spec in (extra or {}).items():
        w.add_key_value(key, *spec)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_shape=list(reversed(t.shape.tolist())),
                     raw_dtype=t.tensor_type)
    for name, a in (add_tensors or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from zlc.testing.gguf_files import write_gguf

    return write_gguf(_model("phi3"), tmp_path_factory.mktemp("phi3") / "phi3.gguf", tokenizer=True)


def _error(path: Path) -> str:
    import zlc
    from zlc.errors import ZlcError

    with pytest.raises(ZlcError) as e:
        zlc.lower(path, options=CompileOptions(max_seq=64))
    msg = str(e.value)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_longrope_factor_tensors_are_refused_by_name(phi3_gguf: Path, tmp_path: Path) -> None:
    import numpy as np

    bad = _rewrite(phi3_gguf, tmp_path / "longrope.gguf",
                   add_tensors={"rope_factors_long.weight": np.ones(8, dtype=np.float32)})
    assert "tensor 'rope_factors_long.weight': LongRoPE" in _error(bad)


def test_a_fused_qkv_of_the_wrong_height_names_the_tensor(phi3_gguf: Path, tmp_path: Path) -> None:
    import gguf

    bad = _rewrite(phi3_gguf, tmp_path / "heads.gguf", drop={"phi3.attention.head_count_kv"},
                   extra={"phi3.attention.head_count_kv": (4, gguf.GGUFValueType.UINT32)})
    assert "tensor 'blk.0.attn_qkv.weight' has shape [128, 64] but the metadata implies [192, 64]" in _error(bad)


def test_a_layer_pattern_of_the_wrong_length_names_the_field(phi3_gguf: Path, tmp_path: Path) -> None:
    import gguf

    bad = _rewrite(phi3_gguf, tmp_path / "pattern.gguf",
                   extra={"phi3.attention.sliding_window": (4, gguf.GGUFValueType.UINT32),
                          "phi3.attention.sliding_window_pattern": ([True, False, True], gguf.GGUFValueType.ARRAY,
                                                                     gguf.GGUFValueType.BOOL)})
    assert "metadata 'phi3.attention.sliding_window_pattern' lists 3 layers, not the 2" in _error(bad)


def test_llama_cpps_default_layer_patterns(phi3_gguf: Path) -> None:
    """Without a listed pattern: Gemma 2 every other layer local, Gemma 3 five of six, Phi-3 all."""
    from zlc.frontend.gguf import _local_layers
    from zlc.frontend.gguf_file import GgufFile

    f = GgufFile(phi3_gguf)
    assert _local_layers(f, 4, 2) == (True, False, True, False)
    assert _local_layers(f, 7, 6) == (True, True, True, True, True, False, True)
    assert _local_layers(f, 3, 0) == (True, True, True)
