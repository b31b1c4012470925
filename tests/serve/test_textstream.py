"""TextStream: streamed pieces with stop sequences equal the whole reply cut at the first stop
sequence, and no piece ever shows part of a stop sequence that then completes (Hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("tokenizers")

from zlc.runtime.serve.ingress.textstream import TextStream  # noqa: E402
from zlc.runtime.tokenizer import BundleTokenizer, bundle_tokenizer  # noqa: E402
from zlc.testing import zoo  # noqa: E402


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> BundleTokenizer:
    root = tmp_path_factory.mktemp("tok")
    bundle_tokenizer(zoo.save_chat_tokenizer(root / "src"), root / "bundle")
    return BundleTokenizer(root / "bundle")


ALPHABET = st.sampled_from(list("ab c\n") + ["é", "🙂"])


def expected(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Generation stops when a stop sequence completes: the one ending first (then starting first)."""
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return text, None
    _, i, s = min(hits)
    return text[:i], s


@settings(max_examples=300, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3))
def test_stream_equals_cut_text(tok: BundleTokenizer, text: str, stops: list[str]) -> None:
    ts = TextStream(tok, stops)
    pieces = [ts.feed(t) for t in tok.encode(text, add_special_tokens=False)]
    pieces.append(ts.finish())
    want, stop = expected(text, stops)
    assert "".join(pieces) == want == ts.text
    assert ts.stopped is not None if stop is not None else ts.stopped is None
    if stop is not None:  # the matched sequence starts where the reply ends
        assert text[len(want):].startswith(ts.stopped or "")


def test_nothing_after_stop(tok: BundleTokenizer) -> None:
    ts = TextStream(tok, ["END"])
    out = [ts.feed(t) for t in tok.encode("hello END more", add_special_tokens=False)]
    assert "".join(out) == "hello " and ts.stopped == "END"
    assert ts.feed(tok.encode("x", add_special_tokens=False)[0]) == "" and ts.finish() == ""


def test_no_stops_streams_immediately(tok: BundleTokenizer) -> None:
    ts = TextStream(tok, [])
    assert [ts.feed(t) for t in tok.encode("abc", add_special_tokens=False)] == ["a", "b", "c"]


def test_held_prefix_released_when_it_cannot_match(tok: BundleTokenizer) -> None:
    ts = TextStream(tok, ["abc"])
    ids = tok.encode("xabx", add_special_tokens=False)
    assert [ts.feed(t) for t in ids] == ["x", "", "", "abx"]


