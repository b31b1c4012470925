"""Batched steps: the interface between the engine's scheduler and whatever runs many sequences
(docs/serving.md, "The batch").

``BatchBackend`` is the protocol the scheduler (serve/scheduler.py) is written against: sequences
are opened and closed, and one ``step()`` appends rows (a decode token, or a prefill chunk) to
several sequences and returns the logits asked for. The KV budget is counted in pages of
``page_size`` positions; a step that needs more pages than are free raises ``OutOfPages`` before
anything runs, so the scheduler can preempt a sequence and try again.

``SequentialBatch`` is the protocol for executors without a batched kernel (interpret, reference,
cuda, and native until its batched kernel lands): one MegakernelSession per open sequence, each
row run on its own session, one after another. Its pages are a token budget it accounts (each
session holds a whole max_seq cache anyway), so preemption and admission behave as they will on a
paged kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from zlc.errors import ZlcError

from .megakernel import MegakernelSession


class OutOfPages(ZlcError):
    """step() would need more KV pages than are free; raised before anything runs."""


class BatchBackend(Protocol):
    max_rows: int  # rows one step can carry in total (decode rows + prefill chunk rows)
    max_seq: int  # positions one sequence may hold (the bundle's max_seq)
    page_size: int  # tokens per KV page (1 page = page_size positions of one sequence)
    pages_total: int  # the KV budget of this session, in pages

    def pages_free(self) -> int: ...

    def open(self) -> int:
        """A new, empty sequence; returns its id. Holds no pages until rows are appended."""
        ...

    def close(self, seq: int) -> None:
        """Forget `seq` and return its pages at once (finished, cancelled or preempted)."""
        ...

    def length(self, seq: int) -> int:
        """Tokens `seq` holds in its KV cache."""
        ...

    def step(self, rows: Sequence[tuple[int, Sequence[int]]],
             want_logits: Sequence[bool]) -> list[np.ndarray | None]:
        """One launch. Each entry (seq, ids) appends `ids` (1 id for a decode row, up to the rest of
        max_rows for a prefill chunk) at seq's next positions, attends causally over seq's own
        cache, and when want_logits[i] returns the f32 logits [vocab] of that entry's LAST id
        (else None). A sequence appears at most once per step; sum(len(ids)) <= max_rows.
        Raises OutOfPages (nothing run, nothing changed) when the pages needed are not free, and a
        ZlcError naming the limit when a sequence would pass max_seq."""
        ...

    def close_all(self) -> None: ...  # end of session (threads, memory)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold `tokens` positions of one sequence."""
    return -(-tokens // page_size)


class SequentialBatch:
    """BatchBackend over one MegakernelSession per open sequence (``max_seqs`` at most), rows run
    one after another. Sessions are made on first need by ``make_session`` and kept for reuse
    after close() (a native session starts threads and lays out weights: too dear per request)."""

    def __init__(self, make_session: Callable[[], MegakernelSession], *, max_seq: int, max_seqs: int = 8,
                 max_rows: int = 256, page_size: int = 16, pages_total: int | None = None):
        if max_seqs < 1 or max_rows < 1 or page_size < 1:
            raise ZlcError(f"bad batch shape: max_seqs={max_seqs}, max_rows={max_rows}, page_size={page_size} "
                           "(each must be >= 1)")
        self.make_session = make_session
        self.max_seq, self.max_seqs, self.max_rows, self.page_size = max_seq, max_seqs, max_rows, page_size
        # Default: every sequence can reach max_seq, so nothing is ever preempted.
        self.pages_total = pages_total if pages_total is not None else max_seqs * pages_for(max_seq, page_size)
        if self.pages_total < 1:
            raise ZlcError(f"the KV budget must be at least 1 page, got {self.pages_total}")
        self._idle: list[MegakernelSession] = []
        self._open: dict[int, MegakernelSession] = {}
        self._next = 1
        self._used = 0  # pages held by open sequences

    def pages_free(self) -> int:
        return self.pages_total - self._used

    def open(self) -> int:
        if len(self._open) >= self.max_seqs:
            raise ZlcError(f"{len(self._open)} sequences are open: the batch holds max_seqs={self.max_seqs}")
        s = self._idle.pop() if self._idle else self.make_session()
        s.reset()
        seq, self._next = self._next, self._next + 1
        self._open[seq] = s
        return seq

    def _session(self, seq: int) -> MegakernelSession:
        s = self._open.get(seq)
        if s is None:
            raise ZlcError(f"sequence {seq} is not open")
        return s

    def close(self, seq: int) -> None:
        s = self._open.pop(seq, None)
        if s is None:
            return
        self._used -= pages_for(s.length, self.page_size)
        s.reset()
        self._idle.append(s)

    def length(self, seq: int) -> int:
        return self._session(seq).length

    def step(self, rows: Sequence[tuple[int, Sequence[int]]],
             want_logits: Sequence[bool]) -> list[np.ndarray | None]:
        if len(want_logits) != len(rows):
            raise ZlcError(f"step: {len(rows)} rows but {len(want_logits)} want_logits flags")
        seqs = [seq for seq, _ in rows]
        if len(set(seqs)) != len(seqs):
            raise ZlcError("step: a sequence appears more than once")
        n_rows = sum(len(ids) for _, ids in rows)
        if n_rows > self.max_rows:
            raise ZlcError(f"step: {n_rows} rows exceed max_rows={self.max_rows}")
        need = 0
        for seq, ids in rows:
            have = self._session(seq).length
            if not ids:
                raise ZlcError(f"step: sequence {seq} has an empty row")
            if have + len(ids) > self.max_seq:
                raise ZlcError(f"sequence {seq}: {have + len(ids)} tokens exceed max_seq={self.max_seq}")
            need += pages_for(have + len(ids), self.page_size) - pages_for(have, self.page_size)
        if need > self.pages_free():
            raise OutOfPages(f"step needs {need} KV pages, {self.pages_free()} of {self.pages_total} are free")
        out: list[np.ndarray | None] = []
        for (seq, ids), want in zip(rows, want_logits, strict=True):
            s = self._open[seq]
            before = pages_for(s.length, self.page_size)
            if len(ids) == 1 and s.length > 0:
                _, lg = s.step(int(ids[0]), want_logits=want)
            else:  # a prompt's first chunk runs as prefill even when it is one token (as alone)
                _, lg = s.prefill([int(i) for i in ids], want_logits=want)
            self._used += pages_for(s.length, self.page_size) - before
            out.append(None if lg is None else np.asarray(lg[-1], dtype=np.float32))
        return out

    def close_all(self) -> None:
        for seq in list(self._open):
            self.close(seq)
        sessions, self._idle = self._idle, []
        for s in sessions:
            s.close()


# Devices whose kernel runs a whole batch in one launch: device -> factory(bundle, threads=, max_seqs=,
# max_rows=, pages_total=). Adding a batched kernel is one line here; every other device gets
# SequentialBatch.
BATCHED: dict[str, Callable[..., BatchBackend]] = {}


def batch_backend(bundle: Any, device: str = "auto", *, threads: int | None = None, max_seqs: int = 8,
                  prefill_chunk: int = 64, pages_total: int | None = None) -> BatchBackend:
    """The BatchBackend the engine serves `bundle` with on `device` (auto resolved as Bundle does):
    the device's batched kernel when there is one, else SequentialBatch over its sessions. Its
    max_rows fits a decode row per sequence plus a whole prefill chunk."""
    device = bundle.resolve_device(device)
    max_rows = max_seqs + prefill_chunk
    batched = BATCHED.get(device)
    if batched is not None:
        return batched(bundle, threads=threads, max_seqs=max_seqs, max_rows=max_rows, pages_total=pages_total)
    return SequentialBatch(lambda: bundle.session(device, threads=threads), max_seq=bundle.max_seq,
                           max_seqs=max_seqs, max_rows=max_rows, pages_total=pages_total)
