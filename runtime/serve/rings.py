"""Single-producer/single-consumer rings between ingress and the kernel: requests in (prompt token
ids, request id, sampling parameters, max tokens), results out (request id, token id, flags), both
in one shared-memory region with a fixed, documented layout (docs/rings.md) that a GPU can map.

The ring operations are C (``zlc.runtime.serve._rings``, C11 acquire/release atomics): this module
wraps them in dataclasses, region lifetimes (POSIX shared memory, a file, an anonymous mapping, or
any writable buffer) and blocking helpers that spin, then back off to sleeping.

    region = RingRegion.create(None, request_capacity=64, result_capacity=4096)   # server side
    peer = RingRegion.attach(region.name)                                         # another process
    peer.requests.push_wait(Request(7, [1, 2, 3], max_tokens=16))
    req = region.requests.pop()            # Request | None, never blocks
    region.results.push(Result(req.request_id, 42, ResultFlag.LAST))

A full ring refuses a push (``push`` returns False, ``push_many`` a shorter count) and leaves the
ring as it was: the producer decides whether to wait, drop or report busy; an entry is never
overwritten or lost. Each ring has exactly one producer and one consumer (process or thread) at a
time; that is what makes a lock unnecessary, and nothing checks it.
"""

from __future__ import annotations

import abc
import mmap
import os
import sys
import time
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Generic, TypeVar

from . import _rings
from .protocol import RequestFlag, ResultFlag

# RequestFlag and ResultFlag are protocol.py's, named here too: the rings' users (docs/rings.md,
# tests/runtime/test_rings.py) build requests and read results with them.
__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "Request",
    "RequestFlag",
    "RequestRing",
    "Result",
    "ResultFlag",
    "ResultRing",
    "RingRegion",
    "region_size",
]

DEFAULT_CHUNK_TOKENS: int = _rings.DEFAULT_CHUNK_TOKENS
_U32 = "I" if array("I").itemsize == 4 else "L"


@dataclass(slots=True)
class Request:
    """One generation request. ``tokens`` is stored as ``array('I')`` (u32 token ids); popped
    requests carry temperature, top_p and the penalties as the f32 values the slot holds.
    ``top_k`` 0 and penalties 0 leave the distribution alone; ``top_logprobs`` (0..20) alternatives
    come with every token of a request flagged ``RequestFlag.LOGPROBS``. ``grammar``: an llguidance
    Lark grammar the output must match (constraints.py), or None; the ring carries it in the token
    words before the prompt, flagged ``RequestFlag.GRAMMAR`` (docs/rings.md), so the slot layout
    stays as it is."""

    request_id: int
    tokens: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    flags: int = 0
    top_k: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    top_logprobs: int = 0
    # an llguidance Lark grammar the reply must match (response_format, a forced tool call)
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.tokens, array) and self.tokens.typecode == _U32):
            self.tokens = _u32_array(self.tokens, self.request_id)

    def _fields(self) -> tuple[Any, ...]:
        tokens, flags = self.tokens, self.flags & ~int(RequestFlag.GRAMMAR)
        if self.grammar is not None:  # [its byte count, its bytes in u32 words (zero-padded), the prompt...]
            data = self.grammar.encode()
            tokens = array(_U32, [len(data)])
            tokens.frombytes(data + bytes(-len(data) % 4))
            tokens.extend(self.tokens)
            flags |= RequestFlag.GRAMMAR
        return (self.request_id, tokens, self.max_tokens, self.temperature, self.top_p, self.seed, flags,
                self.top_k, self.frequency_penalty, self.presence_penalty, self.top_logprobs)

    @staticmethod
    def _popped(t: tuple[Any, ...]) -> Request:
        """A request from the ring's tuple (the grammar taken off its tokens)."""
        tokens = array(_U32, t[1])
        flags = t[6]
        if not flags & RequestFlag.GRAMMAR:
            return Request(t[0], tokens, *t[2:])
        n = tokens[0] if tokens else 0
        words = 1 + (n + 3) // 4
        grammar = tokens[1:words].tobytes()[:n].decode(errors="replace")
        return Request(t[0], tokens[words:], t[2], t[3], t[4], t[5], flags & ~int(RequestFlag.GRAMMAR), t[7], t[8],
                       t[9], t[10], grammar)


def _u32_array(tokens: Any, request_id: int) -> array[int]:
    """tokens as array('I'): a contiguous 1-d uint32 buffer (numpy) is copied as bytes, anything
    else converted item by item (ValueError outside [0, 2**32))."""
    if isinstance(tokens, (bytes, bytearray, str)):
        raise TypeError(f"request {request_id}: tokens must be a sequence of ints or a uint32 array, "
                        f"not {type(tokens).__name__}")
    try:
        view = memoryview(tokens)
    except TypeError:
        pass
    else:
        with view:
            if view.ndim == 1 and view.itemsize == 4 and view.format.lstrip("@=<") == "I" and view.c_contiguous:
                out = array(_U32)
                out.frombytes(view.cast("B"))
                return out
    try:
        return array(_U32, tokens)
    except OverflowError as e:
        raise ValueError(f"request {request_id}: token ids must be in [0, 2**32): {e}") from None


@dataclass(slots=True)
class Result:
    """One generated token (or a flag-only event such as an error). ``t_ns`` is CLOCK_MONOTONIC
    nanoseconds (``time.monotonic_ns()``); 0 on push means "stamp it now". ``logprob``: the token's
    log-probability, for a request that asked for logprobs (0.0 otherwise)."""

    request_id: int
    token: int
    flags: int = 0
    t_ns: int = 0
    logprob: float = 0.0


def region_size(request_capacity: int, result_capacity: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> int:
    """Bytes a region with these rings spans (capacities: powers of two)."""
    return _rings.region_size(request_capacity, result_capacity, chunk_tokens)


T = TypeVar("T")
_SPIN = 64  # tries before yielding the CPU
_YIELD = 64  # then tries with sleep(0)
_MIN_SLEEP, _MAX_SLEEP = 10e-6, 1e-3


def _wait(attempt: Callable[[], T | None], timeout_s: float | None) -> T | None:
    """Calls attempt() until it returns non-None or timeout_s passes (None: forever): spins, then
    yields, then sleeps with exponential backoff up to 1 ms."""
    got = attempt()
    if got is not None:
        return got
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    n = 0
    while True:
        n += 1
        if n > _SPIN:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if n <= _SPIN + _YIELD:
                time.sleep(0)
            else:
                delay = min(_MAX_SLEEP, _MIN_SLEEP * 2 ** min(n - _SPIN - _YIELD, 10))
                time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - now)))
        got = attempt()
        if got is not None:
            return got


class _Ring(abc.ABC, Generic[T]):
    """What both rings share: capacity, occupancy, release and the blocking helpers."""

    raw: _rings.RequestRing | _rings.ResultRing

    @property
    def capacity(self) -> int:
        """Slots in the ring."""
        return self.raw.capacity

    def occupancy(self) -> int:
        """Slots in use right now (a snapshot; the other side may move on meanwhile)."""
        return self.raw.occupancy()

    def release(self) -> None:
        """Let go of the region's memory (then every operation raises ValueError)."""
        self.raw.release()

    @abc.abstractmethod
    def push(self, item: T) -> bool:
        """Appends `item`; False when the ring is full (nothing written: backpressure)."""

    @abc.abstractmethod
    def pop(self) -> T | None:
        """The oldest entry, or None when the ring is empty."""

    def push_wait(self, item: T, timeout_s: float | None = None) -> bool:
        """push(), waiting for room up to timeout_s (None: forever); False on timeout."""
        return _wait(lambda: True if self.push(item) else None, timeout_s) is not None

    def pop_wait(self, timeout_s: float | None = None) -> T | None:
        """pop(), waiting for an entry up to timeout_s (None: forever); None on timeout."""
        return _wait(self.pop, timeout_s)


class RequestRing(_Ring[Request]):
    """The request ring: ingress produces, the serving loop consumes. A prompt longer than
    ``chunk_tokens`` takes several slots, published together; one longer than
    ``max_prompt_tokens`` (all the ring's slots) is refused with ValueError."""

    raw: _rings.RequestRing

    def __init__(self, region: Any):
        self.raw = _rings.RequestRing(region)

    @property
    def chunk_tokens(self) -> int:
        """Prompt tokens per slot."""
        return self.raw.chunk_tokens

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt the ring can ever take (every slot of an empty ring)."""
        return self.raw.capacity * self.raw.chunk_tokens

    def slots_needed(self, n_tokens: int) -> int:
        """Slots a prompt of n_tokens takes (1 for an empty prompt)."""
        return self.raw.slots_needed(n_tokens)

    def push(self, item: Request) -> bool:
        """Publishes the request; False (nothing written) if the ring lacks the slots it needs."""
        return self.raw.push(*item._fields())

    def push_many(self, items: Iterable[Request]) -> int:
        """Pushes the longest prefix of items that fits, publishing once; returns how many."""
        return self.raw.push_many([r._fields() for r in items])

    def pop(self) -> Request | None:
        """The oldest request, or None if the ring is empty."""
        t = self.raw.pop()
        return None if t is None else Request._popped(t)

    def pop_many(self, max_n: int) -> list[Request]:
        """Up to max_n requests, oldest first (fewer if fewer are published; [] if none)."""
        return [Request._popped(t) for t in self.raw.pop_many(max_n)]


class ResultRing(_Ring[Result]):
    """The result ring: the serving loop produces, ingress consumes. For hot loops, ``raw``
    takes and returns plain (request_id, token, flags, t_ns, logprob) tuples."""

    raw: _rings.ResultRing

    def __init__(self, region: Any):
        self.raw = _rings.ResultRing(region)

    def push(self, item: Result) -> bool:
        """Publishes the result; False (nothing written) if the ring is full."""
        return self.raw.push(item.request_id, item.token, item.flags, item.t_ns, item.logprob)

    def push_many(self, items: Iterable[Result]) -> int:
        """Pushes the longest prefix of items that fits, publishing once; returns how many."""
        return self.raw.push_many([(r.request_id, r.token, r.flags, r.t_ns, r.logprob) for r in items])

    def pop(self) -> Result | None:
        """The oldest result, or None if the ring is empty."""
        t = self.raw.pop()
        return None if t is None else Result(*t)

    def pop_many(self, max_n: int) -> list[Result]:
        """Up to max_n results, oldest first."""
        return [Result(*t) for t in self.raw.pop_many(max_n)]


def _open_untracked(name: str) -> mmap.mmap:
    """Maps an existing POSIX shared-memory segment without registering it with this process's
    multiprocessing resource tracker (before Python 3.13, SharedMemory(name) does, and the tracker
    then unlinks the creator's segment when this process exits)."""
    import _posixshmem  # the module SharedMemory itself uses

    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


class RingRegion:
    """One region holding both rings. Constructors:

    - ``create(name, ...)`` / ``attach(name)``: POSIX shared memory (``name`` None: a fresh random
      name, see ``.name``), or, for a name containing '/', a file mapped shared (e.g. under
      /dev/shm or a hugetlbfs mount). The creator owns it: ``close()`` there also unlinks it.
    - ``anonymous(...)``: an anonymous shared mapping (shared with forked children only).
    - ``over(buffer, ...)``: any writable buffer you keep alive (a bytearray, for tests).

    ``close()`` releases both rings before closing the mapping; use it (or ``with``)."""

    def __init__(self, buffer: Any, *, keep: Any = None, name: str | None = None, unlink: Callable[[], None] | None = None):
        self.name = name
        self._keep = keep  # SharedMemory / mmap object that owns the memory (closed by close())
        self._unlink = unlink
        self.info: dict[str, int] = _rings.region_info(buffer)
        self.requests = RequestRing(buffer)
        self.results = ResultRing(buffer)

    # -- constructors --

    @classmethod
    def create(cls, name: str | None, request_capacity: int, result_capacity: int,
               chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> RingRegion:
        """A new region in shared memory (or a file, for a name with '/'), initialized."""
        size = _rings.region_size(request_capacity, result_capacity, chunk_tokens)
        if name is not None and "/" in name:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            _rings.init_region(mm, request_capacity, result_capacity, chunk_tokens)
            path = name
            return cls(mm, keep=mm, name=name, unlink=lambda: os.unlink(path))
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        try:
            buf = shm.buf
            assert buf is not None  # None only once closed
            _rings.init_region(buf, request_capacity, result_capacity, chunk_tokens)
            return cls(buf, keep=shm, name=shm.name, unlink=shm.unlink)
        except BaseException:
            shm.close()
            shm.unlink()
            raise

    @classmethod
    def attach(cls, name: str) -> RingRegion:
        """An existing region by name (or path); ValueError if it is not a valid ring region."""
        if "/" in name:
            fd = os.open(name, os.O_RDWR)
            try:
                mm = mmap.mmap(fd, os.fstat(fd).st_size)
            finally:
                os.close(fd)
        elif sys.version_info >= (3, 13):
            shm = shared_memory.SharedMemory(name=name, create=False, track=False)
            return cls._guarded(shm.buf, shm, name)
        else:
            try:
                mm = _open_untracked(name)
            except ImportError:  # no POSIX shared memory module (Windows): the tracked way
                shm = shared_memory.SharedMemory(name=name, create=False)
                return cls._guarded(shm.buf, shm, name)
        return cls._guarded(mm, mm, name)

    @classmethod
    def _guarded(cls, buffer: Any, keep: Any, name: str | None) -> RingRegion:
        try:
            return cls(buffer, keep=keep, name=name)
        except BaseException:
            keep.close()
            raise

    @classmethod
    def anonymous(cls, request_capacity: int, result_capacity: int,
                  chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> RingRegion:
        """A region in an anonymous shared mapping (visible to this process and forked children)."""
        mm = mmap.mmap(-1, _rings.region_size(request_capacity, result_capacity, chunk_tokens))
        _rings.init_region(mm, request_capacity, result_capacity, chunk_tokens)
        return cls(mm, keep=mm)

    @classmethod
    def over(cls, buffer: Any, request_capacity: int | None = None, result_capacity: int | None = None,
             chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> RingRegion:
        """A region over a writable buffer you own: initialized if capacities are given, else
        validated as an existing region. The buffer must start 8-byte aligned."""
        if (request_capacity is None) != (result_capacity is None):
            raise ValueError("give both ring capacities (initialize) or neither (attach)")
        if request_capacity is not None and result_capacity is not None:
            _rings.init_region(buffer, request_capacity, result_capacity, chunk_tokens)
        return cls(buffer)

    # -- lifetime --

    def close(self) -> None:
        """Releases both rings and closes the mapping; the creator also unlinks the segment/file.
        Idempotent."""
        self.requests.release()
        self.results.release()
        keep, self._keep = self._keep, None
        if keep is not None:
            keep.close()
        unlink, self._unlink = self._unlink, None
        if unlink is not None:
            try:
                unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> RingRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
