"""Constrained decoding in the scheduler (runtime/serve/constraints.py), driven directly over the
engine's own backend for the tiny chat bundle on the CPU (NativeBatch: one kernel launch per step).
Oracles: every constrained answer parses and validates against its schema (`jsonschema`) for every
seed; a greedy constrained row is the argmax of a session's logits of the whole answer (decode
equals prefill) over the tokens a fresh matcher allows at each step (the mask from llguidance's
compute_bitmask, not the scheduler's path); constrained and unconstrained rows run side by side
each equal their solo answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.runtime.batch import batch_backend
from zlc.runtime.serve.constraints import GrammarError, Grammars, grammar_for_json_schema
from zlc.runtime.serve.engine.scheduler import Scheduler
from zlc.runtime.serve.protocol import EngineError, RequestFlag, ResultFlag
from zlc.runtime.serve.rings import Request, RingRegion

jsonschema = pytest.importorskip("jsonschema")
llguidance = pytest.importorskip("llguidance")

# Bounded so that a random-weight model's answer fits in MAX_NEW tokens: byte tokens, a string of
# at most 4 characters (up to 4 UTF-8 bytes or a 6-byte escape each), a small integer, an enum.
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "ok", "color"], "additionalProperties": False}
MAX_NEW = 80


@pytest.fixture(scope="module")
def bundle(chat_bundle: Path) -> Any:
    import zlc

    return zlc.load(chat_bundle)


@pytest.fixture(scope="module")
def grammars(bundle: Any) -> Grammars:
    g = Grammars.of_bundle(bundle)
    assert g is not None
    return g


@pytest.fixture(scope="module")
def session(bundle: Any) -> Any:
    with bundle.session("cpu") as s:
        yield s


@pytest.fixture(scope="module")
def batch(bundle: Any) -> Any:
    b = batch_backend(bundle, "cpu", threads=1, max_seqs=5, prefill_chunk=6)
    yield b
    b.close_all()


def run(bundle: Any, b: Any, grammars: Grammars, requests: list[Request], stats: list[Any] | None = None
        ) -> dict[int, list[tuple[int, int]]]:
    """Every request's results (token, flags), all run side by side (the scheduler's stats appended
    to `stats`)."""
    out: dict[int, list[tuple[int, int]]] = {}

    def emit(rid: int, tok: int, flags: int, logprob: float = 0.0) -> None:
        out.setdefault(rid, []).append((tok, flags))

    s = Scheduler(b, emit, eos=frozenset(bundle.eos_token_ids), vocab=bundle.vocab, max_batch=5, prefill_chunk=6,
                  grammars=grammars)
    for r in requests:
        s.submit(r)
    for _ in range(2000):
        if not s.step() and s.idle:
            if stats is not None:
                stats.append(s.stats)
            return out
    raise AssertionError("the scheduler did not go idle")


def tokens(results: list[tuple[int, int]]) -> list[int]:
    return [t for t, f in results if not f & ResultFlag.ERROR]


def answer(bundle: Any, results: list[tuple[int, int]]) -> Any:
    """The constrained answer as JSON: it ended because the grammar was complete (or at EOS)."""
    tok, flags = results[-1]
    assert flags & ResultFlag.LAST and flags & (ResultFlag.COMPLETE | ResultFlag.EOS), results[-3:]
    ids = [t for t in tokens(results) if t not in bundle.eos_token_ids]
    return json.loads(bundle.tokenizer.decode(ids))


def prompt_of(i: int, n: int, vocab: int) -> list[int]:
    return [(i * 131 + k * 17 + 3) % 256 for k in range(n)]


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), i=st.integers(0, 40))
def test_constrained_answers_validate_for_every_seed(bundle: Any, batch: Any, grammars: Grammars, seed: int,
                                                     i: int) -> None:
    grammar = grammar_for_json_schema(SCHEMA)
    rows = [Request(k, prompt_of(i + k, 4, bundle.vocab), MAX_NEW, temperature=1.0 if k else 0.0, top_p=0.95,
                    seed=(seed + k) % 2**64, grammar=grammar) for k in range(3)]  # row 0 greedy
    out = run(bundle, batch, grammars, rows)
    for r in rows:
        jsonschema.validate(answer(bundle, out[r.request_id]), SCHEMA)


def test_constrained_and_plain_rows_side_by_side_equal_their_solo_answers(bundle: Any, batch: Any,
                                                                          grammars: Grammars, session: Any) -> None:
    grammar = grammar_for_json_schema(SCHEMA)
    p1, p2 = prompt_of(1, 5, bundle.vocab), prompt_of(2, 7, bundle.vocab)
    rows = [Request(1, p1, MAX_NEW, grammar=grammar),  # constrained greedy
            Request(2, p2, MAX_NEW, temperature=1.0, top_p=0.95, seed=7, grammar=grammar),  # constrained sampled
            Request(3, p2, 12),  # plain greedy
            Request(4, p1, 12, temperature=0.9, seed=7),  # plain sampled
            # constrained through the options' path (sampling.RowSampler): top_k and logprobs
            Request(5, p2, MAX_NEW, temperature=0.8, seed=3, top_k=5, flags=RequestFlag.LOGPROBS, top_logprobs=2,
                    grammar=grammar)]
    together = run(bundle, batch, grammars, rows)
    for r in (rows[1], rows[3], rows[4]):
        assert together[r.request_id] == run(bundle, batch, grammars, [r])[r.request_id], r.request_id
    for rid in (1, 2, 5):
        jsonschema.validate(answer(bundle, [(t, f) for t, f in together[rid] if not f & ResultFlag.TOP]), SCHEMA)
    # the greedy rows: the plain one is the session's own greedy answer; the constrained one the
    # argmax of the reference logits over the tokens a fresh matcher allows, step by step
    session.reset()
    assert tokens(together[3]) == list(session.stream(p2, 12, eos=bundle.eos_token_ids))
    got = tokens(together[1])
    session.reset()
    _, lg = session.prefill(p1 + got[:-1], all_logits=True, want_logits=True)
    lg = np.asarray(lg)[len(p1) - 1:]
    m = llguidance.LLMatcher(grammars.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    for k, tok in enumerate(got):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = bits[:bundle.vocab].astype(bool)
        assert tok == int(np.argmax(np.where(allowed, lg[k], -np.inf))), k
        assert m.consume_token(tok)
    assert m.is_stopped()


def test_preempted_constrained_rows_resume_their_matchers(bundle: Any, grammars: Grammars) -> None:
    """A page budget too small for three answers at once preempts rows mid-answer: each recomputes
    its context and goes on with its matcher where it was, giving its solo answer."""
    grammar = grammar_for_json_schema(SCHEMA)
    rows = [Request(k, prompt_of(k, 6, bundle.vocab), MAX_NEW, temperature=0.8, seed=k, grammar=grammar)
            for k in range(1, 4)]
    b = batch_backend(bundle, "cpu", threads=1, max_seqs=3, prefill_chunk=6, pages_total=8)
    stats: list[Any] = []
    try:
        together = run(bundle, b, grammars, rows, stats)
        assert stats[0].preemptions > 0
        for r in rows:
            jsonschema.validate(answer(bundle, together[r.request_id]), SCHEMA)
            assert together[r.request_id] == run(bundle, b, grammars, [r])[r.request_id]
    finally:
        b.close_all()


def test_an_uncompilable_grammar_in_the_engine_is_one_error_result(bundle: Any, batch: Any,
                                                                   grammars: Grammars) -> None:
    # a grammar the engine cannot compile (the ingress refuses it first; frames or a bug could send
    # one): one GRAMMAR error result, and the engine goes on
    out = run(bundle, batch, grammars, [Request(1, [5, 6], 4, grammar="start: nothing"),
                                        Request(2, [5, 6], 3)])
    assert out[1] == [(int(EngineError.GRAMMAR), ResultFlag.ERROR | ResultFlag.LAST)]
    assert len(tokens(out[2])) == 3


def test_grammar_check_names_what_llguidance_refuses(grammars: Grammars) -> None:
    grammars.check(grammar_for_json_schema(SCHEMA))
    for schema, words in [({"type": "foo"}, "Invalid type: foo"),
                          ({"type": "string", "pattern": "(?<=a)b"}, "look-around")]:
        with pytest.raises(GrammarError, match=words) as e:
            grammars.check(grammar_for_json_schema(schema))
        assert "\n" not in str(e.value) and "start: %json" not in str(e.value)
    with pytest.raises(GrammarError, match="at most 32768"):
        grammars.check(grammar_for_json_schema({"description": "x" * 40000}))
    with pytest.raises(GrammarError, match="not UTF-8 text"):
        grammars.check('start: "\ud800"')


def test_the_ring_carries_the_grammar_before_the_prompt() -> None:
    region = RingRegion.anonymous(8, 16, chunk_tokens=16)
    try:
        sent = [Request(5, [1, 2, 3], 9, 0.5, flags=4, top_logprobs=2, grammar='start: "é" %json {"type": "object"}'),
                Request(6, list(range(40)), 9), Request(7, [], 1, grammar="")]
        assert region.requests.push_many(sent) == 3
        got = region.requests.pop_many(8)
        assert [(r.request_id, list(r.tokens), r.flags, r.grammar) for r in got] == \
               [(r.request_id, list(r.tokens), r.flags, r.grammar) for r in sent]
    finally:
        region.close()
