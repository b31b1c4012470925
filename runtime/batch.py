"""Batched steps: many sequences' rows in one launch, over a paged KV cache.

`BatchBackend` is the protocol the engine's scheduler (serve/scheduler.py) is written against
(docs/serving.md, "The batch"; docs/megakernel.md, "Batched steps and the paged KV cache"):
sequences are opened, fed rows step by step (decode rows of running sequences and prefill chunks
of new ones in the same step) and closed. The KV budget is counted in pages of ``page_size``
positions; a step that needs more pages than are free raises ``OutOfPages`` before anything runs,
so the scheduler can preempt a sequence and try again.

`NativeBatch` implements it on the native C kernel with one launch per step: the prefill table's
Linear tasks read each weight tile once for all rows, the row-dependent ops read each row's
(position, page table), and the KV cache is one arena of fixed-size pages handed out here, on the
host, from a free list, so memory is spent on tokens that exist. Its full pages form a shared-prefix
cache (`PagePool`): a sequence opened with its prompt maps the pages another sequence already
filled with the same tokens at the same positions, and prefills only the rest.

`SequentialBatch` is the protocol for executors without a batched kernel (interpret, reference,
cuda): one MegakernelSession per open sequence, each row run on its own session, one after
another. Its pages are a token budget it accounts (each session holds a whole max_seq cache
anyway), so preemption and admission behave as they do on the paged kernel. Its prefix reuse is a
slot's: a sequence opened with its prompt takes the idle session whose last tokens share the longest
prefix with it and keeps that much of its cache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from zlc import bundle as fmt
from zlc.errors import ZlcError

from .kv_pages import PagePool, pages_for
from .megakernel import MegakernelSession
from .native import NativeBackend, NativeError

DEFAULT_PAGE_SIZE = 16  # tokens per page: a sequence wastes < 16 positions; a lookup per 16 keys
DEFAULT_KV_BYTES = 256 << 20  # the default KV budget (at least one full max_seq sequence)


class OutOfPages(ZlcError):
    """step() would need more KV pages than are free; raised before anything runs."""


class BatchBackend(Protocol):
    max_rows: int      # rows one step can carry in total (decode rows + prefill chunk rows)
    max_seq: int       # positions one sequence may hold (the bundle's max_seq)
    page_size: int     # tokens per KV page (1 page = page_size positions of one sequence)
    pages_total: int   # the KV budget of this session, in pages

    def pages_free(self) -> int:
        """Pages a step may take now: free ones and cached ones (evicted, least recently used first)."""

    def pages_cached(self) -> int:
        """Pages no open sequence holds, kept because their tokens may come again (in pages_free)."""

    def lookup(self, prompt: Sequence[int]) -> tuple[int, int]:
        """What open(prompt) would reuse now, changing nothing: (positions already cached, and how
        many of their pages open sequences hold: those are shared without taking from pages_free)."""

    def open(self, prompt: Sequence[int] = ()) -> int:
        """A new sequence; returns its id. Given the ids it will be fed first, the longest cached
        prefix of `prompt` (at most len(prompt) - 1 positions: the last id is always computed, it
        gives the logits) is mapped into it: length(seq) says how many positions are already there,
        and the caller feeds prompt[length(seq):]. Holds no other pages until rows are appended."""

    def close(self, seq: int) -> None:
        """Forget `seq` and return its pages at once (finished, cancelled or preempted)."""

    def length(self, seq: int) -> int:
        """Tokens `seq` holds in its KV cache."""

    def step(self, rows: Sequence[tuple[int, Sequence[int]]], want_logits: Sequence[bool]) \
            -> list[np.ndarray | None]:
        """One launch. Each entry (seq, ids) appends `ids` (1 id for a decode row, up to the rest of
        max_rows for a prefill chunk) at seq's next positions, attends causally over seq's own
        cache, and when want_logits[i] returns the f32 logits [vocab] of that entry's LAST id
        (else None). A sequence appears at most once per step; sum(len(ids)) <= max_rows.
        Raises OutOfPages (nothing run, nothing changed) when the pages needed are not free, and a
        ZlcError naming the limit when a sequence would pass max_seq."""

    def close_all(self) -> None: ...   # end of session (threads, memory)


class BatchLauncher(Protocol):
    """What runs a batched launch: NativeBackend, or the Triton kernel's executors (InterpretBackend,
    CudaBackend), whose page pool lives in their own A (`kv` is then None)."""

    def batch_launch(self, kv: Any, page_size: int, tokens: np.ndarray, pos: np.ndarray, pt: np.ndarray,
                     pages: np.ndarray, lrows: np.ndarray) -> np.ndarray: ...

    def close(self) -> None: ...


class NativeBatch:
    """`BatchBackend` on the native C kernel: one launch per step, a paged KV cache.

    `page_size` tokens per page (default 16); `pages` the KV budget in pages (default: what
    DEFAULT_KV_BYTES holds, at least one full max_seq sequence); `cache_pages` the most pages the
    shared-prefix cache keeps after their sequences close (default: what DEFAULT_KV_BYTES holds,
    at most the budget; 0 turns the prefix cache off). Other keywords go to `NativeBackend`
    (threads, pin, tables, library, level, debug). The session's own contiguous cache
    (MegakernelSession's) is not used; the arena is `pages * page_size` tokens."""

    nb: BatchLauncher
    kv: np.ndarray | None  # the page arena (None: the launcher keeps it, TritonBatch)

    def __init__(self, bundle: str | Path, manifest: Mapping[str, Any] | None = None, *,
                 page_size: int = DEFAULT_PAGE_SIZE, pages: int | None = None, cache_pages: int | None = None,
                 **backend: Any):
        if manifest is None:
            manifest = fmt.read_manifest(Path(bundle), check=True)
        if page_size < 1:
            raise ZlcError(f"page_size must be at least 1, got {page_size}")
        self.max_seq = int(manifest["model"]["max_seq"])
        self.vocab = int(manifest["model"]["vocab"])
        self.nb = native = NativeBackend(bundle, manifest, **backend)
        self.max_rows = native.chunk
        self.page_size = int(page_size)
        self.token_floats = native.kv_token_floats()
        if self.token_floats <= 0:
            self.nb.close()
            raise NativeError(f"{bundle}: an attention reads a KV cache no cache_append writes; this model has "
                              "no batched launch")
        try:
            self.pages_total = self._budget(pages)
        except ZlcError:
            self.nb.close()
            raise
        # np.zeros: untouched pages cost no memory until a sequence first writes them
        self.kv = np.zeros(self.pages_total * self.page_size * self.token_floats, dtype=np.float32)
        self._init_pages(cache_pages)

    def _budget(self, pages: int | None) -> int:
        """The KV budget in pages (page_size, token_floats and max_seq set): `pages`, or by default
        what DEFAULT_KV_BYTES holds and at least one full max_seq sequence."""
        if pages is None:
            pages = max(pages_for(self.max_seq, self.page_size),
                        DEFAULT_KV_BYTES // (4 * self.page_size * self.token_floats))
        if pages < 1:
            raise ZlcError(f"the KV budget must be at least 1 page, got {pages}")
        return int(pages)

    def _init_pages(self, cache_pages: int | None) -> None:
        """The page pool and the per-sequence records (pages_total, page_size, token_floats set)."""
        if cache_pages is None:
            cache_pages = DEFAULT_KV_BYTES // (4 * self.page_size * self.token_floats)
        self.pool = PagePool(self.pages_total, self.page_size, min(int(cache_pages), self.pages_total))
        self._pages: dict[int, list[int]] = {}
        self._length: dict[int, int] = {}
        self._tokens: dict[int, list[int]] = {}  # what each sequence was fed (its full pages' keys)
        self._chain: dict[int, list[int]] = {}  # the node of each of its full pages
        self._next_id = 0

    # ---- sequences and pages --------------------------------------------------------------------
    def pages_free(self) -> int:
        return self.pool.available()

    def pages_cached(self) -> int:
        return len(self.pool.lru)

    def _reusable(self, prompt: Sequence[int]) -> tuple[list[int], list[int]]:
        # Whole pages, and never the last prompt id: its row gives the logits, and the sequence
        # then appends into a page of its own, never into a shared one.
        return self.pool.match(prompt, max(0, len(prompt) - 1) // self.page_size)

    def lookup(self, prompt: Sequence[int]) -> tuple[int, int]:
        pages, _ = self._reusable(prompt)
        return len(pages) * self.page_size, sum(1 for p in pages if self.pool.refs[p])

    def open(self, prompt: Sequence[int] = ()) -> int:
        pages, nodes = self._reusable(prompt)
        for p in pages:
            self.pool.hold(p)
        seq = self._next_id
        self._next_id += 1
        n = len(pages) * self.page_size
        self._pages[seq], self._length[seq] = pages, n
        self._tokens[seq], self._chain[seq] = [int(t) for t in prompt[:n]], nodes
        return seq

    def _known(self, seq: int) -> None:
        if seq not in self._length:
            raise ZlcError(f"sequence {seq} is not open")

    def close(self, seq: int) -> None:
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

    def page_kv(self, page: int) -> np.ndarray:
        """The arena's floats of `page` (every layer's K and V of its positions): a view."""
        if self.kv is None:
            raise ZlcError("this batch's pages live in its executor's arena (TritonBatch), not on the host")
        n = self.page_size * self.token_floats
        return self.kv[page * n:(page + 1) * n]

    def check_pages(self) -> None:
        """The page invariants (PagePool.check) over the open sequences. AssertionError naming what is wrong."""
        self.pool.check(self._pages, self._length)

    # ---- one step -------------------------------------------------------------------------------
    def _validate(self, rows: Sequence[tuple[int, Sequence[int]]], want_logits: Sequence[bool]) -> int:
        """Checks a step before anything changes; returns the pages it needs."""
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
            if not ids:
                raise ZlcError(f"sequence {seq}: a step entry with no ids")
            bad = [i for i in ids if not 0 <= int(i) < self.vocab]
            if bad:
                raise ZlcError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab - 1})")
            end = self._length[seq] + len(ids)
            if end > self.max_seq:
                raise ZlcError(f"sequence {seq} would hold {end} tokens, past the bundle's max_seq={self.max_seq}")
            total += len(ids)
            need += pages_for(end, self.page_size) - len(self._pages[seq])
        if total > self.max_rows:
            raise ZlcError(f"a step of {total} rows exceeds max_rows={self.max_rows} (the native chunk)")
        if need > self.pool.available():
            raise OutOfPages(f"the step needs {need} KV pages, {self.pool.available()} of {self.pages_total} are free")
        return need

    def step(self, rows: Sequence[tuple[int, Sequence[int]]], want_logits: Sequence[bool]) \
            -> list[np.ndarray | None]:
        self._validate(rows, want_logits)
        taken: list[tuple[int, int]] = []  # (seq, pages added): undone if the launch fails
        tokens: list[int] = []
        pos: list[int] = []
        pt: list[int] = []
        table: list[int] = []
        lrows: list[int] = []
        for (seq, ids), want in zip(rows, want_logits, strict=True):
            start, n = self._length[seq], len(ids)
            own = self._pages[seq]
            add = pages_for(start + n, self.page_size) - len(own)
            own.extend(self.pool.take() for _ in range(add))
            taken.append((seq, add))
            base = len(table)
            table.extend(own)
            tokens.extend(int(i) for i in ids)
            pos.extend(range(start, start + n))
            pt.extend([base] * n)
            if want:
                lrows.append(len(tokens) - 1)
        i32 = np.int32
        try:
            logits = self.nb.batch_launch(self.kv, self.page_size, np.array(tokens, i32), np.array(pos, i32),
                                          np.array(pt, i32), np.array(table, i32), np.array(lrows, i32))
        except BaseException:  # the new pages go back (free: a cached page taken lost its key)
            for seq, add in taken:
                own = self._pages[seq]
                self.pool.release(own[len(own) - add:])
                del own[len(own) - add:]
            raise
        for seq, ids in rows:
            self._length[seq] += len(ids)
            self._tokens[seq].extend(int(i) for i in ids)
            self._register_full(seq)
        out: list[np.ndarray | None] = []
        k = 0
        for want in want_logits:
            out.append(logits[k] if want else None)
            k += bool(want)
        return out

    def _register_full(self, seq: int) -> None:
        """Keys the pages `seq` has filled since its last step (written now, never again)."""
        chain, pages, toks, ps = self._chain[seq], self._pages[seq], self._tokens[seq], self.page_size
        for k in range(len(chain), self._length[seq] // ps):
            chain.append(self.pool.register(pages[k], chain[-1] if chain else 0, toks[k * ps:(k + 1) * ps]))

    def close_all(self) -> None:
        for seq in list(self._length):
            self.close(seq)
        self.nb.close()

    def __enter__(self) -> NativeBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()


class TritonBatch(NativeBatch):
    """`BatchBackend` on the Triton kernel: NativeBatch's pages and checks, its launches the
    Triton kernel's batched launch (the prefill kernel over the prefill table, the rows' positions
    and page tables in a batch block; runtime/paged_kv.py), in the interpreter (`device`
    "interpret", the cpu tiling) or on a GPU ("cuda", the bundle's cubin). The page pool lives in
    the executor's own A arena (`kv` stays None), sized here: `pages` (default: what
    DEFAULT_KV_BYTES holds, at least one full max_seq sequence) of `page_size` tokens, with the
    shared-prefix cache as on NativeBatch (`cache_pages`). Other keywords go to CudaBackend
    (weights, deadlines, ctrl; the benchmark's)."""

    def __init__(self, bundle: str | Path, manifest: Mapping[str, Any] | None = None, *, device: str = "interpret",
                 page_size: int = DEFAULT_PAGE_SIZE, pages: int | None = None, cache_pages: int | None = None,
                 debug: bool = False, **backend: Any):
        bundle = Path(bundle)
        if manifest is None:
            manifest = fmt.read_manifest(bundle, check=True)
        if page_size < 1:
            raise ZlcError(f"page_size must be at least 1, got {page_size}")
        self.max_seq = int(manifest["model"]["max_seq"])
        self.vocab = int(manifest["model"]["vocab"])
        self.page_size = int(page_size)
        if device == "interpret":
            tiling = "cpu"
        elif device == "cuda" or device.startswith("cuda:"):
            from .cuda_launch import gpu_targets

            # every GPU target of a bundle shares one tiling (docs/megakernel.md, "Tilings")
            tiling = str(next(iter(t["tiling"] for t in gpu_targets(manifest).values()), "gpu"))
        else:
            raise ZlcError(f"TritonBatch runs on 'interpret' or 'cuda[:N]', not {device!r}")
        layout = manifest["tilings"][tiling]["layout"]
        self.token_floats = int(layout.get("paged_kv", {}).get("tok_floats", -1))
        if self.token_floats <= 0:
            raise ZlcError(f"{bundle}: no batched launch for this bundle (recompile it with this zlc; or an attention "
                           "reads a KV cache no cache_append writes)")
        self.pages_total = self._budget(pages)
        self.kv = None
        if device == "interpret":
            from .interpret import InterpretBackend

            if backend:
                raise ZlcError(f"TritonBatch on the interpreter takes no {', '.join(backend)}")

            self.nb = InterpretBackend(bundle, tiling, debug=debug, kv_pages=(self.pages_total, self.page_size))
        else:
            from .cuda import CudaBackend

            index = device.partition(":")[2]
            self.nb = CudaBackend(bundle, manifest, device=int(index or 0), debug=debug,
                                  kv_pages=(self.pages_total, self.page_size), **backend)
        self.max_rows = int(layout["chunk"])
        self._init_pages(cache_pages)


class SequentialBatch:
    """BatchBackend over one MegakernelSession per open sequence (``max_seqs`` at most), rows run
    one after another. Sessions are made on first need by ``make_session`` and kept for reuse
    after close() (a native session starts threads and lays out weights: too dear per request),
    with their caches: a sequence opened with its prompt takes the idle session whose cache holds
    the longest prefix of it (a slot, as llama.cpp's server reuses them) and rewinds it there
    (a session's cache rows past its length are rewritten before they are read). Those caches are
    outside the page budget: pages_cached() is 0. ``reuse_prefixes=False``: every sequence starts
    empty."""

    def __init__(self, make_session: Callable[[], MegakernelSession], *, max_seq: int, max_seqs: int = 8,
                 max_rows: int = 256, page_size: int = 16, pages_total: int | None = None,
                 reuse_prefixes: bool = True):
        if max_seqs < 1 or max_rows < 1 or page_size < 1:
            raise ZlcError(f"bad batch shape: max_seqs={max_seqs}, max_rows={max_rows}, page_size={page_size} "
                           "(each must be >= 1)")
        self.make_session, self.reuse_prefixes = make_session, reuse_prefixes
        self.max_seq, self.max_seqs, self.max_rows, self.page_size = max_seq, max_seqs, max_rows, page_size
        # Default: every sequence can reach max_seq, so nothing is ever preempted.
        self.pages_total = pages_total if pages_total is not None else max_seqs * pages_for(max_seq, page_size)
        if self.pages_total < 1:
            raise ZlcError(f"the KV budget must be at least 1 page, got {self.pages_total}")
        self._idle: list[MegakernelSession] = []
        self._open: dict[int, MegakernelSession] = {}
        self._history: dict[int, list[int]] = {}  # id(session) -> the ids its cache holds (open or idle)
        self._unfed: set[int] = set()  # open sequences not stepped yet: their first chunk runs as prefill
        self._next = 1
        self._used = 0  # pages held by open sequences

    def pages_free(self) -> int:
        return self.pages_total - self._used

    def pages_cached(self) -> int:
        return 0

    def _best_idle(self, prompt: Sequence[int]) -> tuple[int, int]:
        """(index in _idle of the session to take, positions of `prompt` its cache holds): at most
        len(prompt) - 1 (the last id gives the logits) and what the free pages hold."""
        limit = min(max(0, len(prompt) - 1), self.pages_free() * self.page_size) if self.reuse_prefixes else 0
        best, keep = len(self._idle) - 1, 0
        for i, s in enumerate(self._idle):
            hist, n = self._history.get(id(s), []), 0
            while n < min(limit, len(hist)) and hist[n] == int(prompt[n]):
                n += 1
            if n > keep:
                best, keep = i, n
        return best, keep

    def lookup(self, prompt: Sequence[int]) -> tuple[int, int]:
        return (self._best_idle(prompt)[1] if self._idle else 0), 0

    def open(self, prompt: Sequence[int] = ()) -> int:
        if len(self._open) >= self.max_seqs:
            raise ZlcError(f"{len(self._open)} sequences are open: the batch holds max_seqs={self.max_seqs}")
        if self._idle:
            i, keep = self._best_idle(prompt)
            s = self._idle.pop(i)
        else:
            s, keep = self.make_session(), 0
        s.length = keep
        del self._history.setdefault(id(s), [])[keep:]
        self._used += pages_for(keep, self.page_size)
        seq, self._next = self._next, self._next + 1
        self._open[seq] = s
        self._unfed.add(seq)
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
        self._unfed.discard(seq)
        self._used -= pages_for(s.length, self.page_size)
        self._idle.append(s)  # its cache and history stay: a later prompt may start the same way

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
            if len(ids) == 1 and seq not in self._unfed:
                _, lg = s.step(int(ids[0]), want_logits=want)
            else:  # a prompt's first chunk runs as prefill even when it is one token (as alone)
                _, lg = s.prefill([int(i) for i in ids], want_logits=want)
            self._unfed.discard(seq)
            self._history[id(s)].extend(int(i) for i in ids)
            self._used += pages_for(s.length, self.page_size) - before
            out.append(None if lg is None else np.asarray(lg[-1], dtype=np.float32))
        return out

    def close_all(self) -> None:
        for seq in list(self._open):
            self.close(seq)
        sessions, self._idle = self._idle, []
        self._history.clear()
        for s in sessions:
            s.close()


# Devices whose kernel runs a whole batch in one launch: device -> factory(bundle, threads=, max_seqs=,
# max_rows=, pages_total=, cache_pages=). Adding a batched kernel is one line here; every other device gets
# SequentialBatch.
BATCHED: dict[str, Callable[..., BatchBackend]] = {}


def _native_batch(bundle: Any, *, threads: int | None, max_seqs: int, max_rows: int,
                  pages_total: int | None, cache_pages: int | None) -> BatchBackend:
    """NativeBatch for the engine. Its rows per step are the native chunk (the prefill table's);
    the default budget is max_seqs full max_seq contexts, as SequentialBatch's, so the defaults
    never preempt (untouched pages cost no memory)."""
    del max_rows  # fixed by the kernel's tables: NativeBatch.max_rows
    pages = pages_total if pages_total is not None else max_seqs * pages_for(bundle.max_seq, DEFAULT_PAGE_SIZE)
    return NativeBatch(bundle.path, bundle.manifest, threads=threads, pages=pages, cache_pages=cache_pages)


BATCHED["cpu"] = _native_batch


def _triton_batch(device: str) -> Callable[..., BatchBackend]:
    def make(bundle: Any, *, threads: int | None, max_seqs: int, max_rows: int,
             pages_total: int | None, cache_pages: int | None) -> BatchBackend:
        """TritonBatch for the engine: rows per step are the tiling's chunk; the default budget is
        max_seqs full max_seq contexts, as SequentialBatch's."""
        del threads, max_rows  # one kernel launch; rows fixed by the tables: TritonBatch.max_rows
        pages = pages_total if pages_total is not None else max_seqs * pages_for(bundle.max_seq, DEFAULT_PAGE_SIZE)
        return TritonBatch(bundle.path, bundle.manifest, device=device, pages=pages, cache_pages=cache_pages)
    return make


BATCHED["interpret"] = _triton_batch("interpret")
# Not "cuda" yet: TritonBatch runs there (bench/device_bench.py's batch sweep), but the latency model
# prices its step far above the decode kernel's per sequence (docs/performance.md, "Batched decode
# step"), so the engine keeps SequentialBatch on GPUs until a measured sweep shows the batch pays.


def batch_backend(bundle: Any, device: str = "auto", *, threads: int | None = None, max_seqs: int = 8,
                  prefill_chunk: int = 64, pages_total: int | None = None,
                  cache_pages: int | None = None) -> BatchBackend:
    """The BatchBackend the engine serves `bundle` with on `device` (auto resolved as Bundle does):
    the device's batched kernel when there is one, else SequentialBatch over its sessions. Its
    max_rows fits a decode row per sequence plus a whole prefill chunk. `cache_pages`: the most
    pages the prefix cache keeps (None: the backend's default; 0: no prefix reuse)."""
    device = bundle.resolve_device(device)
    max_rows = max_seqs + prefill_chunk
    batched = BATCHED.get(device)
    if batched is not None:
        return batched(bundle, threads=threads, max_seqs=max_seqs, max_rows=max_rows, pages_total=pages_total,
                       cache_pages=cache_pages)
    return SequentialBatch(lambda: bundle.session(device, threads=threads), max_seq=bundle.max_seq,
                           max_seqs=max_seqs, max_rows=max_rows, pages_total=pages_total,
                           reuse_prefixes=cache_pages != 0)
