"""Tokens to text for one streaming reply: incremental detokenization plus stop sequences.

Text that could be the start of a stop sequence is held back until it either completes the
sequence (the reply ends before it) or cannot any more (it is released), so a client never sees
part of a stop sequence.
"""

from __future__ import annotations

from typing import Any


class TextStream:
    def __init__(self, tokenizer: Any, stop_sequences: list[str] | None = None, skip_special_tokens: bool = True):
        """`skip_special_tokens` False: a tool call's special opener (Mistral's [TOOL_CALLS]) stays in the text."""
        self._decoder = tokenizer.stream_decoder(skip_special_tokens=skip_special_tokens)
        self.stops = [s for s in (stop_sequences or []) if s]
        self._held = ""
        self.stopped: str | None = None  # the stop sequence that ended the reply
        self.text = ""  # everything released so far

    def _release(self, piece: str) -> str:
        self.text += piece
        return piece

    def feed(self, token: int) -> str:
        """The text this token releases (may be ''). After a stop sequence matched, nothing more."""
        if self.stopped is not None:
            return ""
        piece = self._decoder.feed(token)
        if not self.stops:
            return self._release(piece)
        held = self._held + piece
        hit = _first_stop(held, self.stops)
        if hit is not None:
            cut, self.stopped = hit
            self._held = ""
            return self._release(held[:cut])
        keep = 0  # longest suffix of `held` that is a proper prefix of a stop sequence
        for s in self.stops:
            for n in range(min(len(s) - 1, len(held)), keep, -1):
                if held.endswith(s[:n]):
                    keep = n
                    break
        self._held = held[len(held) - keep:] if keep else ""
        return self._release(held[:len(held) - keep] if keep else held)

    def finish(self) -> str:
        """Whatever is left at the end of the reply (held text, incomplete UTF-8 flushed)."""
        if self.stopped is not None:
            return ""
        rest = self._held + self._decoder.flush()
        self._held = ""
        hit = _first_stop(rest, self.stops)  # the flush may complete a stop sequence
        if hit is not None:
            cut, self.stopped = hit
            rest = rest[:cut]
        return self._release(rest)


def _first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """(start, sequence) of the stop sequence that completes first in `text` (generation stops as
    soon as one is complete); on a tie, the one that starts first."""
    best: tuple[int, int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return None if best is None else (best[1], best[2])
