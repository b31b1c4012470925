"""Frames are as protected as HTTP, against a real `zlc serve --api-key` over real sockets: TCP
connections authenticate once (CHALLENGE, then AUTH with the proof), UDP datagrams carry a tag;
without them (or with a wrong key, a replayed proof, a tampered datagram) nothing is served. The
UDP amplification bound: an unverified source gets at most 3x its datagram's bytes back, the
cookie round trip lifts it, and a cookie is good for its own address only. /metrics needs the key,
and frame ports beyond loopback need a key or --insecure-frames (overload answers and their
Retry-After: test_admission.py).

Every wait is bounded by a socket timeout, so a hang fails the test instead of hanging CI."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import closed_within, get, metric, serve_refused

from zlc.runtime.serve.ingress import frame_auth, frames
from zlc.runtime.serve.ingress.frames import FrameErrorCode, FrameFlag, ResultFrame

KEY = "frame-secret"
K = KEY.encode()
AUTH = {"x-api-key": KEY}
TIMEOUT_S = 15.0
PROMPT = [72, 101, 108, 108, 111]
ERROR_LAST = FrameFlag.ERROR | FrameFlag.LAST


@pytest.fixture(scope="module")
def keyed(chat_bundle: Path, server_process: Any) -> Iterator[Any]:
    s = server_process(chat_bundle, "--device", "reference", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def greedy(chat_bundle: Path) -> Iterator[Any]:
    import zlc

    b = zlc.load(chat_bundle)
    with b.session("reference") as s:
        yield lambda ids, n: s.generate(list(ids), n, eos=b.eos_token_ids)


# --------------------------------------------------------------------------------------------------
# TCP


class Tcp:
    def __init__(self, server: Any):
        self.sock = socket.create_connection((server.host, server.frame_port), timeout=TIMEOUT_S)
        self.buf = bytearray()
        self.ready: list[ResultFrame] = []

    def __enter__(self) -> Tcp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sock.close()

    def read(self) -> ResultFrame:
        """The next result frame."""
        while not self.ready:
            self.ready += frames.decode_results(self.buf)
            if self.ready:
                break
            data = self.sock.recv(65536)
            if not data:
                raise EOFError("the server closed the connection")
            self.buf += data
        return self.ready.pop(0)

    def challenge(self) -> bytes:
        f = self.read()
        assert f.flags == FrameFlag.CHALLENGE and f.request_id == 0 and len(f.tokens) == frames.NONCE_WORDS, f
        return f.payload()

    def until_last(self, rid: int) -> list[ResultFrame]:
        out = []
        while not out or not out[-1].flags & FrameFlag.LAST:
            f = self.read()
            assert f.request_id == rid, f
            out.append(f)
        return out


def test_tcp_serves_after_auth(keyed: Any, greedy: Any) -> None:
    with Tcp(keyed) as c:
        nonce = c.challenge()
        c.sock.sendall(frames.encode_auth(K, nonce) + frames.encode_request(1, PROMPT, 6))
        got = c.until_last(1)
        assert [f.tokens[0] for f in got] == greedy(PROMPT, 6) and got[-1].flags & FrameFlag.LAST
        c.sock.sendall(frames.encode_request(2, [1, 2, 3], 3))  # authenticated for the connection
        assert [f.tokens[0] for f in c.until_last(2)] == greedy([1, 2, 3], 3)


@pytest.mark.parametrize("how", ["no AUTH", "wrong key", "another connection's proof", "garbage proof"])
def test_tcp_refused_without_the_proof(keyed: Any, how: str) -> None:
    before = metric(keyed, "zlc_frames_total", AUTH, transport="tcp", outcome="unauthorized")
    with Tcp(keyed) as other:
        stale = frames.encode_auth(K, other.challenge())
    with Tcp(keyed) as c:
        nonce = c.challenge()
        auth = {"no AUTH": b"", "wrong key": frames.encode_auth(b"not-" + K, nonce),
                "another connection's proof": stale,
                "garbage proof": frames.HEADER.pack(frames.MAGIC, 2, FrameFlag.AUTH, 0, 0, 8) + bytes(32)}[how]
        c.sock.sendall(auth + frames.encode_request(7, PROMPT, 4))
        f = c.read()
        assert f.flags == ERROR_LAST and f.tokens == [FrameErrorCode.UNAUTHORIZED], f
        assert f.request_id == (7 if how == "no AUTH" else 0)
        assert closed_within(c.sock, 5.0)
    assert metric(keyed, "zlc_frames_total", AUTH, transport="tcp", outcome="unauthorized") == before + 1


# --------------------------------------------------------------------------------------------------
# UDP


class Udp:
    def __init__(self, server: Any):
        self.to = (server.host, server.udp_port)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))

    def __enter__(self) -> Udp:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.sock.close()

    def send(self, data: bytes) -> int:
        self.sock.sendto(data, self.to)
        return len(data)

    def recv_all(self, quiet_s: float) -> list[bytes]:
        """Every datagram until none comes for `quiet_s`."""
        out = []
        self.sock.settimeout(quiet_s)
        try:
            while True:
                data, addr = self.sock.recvfrom(65536)
                assert addr == self.to
                out.append(data)
        except TimeoutError:
            return out

    def until_last(self, rid: int) -> list[ResultFrame]:
        out: list[ResultFrame] = []
        self.sock.settimeout(TIMEOUT_S)
        while not out or not out[-1].flags & FrameFlag.LAST:
            f = frames.decode_results(bytearray(self.sock.recvfrom(65536)[0]))
            assert len(f) == 1 and f[0].request_id == rid, f
            out += f
        return out


def test_udp_needs_the_tag(keyed: Any, greedy: Any) -> None:
    signed = frames.encode_request(21, PROMPT, 3, key=K)
    tampered = bytearray(signed)
    tampered[frames.HEADER_SIZE] ^= 1  # another first token under the same tag
    bad = {"unsigned": frames.encode_request(21, PROMPT, 3),
           "wrong key": frames.encode_request(21, PROMPT, 3, key=b"x"),
           "tampered": bytes(tampered), "cut tag": signed[:-4] + bytes(4)}
    before = metric(keyed, "zlc_frames_total", AUTH, transport="udp", outcome="unauthorized")
    with Udp(keyed) as u:
        for name, data in bad.items():
            u.send(data)
            got = u.until_last(21)
            assert got == [ResultFrame(ERROR_LAST, 21, [FrameErrorCode.UNAUTHORIZED])], name
        u.send(signed)
        assert [f.tokens[0] for f in u.until_last(21)] == greedy(PROMPT, 3)
        u.send(frames.encode_cancel(99, key=b"x"))  # a CANCEL needs the tag too
        assert u.until_last(99) == [ResultFrame(ERROR_LAST, 99, [FrameErrorCode.UNAUTHORIZED])]
    after = metric(keyed, "zlc_frames_total", AUTH, transport="udp", outcome="unauthorized")
    assert after == before + len(bad) + 1


def test_udp_amplification_bound_and_cookie(keyed: Any, greedy: Any) -> None:
    """A 1-token prompt asking for 255 tokens: 44 bytes in; the unverified source gets one VERIFY
    (44 bytes), nothing else. Sent again with the cookie it gets the whole reply; the same cookie
    from another address is worth nothing."""
    request = frames.encode_request(31, [256], 255, key=K)
    with Udp(keyed) as u, Udp(keyed) as other:
        sent = u.send(request)
        replies = u.recv_all(1.0)
        assert sum(map(len, replies)) <= frame_auth.AMPLIFICATION * sent, replies
        [verify] = [f for r in replies for f in frames.decode_results(bytearray(r))]
        assert verify.flags == ERROR_LAST and verify.tokens[0] == FrameErrorCode.VERIFY
        cookie = verify.cookie()
        assert cookie is not None and len(cookie) == frame_auth.COOKIE_BYTES
        # the cookie proves this address only
        other.send(frames.encode_request(32, [256], 255, cookie=cookie, key=K))
        [again] = [f for r in other.recv_all(1.0) for f in frames.decode_results(bytearray(r))]
        assert again.tokens[0] == FrameErrorCode.VERIFY and again.request_id == 32
        # with it, the whole reply (clipped to the context)
        u.send(frames.encode_request(31, [256], 255, cookie=cookie, key=K))
        got = u.until_last(31)
        assert [f.tokens[0] for f in got] == greedy([256], 128)
        # a reply within the bound needs no cookie
        small = frames.encode_request(33, PROMPT, 4, key=K)
        assert 4 * frames.RESULT_SIZE <= frame_auth.AMPLIFICATION * len(small)
        u.send(small)
        assert [f.tokens[0] for f in u.until_last(33)] == greedy(PROMPT, 4)
    assert metric(keyed, "zlc_frames_total", AUTH, transport="udp", outcome="verify") >= 2


def test_cookies_last_one_to_two_periods() -> None:
    """Stateless cookies: valid for the address they were issued to, in their period and the next."""
    now = [1000.0]
    c = frame_auth.Cookies(period_s=60.0, clock=lambda: now[0])
    a, b = ("127.0.0.1", 5000), ("127.0.0.1", 5001)
    cookie = c.issue(a)
    assert c.valid(a, cookie) and not c.valid(b, cookie) and not c.valid(a, bytes(len(cookie)))
    now[0] += 60.0
    assert c.valid(a, cookie)  # the next period
    now[0] += 60.0
    assert not c.valid(a, cookie)  # and no longer
    assert c.valid(a, c.issue(a))


# --------------------------------------------------------------------------------------------------
# HTTP: /metrics, Retry-After


def test_metrics_needs_the_key(keyed: Any) -> None:
    status, body = get(keyed, "/metrics")
    assert status == 401 and body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == \
        "invalid_api_key", body
    status, body = get(keyed, "/metrics", {"anthropic-version": "2023-06-01", "x-api-key": "wrong"})
    assert status == 401 and body["error"]["type"] == "authentication_error", body
    for headers in (AUTH, {"authorization": f"Bearer {KEY}"}):
        status, text = get(keyed, "/metrics", headers)
        assert status == 200 and "zlc_engine_up 1.0" in text
    assert get(keyed, "/health")[0] == 200  # never needs the key


# --------------------------------------------------------------------------------------------------
# exposure


@pytest.mark.parametrize("args", [["--host", "0.0.0.0", "--frame-port", "0"],
                                  ["--host", "0.0.0.0", "--udp-port", "0"],
                                  ["--xdp", "lo", "--udp-port", "0"]], ids=["tcp", "udp", "xdp"])
def test_frame_ports_beyond_loopback_need_a_key(chat_bundle: Path, args: list[str]) -> None:
    """Refused before anything listens: one error line, exit 1."""
    out = serve_refused(chat_bundle, "--device", "reference", *args)
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "without --api-key" in errors[0] and "--insecure-frames" in errors[0], out.stderr
    assert "Traceback" not in out.stderr and not out.stdout


def test_insecure_frames_and_a_key_each_allow_them(chat_bundle: Path) -> None:
    from zlc.runtime.serve.ingress.server import ServeOptions, Server

    for opts in (ServeOptions(host="0.0.0.0", frame_port=0, insecure_frames=True),
                 ServeOptions(host="0.0.0.0", udp_port=0, api_key="k"),
                 ServeOptions(host="127.0.0.1", frame_port=0, udp_port=0)):
        Server(str(chat_bundle), opts).check_exposure()  # no error
