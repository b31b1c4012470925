"""A GGUF file's tokenizer built with the `tokenizers` library directly, from the vocabulary,
merges, scores and token types in its metadata (read through zlc.gguf_reader, the reader the GGUF
frontend shares): no `transformers`, whose import and conversion cost a minute on a 150k-token
vocabulary.

It builds what transformers' GGUF conversion builds (`transformers.integrations.gguf`,
`convert_gguf_tokenizer`), token for token (tests/runtime/test_gguf_vocab.py checks the ids
against it on the test files and on random strings), for the two vocabularies llama.cpp writes
most:

- `gpt2`: byte-level BPE (SmolLM, Qwen, Llama 3, ...): tokens respelled in GPT-2's byte alphabet,
  the file's merges, the split regex of its `tokenizer.ggml.pre` where one is known, byte-level
  pre-tokenizer and decoder;
- `llama`: SentencePiece-style BPE (Llama 2, Mistral, TinyLlama, ...) for the architectures that
  keep its plain form: byte fallback, `▁` for spaces prepended to the first word, the merges from
  the file or, as transformers recovers them, from the vocabulary ordered by score.

Control tokens (type 3) are special added tokens and user-defined ones (type 4) plain added
tokens, as there. `build` returns None for anything else (Gemma's and Phi-3's SentencePiece
variants, unigram vocabularies): the caller converts those with transformers.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from functools import lru_cache
from typing import Any, cast

from zlc.gguf_reader import field

__all__ = ["build", "byte_alphabet", "generate_merges"]

# The split regexes transformers applies per `tokenizer.ggml.pre` (integrations/gguf
# GGUF_PRE_TOKENIZER_SPLITS; Qwen2's and Qwen3.5's from their tokenizers).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
# architectures whose `llama` vocabulary transformers builds another way (Gemma's respelled spaces
# and merges in file order, Phi-3's normalizer): left to it
_OTHER_SENTENCEPIECE = ("gemma", "gemma2", "gemma3", "phi3")
CONTROL, USER_DEFINED = 3, 4


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def generate_merges(vocab: dict[str, int], scores: dict[str, float] | None = None,
                    skip: Collection[str] = ()) -> list[tuple[str, str]]:
    """The merges a vocabulary implies (transformers' `generate_merges`): every split of a token into
    two tokens, ordered by the token's score (best first) or, without scores, by its id."""
    reverse = scores is not None
    by = dict(scores) if scores is not None else vocab
    skipped = set(skip)
    merges: list[tuple[str, str, float]] = []
    for merge, score in by.items():
        if merge in skipped:
            continue
        local = [(merge[:i], merge[i:], score) for i in range(1, len(merge))
                 if merge[:i] not in skipped and merge[i:] not in skipped and merge[:i] in vocab and merge[i:] in vocab]
        merges.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=reverse)
    return [(a, b) for a, b, _ in merges]


def build(reader: Any) -> Any | None:
    """The `tokenizers.Tokenizer` of the GGUF file `reader` reads (zlc.gguf_reader.open_gguf), or
    None when its vocabulary is not one this module builds."""
    kind = field(reader, "tokenizer.ggml.model")
    arch = field(reader, "general.architecture")
    if kind == "gpt2":
        tok = _byte_level(reader)
    elif kind == "llama" and arch not in _OTHER_SENTENCEPIECE:
        tok = _sentencepiece(reader)
    else:
        return None
    _add_special(tok, reader, byte_level=kind == "gpt2")
    split = SPLITS.get(field(reader, "tokenizer.ggml.pre"))
    if split is not None:
        from tokenizers import Regex, pre_tokenizers

        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def _merges(reader: Any, vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    merges = field(reader, "tokenizer.ggml.merges")
    if merges is not None:  # as transformers splits them (a malformed one fails in BPE, as there)
        return cast(list[tuple[str, str]], [tuple(m.split(" ")) for m in merges])
    tokens = field(reader, "tokenizer.ggml.tokens")
    if scores is None:
        scores = dict(zip(tokens, field(reader, "tokenizer.ggml.scores"), strict=True))
    return generate_merges(vocab, scores)


def _byte_level(reader: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    tokens: Sequence[str] = field(reader, "tokenizer.ggml.tokens")
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(reader, vocab, None), dropout=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(reader: Any) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens: Sequence[str] = field(reader, "tokenizer.ggml.tokens")
    vocab = {t: i for i, t in enumerate(tokens)}
    scores = field(reader, "tokenizer.ggml.scores")
    merges = _merges(reader, vocab, dict(zip(tokens, scores, strict=True)) if scores is not None else None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1)])
    return tok


def _add_special(tok: Any, reader: Any, byte_level: bool) -> None:
    """Control tokens and the file's bos/eos/unk/pad as special added tokens, user-defined tokens as
    plain ones (transformers' add_gguf_special_tokens and its special-token arguments). A control
    token outside the byte alphabet of a byte-level vocabulary is a llama.cpp mislabel: skipped."""
    from tokenizers import AddedToken

    tokens: Sequence[str] = field(reader, "tokenizer.ggml.tokens")
    types: Sequence[int] = field(reader, "tokenizer.ggml.token_type") or ()
    spelled = set(byte_alphabet().values()) if byte_level else None
    control = [t for t, k in zip(tokens, types, strict=False) if k == CONTROL and (spelled is None or set(t) <= spelled)]
    named = [tokens[i] for key in ("bos", "eos", "unknown", "padding")
             if isinstance(i := field(reader, f"tokenizer.ggml.{key}_token_id"), int) and 0 <= i < len(tokens)]
    if byte_level and "<|endoftext|>" in tok.get_vocab():  # GPT2Tokenizer's default unk/bos/eos
        named.append("<|endoftext|>")
    special = list(dict.fromkeys([*control, *named]))
    if special:
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    vocab = tok.get_vocab()
    user = [t for t, k in zip(tokens, types, strict=False) if k == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
