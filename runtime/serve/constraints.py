"""Constrained decoding with llguidance: the grammar a request's output must match, checked at the
ingress and enforced by a token mask per row in the engine's scheduler.

A constraint travels as one string, an llguidance Lark grammar (llguidance's Lark dialect, which
embeds JSON schemas as ``%json { ... }``): OpenAI's ``response_format`` becomes
``start: %json {schema}`` (``grammar_for_json_schema``), a forced tool call a grammar such as
``start: "<tool_call>\\n" %json {...} "\\n</tool_call>"``. The ingress compiles it against the
model's tokenizer before anything reaches the engine (``Grammars.check``: a grammar llguidance
cannot compile is one ``GrammarError`` line, which the API answers with a 400 naming its field);
the engine compiles it again into an ``LLMatcher`` per request (``Grammars.matcher``: compiled once
per distinct grammar, then copied, so n choices or repeated schemas compile once).

Why llguidance (rather than xgrammar): its mask is computed in Rust from a token trie, tens of µs
per token on a 49k vocabulary (measured: docs/serving.md); Lark grammars with inline JSON schemas
are one format for both response_format and tool calls; the wheel is abi3 with no dependencies (no
torch), so the ingress can load it.

JSON is generated compact (``whitespace_flexible`` off, ``,`` and ``:`` without spaces): free
whitespace lets a weak or confused model emit blanks until max_tokens, and a compact answer costs
fewer tokens. A schema's own ``x-guidance`` options override that.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from .protocol import MAX_GRAMMAR_BYTES

__all__ = ["ANY_OBJECT", "GrammarError", "Grammars", "grammar_for_json_schema", "masked"]

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # json_object: any JSON object
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
_CACHED = 32  # compiled grammars kept per engine (LRU)
# llguidance's errors echo the grammar with a caret under the spot: lines the client cannot use
_ECHO = re.compile(r"^\s*(\d+ \|.*|\^+)\s*$")
_WHERE = re.compile(r"^at \d+\(\d+\): ")


class GrammarError(ValueError):
    """A grammar llguidance cannot compile (or one too long for the ring); the message is one line."""


def grammar_for_json_schema(schema: Any, *, lenient: bool = False) -> str:
    """``start: %json {schema}`` with zlc's JSON options (compact). ``lenient``: keywords llguidance
    does not implement are ignored instead of refused (OpenAI's non-strict schemas)."""
    if not isinstance(schema, dict):
        raise GrammarError(f"the schema must be a JSON object, got {type(schema).__name__}")
    options = {**JSON_OPTIONS, **({"lenient": True} if lenient else {})}
    given = schema.get("x-guidance")
    if isinstance(given, dict):
        options.update(given)
    # json.dumps' ASCII output: a lone surrogate in a key stays an escape, never a str that cannot encode
    return "start: %json " + json.dumps({**schema, "x-guidance": options})


def _one_line(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if ln.strip() and not _ECHO.match(ln)]
    return _WHERE.sub("", " ".join(lines))


class Grammars:
    """The model's tokenizer as llguidance sees it (built once per process: 0.7-1.7 s for a 49k
    vocabulary, with the GIL held, so a process builds it when it starts) and the grammars compiled
    against it."""

    def __init__(self, tokenizer_json: str | Path, vocab: int, eos: list[int]):
        import llguidance
        from tokenizers import Tokenizer

        self._llg = llguidance
        text = Path(tokenizer_json).read_text()
        # The mask spans the model's vocabulary (ids past the tokenizer's own, a padded LM head, are
        # never allowed) or the tokenizer's, if that is larger (ids the model cannot give).
        self.vocab = max(vocab, Tokenizer.from_str(text).get_vocab_size(with_added_tokens=True))
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab, eos_token=list(eos) or None)
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    @staticmethod
    def of_bundle(bundle: Any) -> Grammars | None:
        """The bundle's (its tokenizer.json, vocabulary and end-of-sequence tokens), or None for a
        bundle without a tokenizer or a host without llguidance (GRAMMAR requests are then refused)."""
        tok = bundle.tokenizer
        if tok is None:
            return None
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return None
        from zlc.runtime.tokenizer import TOKENIZER_FILE

        return Grammars(tok.folder / TOKENIZER_FILE, bundle.vocab, bundle.eos_token_ids)

    def check(self, grammar: str) -> None:
        """Raises GrammarError (one line) unless llguidance compiles `grammar` for this tokenizer."""
        try:
            size = len(grammar.encode())
        except UnicodeEncodeError as e:  # a lone surrogate from a JSON escape
            raise GrammarError(f"the grammar is not UTF-8 text: {e.reason} at character {e.start}") from None
        if size > MAX_GRAMMAR_BYTES:
            raise GrammarError(f"the grammar is {size} bytes; at most {MAX_GRAMMAR_BYTES}")
        llm = self._llg.LLMatcher
        failed, messages = llm.validate_grammar_with_warnings(llm.grammar_from_lark(grammar), self.tokenizer)
        if failed:
            raise GrammarError("llguidance cannot compile it: " + _one_line(messages[0]))

    def matcher(self, grammar: str) -> Any:
        """A fresh LLMatcher for `grammar`; GrammarError (one line) if it does not compile."""
        m = self._compiled.get(grammar)
        if m is None:
            llm = self._llg.LLMatcher
            m = llm(self.tokenizer, llm.grammar_from_lark(grammar), log_level=0)
            if m.is_error():
                raise GrammarError("llguidance cannot compile it: " + _one_line(m.get_error()))
            self._compiled[grammar] = m
            if len(self._compiled) > _CACHED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar)
        return m.deep_copy()

    def masks(self, matchers: list[Any]) -> np.ndarray:
        """[len(matchers), vocab] bool: the tokens each matcher allows next. Row after row (each call
        drops the GIL): llguidance's parallel LLExecutor was slower on 2 cores (docs/serving.md)."""
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        bits = allocate_token_bitmask(len(matchers), self.vocab)
        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, bits, i)
        return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :self.vocab].astype(bool)


def masked(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The logits with every token the grammar does not allow at -inf (a copy)."""
    return np.where(allowed[:logits.shape[0]], logits, np.float32(-np.inf)).astype(np.float32, copy=False)
