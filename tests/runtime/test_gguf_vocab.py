"""The tokenizer built from a GGUF's vocabulary with `tokenizers` directly (runtime/gguf_vocab.py)
against transformers' conversion of the same file (`AutoTokenizer.from_pretrained(...,
gguf_file=...)`, what zlc used before): the ids of a fixed text set and of random strings
(Hypothesis), and the bundle's config, on GGUF files written with gguf's writer (a byte-level
vocabulary without merges as the test models carry, a byte-level BPE with merges and Qwen2's
split, a SentencePiece llama vocabulary with byte fallback and merges recovered from its scores)
and on the real SmolLM2 file."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zlc.gguf_reader import open_gguf
from zlc.runtime.gguf_vocab import build, byte_alphabet
from zlc.runtime.tokenizer import BundleTokenizer, _from_gguf_transformers, _gguf_metadata, bundle_tokenizer

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

TEXTS = ["Hello world", " What is the capital of France?", "the theater then", "  two  spaces,\ttab\n\nlines\r\n",
         "naïve café 日本語 🙂 Ωμέγα", "1234567 3.14159 x2", "don't I'll we're THE'S", "<|im_start|>user\nhi<|im_end|>\n",
         "<|endoftext|>x<s>y</s>", "<think>a</think>", "▁already▁spaced", "", " ", "\n", "inner in thin"]

# a few merges in GPT-2's byte alphabet (Ġ is the space)
_BPE_MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġt", "h"),
               ("r", "e"), ("Ġ", "w"), ("Ġth", "e"), ("in", "g"), ("Ġ", "s"), ("a", "t"), ("Ġ", "c"), ("e", "n"),
               ("Ġw", "or"), ("o", "r"), ("l", "d"), ("Ġwor", "ld"), ("Ġthe", "n"), ("Ġ", "Ġ")]
# SentencePiece pieces, best score first: merges are recovered from the scores
_PIECES = ["▁t", "he", "▁the", "in", "▁a", "er", "on", "▁th", "re", "▁w", "ing", "▁s", "at", "▁c", "en", "or",
           "▁wor", "ld", "▁world", "▁then", "▁▁", "an", "▁an", "is", "▁is", "▁in", "it", "▁it", "▁", "e", "t", "h",
           "w", "o", "r", "l", "d", "n", "a", "i", "s", "c", "g"]


def _writer(path: Path, arch: str) -> Any:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    return w


def _close(w: Any) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_byte_vocab(path: Path) -> Path:
    """The test models' vocabulary (compiler/testing/gguf_files.py): bytes, ChatML specials, padding."""
    from zlc.testing.gguf_files import byte_tokens

    w = _writer(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    toks = byte_tokens(300)
    w.add_token_list(toks)
    w.add_token_types([3 if t.startswith("<|") else (5 if t.startswith("<pad") else 1) for t in toks])
    w.add_token_scores([0.0] * len(toks))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)
    _close(w)
    return path


def write_bpe_vocab(path: Path) -> Path:
    """Byte-level BPE with merges, Qwen2's split regex, control and user-defined tokens."""
    w = _writer(path, "qwen2")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    toks = list(byte_alphabet().values())
    toks += [a + b for a, b in _BPE_MERGES if a + b not in toks]
    toks += ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    w.add_token_list(toks)
    w.add_token_types([3 if t.startswith("<|") else (4 if "think>" in t else 1) for t in toks])
    w.add_token_merges([f"{a} {b}" for a, b in _BPE_MERGES])
    w.add_bos_token_id(toks.index("<|endoftext|>"))
    w.add_eos_token_id(toks.index("<|im_end|>"))
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    _close(w)
    return path


def write_spm_vocab(path: Path) -> Path:
    """A SentencePiece llama vocabulary: <unk>, <s>, </s>, 256 byte pieces, then pieces by score."""
    w = _writer(path, "llama")
    w.add_tokenizer_model("llama")
    toks = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(_PIECES)]
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *(-float(i) for i in range(len(_PIECES)))]
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    _close(w)
    return path


def _transformers(path: Path) -> tuple[Any, dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        return _from_gguf_transformers(path, _gguf_metadata(path))


@pytest.fixture(scope="module", params=["byte", "bpe", "spm"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    """(ours, transformers', the file) for one written vocabulary."""
    path = {"byte": write_byte_vocab, "bpe": write_bpe_vocab, "spm": write_spm_vocab}[request.param](
        tmp_path_factory.mktemp("vocab") / f"{request.param}.gguf")
    ours = build(open_gguf(path))
    assert ours is not None
    theirs, _ = _transformers(path)
    return ours, theirs, path


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def test_fixed_texts_equal_transformers(pair: tuple[Any, Any, Path]) -> None:
    ours, theirs, _ = pair
    assert ours.get_vocab_size(with_added_tokens=True) == theirs.get_vocab_size(with_added_tokens=True)
    for text in TEXTS:
        assert _ids(ours, text) == _ids(theirs, text), text
        assert ours.decode(_ids(ours, text)) == theirs.decode(_ids(theirs, text)), text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=40) | st.text(alphabet=" thewrldoinag<|>_\n▁'", max_size=40))
def test_random_strings_equal_transformers(pair: tuple[Any, Any, Path], text: str) -> None:
    ours, theirs, _ = pair
    assert _ids(ours, text) == _ids(theirs, text)


def test_bundle_config_equals_transformers(pair: tuple[Any, Any, Path], tmp_path: Path) -> None:
    _, _, path = pair
    cfg = bundle_tokenizer(path, tmp_path / "tok")
    _, want = _transformers(path)
    keys = ("bos_token", "eos_token", "eos_token_ids", "add_bos_token", "pad_token", "chat_template")
    assert {k: cfg.get(k) for k in keys} == {k: want.get(k) for k in keys}
    bt = BundleTokenizer(tmp_path / "tok")
    assert bt.encode("the world") == ([bt.bos_token_id] if cfg["add_bos_token"] else []) + _ids(pair[1], "the world")


def test_other_vocabularies_are_left_to_transformers(tmp_path: Path) -> None:
    """Gemma's SentencePiece variant is not built here (None): bundle_tokenizer converts it with
    transformers, as before."""
    path = tmp_path / "gemma.gguf"
    w = _writer(path, "gemma")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<eos>", "<bos>", "a"])
    w.add_token_scores([0.0] * 4)
    _close(w)
    assert build(open_gguf(path)) is None


@pytest.fixture(scope="module")
def smollm2_pair() -> tuple[Any, Any, dict[str, Any], Path]:
    """(ours, transformers', transformers' config, the file) for the real SmolLM2 GGUF (49k tokens,
    48.9k merges, pre-tokenizer `smollm`)."""
    from zlc.testing import zoo

    try:
        path = zoo.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    ours = build(open_gguf(path))
    theirs, want = _transformers(path)
    return ours, theirs, want, path


@pytest.mark.slow
def test_smollm2_equals_transformers(smollm2_pair: tuple[Any, Any, dict[str, Any], Path], tmp_path: Path) -> None:
    ours, theirs, want, path = smollm2_pair
    for text in TEXTS:
        assert _ids(ours, text) == _ids(theirs, text), text
    cfg = bundle_tokenizer(path, tmp_path / "tok")
    assert {k: cfg[k] for k in want} == want


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=60))
def test_smollm2_random_strings_equal_transformers(smollm2_pair: tuple[Any, Any, dict[str, Any], Path],
                                                   text: str) -> None:
    ours, theirs, _, _ = smollm2_pair
    assert _ids(ours, text) == _ids(theirs, text)
