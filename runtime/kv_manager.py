"""The one owner of a batch's KV pages, and the step value every batched backend encodes.

`KVManager` owns the pages of one arena (`PagePool`: free list, prefix keys, reference counts,
least-recently-used eviction) and each open sequence's page table, length and tokens. It answers
what the scheduler asks, modelled on vLLM v1's kv_cache_manager: what an admission would reuse
(`lookup`), whether a sequence can get the slots for n more positions (`allocate_slots`: the pages
taken, or None with nothing changed; the scheduler preempts on None, no exception as control
flow), and, for a whole step, the plain `BatchStep` value (`plan`): every row's ids, positions
and page table, and which rows' logits come back, validated once here. A backend only encodes that
value into its launch (runtime/batch.py); after the launch `commit` records what was written
(lengths, tokens, the full pages keyed for the prefix cache), or `abort` hands the step's new
pages back when the launch failed.

The router of several engines (runtime/serve/ingress/router.py) keys prompts with `page_keys` and the
page size from here too, so its affinity and the engines' caches speak of the same pages.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from zlc.errors import ZlcError

from .kv_pages import PagePool, pages_for

DEFAULT_PAGE_SIZE = 16  # tokens per page: a sequence wastes < 16 positions; a lookup per 16 keys

Rows = Sequence[tuple[int, Sequence[int]]]


def page_keys(tokens: Any, page_size: int = DEFAULT_PAGE_SIZE) -> list[int]:
    """One key per full page of `tokens` (array('I') or ints), each covering the page and all
    before it: the digest of the chain the pool keys exactly ((the previous page's node, this
    page's ids)), for the router, which keeps no pages. Python's hash of bytes (SipHash): keys live
    only in this process."""
    raw = (tokens if isinstance(tokens, array) else array("I", tokens)).tobytes()
    step = 4 * page_size
    keys: list[int] = []
    key = 0
    for at in range(0, len(raw) - step + 1, step):
        key = hash((key, raw[at:at + step]))
        keys.append(key)
    return keys


@dataclass(frozen=True, eq=False)
class BatchStep:
    """One launch, as plain arrays (int32): entry i appends ``ids[i]`` to sequence ``seqs[i]`` at
    positions ``starts[i]..``; ``tokens``/``pos`` are every row's id and position, ``pt[r]`` the
    offset in ``pages`` where row r's sequence's page table starts, ``lrows`` the rows whose logits
    come back (entry order). ``added[i]``: pages entry i took for this step (``abort`` returns them)."""

    seqs: tuple[int, ...]
    ids: tuple[tuple[int, ...], ...]
    want: tuple[bool, ...]
    starts: tuple[int, ...]
    added: tuple[int, ...]
    tokens: np.ndarray
    pos: np.ndarray
    pt: np.ndarray
    pages: np.ndarray
    lrows: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.tokens)


class KVManager:
    """The pages of one arena: `pages_total` pages of `page_size` positions; at most `cache_pages`
    kept for their prefix after their sequences close (0: no prefix cache). `max_seq`, `vocab` (None:
    the executor checks ids itself) and `max_rows` bound a step (`plan` names the limit a step passes)."""

    def __init__(self, *, pages_total: int, page_size: int, max_seq: int, vocab: int | None, max_rows: int,
                 cache_pages: int = 0):
        if page_size < 1:
            raise ZlcError(f"page_size must be at least 1, got {page_size}")
        if pages_total < 1:
            raise ZlcError(f"the KV budget must be at least 1 page, got {pages_total}")
        self.pages_total, self.page_size = int(pages_total), int(page_size)
        self.max_seq, self.vocab, self.max_rows = int(max_seq), vocab, int(max_rows)
        self.pool = PagePool(self.pages_total, self.page_size, min(int(cache_pages), self.pages_total))
        self._pages: dict[int, list[int]] = {}
        self._length: dict[int, int] = {}
        self._tokens: dict[int, list[int]] = {}  # what each sequence was fed (its full pages' keys)
        self._chain: dict[int, list[int]] = {}  # the node of each of its full pages
        self._next_id = 0

    # ---- what the scheduler asks ----------------------------------------------------------------
    def pages_free(self) -> int:
        """Pages a step may take now: free ones and cached ones (evicted least recently used first)."""
        return self.pool.available()

    def pages_cached(self) -> int:
        """Pages no open sequence holds, kept because their tokens may come again (in pages_free)."""
        return len(self.pool.lru)

    def _reusable(self, prompt: Sequence[int]) -> tuple[list[int], list[int]]:
        # Whole pages, and never the last prompt id: its row gives the logits, and the sequence
        # then appends into a page of its own, never into a shared one.
        return self.pool.match(prompt, max(0, len(prompt) - 1) // self.page_size)

    def lookup(self, prompt: Sequence[int]) -> tuple[int, int]:
        """What open(prompt) would reuse now, changing nothing: (positions already cached, and how
        many of their pages open sequences hold: those are shared without taking from pages_free)."""
        pages, _ = self._reusable(prompt)
        return len(pages) * self.page_size, sum(1 for p in pages if self.pool.refs[p])

    def open(self, prompt: Sequence[int] = (), *, keep: int | None = None) -> int:
        """A new sequence; returns its id. By default the longest cached prefix of `prompt` is
        mapped into it (length() says how much). `keep`: positions the caller's executor already
        holds for it (a session's own cache, SequentialBatch): they take fresh pages, no prefix
        lookup; None when they are not free."""
        seq = self._next_id
        if keep is not None:
            pages = self.allocate(keep)
            if pages is None:
                raise ZlcError(f"{keep} kept positions need {pages_for(keep, self.page_size)} KV pages, "
                               f"{self.pages_free()} are free")
            nodes: list[int] = []
            n = keep
        else:
            pages, nodes = self._reusable(prompt)
            for p in pages:
                self.pool.hold(p)
            n = len(pages) * self.page_size
        self._next_id += 1
        self._pages[seq], self._length[seq] = pages, n
        self._tokens[seq], self._chain[seq] = [int(t) for t in prompt[:n]], nodes
        return seq

    def close(self, seq: int) -> None:
        """Forget `seq`: its pages go back (keyed ones to the prefix cache) at once."""
        self._known(seq)
        self.pool.release(self._pages.pop(seq))
        del self._length[seq], self._tokens[seq], self._chain[seq]

    def length(self, seq: int) -> int:
        self._known(seq)
        return self._length[seq]

    def pages_of(self, seq: int) -> list[int]:
        """The pages `seq` holds, in position order (a copy)."""
        self._known(seq)
        return list(self._pages[seq])

    def open_seqs(self) -> list[int]:
        return list(self._length)

    def _known(self, seq: int) -> None:
        if seq not in self._length:
            raise ZlcError(f"sequence {seq} is not open")

    def allocate(self, n: int) -> list[int] | None:
        """`pages_for(n)` pages taken for a new holder, or None (nothing taken) when not free."""
        need = pages_for(n, self.page_size)
        if need > self.pool.available():
            return None
        return [self.pool.take() for _ in range(need)]

    def slots_needed(self, seq: int, n: int) -> int:
        """Pages `seq` must take to hold `n` more positions."""
        return pages_for(self._length[seq] + n, self.page_size) - len(self._pages[seq])

    def allocate_slots(self, seq: int, n: int) -> list[int] | None:
        """The pages `seq` takes to hold `n` more positions (appended to its page table), or None
        with nothing changed when they are not free: the caller preempts, or waits."""
        self._known(seq)
        need = self.slots_needed(seq, n)
        if need > self.pool.available():
            return None
        got = [self.pool.take() for _ in range(need)]
        self._pages[seq].extend(got)
        return got

    def _give_back(self, seq: int, n: int) -> None:
        own = self._pages[seq]
        if n:
            self.pool.release(own[len(own) - n:])
            del own[len(own) - n:]

    # ---- one step --------------------------------------------------------------------------------
    def validate(self, rows: Rows, want_logits: Sequence[bool]) -> int:
        """Checks a step (one-line ZlcError naming the limit) and returns the pages it needs."""
        if len(want_logits) != len(rows):
            raise ZlcError(f"want_logits has {len(want_logits)} entries for {len(rows)} rows")
        if not rows:
            raise ZlcError("a step needs at least one row")
        seen: set[int] = set()
        total = need = 0
        for seq, ids in rows:
            self._known(seq)
            if seq in seen:
                raise ZlcError(f"sequence {seq} appears twice in one step")
            seen.add(seq)
            if not len(ids):
                raise ZlcError(f"sequence {seq}: a step entry with no ids")
            vocab = self.vocab
            bad = [] if vocab is None else [i for i in ids if not 0 <= int(i) < vocab]
            if bad:
                raise ZlcError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1 if vocab else 0})")
            end = self._length[seq] + len(ids)
            if end > self.max_seq:
                raise ZlcError(f"sequence {seq} would hold {end} tokens, past the bundle's max_seq={self.max_seq}")
            total += len(ids)
            need += self.slots_needed(seq, len(ids))
        if total > self.max_rows:
            raise ZlcError(f"a step of {total} rows exceeds max_rows={self.max_rows}")
        return need

    def shortage(self, rows: Rows) -> str:
        """Why plan() returned None, in one line."""
        need = sum(self.slots_needed(seq, len(ids)) for seq, ids in rows)
        return f"the step needs {need} KV pages, {self.pool.available()} of {self.pages_total} are free"

    def plan(self, rows: Rows, want_logits: Sequence[bool]) -> BatchStep | None:
        """The step value for `rows` ((seq, ids) entries) with their slots allocated, or None with
        nothing changed when the pages are not free. ZlcError (nothing changed) on a malformed step."""
        if self.validate(rows, want_logits) > self.pool.available():
            return None
        tokens: list[int] = []
        pos: list[int] = []
        pt: list[int] = []
        table: list[int] = []
        lrows: list[int] = []
        added: list[int] = []
        starts: list[int] = []
        for (seq, ids), want in zip(rows, want_logits, strict=True):
            start, n = self._length[seq], len(ids)
            got = self.allocate_slots(seq, n)
            assert got is not None  # validate() counted them free
            added.append(len(got))
            starts.append(start)
            base = len(table)
            table.extend(self._pages[seq])
            tokens.extend(int(i) for i in ids)
            pos.extend(range(start, start + n))
            pt.extend([base] * n)
            if want:
                lrows.append(len(tokens) - 1)
        i32 = np.int32
        return BatchStep(tuple(seq for seq, _ in rows), tuple(tuple(int(i) for i in ids) for _, ids in rows),
                         tuple(bool(w) for w in want_logits), tuple(starts), tuple(added),
                         np.array(tokens, i32), np.array(pos, i32), np.array(pt, i32), np.array(table, i32),
                         np.array(lrows, i32))

    def commit(self, step: BatchStep) -> None:
        """The launch of `step` ran: the sequences hold its ids; their newly full pages are keyed."""
        for seq, ids in zip(step.seqs, step.ids, strict=True):
            self._length[seq] += len(ids)
            self._tokens[seq].extend(ids)
            self._register_full(seq)

    def abort(self, step: BatchStep) -> None:
        """The launch of `step` failed: the pages it took go back (free: a cached page taken lost
        its key); lengths never moved."""
        for seq, n in zip(step.seqs, step.added, strict=True):
            if seq in self._pages:
                self._give_back(seq, n)

    def _register_full(self, seq: int) -> None:
        """Keys the pages `seq` has filled since its last step (written now, never again)."""
        chain, pages, toks, ps = self._chain[seq], self._pages[seq], self._tokens[seq], self.page_size
        for k in range(len(chain), self._length[seq] // ps):
            chain.append(self.pool.register(pages[k], chain[-1] if chain else 0, toks[k * ps:(k + 1) * ps]))

    def check(self) -> None:
        """The page invariants (PagePool.check) over the open sequences. AssertionError naming what is wrong."""
        self.pool.check(self._pages, self._length)
