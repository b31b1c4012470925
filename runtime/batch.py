"""Batched steps: many sequences' rows in one launch, over a paged KV cache.

`BatchBackend` is the protocol the engine's scheduler (serve/scheduler.py) is written against
(docs/serving.md, "The batch"; docs/megakernel.md, "Batched steps and the paged KV cache"):
sequences are opened, fed rows step by step (decode rows of running sequences and prefill chunks
of new ones in the same step) and closed. Every backend's pages belong to its `KVManager`
(runtime/kv_manager.py: the page pool, prefix keys, reference counts, eviction, each sequence's
page table), which plans a step into a plain `BatchStep` value (validated once; None when the
pages are not free, so the scheduler preempts); the backend only encodes that value into its
launch (`run`). `step(rows, want)` is plan + run for direct callers, raising ``OutOfPages``.

`NativeBatch` runs the step on the native C kernel with one launch: the prefill table's Linear
tasks read each weight tile once for all rows, the row-dependent ops read each row's (position,
page table), and the KV cache is one arena of fixed-size pages handed out by the manager, so
memory is spent on tokens that exist. Its full pages form a shared-prefix cache: a sequence opened
with its prompt maps the pages another sequence already filled with the same tokens at the same
positions, and prefills only the rest. `TritonBatch` is the same on the Triton kernel (the
interpreter or a GPU), its arena in the executor's A.

`SequentialBatch` is the protocol for executors without a batched kernel (interpret, reference,
cuda): one MegakernelSession per open sequence, each row run on its own session, one after
another. Its pages are a budget the same manager accounts (each session holds a whole max_seq
cache anyway), so preemption and admission behave as they do on the paged kernel. Its prefix reuse
is a slot's: a sequence opened with its prompt takes the idle session whose last tokens share the
longest prefix with it and keeps that much of its cache.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from zlc import bundle as fmt
from zlc.errors import ZlcError

from .kv_manager import DEFAULT_PAGE_SIZE, BatchStep, KVManager
from .kv_pages import PagePool, pages_for
from .megakernel import MegakernelSession
from .native import NativeBackend, NativeError

DEFAULT_KV_BYTES = 256 << 20  # the default KV budget (at least one full max_seq sequence)


class OutOfPages(ZlcError):
    """step() would need more KV pages than are free; raised before anything runs (for callers
    that drive a backend directly: the scheduler asks KVManager.plan, which answers None)."""


class BatchBackend(Protocol):
    max_rows: int      # rows one step can carry in total (decode rows + prefill chunk rows)
    max_seq: int       # positions one sequence may hold (the bundle's max_seq)
    page_size: int     # tokens per KV page (1 page = page_size positions of one sequence)
    pages_total: int   # the KV budget of this session, in pages
    kv_manager: KVManager  # the one owner of the pages (runtime/kv_manager.py)

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

    def run(self, step: BatchStep) -> list[np.ndarray | None]:
        """One launch of a planned step (KVManager.plan): entry i appends its ids at its sequence's
        next positions, attending causally over that sequence's own cache, and when want[i] returns
        the f32 logits [vocab] of its last id (else None). The pages are committed after the launch,
        or handed back when it fails."""

    def step(self, rows: Sequence[tuple[int, Sequence[int]]], want_logits: Sequence[bool]) \
            -> list[np.ndarray | None]:
        """plan + run: OutOfPages (nothing run, nothing changed) when the pages needed are not
        free, a ZlcError naming the limit on a malformed step."""

    def close_all(self) -> None: ...   # end of session (threads, memory)


class BatchLauncher(Protocol):
    """What runs a batched launch: NativeBackend, or the Triton kernel's executors (InterpretBackend,
    CudaBackend), whose page pool lives in their own A (`kv` is then None)."""

    def batch_launch(self, kv: Any, page_size: int, tokens: np.ndarray, pos: np.ndarray, pt: np.ndarray,
                     pages: np.ndarray, lrows: np.ndarray) -> np.ndarray: ...

    def close(self) -> None: ...


class _Paged(abc.ABC):
    """What the three backends share: the sequences and pages are `kv_manager`'s, and a step is
    planned there (validated once), launched here (`_launch`: the backend's own encoding of the
    BatchStep value), then committed there."""

    kv_manager: KVManager
    max_rows: int
    max_seq: int
    page_size: int
    pages_total: int

    def pages_free(self) -> int:
        return self.kv_manager.pages_free()

    def pages_cached(self) -> int:
        return self.kv_manager.pages_cached()

    def lookup(self, prompt: Sequence[int]) -> tuple[int, int]:
        return self.kv_manager.lookup(prompt)

    def open(self, prompt: Sequence[int] = ()) -> int:
        return self.kv_manager.open(prompt)

    def close(self, seq: int) -> None:
        self.kv_manager.close(seq)

    def length(self, seq: int) -> int:
        return self.kv_manager.length(seq)

    def pages_of(self, seq: int) -> list[int]:
        """The pages `seq` holds, in position order (a copy)."""
        return self.kv_manager.pages_of(seq)

    @property
    def pool(self) -> PagePool:
        return self.kv_manager.pool

    def check_pages(self) -> None:
        """The page invariants (PagePool.check) over the open sequences. AssertionError naming what is wrong."""
        self.kv_manager.check()

    def step(self, rows: Sequence[tuple[int, Sequence[int]]], want_logits: Sequence[bool]) \
            -> list[np.ndarray | None]:
        plan = self.kv_manager.plan(rows, want_logits)
        if plan is None:
            raise OutOfPages(self.kv_manager.shortage(rows))
        return self.run(plan)

    def run(self, step: BatchStep) -> list[np.ndarray | None]:
        try:
            out = self._launch(step)
        except BaseException:
            self.kv_manager.abort(step)
            raise
        self.kv_manager.commit(step)
        return out

    @abc.abstractmethod
    def _launch(self, step: BatchStep) -> list[np.ndarray | None]:
        """Runs `step` (its pages already allocated): each backend's own encoding of the value."""

    def close_all(self) -> None:
        for seq in self.kv_manager.open_seqs():
            self.close(seq)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_all()


class NativeBatch(_Paged):
    """`BatchBackend` on the native C kernel: one launch per step, a paged KV cache.

    `page_size` tokens per page (default 16); `pages` the KV budget in pages (default: what
    DEFAULT_KV_BYTES holds, at least one full max_seq sequence); `cache_pages` the most pages the
    shared-prefix cache keeps after their sequences close (default: what DEFAULT_KV_BYTES holds,
    at most the budget; 0 turns the prefix cache off). Other keywords go to `NativeBackend`
    (threads, pin, tables, library, level, debug). The session's own contiguous cache
    (MegakernelSession's) is not used; the arena is `pages * page_size` tokens.

    What differs between the paged kernels is three hooks: `_shape` (floats per token, rows per
    step), `_launcher` (what runs the launch, given the budget) and `_arena` (the host's page
    arena, or None where the executor keeps it); the pages, the budget and the step's encoding
    are this class's, TritonBatch's too."""

    nb: BatchLauncher
    kv: np.ndarray | None  # the page arena (None: the launcher keeps it, TritonBatch)

    def __init__(self, bundle: str | Path, manifest: Mapping[str, Any] | None = None, *,
                 page_size: int = DEFAULT_PAGE_SIZE, pages: int | None = None, cache_pages: int | None = None,
                 **backend: Any):
        bundle = Path(bundle)
        if manifest is None:
            manifest = fmt.read_manifest(bundle, check=True)
        self._native: NativeBackend | None = None
        try:
            token_floats, max_rows = self._shape(bundle, manifest, backend)
            self._paged(bundle, manifest, page_size, token_floats, max_rows, pages, cache_pages)
            self.nb = self._launcher(bundle, manifest, backend)
        except ZlcError:
            if self._native is not None:
                self._native.close()
            raise
        self.kv = self._arena()

    def _shape(self, bundle: Path, manifest: Mapping[str, Any], backend: dict[str, Any]) -> tuple[int, int]:
        """(floats per cached token, rows per step) of the kernel: the native library's (loaded here)."""
        self._native = NativeBackend(bundle, manifest, **backend)
        return self._native.kv_token_floats(), self._native.chunk

    def _launcher(self, bundle: Path, manifest: Mapping[str, Any], backend: dict[str, Any]) -> BatchLauncher:
        assert self._native is not None
        return self._native

    def _arena(self) -> np.ndarray | None:
        # np.zeros: untouched pages cost no memory until a sequence first writes them
        return np.zeros(self.pages_total * self.page_size * self.token_floats, dtype=np.float32)

    def _paged(self, bundle: str | Path, manifest: Mapping[str, Any], page_size: int, token_floats: int,
               max_rows: int, pages: int | None, cache_pages: int | None) -> None:
        """The shape and the KVManager: `pages` (default: what DEFAULT_KV_BYTES holds and at least
        one full max_seq sequence) of `page_size` tokens of `token_floats` floats each."""
        self.max_seq = int(manifest["model"]["max_seq"])
        self.vocab = int(manifest["model"]["vocab"])
        if page_size < 1:
            raise ZlcError(f"page_size must be at least 1, got {page_size}")
        self.page_size, self.token_floats, self.max_rows = int(page_size), int(token_floats), int(max_rows)
        if self.token_floats <= 0:
            raise NativeError(f"{bundle}: an attention reads a KV cache no cache_append writes; this model has "
                              "no batched launch")
        default = DEFAULT_KV_BYTES // (4 * self.page_size * self.token_floats)
        if pages is None:
            pages = max(pages_for(self.max_seq, self.page_size), default)
        if pages < 1:
            raise ZlcError(f"the KV budget must be at least 1 page, got {pages}")
        self.pages_total = int(pages)
        self.kv_manager = KVManager(pages_total=self.pages_total, page_size=self.page_size, max_seq=self.max_seq,
                                    vocab=self.vocab, max_rows=self.max_rows,
                                    cache_pages=default if cache_pages is None else cache_pages)

    def page_kv(self, page: int) -> np.ndarray:
        """The arena's floats of `page` (every layer's K and V of its positions): a view."""
        if self.kv is None:
            raise ZlcError("this batch's pages live in its executor's arena (TritonBatch), not on the host")
        n = self.page_size * self.token_floats
        return self.kv[page * n:(page + 1) * n]

    def _launch(self, step: BatchStep) -> list[np.ndarray | None]:
        logits = self.nb.batch_launch(self.kv, self.page_size, step.tokens, step.pos, step.pt, step.pages,
                                      step.lrows)
        out: list[np.ndarray | None] = []
        k = 0
        for want in step.want:
            out.append(logits[k] if want else None)
            k += want
        return out

    def close_all(self) -> None:
        super().close_all()
        self.nb.close()


class TritonBatch(NativeBatch):
    """`BatchBackend` on the Triton kernel: NativeBatch's pages, budget and step encoding, its
    launches the Triton kernel's batched launch (the prefill kernel over the prefill table, the
    rows' positions and page tables in a batch block; runtime/paged_kv.py), in the interpreter
    (`device` "interpret", the cpu tiling) or on a GPU ("cuda", the bundle's cubin). Its hooks:
    the tiling's layout gives the shape; the launcher is the executor, made with the budget, which
    keeps the page pool in its own A arena (`kv` stays None). Other keywords go to CudaBackend
    (weights, deadlines, ctrl; the benchmark's)."""

    def __init__(self, bundle: str | Path, manifest: Mapping[str, Any] | None = None, *, device: str = "interpret",
                 page_size: int = DEFAULT_PAGE_SIZE, pages: int | None = None, cache_pages: int | None = None,
                 debug: bool = False, **backend: Any):
        self.device, self.debug = device, debug
        super().__init__(bundle, manifest, page_size=page_size, pages=pages, cache_pages=cache_pages, **backend)

    def _tiling(self, manifest: Mapping[str, Any]) -> str:
        if self.device == "interpret":
            return "cpu"
        if self.device == "cuda" or self.device.startswith("cuda:"):
            from .cuda_launch import gpu_targets

            # every GPU target of a bundle shares one tiling (docs/megakernel.md, "Tilings")
            return str(next(iter(t["tiling"] for t in gpu_targets(manifest).values()), "gpu"))
        raise ZlcError(f"TritonBatch runs on 'interpret' or 'cuda[:N]', not {self.device!r}")

    def _shape(self, bundle: Path, manifest: Mapping[str, Any], backend: dict[str, Any]) -> tuple[int, int]:
        layout = manifest["tilings"][self._tiling(manifest)]["layout"]
        token_floats = int(layout.get("paged_kv", {}).get("tok_floats", -1))
        if token_floats <= 0:
            raise ZlcError(f"{bundle}: no batched launch for this bundle (recompile it with this zlc; or an attention "
                           "reads a KV cache no cache_append writes)")
        return token_floats, int(layout["chunk"])

    def _launcher(self, bundle: Path, manifest: Mapping[str, Any], backend: dict[str, Any]) -> BatchLauncher:
        kv_pages = (self.pages_total, self.page_size)
        if self.device == "interpret":
            from .interpret import InterpretBackend

            if backend:
                raise ZlcError(f"TritonBatch on the interpreter takes no {', '.join(backend)}")
            return InterpretBackend(bundle, self._tiling(manifest), debug=self.debug, kv_pages=kv_pages)
        from .cuda import CudaBackend

        index = self.device.partition(":")[2]
        return CudaBackend(bundle, manifest, device=int(index or 0), debug=self.debug, kv_pages=kv_pages, **backend)

    def _arena(self) -> np.ndarray | None:
        return None


class SequentialBatch(_Paged):
    """BatchBackend over one MegakernelSession per open sequence (``max_seqs`` at most), rows run
    one after another. Sessions are made on first need by ``make_session`` and kept for reuse
    after close() (a native session starts threads and lays out weights: too dear per request),
    with their caches: a sequence opened with its prompt takes the idle session whose cache holds
    the longest prefix of it (a slot, as llama.cpp's server reuses them) and rewinds it there
    (a session's cache rows past its length are rewritten before they are read). The page budget
    is the KVManager's as on the paged kernels (its prefix cache off: the sessions' caches are
    outside the budget, pages_cached() is 0), so admission and preemption behave the same.
    ``reuse_prefixes=False``: every sequence starts empty."""

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
        self.kv_manager = KVManager(pages_total=self.pages_total, page_size=page_size, max_seq=max_seq, vocab=None,
                                    max_rows=max_rows, cache_pages=0)
        self._idle: list[MegakernelSession] = []
        self._open: dict[int, MegakernelSession] = {}
        self._history: dict[int, list[int]] = {}  # id(session) -> the ids its cache holds (open or idle)
        self._unfed: set[int] = set()  # open sequences not stepped yet: their first chunk runs as prefill

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
        seq = self.kv_manager.open(prompt, keep=keep)  # its kept positions' pages (free: _best_idle's limit)
        self._open[seq] = s
        self._unfed.add(seq)
        return seq

    def close(self, seq: int) -> None:
        s = self._open.pop(seq, None)
        if s is None:
            return
        self._unfed.discard(seq)
        self.kv_manager.close(seq)
        self._idle.append(s)  # its cache and history stay: a later prompt may start the same way

    def _launch(self, step: BatchStep) -> list[np.ndarray | None]:
        out: list[np.ndarray | None] = []
        for seq, ids, want in zip(step.seqs, step.ids, step.want, strict=True):
            s = self._open[seq]
            if len(ids) == 1 and seq not in self._unfed:
                _, lg = s.step(ids[0], want_logits=want)
            else:  # a prompt's first chunk runs as prefill even when it is one token (as alone)
                _, lg = s.prefill(list(ids), want_logits=want)
            self._unfed.discard(seq)
            self._history[id(s)].extend(ids)
            out.append(None if lg is None else np.asarray(lg[-1], dtype=np.float32))
        return out

    def close_all(self) -> None:
        super().close_all()
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


# `zlc serve`'s --max-batch when none is given (docs/serving.md, "The default batch", measured with
# bench/serve_load.py). Executors that run a session per sequence, rows one after another
# (SequentialBatch: reference, cuda; and the Triton interpreter, a check rather than a server),
# gain fairness but no tokens from a bigger batch and hold a whole max_seq cache per session: 8.
SEQUENTIAL_MAX_BATCH = 8


def default_max_batch(bundle: Any, device: str, *, prefill_chunk: int = 64, kv_pages: int | None = None) -> int:
    """The batch `zlc serve` runs on `device` (resolved) by default. On the native kernel ("cpu"),
    where a step is one launch for every row, each running sequence adds one row to a step that
    reads the weights once: as many sequences as leave a whole prefill chunk of rows beside their
    decode rows (the kernel's rows per step less min(prefill_chunk, half of them): 64 for a
    bundle of max_seq >= 128), which the load bench measured fastest (TTFT p99 and tok/s at 16
    and 64 streams). Elsewhere SEQUENTIAL_MAX_BATCH. With a KV budget given (--kv-pages), never more
    sequences than pages (each running one holds at least a page; more would only wait)."""
    n = SEQUENTIAL_MAX_BATCH
    if device == "cpu":
        from .native import native_entry

        tiling = bundle.manifest["tilings"][native_entry(bundle.path, bundle.manifest)["tiling"]]
        rows = int(tiling["layout"]["chunk"])
        n = max(1, rows - min(prefill_chunk, rows // 2))
    return n if kv_pages is None else max(1, min(n, kv_pages))


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
