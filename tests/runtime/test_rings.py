"""The request/result rings (``zlc.runtime.serve.rings``, C in runtime/serve/_rings.c; layout in docs/rings.md).

- the documented byte layout, read back with struct;
- a Hypothesis state machine against a deque model: backpressure (a full ring refuses and stays
  as it was), empty pops, batches, wraparound with tiny capacities, counters near 2**64, prompts
  split into chunks up to the longest the ring takes, refused oversize prompts and bad fields,
  and several handles on one ring used in turn (their cached counters go stale);
- malformed regions and corrupted counters/chunks raise ValueError;
- cross-process: an ingress process and a kernel process over POSIX shared memory (spawned),
  each the producer of one ring and the consumer of the other, 200k requests of variable length
  and 2M results through small rings, checked entry by entry (no loss, duplicate or reordering)
  and by checksum; blocking push_wait/pop_wait ping-pong; attach from an unrelated process.
"""

from __future__ import annotations

import mmap
import multiprocessing as mp
import queue
import struct
import subprocess
import sys
import time
import zlib
from array import array
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from zlc.runtime.serve import _rings
from zlc.runtime.serve.rings import (
    Request,
    RequestFlag,
    RequestRing,
    Result,
    ResultFlag,
    ResultRing,
    RingRegion,
    region_size,
)

HDR = struct.Struct("<QIIQII")  # magic, version, header_size, region_size, n_rings, reserved
DESC = struct.Struct("<IIIIQQ")  # kind, slot_size, capacity, chunk_tokens, control_offset, slots_offset
REQ = struct.Struct("<QIIffQIIIIffII")  # the request slot's 64-byte header
RES = struct.Struct("<QIIQfI")


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def fresh(request_capacity: int, result_capacity: int, chunk_tokens: int = 16) -> tuple[mmap.mmap, RingRegion]:
    mm = mmap.mmap(-1, region_size(request_capacity, result_capacity, chunk_tokens))
    return mm, RingRegion.over(mm, request_capacity, result_capacity, chunk_tokens)


# --------------------------------------------------------------------------------------------
# layout


def test_layout_matches_the_documentation() -> None:
    mm, region = fresh(4, 8, 32)
    assert region_size(4, 8, 32) == 384 + 4 * (64 + 128) + 8 * 32 == len(mm)
    magic, version, header_size, size, n_rings, _ = HDR.unpack_from(mm, 0)
    assert (magic, version, header_size, size, n_rings) == (_rings.MAGIC, 1, 128, len(mm), 2)
    assert struct.pack("<Q", magic) == b"ZLCRINGS"
    assert DESC.unpack_from(mm, 0x20) == (1, 64 + 4 * 32, 4, 32, 0x80, 0x180)
    assert DESC.unpack_from(mm, 0x40) == (2, 32, 8, 0, 0x100, 0x180 + 4 * 192)
    assert bytes(mm[0x60:0x80]) == bytes(32)

    assert region.requests.push(Request(9, range(40), 7, 0.5, 0.25, 2**63 + 5, 3, 40, -0.5, 1.5, 20))
    assert struct.unpack_from("<QQ", mm, 0x80)[0] == 0 and struct.unpack_from("<Q", mm, 0x80 + 64)[0] == 2
    s0, s1 = 0x180, 0x180 + 192
    options = (40, -0.5, 1.5, 20, 0)  # top_k, frequency_penalty, presence_penalty, top_logprobs, reserved
    assert REQ.unpack_from(mm, s0) == (9, 3 | _rings.REQUEST_CONTINUE, 7, 0.5, 0.25, 2**63 + 5, 32, 40, 0, *options)
    assert REQ.unpack_from(mm, s1) == (9, 3, 7, 0.5, 0.25, 2**63 + 5, 8, 40, 1, *options)
    assert list(array("I", mm[s0 + 64 : s0 + 64 + 128])) == list(range(32))
    assert list(array("I", mm[s1 + 64 : s1 + 64 + 32])) == list(range(32, 40))

    assert region.results.push(Result(11, 12, ResultFlag.EOS | ResultFlag.LAST, 13, -2.25))
    assert RES.unpack_from(mm, 0x180 + 4 * 192) == (11, 12, 5, 13, -2.25, 0)
    assert struct.unpack_from("<Q", mm, 0x100 + 64)[0] == 1
    assert region.results.pop() == Result(11, 12, 5, 13, -2.25)
    assert struct.unpack_from("<Q", mm, 0x100)[0] == 1
    assert region.info["result_slots_offset"] == 0x180 + 4 * 192
    region.close()


def test_defaults_and_slot_arithmetic() -> None:
    region = RingRegion.anonymous(2, 2)
    assert region.requests.chunk_tokens == _rings.DEFAULT_CHUNK_TOKENS == 4096
    assert region.requests.max_prompt_tokens == 8192
    assert [region.requests.slots_needed(n) for n in (0, 1, 4096, 4097, 8192)] == [1, 1, 1, 2, 2]
    assert region.requests.push(Request(1, range(8192), 1))
    assert region.requests.occupancy() == 2
    assert list(region.requests.pop().tokens) == list(range(8192))  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"8193 tokens needs 3 request slots of 4096 tokens.*longest prompt: 8192"):
        region.requests.push(Request(1, range(8193), 1))
    region.close()


# --------------------------------------------------------------------------------------------
# the state machine

tokens_st = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


@st.composite
def request_st(draw: Any, max_tokens: int = 300) -> Request:
    if draw(st.booleans()):  # short prompts, every token drawn
        tokens = draw(st.lists(tokens_st, max_size=min(max_tokens, 20)))
    else:  # up to past the longest prompt (8 slots of 32): an arithmetic sequence mod 2**32
        n, base, stride = draw(st.integers(0, max_tokens)), draw(tokens_st), draw(tokens_st)
        tokens = [(base + i * stride) % 2**32 for i in range(n)]
    return Request(
        draw(u64),
        tokens,
        draw(st.integers(0, 2**32 - 1)),
        draw(st.floats(0, 4, width=32)),
        draw(st.floats(0, 1, width=32)),
        draw(u64),
        # GRAMMAR is no opaque bit: Request sets it exactly when it carries a grammar (in its words)
        draw(st.integers(0, 2**31 - 1)) & ~int(RequestFlag.GRAMMAR),
        grammar=draw(st.none() | st.text(max_size=30)),
    )


result_st = st.builds(Result, u64, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1),
                    st.one_of(st.just(0), st.integers(1, 2**64 - 1)))


class RingMachine(RuleBasedStateMachine):
    """Both rings of one region against deques; two handles per ring, used in turn."""

    @initialize(
        req_cap=st.sampled_from([1, 2, 4, 8]),
        res_cap=st.sampled_from([1, 2, 4, 16]),
        chunk=st.sampled_from([16, 32]),
        start=st.one_of(st.just(0), st.just(2**64 - 3), u64),
    )
    def setup(self, req_cap: int, res_cap: int, chunk: int, start: int) -> None:
        self.mm = mmap.mmap(-1, region_size(req_cap, res_cap, chunk))
        _rings.init_region(self.mm, req_cap, res_cap, chunk)
        for control in (0x80, 0x100):  # head = tail = start: the u64 counters wrap during the run
            struct.pack_into("<Q", self.mm, control, start)
            struct.pack_into("<Q", self.mm, control + 64, start)
        self.req = [RequestRing(self.mm), RequestRing(self.mm)]
        self.res = [ResultRing(self.mm), ResultRing(self.mm)]
        self.req_model: deque[Request] = deque()
        self.res_model: deque[Result] = deque()
        self.req_cap, self.res_cap, self.chunk = req_cap, res_cap, chunk

    def teardown(self) -> None:
        if hasattr(self, "mm"):
            for r in (*self.req, *self.res):
                r.release()
            self.mm.close()

    # -- helpers --

    def need(self, r: Request) -> int:
        words = len(r.tokens) + (0 if r.grammar is None else 1 + -(-len(r.grammar.encode()) // 4))
        return max(1, -(-words // self.chunk))

    def req_used(self) -> int:
        return sum(self.need(r) for r in self.req_model)

    def check_req(self, got: Request | None, want: Request) -> None:
        assert got is not None
        assert (got.request_id, list(got.tokens), got.max_tokens, got.seed, got.flags, got.grammar) == (
            want.request_id, list(want.tokens), want.max_tokens, want.seed, want.flags, want.grammar)
        assert (got.temperature, got.top_p) == (f32(want.temperature), f32(want.top_p))

    def check_res(self, got: Result | None, want: Result) -> None:
        assert got is not None
        assert (got.request_id, got.token, got.flags) == (want.request_id, want.token, want.flags)
        if want.t_ns:
            assert got.t_ns == want.t_ns
        else:  # stamped at push
            assert 0 < got.t_ns <= time.monotonic_ns()

    # -- request ring --

    @rule(h=st.integers(0, 1), r=request_st())
    def push_request(self, h: int, r: Request) -> None:
        before = self.req[h].raw.counters()
        if self.need(r) > self.req_cap:
            with pytest.raises(ValueError, match="request slots"):
                self.req[h].push(r)
        elif self.req_used() + self.need(r) > self.req_cap:
            assert self.req[h].push(r) is False
        else:
            assert self.req[h].push(r) is True
            self.req_model.append(r)
            return
        assert self.req[h].raw.counters() == before

    @rule(h=st.integers(0, 1), n_chunks=st.integers(1, 8))
    def push_longest_prompt(self, h: int, n_chunks: int) -> None:
        """A prompt filling whole slots exactly (the longest the ring takes when n == capacity)."""
        r = Request(n_chunks, [(n_chunks << 16) + i for i in range(n_chunks * self.chunk)], 1)
        ok = n_chunks <= self.req_cap and self.req_used() + n_chunks <= self.req_cap
        if n_chunks > self.req_cap:
            with pytest.raises(ValueError):
                self.req[h].push(r)
            return
        assert self.req[h].push(r) is ok
        if ok:
            self.req_model.append(r)

    @rule(h=st.integers(0, 1), rs=st.lists(request_st(max_tokens=40), max_size=5))
    def push_many_requests(self, h: int, rs: list[Request]) -> None:
        rs = [r for r in rs if self.need(r) <= self.req_cap]
        used, fit = self.req_used(), 0
        for r in rs:
            if used + self.need(r) > self.req_cap:
                break
            used += self.need(r)
            fit += 1
        assert self.req[h].push_many(rs) == fit
        self.req_model.extend(rs[:fit])

    @rule(h=st.integers(0, 1), bad=st.sampled_from(["token", "request_id", "flags", "max_tokens", "type"]))
    def push_bad_request(self, h: int, bad: str) -> None:
        before = self.req[h].raw.counters()
        fields: list[Any] = [1, [1, 2, 3], 4, 0.5, 0.5, 6, 0]
        if bad == "token":
            fields[1] = [1, 2**32, 3]
        elif bad == "request_id":
            fields[0] = -1
        elif bad == "flags":
            fields[6] = _rings.REQUEST_CONTINUE
        elif bad == "max_tokens":
            fields[2] = 2**32
        else:
            fields[1] = "abc"
        if bad == "token" and self.req_used() == self.req_cap:
            assert self.req[h].raw.push(*fields) is False  # no room: the tokens are not even read
        else:
            with pytest.raises((ValueError, TypeError)):
                self.req[h].raw.push(*fields)
        if self.req_cap - self.req_used() >= 2:  # a bad item among those that fit: nothing published
            with pytest.raises((ValueError, TypeError)):
                self.req[h].raw.push_many([(2, [], 0, 0.0, 0.0, 0, 0), tuple(fields)])
        assert self.req[h].raw.counters() == before

    @rule(h=st.integers(0, 1))
    def pop_request(self, h: int) -> None:
        got = self.req[h].pop()
        if not self.req_model:
            assert got is None
        else:
            self.check_req(got, self.req_model.popleft())

    @rule(h=st.integers(0, 1), n=st.integers(0, 10))
    def pop_many_requests(self, h: int, n: int) -> None:
        got = self.req[h].pop_many(n)
        assert len(got) == min(n, len(self.req_model))
        for g in got:
            self.check_req(g, self.req_model.popleft())

    @precondition(lambda self: self.req_used() == self.req_cap)
    @rule(h=st.integers(0, 1))
    def push_wait_full_times_out(self, h: int) -> None:
        assert self.req[h].push_wait(Request(0, [], 0), timeout_s=0.0) is False

    # -- result ring --

    @rule(h=st.integers(0, 1), r=result_st)
    def push_result(self, h: int, r: Result) -> None:
        before = self.res[h].raw.counters()
        ok = self.res[h].push(r)
        assert ok is (len(self.res_model) < self.res_cap)
        if ok:
            self.res_model.append(r)
        else:
            assert self.res[h].raw.counters() == before

    @rule(h=st.integers(0, 1), rs=st.lists(result_st, max_size=20))
    def push_many_results(self, h: int, rs: list[Result]) -> None:
        fit = min(len(rs), self.res_cap - len(self.res_model))
        assert self.res[h].push_many(rs) == fit
        self.res_model.extend(rs[:fit])

    @rule(h=st.integers(0, 1), bad=st.sampled_from([(-1, 0), (0, 2**32), (0, 0, -1), (0, 0, 0, 2**64), (1,), "x"]))
    def push_bad_result(self, h: int, bad: Any) -> None:
        before = self.res[h].raw.counters()
        if self.res_cap - len(self.res_model) >= 2:  # a bad item among those that fit: nothing published
            with pytest.raises((ValueError, TypeError)):
                self.res[h].raw.push_many([(1, 2), bad])
        with pytest.raises((ValueError, TypeError)):
            self.res[h].raw.push(*bad) if isinstance(bad, tuple) else self.res[h].raw.push(bad)
        assert self.res[h].raw.counters() == before

    @rule(h=st.integers(0, 1))
    def pop_result(self, h: int) -> None:
        got = self.res[h].pop()
        if not self.res_model:
            assert got is None
            assert self.res[h].pop_wait(timeout_s=0.0) is None
        else:
            self.check_res(got, self.res_model.popleft())

    @rule(h=st.integers(0, 1), n=st.integers(0, 40))
    def pop_many_results(self, h: int, n: int) -> None:
        got = self.res[h].pop_many(n)
        assert len(got) == min(n, len(self.res_model))
        for g in got:
            self.check_res(g, self.res_model.popleft())

    # -- invariants --

    @invariant()
    def occupancy_matches_model(self) -> None:
        if not hasattr(self, "mm"):
            return
        for ring in self.req:
            assert ring.occupancy() == self.req_used()
        for res in self.res:
            assert res.occupancy() == len(self.res_model)
        head, tail = self.req[0].raw.counters()
        assert (tail - head) % 2**64 == self.req_used()


TestRingMachine = RingMachine.TestCase
TestRingMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------------------------
# malformed regions


def _valid() -> bytearray:
    buf = bytearray(region_size(4, 4, 16))
    _rings.init_region(buf, 4, 4, 16)  # bytearray storage is at least 8-byte aligned
    return buf


def _poke(buf: bytearray, fmt: str, off: int, value: int) -> bytearray:
    struct.pack_into(fmt, buf, off, value)
    return buf


MALFORMED = {
    "too small": (lambda: bytearray(64), "too small: 64 bytes"),
    "no magic": (lambda: bytearray(4096), "bad ring region magic 0x0000000000000000"),
    "wrong magic": (lambda: _poke(_valid(), "<Q", 0, 0x1234), "bad ring region magic"),
    "wrong version": (lambda: _poke(_valid(), "<I", 8, 2), "unsupported ring region version 2"),
    "header size": (lambda: _poke(_valid(), "<I", 12, 64), "header_size 64"),
    "ring count": (lambda: _poke(_valid(), "<I", 0x18, 3), "n_rings 3"),
    "ring kind": (lambda: _poke(_valid(), "<I", 0x20, 2), "ring kinds 2, 2"),
    "capacity not a power of two": (lambda: _poke(_valid(), "<I", 0x28, 3), "capacity must be a power of two"),
    "huge capacity": (lambda: _poke(_valid(), "<I", 0x48, 2**31), "capacity must be a power of two"),
    "capacity beyond the buffer": (lambda: _poke(_valid(), "<I", 0x48, 1024), "region_size is"),
    "chunk tokens": (lambda: _poke(_valid(), "<I", 0x2C, 17), "chunk_tokens"),
    "slot size": (lambda: _poke(_valid(), "<I", 0x24, 4096), "request slot_size is 4096"),
    "slots offset": (lambda: _poke(_valid(), "<Q", 0x58, 8), "result slots_offset is 8"),
    "control offset": (lambda: _poke(_valid(), "<Q", 0x30, 0), "request control_offset is 0"),
    "region size": (lambda: _poke(_valid(), "<Q", 0x10, 10**12), "region_size is 1000000000000"),
    "truncated": (lambda: _valid()[:-64], "truncated mapping"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_region_raises_value_error(case: str) -> None:
    make, message = MALFORMED[case]
    buf = make()
    for attach in (_rings.region_info, _rings.RequestRing, _rings.ResultRing, RingRegion.over):
        with pytest.raises(ValueError, match=message):
            attach(buf)


def test_bad_buffers_and_parameters() -> None:
    with pytest.raises(ValueError, match="writable"):
        _rings.RequestRing(bytes(_valid()))
    with pytest.raises(TypeError, match="must be a buffer"):
        _rings.ResultRing(12)
    buf = bytearray(region_size(4, 4, 16) + 8)
    with pytest.raises(ValueError, match="8-byte aligned"):
        _rings.init_region(memoryview(buf)[1:], 4, 4, 16)
    with pytest.raises(ValueError, match="8-byte aligned"):
        _rings.region_info(memoryview(_valid())[4:])
    with pytest.raises(ValueError, match="too small"):
        _rings.init_region(bytearray(1000), 4, 4, 16)
    for args, message in [((3, 4), "request ring capacity"), ((4, 0), "result ring capacity"),
                          ((2**31, 4), "request ring capacity"), ((4, 4, 8), "chunk_tokens"),
                          ((4, 4, 0), "chunk_tokens"), ((4, 4, 2**21), "chunk_tokens"), ((-1, 4), "request_capacity")]:
        with pytest.raises(ValueError, match=message):
            _rings.region_size(*args)
    with pytest.raises(ValueError, match="both ring capacities"):
        RingRegion.over(bytearray(4096), 4)
    region = RingRegion.over(_valid())
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 2\*\*32\)"):
        Request(1, [-1], 1)
    with pytest.raises(ValueError, match="reserved"):
        region.requests.push(Request(1, [], 1, flags=_rings.REQUEST_CONTINUE))
    region.close()


def test_corrupted_counters_and_chunks_raise() -> None:
    mm, region = fresh(4, 4, 16)
    struct.pack_into("<Q", mm, 0x100 + 64, 5)  # result tail 5 past head 0, capacity 4
    with pytest.raises(ValueError, match="result ring corrupt: tail - head exceeds the capacity"):
        region.results.pop()
    with pytest.raises(ValueError, match="result ring corrupt"):
        region.results.push(Result(1, 1))

    assert region.requests.push(Request(1, range(40), 1))  # 3 chunks
    struct.pack_into("<I", mm, 0x180 + 128 + 0x28, 7)  # second chunk's chunk_index
    with pytest.raises(ValueError, match="inconsistent chunk"):
        region.requests.pop()
    assert region.requests.raw.counters() == (0, 3)  # nothing consumed
    struct.pack_into("<I", mm, 0x180 + 128 + 0x28, 1)
    struct.pack_into("<I", mm, 0x180 + 0x24, 1000)  # total_tokens past the published slots
    with pytest.raises(ValueError, match="run past the published tail"):
        region.requests.pop_many(4)
    struct.pack_into("<I", mm, 0x180 + 0x24, 40)
    assert list(region.requests.pop().tokens) == list(range(40))  # type: ignore[union-attr]
    region.close()
    with pytest.raises(ValueError, match="released"):
        region.requests.pop()


@settings(max_examples=300, deadline=None)
@given(pokes=st.lists(st.tuples(st.integers(0, 1024 + 4 * 32 - 1), st.integers(0, 255)), min_size=1, max_size=12),
       fill=st.integers(0, 6))
def test_random_corruption_raises_or_works_never_crashes(pokes: list[tuple[int, int]], fill: int) -> None:
    """Random bytes anywhere in a live region (header, counters, slots): every operation either
    works or raises ValueError; the C code never reads or writes outside the buffer."""
    buf = bytearray(region_size(4, 4, 16) + 4 * 32)  # slack after the region: overruns would land here
    _rings.init_region(buf, 4, 4, 16)
    with RingRegion.over(buf) as region:
        for i in range(fill):
            region.requests.push(Request(i, range(i * 9), i))
            region.results.push(Result(i, i))
    for off, byte in pokes:
        buf[off] = byte
    slack = bytes(buf[-4 * 32:])
    try:
        region = RingRegion.over(memoryview(buf)[: -4 * 32])
    except ValueError:
        return
    for op in (lambda: region.requests.pop_many(8), lambda: region.results.pop_many(8),
               lambda: region.requests.push(Request(9, range(20), 1)), lambda: region.results.push(Result(9, 9)),
               region.requests.occupancy, region.results.occupancy):
        try:
            op()
        except ValueError:
            pass
    region.close()
    assert bytes(buf[-4 * 32:]) == slack


def test_token_sources_and_close() -> None:
    np = pytest.importorskip("numpy")
    with RingRegion.anonymous(8, 8, 16) as region:
        q = region.requests
        assert q.raw.push(1, np.arange(20, dtype=np.uint32), 1, 0.0, 1.0, 0, 0)
        assert q.raw.push(2, np.arange(20, dtype=np.int64), 1, 0.0, 1.0, 0, 0)  # via __index__
        assert q.raw.push(3, array("I", [5, 6]), np.uint32(1), 0.0, 1.0, np.uint64(2**64 - 1), 0)
        with pytest.raises(TypeError, match="tokens must be"):
            q.raw.push(4, b"\x01\x02", 1, 0.0, 1.0, 0, 0)
        with pytest.raises(ValueError, match=r"token 1 must be in \[0, 2\*\*32\)"):
            q.raw.push(4, np.array([1, -1]), 1, 0.0, 1.0, 0, 0)
        assert list(Request(6, np.arange(5, dtype=np.uint32), 1).tokens) == [0, 1, 2, 3, 4]  # bytes copy
        assert list(Request(6, np.arange(5, dtype=np.int64), 1).tokens) == [0, 1, 2, 3, 4]
        with pytest.raises(TypeError, match="tokens must be"):
            Request(6, b"\x01\x02\x03\x04", 1)
        got = q.pop_many(5)
        assert [list(r.tokens) for r in got] == [list(range(20)), list(range(20)), [5, 6]]
        assert got[2].seed == 2**64 - 1
        assert q.push(Request(5, [], 1, flags=RequestFlag.CANCEL)) and q.pop() == Request(5, [], 1, flags=1)
    assert q.raw.released
    region.close()  # idempotent


# --------------------------------------------------------------------------------------------
# cross-process

N_REQUESTS = 200_000
N_RESULTS = 2_000_000
STRESS_CHUNK = 64
KNUTH = 2654435761


def _req(seq: int) -> Request:
    n = ((seq * KNUTH) >> 7) % 200  # 0..199 tokens: 1..4 slots of 64
    return Request(seq, array("I", range(seq, seq + n)), seq % 1000, (seq % 8) / 4, 1.0 - (seq % 4) / 8,
                   (seq * 0x9E3779B97F4A7C15) % 2**64, seq % 3, seq % 50, (seq % 9) / 4 - 1, (seq % 5) / 4,
                   seq % 21)


def _results(start: int, stop: int) -> list[tuple[int, int, int, int, float]]:
    # logprobs in quarters: exact in the slot's f32
    return [(s, (s * KNUTH) & 0xFFFFFFFF, s & 7, s + 1, -(s % 64) / 4) for s in range(start, stop)]


def _ingress(name: str, out: Any) -> None:
    """Produces the requests, consumes and checks the results."""
    try:
        region = RingRegion.attach(name)
        reqs, res = region.requests, region.results.raw
        pending: deque[Request] = deque()
        sent = got = idle = full = 0
        crc = 0
        deadline = time.monotonic() + 200
        while sent < N_REQUESTS or pending or got < N_RESULTS:
            moved = 0
            while len(pending) < 32 and sent < N_REQUESTS:
                pending.append(_req(sent))
                sent += 1
            if pending:
                n = reqs.push_many(pending)
                full += n < len(pending)
                for _ in range(n):
                    crc = zlib.crc32(pending.popleft().tokens, crc)
                moved += n
            batch = res.pop_many(1024)
            if batch:
                want = _results(got, got + len(batch))
                if batch != want:
                    i = next(i for i, (a, b) in enumerate(zip(batch, want, strict=True)) if a != b)
                    raise AssertionError(f"result {got + i}: got {batch[i]}, expected {want[i]}")
                got += len(batch)
                moved += len(batch)
            if moved:
                idle = 0
            else:
                idle += 1
                if idle > 50:
                    time.sleep(0)
                if time.monotonic() > deadline:
                    raise AssertionError(f"stuck: sent {sent - len(pending)} requests, received {got} results")
        region.close()
        out.put(("ingress", None, sent, got, crc, full))
    except BaseException as e:
        out.put(("ingress", f"{type(e).__name__}: {e}", 0, 0, 0, 0))


def _kernel(name: str, out: Any) -> None:
    """Consumes and checks the requests, produces the results."""
    try:
        region = RingRegion.attach(name)
        reqs, res = region.requests, region.results.raw
        got = sent = idle = full = 0
        crc = 0
        pending: list[tuple[int, int, int, int]] = []
        deadline = time.monotonic() + 200
        while got < N_REQUESTS or sent < N_RESULTS:
            moved = 0
            for r in reqs.pop_many(64):
                w = _req(got)
                if r != w:  # every field: all are exact in the slot's f32
                    raise AssertionError(f"request {got}: got {r}, expected {w}")
                crc = zlib.crc32(r.tokens, crc)
                got += 1
                moved += 1
            if not pending and sent < N_RESULTS:
                pending = _results(sent, min(N_RESULTS, sent + 256))
            if pending:
                n = res.push_many(pending)
                full += n < len(pending)
                pending = pending[n:]
                sent += n
                moved += n
            if moved:
                idle = 0
            else:
                idle += 1
                if idle > 50:
                    time.sleep(0)
                if time.monotonic() > deadline:
                    raise AssertionError(f"stuck: received {got} requests, sent {sent} results")
        region.close()
        out.put(("kernel", None, got, sent, crc, full))
    except BaseException as e:
        out.put(("kernel", f"{type(e).__name__}: {e}", 0, 0, 0, 0))


def _run_pair(targets: list[Any], name: str, timeout_s: float) -> dict[str, tuple[Any, ...]]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=t, args=(name, out), daemon=True) for t in targets]
    for p in procs:
        p.start()
    reports: dict[str, tuple[Any, ...]] = {}
    try:
        deadline = time.monotonic() + timeout_s
        while len(reports) < len(procs):
            try:
                rep = out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"cross-process run timed out after {timeout_s} s; reports so far: {reports}") from None
            reports[rep[0]] = rep[1:]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return reports


def test_cross_process_stress_no_loss_duplicate_or_reorder() -> None:
    with RingRegion.create(None, request_capacity=64, result_capacity=1024, chunk_tokens=STRESS_CHUNK) as region:
        assert region.name is not None
        t0 = time.monotonic()
        reports = _run_pair([_ingress, _kernel], region.name, timeout_s=240)
        elapsed = time.monotonic() - t0
        (err_i, sent_q, got_r, crc_sent, full_q), (err_k, got_q, sent_r, crc_got, full_r) = (
            reports["ingress"], reports["kernel"])
        assert err_i is None and err_k is None, (err_i, err_k)
        assert (sent_q, got_q) == (N_REQUESTS, N_REQUESTS)
        assert (sent_r, got_r) == (N_RESULTS, N_RESULTS)
        assert crc_sent == crc_got
        # the rings are drained and the counters are where the traffic left them
        assert region.requests.occupancy() == 0 and region.results.occupancy() == 0
        head, tail = region.results.raw.counters()
        assert head == tail == N_RESULTS
        slots = sum(max(1, -(-len(_req(s).tokens) // STRESS_CHUNK)) for s in range(N_REQUESTS))
        assert region.requests.raw.counters() == (slots, slots)
        print(f"cross-process: {N_REQUESTS} requests ({slots} slots) + {N_RESULTS} results in {elapsed:.1f} s; "
              f"pushes cut short by a full ring: {full_q} request, {full_r} result")


PINGS = 2000


def _pinger(name: str, out: Any) -> None:
    try:
        region = RingRegion.attach(name)
        for i in range(PINGS):
            assert region.requests.push_wait(Request(i, [i], 1), timeout_s=30)
            r = region.results.pop_wait(timeout_s=30)
            assert r is not None and (r.request_id, r.token) == (i, i + 1), r
        region.close()
        out.put(("pinger", None))
    except BaseException as e:
        out.put(("pinger", f"{type(e).__name__}: {e}"))


def _ponger(name: str, out: Any) -> None:
    try:
        region = RingRegion.attach(name)
        for i in range(PINGS):
            q = region.requests.pop_wait(timeout_s=30)
            assert q is not None and q.request_id == i and list(q.tokens) == [i], q
            assert region.results.push_wait(Result(i, i + 1, ResultFlag.LAST), timeout_s=30)
        region.close()
        out.put(("ponger", None))
    except BaseException as e:
        out.put(("ponger", f"{type(e).__name__}: {e}"))


def test_cross_process_blocking_ping_pong() -> None:
    with RingRegion.create(None, 1, 1, 16) as region:
        assert region.name is not None
        reports = _run_pair([_pinger, _ponger], region.name, timeout_s=120)
        assert reports == {"pinger": (None,), "ponger": (None,)}


def test_attach_from_an_unrelated_process_leaves_the_segment_alone(tmp_path: Any) -> None:
    """A process that attaches by name (its own resource tracker) and exits must not unlink the
    creator's segment; a file-backed region works the same way."""
    code = (
        "import sys\nfrom zlc.runtime.serve.rings import RingRegion, Request\n"
        "r = RingRegion.attach(sys.argv[1])\nassert r.requests.push(Request(77, [1, 2, 3], 5))\nr.close()\n"
    )
    for name in (None, str(tmp_path / "rings.bin")):
        with RingRegion.create(name, 4, 4, 16) as region:
            assert region.name is not None
            subprocess.run([sys.executable, "-c", code, region.name], check=True, timeout=60)
            again = RingRegion.attach(region.name)  # still there
            got = again.requests.pop()
            assert got is not None and (got.request_id, list(got.tokens)) == (77, [1, 2, 3])
            again.close()
        with pytest.raises((FileNotFoundError, OSError)):
            RingRegion.attach(region.name)  # the creator's close unlinked it
