"""Binary token frames (runtime/frames.py) against a real `zlc serve` subprocess, over TCP and UDP:
results equal the executor's greedy tokens with LAST/EOS set right, several requests share one
connection or use several, CANCEL stops a request, and malformed frames get what the protocol
promises (TCP: the connection closes, promptly or at the partial-frame timeout; UDP: an ERROR frame
with MALFORMED, or silence for a datagram that is not ours) while the server keeps serving.

Every wait is bounded by a socket timeout, so a hang fails the test instead of hanging CI."""

from __future__ import annotations

import re
import socket
import struct
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from serve_helpers import closed_within

from zlc.runtime.serve.ingress import frames
from zlc.runtime.serve.ingress.frames import FrameErrorCode, FrameFlag, ResultFrame

MAX_SEQ = 128  # the chat bundle's context (conftest compiles it with max_seq=128)
FRAME_TIMEOUT_S = 5.0  # ServeOptions.frame_timeout_s (no CLI flag: the default)
TIMEOUT_S = 15.0  # bound on any single socket wait
ERROR_LAST = FrameFlag.ERROR | FrameFlag.LAST
PROMPT = [72, 101, 108, 108, 111]
# A prompt whose greedy continuation on this tiny random model reaches the EOS token (258) after
# 31 tokens (found by searching every one-token prompt); checked against the executor below.
EOS_PROMPT = [256]

Greedy = Callable[[list[int], int], list[int]]


@pytest.fixture(scope="module")
def greedy(bundle: Any) -> Iterator[Greedy]:
    """The greedy tokens `bundle.generate(ids, n, device="reference")` gives, stopping at EOS as the
    server does (one session for the module instead of one per call)."""
    cache: dict[tuple[tuple[int, ...], int], list[int]] = {}
    with bundle.session("reference") as s:
        def run(ids: list[int], n: int) -> list[int]:
            key = (tuple(ids), n)
            if key not in cache:
                cache[key] = s.generate(list(ids), n, eos=bundle.eos_token_ids)
            return cache[key]

        yield run


# --------------------------------------------------------------------------------------------------
# clients


class Tcp:
    def __init__(self, server: Any):
        self.sock = socket.create_connection((server.host, server.frame_port), timeout=TIMEOUT_S)
        self.buf = bytearray()

    def __enter__(self) -> Tcp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def read(self) -> list[ResultFrame]:
        """At least one complete result frame."""
        while True:
            got = frames.decode_results(self.buf)
            if got:
                return got
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the server closed the connection")
            self.buf += data

    def until_last(self, ids: set[int], got: dict[int, list[ResultFrame]] | None = None
                   ) -> dict[int, list[ResultFrame]]:
        """Result frames by request id until each of `ids` has had its LAST frame."""
        got = got if got is not None else {}
        pending = set(ids)
        while pending:
            for f in self.read():
                assert f.request_id in ids, f
                assert f.request_id in pending, f"a frame after LAST: {f}"
                got.setdefault(f.request_id, []).append(f)
                if f.flags & FrameFlag.LAST:
                    pending.discard(f.request_id)
        return got

    def closed_within(self, seconds: float) -> bool:
        """True if the server closes the connection within `seconds` (what it sends before is dropped)."""
        return closed_within(self.sock, seconds)


class Udp:
    """A UDP frame client that does what docs/frames.md asks of one: a request answered VERIFY (its
    replies could outweigh the datagram more than frame_auth.AMPLIFICATION times) is sent again
    with the cookie, once, and the VERIFY is not reported."""

    def __init__(self, server: Any):
        self.to = (server.host, server.udp_port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(TIMEOUT_S)
        self.sent: dict[int, bytes] = {}  # request id -> the last request frame sent for it
        self.verified: list[int] = []  # request ids sent again with a cookie

    def __enter__(self) -> Udp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        if len(data) >= frames.HEADER_SIZE:
            self.sent[int.from_bytes(data[8:16], "little")] = data
        self.sock.sendto(data, self.to)

    def recv(self, timeout: float = TIMEOUT_S) -> ResultFrame | None:
        """One datagram, which must be exactly one result frame; None on timeout."""
        while True:
            self.sock.settimeout(timeout)
            try:
                data, addr = self.sock.recvfrom(65536)
            except TimeoutError:
                return None
            assert addr == self.to
            buf = bytearray(data)
            got = frames.decode_results(buf)
            assert len(got) == 1 and not buf, f"a datagram that is not one frame: {data!r}"
            f = got[0]
            cookie = f.cookie()
            if cookie is None or f.request_id not in self.sent or f.request_id in self.verified:
                return f
            sent = self.sent[f.request_id]
            h = frames.parse_header(sent, frames.MAX_UDP_TOKENS)
            tokens = frames.tokens_from(sent[frames.HEADER_SIZE:frames.HEADER_SIZE + 4 * h.n_tokens])
            self.verified.append(f.request_id)
            self.send(frames.encode_request(h.request_id, tokens, h.max_tokens, flags=h.flags, cookie=cookie))

    def until_last(self, ids: set[int]) -> dict[int, list[ResultFrame]]:
        got: dict[int, list[ResultFrame]] = {}
        pending = set(ids)
        while pending:
            f = self.recv()
            assert f is not None, f"no reply for {pending} within {TIMEOUT_S} s"
            assert f.request_id in pending, f
            got.setdefault(f.request_id, []).append(f)
            if f.flags & FrameFlag.LAST:
                pending.discard(f.request_id)
        return got


def header(*, magic: int = frames.MAGIC, version: int = frames.VERSION, flags: int = 0, request_id: int = 1,
           max_tokens: int = 4, n_tokens: int = 0) -> bytes:
    return frames.HEADER.pack(magic, version, flags, request_id, max_tokens, n_tokens)


def payload(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def check_result(fs: list[ResultFrame], want: list[int], eos: list[int]) -> None:
    """`fs` carry `want`, one token per frame; LAST on the last only; EOS on an eos token only."""
    assert [f.tokens for f in fs] == [[t] for t in want]
    for f in fs[:-1]:
        assert f.flags == 0, f
    last = fs[-1]
    assert last.flags == (FrameFlag.LAST | (FrameFlag.EOS if want[-1] in eos else 0)), last


def check_error(f: ResultFrame, request_id: int, code: FrameErrorCode) -> None:
    assert f.request_id == request_id and f.flags == ERROR_LAST and f.tokens == [int(code)], f


def frame_count(server: Any, transport: str, outcome: str) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=TIMEOUT_S) as r:
        text = r.read().decode()
    for m in re.finditer(r"^zlc_frames_total\{([^}]*)\} (\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels == {"transport": transport, "outcome": outcome}:
            return float(m.group(2))
    return 0.0


def assert_tcp_serving(server: Any, greedy: Greedy, eos: list[int]) -> None:
    with Tcp(server) as c:
        c.send(frames.encode_request(99, PROMPT, 3))
        check_result(c.until_last({99})[99], greedy(PROMPT, 3), eos)


def assert_udp_serving(server: Any, greedy: Greedy, eos: list[int]) -> None:
    with Udp(server) as u:
        u.send(frames.encode_request(98, PROMPT, 3))
        check_result(u.until_last({98})[98], greedy(PROMPT, 3), eos)


# --------------------------------------------------------------------------------------------------
# TCP


def test_tcp_results_equal_greedy(server: Any, bundle: Any, greedy: Greedy) -> None:
    eos = bundle.eos_token_ids
    with Tcp(server) as c:
        c.send(frames.encode_request(1, PROMPT, 8))
        check_result(c.until_last({1})[1], greedy(PROMPT, 8), eos)
        # max_tokens beyond the context is clipped to what fits (the last token needs no cache row)
        long = [(7 * i) % 250 + 3 for i in range(MAX_SEQ - 5)]
        c.send(frames.encode_request(2, long, 1000))
        fs = c.until_last({2})[2]
        check_result(fs, greedy(long, 6), eos)
        assert len(fs) <= 6
        # a prompt that fills the context exactly still gets its one token
        full = long + [1, 2, 3, 4, 5]
        c.send(frames.encode_request(3, full, 50))
        check_result(c.until_last({3})[3], greedy(full, 1), eos)


def test_tcp_eos_flag(server: Any, bundle: Any, greedy: Greedy) -> None:
    eos = bundle.eos_token_ids
    want = greedy(EOS_PROMPT, 60)
    assert want[-1] in eos and len(want) < 60, (
        f"EOS_PROMPT no longer reaches EOS {eos} on this model (got {want}): pick another prompt")
    with Tcp(server) as c:
        c.send(frames.encode_request(5, EOS_PROMPT, 60))
        fs = c.until_last({5})[5]
    check_result(fs, want, eos)
    assert fs[-1].flags == FrameFlag.EOS | FrameFlag.LAST


def test_tcp_two_requests_interleaved_on_one_connection(server: Any, bundle: Any, greedy: Greedy) -> None:
    eos = bundle.eos_token_ids
    a, b = PROMPT, [1, 2, 3]
    with Tcp(server) as c:
        c.send(frames.encode_request(11, a, 6))
        got: dict[int, list[ResultFrame]] = {}
        first = c.read()  # A is running: B goes in behind it, on the same connection
        for f in first:
            got.setdefault(f.request_id, []).append(f)
        c.send(frames.encode_request(2**64 - 1, b, 5))
        c.until_last({11, 2**64 - 1} - {f.request_id for f in first if f.flags & FrameFlag.LAST}, got)
    check_result(got[11], greedy(a, 6), eos)
    check_result(got[2**64 - 1], greedy(b, 5), eos)
    with Tcp(server) as c:  # both in one write
        c.send(frames.encode_request(21, b, 4) + frames.encode_request(22, a, 4))
        got = c.until_last({21, 22})
    check_result(got[21], greedy(b, 4), eos)
    check_result(got[22], greedy(a, 4), eos)


def test_tcp_same_id_on_two_connections(server: Any, bundle: Any, greedy: Greedy) -> None:
    """Request ids are per connection: the same id on two connections is two requests."""
    eos = bundle.eos_token_ids
    a, b = PROMPT, [200, 100, 50, 25]
    with Tcp(server) as c1, Tcp(server) as c2:
        c1.send(frames.encode_request(7, a, 5))
        c2.send(frames.encode_request(7, b, 5))
        r2 = c2.until_last({7})[7]
        r1 = c1.until_last({7})[7]
    check_result(r1, greedy(a, 5), eos)
    check_result(r2, greedy(b, 5), eos)


def test_tcp_same_id_twice_in_flight_is_refused(server: Any, bundle: Any, greedy: Greedy) -> None:
    with Tcp(server) as c:
        c.send(frames.encode_request(8, PROMPT, 4) + frames.encode_request(8, [1, 2], 4))
        got = []
        while len(got) < 5:  # 4 tokens of the first + the refusal of the second, in some order
            got += c.read()
    refusals = [f for f in got if f.flags & FrameFlag.ERROR]
    assert len(refusals) == 1
    check_error(refusals[0], 8, FrameErrorCode.BAD_REQUEST)
    check_result([f for f in got if not f.flags & FrameFlag.ERROR], greedy(PROMPT, 4), bundle.eos_token_ids)


def test_tcp_cancel(server: Any, bundle: Any, greedy: Greedy) -> None:
    eos = bundle.eos_token_ids
    long = [1, 2, 3]
    with Tcp(server) as c:
        c.send(frames.encode_request(31, long, 120) + frames.encode_request(32, PROMPT, 120))
        fs: list[ResultFrame] = []
        while len(fs) < 2:
            fs += c.read()
        c.send(frames.encode_cancel(32))  # both run side by side (continuous batching)
        c.send(frames.encode_cancel(31))
        got = c.until_last({31, 32}, {rid: [f for f in fs if f.request_id == rid] for rid in (31, 32)})
        c.send(frames.encode_cancel(12345))  # unknown: nothing comes back, the connection stays
        c.send(frames.encode_request(31, PROMPT, 3))  # the id is free again
        check_result(c.until_last({31})[31], greedy(PROMPT, 3), eos)
    for rid, prompt in ((31, long), (32, PROMPT)):
        *tokens, last = got[rid]
        check_error(last, rid, FrameErrorCode.CANCELLED)
        assert len(tokens) < 120
        assert [f.tokens[0] for f in tokens] == greedy(prompt, len(tokens))
    assert len(got[31]) + len(got[32]) >= 4  # the two tokens read before the cancels, and the two ends


@pytest.mark.parametrize("bad", {
    "bad magic": header(magic=0x46434C5B, n_tokens=1) + payload([1]),
    "HTTP": b"POST /v1/messages HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad version": header(version=3, n_tokens=1) + payload([1]),
    "version 0": header(version=0, n_tokens=1) + payload([1]),
    "n_tokens over any limit": header(n_tokens=0xFFFFFFFF),
    "n_tokens over the ring": header(n_tokens=(1 << 20) + 1),
    "no tokens": header(n_tokens=0),
    "max_tokens 0": header(max_tokens=0, n_tokens=1) + payload([1]),
    "cancel with tokens": header(flags=FrameFlag.CANCEL, n_tokens=1) + payload([1]),
}.items(), ids=lambda kv: kv[0])
def test_tcp_malformed_closes(server: Any, bundle: Any, greedy: Greedy, bad: tuple[str, bytes]) -> None:
    before = frame_count(server, "tcp", "malformed")
    with Tcp(server) as c:
        c.send(bad[1])
        assert c.closed_within(1.0)
    assert frame_count(server, "tcp", "malformed") == before + 1
    assert_tcp_serving(server, greedy, bundle.eos_token_ids)


def test_tcp_malformed_after_a_good_frame(server: Any, bundle: Any, greedy: Greedy) -> None:
    """A good frame, then a bad one in the same write: the good one is accepted (and cancelled when
    the connection closes); the connection closes."""
    with Tcp(server) as c:
        c.send(frames.encode_request(1, PROMPT, 100) + header(magic=0, n_tokens=1) + payload([1]))
        assert c.closed_within(2.0)
    t0 = time.monotonic()
    assert_tcp_serving(server, greedy, bundle.eos_token_ids)
    assert time.monotonic() - t0 < 1.5, "the closed connection's request was not cancelled"


def test_tcp_prompt_over_the_context_is_refused(server: Any, bundle: Any, greedy: Greedy) -> None:
    """A well-formed frame whose prompt is longer than max_seq: never served. Today the server
    closes the connection (its per-frame limit is max_seq); a BAD_REQUEST frame would do too."""
    with Tcp(server) as c:
        c.send(frames.encode_request(4, [5] * (MAX_SEQ + 1), 2))
        try:
            f = c.read()
        except (EOFError, ConnectionResetError):
            pass
        else:
            check_error(f[0], 4, FrameErrorCode.BAD_REQUEST)
    assert_tcp_serving(server, greedy, bundle.eos_token_ids)


def test_tcp_length_that_lies_closes_at_the_frame_timeout(server: Any, bundle: Any, greedy: Greedy) -> None:
    """The header says 100 tokens, 3 come, then nothing: closed at frame_timeout_s (5 s), and other
    connections are served meanwhile."""
    with Tcp(server) as c:
        t0 = time.monotonic()
        c.send(header(n_tokens=100) + payload([1, 2, 3]))
        assert not c.closed_within(1.0), "closed before the timeout"
        assert_tcp_serving(server, greedy, bundle.eos_token_ids)
        assert c.closed_within(FRAME_TIMEOUT_S + 2.0 - (time.monotonic() - t0))
        took = time.monotonic() - t0
    assert FRAME_TIMEOUT_S - 0.5 < took < FRAME_TIMEOUT_S + 2.0, took
    assert_tcp_serving(server, greedy, bundle.eos_token_ids)


def test_tcp_trickled_frame_closes_at_the_frame_timeout(server: Any, bundle: Any, greedy: Greedy) -> None:
    """Frame slowloris: the lying frame's missing bytes trickle in one every second. The frame is
    still incomplete after frame_timeout_s, so the connection closes then (the timeout counts from
    the frame's first byte, not from the last byte received)."""
    with Tcp(server) as c:
        t0 = time.monotonic()
        c.send(header(n_tokens=100) + payload([1, 2, 3]))
        closed = False
        while not closed and time.monotonic() - t0 < FRAME_TIMEOUT_S + 2.5:
            try:
                c.send(b"\x00")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            closed = c.closed_within(1.0)
        took = time.monotonic() - t0
    assert closed, f"a frame kept incomplete by a byte a second was still open after {took:.1f} s"
    assert took < FRAME_TIMEOUT_S + 2.0, took
    assert_tcp_serving(server, greedy, bundle.eos_token_ids)


# --------------------------------------------------------------------------------------------------
# UDP


def test_udp_results_equal_greedy(server: Any, bundle: Any, greedy: Greedy) -> None:
    eos = bundle.eos_token_ids
    with Udp(server) as u:
        u.send(frames.encode_request(41, PROMPT, 6))
        check_result(u.until_last({41})[41], greedy(PROMPT, 6), eos)
        u.send(frames.encode_request(42, [1, 2, 3], 4))
        check_result(u.until_last({42})[42], greedy([1, 2, 3], 4), eos)


def test_udp_same_id_from_two_senders(server: Any, bundle: Any, greedy: Greedy) -> None:
    """Request ids are per sender address."""
    eos = bundle.eos_token_ids
    with Udp(server) as u1, Udp(server) as u2:
        u1.send(frames.encode_request(7, PROMPT, 4))
        u2.send(frames.encode_request(7, [1, 2, 3], 4))
        check_result(u1.until_last({7})[7], greedy(PROMPT, 4), eos)
        check_result(u2.until_last({7})[7], greedy([1, 2, 3], 4), eos)


def test_udp_request_id_is_free_again_after_its_last_frame(server: Any, bundle: Any, greedy: Greedy) -> None:
    eos = bundle.eos_token_ids
    with Udp(server) as u:
        for prompt in (PROMPT, [1, 2, 3], PROMPT):
            u.send(frames.encode_request(43, prompt, 3))
            check_result(u.until_last({43})[43], greedy(prompt, 3), eos)


def test_udp_cancel(server: Any, greedy: Greedy) -> None:
    with Udp(server) as u:
        u.send(frames.encode_request(44, [1, 2, 3], 120))
        first = u.recv()
        assert first is not None and first.request_id == 44 and first.flags == 0
        u.send(frames.encode_cancel(44))
        got = [first] + u.until_last({44})[44]
    *tokens, last = got
    check_error(last, 44, FrameErrorCode.CANCELLED)
    assert 1 <= len(tokens) < 120
    assert [f.tokens[0] for f in tokens] == greedy([1, 2, 3], len(tokens))


def test_udp_malformed_gets_an_error_frame(server: Any, bundle: Any, greedy: Greedy) -> None:
    good = frames.encode_request(51, PROMPT, 3)
    bad = {
        "one token short": good[:-4],
        "one token long": good + payload([1]),
        "not a multiple of 4": good + b"\x00",
        "header only": good[:frames.HEADER_SIZE],
        "bad version": header(version=9, request_id=51, n_tokens=1) + payload([1]),
        "no tokens": header(request_id=51, n_tokens=0),
        "max_tokens 0": header(request_id=51, max_tokens=0, n_tokens=1) + payload([1]),
        "cancel with tokens": header(flags=FrameFlag.CANCEL, request_id=51, n_tokens=1) + payload([1]),
    }
    before = frame_count(server, "udp", "malformed")
    with Udp(server) as u:
        for name, data in bad.items():
            u.send(data)
            f = u.recv(5.0)
            assert f is not None, f"no reply to {name}"
            check_error(f, 51, FrameErrorCode.MALFORMED)
    after = frame_count(server, "udp", "malformed")
    assert after == before + len(bad), (before, after)
    assert_udp_serving(server, greedy, bundle.eos_token_ids)


def test_udp_not_ours_is_dropped_silently(server: Any, bundle: Any, greedy: Greedy) -> None:
    before = frame_count(server, "udp", "malformed")
    with Udp(server) as u:
        for data in (header(magic=0xDEADBEEF, n_tokens=1) + payload([1]), b"hello", b"", b"ZLCF\x01\x00"):
            u.send(data)
        assert u.recv(0.5) is None
        u.send(frames.encode_request(52, PROMPT, 3))  # the same socket is still served
        check_result(u.until_last({52})[52], greedy(PROMPT, 3), bundle.eos_token_ids)
    assert frame_count(server, "udp", "malformed") == before + 4


def test_udp_prompt_over_the_context_is_bad_request(server: Any, bundle: Any, greedy: Greedy) -> None:
    """A well-formed frame whose prompt is longer than max_seq is a BAD_REQUEST (the request is
    refused), not MALFORMED (the frame is fine)."""
    with Udp(server) as u:
        u.send(frames.encode_request(53, [5] * (MAX_SEQ + 1), 2))
        f = u.recv(5.0)
        assert f is not None
        check_error(f, 53, FrameErrorCode.BAD_REQUEST)
        # and one over what a datagram can carry is not even sent: the header alone claims it
        u.send(header(request_id=54, n_tokens=frames.MAX_UDP_TOKENS + 1))
        f = u.recv(5.0)
        assert f is not None
        check_error(f, 54, FrameErrorCode.MALFORMED)
    assert_udp_serving(server, greedy, bundle.eos_token_ids)
