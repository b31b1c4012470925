"""Binary frames in (docs/frames.md): TCP connections, UDP datagrams (and what the XDP program
passes on), validated against the bundle, authenticated when the server has a key
(frame_auth.py), and submitted to the engine; each result goes straight back as a frame.

TCP: a malformed frame closes the connection (its byte stream can no longer be trusted), and so
does a frame that stays incomplete longer than frame_timeout_s, or, with a key, any frame before
a valid AUTH. UDP: a datagram without the magic is counted and dropped (it may not be ours); any
other bad datagram gets one small ERROR frame; a reply that could exceed AMPLIFICATION times the
datagram goes only to a source that has echoed a cookie.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from typing import Any

from ..protocol import ResultFlag
from ..rings import Request
from . import frame_auth, frames
from .frames import FrameErrorCode, FrameFlag
from .state import ServerState

UDP_BUFFER_BYTES = 8 << 20  # capped by net.core.rmem_max / wmem_max (deploy/sysctl.d raises those)
ERROR_LAST = FrameFlag.ERROR | FrameFlag.LAST


class FrameReply:
    """One binary-frame request: each result goes straight back as a frame."""

    __slots__ = ("send", "client_id", "rid", "owner", "key", "version")

    def __init__(self, send: Any, client_id: int, rid: int, owner: dict[Any, int] | None, key: Any = None,
                 version: int = 1):
        self.send, self.client_id, self.rid, self.owner, self.key = send, client_id, rid, owner, key
        self.version = version

    def on_result(self, token: int, flags: int, t_ns: int, logprob: float = 0.0) -> None:
        self.send(frames.encode_result(self.client_id, token, flags, self.version))
        if flags & ResultFlag.LAST and self.owner is not None:
            self.owner.pop(self.key, None)


class FrameSubmitter:
    """What TCP and UDP frames share: validation against the bundle and submission."""

    def __init__(self, server: ServerState, transport_name: str):
        self.server = server
        self.name = transport_name
        self.inflight: dict[Any, int] = {}  # client request id -> engine request id

    def refuse(self, header: frames.FrameHeader, code: FrameErrorCode, send: Any, outcome: str, via: str) -> None:
        self.server.metrics.frames.labels(via, outcome).inc()
        send(frames.encode_error(header.request_id, code, header.version))

    def max_tokens(self, header: frames.FrameHeader) -> int:
        """The tokens a request may produce: what it asks, clipped to the context."""
        return max(1, min(header.max_tokens, self.server.max_seq - header.n_tokens + 1))

    def submit(self, header: frames.FrameHeader, tokens: Any, send: Any, key: Any, via: str | None = None) -> None:
        server = self.server
        m = server.metrics.frames
        name = via or self.name
        if header.flags & FrameFlag.CANCEL:
            rid = self.inflight.pop(key, None)
            if rid is not None:
                server.engine.cancel(rid)
                send(frames.encode_error(header.request_id, FrameErrorCode.CANCELLED, header.version))
            m.labels(name, "cancel").inc()
            return
        n = len(tokens)
        if key in self.inflight or n > server.max_seq:
            return self.refuse(header, FrameErrorCode.BAD_REQUEST, send, "refused", name)
        if not server.accepting:
            return self.refuse(header, FrameErrorCode.UNAVAILABLE, send, "unavailable", name)
        rid = server.engine.new_id()
        reply = FrameReply(send, header.request_id, rid, None, key, header.version)
        if not server.engine.submit(Request(rid, tokens, self.max_tokens(header)), reply):
            return self.refuse(header, FrameErrorCode.OVERLOADED, send, "overloaded", name)
        self.inflight[key] = rid
        reply.owner = self.inflight
        m.labels(name, "accepted").inc()
        server.metrics.prompt_tokens.inc(n)


class FrameConnection(asyncio.Protocol):
    """Binary frames over TCP. With a key, the server's first frame is a CHALLENGE and the client's
    first must be the AUTH frame that answers it."""

    def __init__(self, server: ServerState):
        self.server = server
        self.sub = FrameSubmitter(server, "tcp")
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        # the framing bound (the longest prompt the ring can carry); longer than the context is
        # answered BAD_REQUEST in submit() instead of closing the connection
        self.limit = server.engine.max_prompt_tokens
        self.key = server.frame_key
        self.nonce = frame_auth.new_nonce() if self.key is not None else b""
        self.authenticated = self.key is None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio subclass)
        self.server.frame_connections.add(self)
        if self.key is not None:
            self._send(frames.encode_challenge(self.nonce))

    def _send(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        consumed = False
        while len(buf) >= frames.HEADER_SIZE:
            try:
                h = frames.parse_header(buf, self.limit)
                if h.flags & frames.TRAILERS:
                    raise frames.FrameError("COOKIE and MAC are for UDP; a TCP connection authenticates "
                                            "once (AUTH)")
            except frames.FrameError as e:
                self._malformed(str(e))
                return
            end = h.size
            if len(buf) < end:
                break
            payload = bytes(buf[frames.HEADER_SIZE:end]) if h.flags & FrameFlag.AUTH else b""
            tokens = frames.tokens_from(memoryview(buf)[frames.HEADER_SIZE:end]) if not payload else None
            del buf[:end]
            consumed = True
            if h.flags & FrameFlag.AUTH or not self.authenticated:
                if not self._authenticate(h, payload):
                    return
                continue
            # client ids are per connection, so the id alone is the key
            self.sub.submit(h, tokens, self._send, h.request_id)
        self._watch_partial(consumed)

    def _authenticate(self, h: frames.FrameHeader, proof: bytes) -> bool:
        """An AUTH frame (or a frame before one); False when the connection is closed for it."""
        if self.key is None:
            return True  # nothing to prove: AUTH is a no-op without a key
        if h.flags & FrameFlag.AUTH and frame_auth.same(proof, frame_auth.tcp_proof(self.key, self.nonce)):
            self.authenticated = True
            return True
        self.server.metrics.frames.labels("tcp", "unauthorized").inc()
        self._send(frames.encode_error(h.request_id, FrameErrorCode.UNAUTHORIZED, 2))
        why = "a wrong AUTH proof" if h.flags & FrameFlag.AUTH else "a frame before AUTH"
        print(f"zlc serve: frames/tcp: closing a connection: {why} (--api-key is set)", file=sys.stderr)
        self.buf.clear()
        if self.transport is not None:
            self.transport.close()
        return False

    def _watch_partial(self, new_frame: bool) -> None:
        """The deadline runs from a partial frame's first byte: bytes trickling in do not extend it."""
        if self.timer is not None and (new_frame or not self.buf):
            self.timer.cancel()
            self.timer = None
        if self.buf and self.timer is None:
            loop = asyncio.get_running_loop()
            self.timer = loop.call_later(self.server.options.frame_timeout_s, self._malformed,
                                         "an incomplete frame timed out (does its n_tokens lie?)")

    def _malformed(self, why: str) -> None:
        self.server.metrics.frames.labels("tcp", "malformed").inc()
        print(f"zlc serve: frames/tcp: closing a connection: {why}", file=sys.stderr)
        self.buf.clear()
        if self.transport is not None:
            self.transport.close()

    @property
    def idle(self) -> bool:
        return not self.sub.inflight

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.frame_connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
        for rid in self.sub.inflight.values():
            self.server.engine.cancel(rid)
        self.sub.inflight.clear()


class FrameDatagram(asyncio.DatagramProtocol):
    """Binary frames over UDP: one frame per datagram, its length exactly what its header says
    (24 + 4 * n_tokens, plus the cookie and tag it flags)."""

    def __init__(self, server: ServerState):
        self.server = server
        self.sub = FrameSubmitter(server, "udp")
        self.transport: asyncio.DatagramTransport | None = None
        self.limit = frames.MAX_UDP_TOKENS  # longer than max_seq: BAD_REQUEST in submit()
        self.key = server.frame_key
        self.cookies = frame_auth.Cookies()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is not an asyncio subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None:  # room for bursts (and for what XDP passes on when its ring is full)
            for force, opt in ((33, socket.SO_RCVBUF), (32, socket.SO_SNDBUF)):  # SO_*BUFFORCE: root only
                try:
                    sock.setsockopt(socket.SOL_SOCKET, force, UDP_BUFFER_BYTES)
                except OSError:
                    try:
                        sock.setsockopt(socket.SOL_SOCKET, opt, UDP_BUFFER_BYTES)
                    except OSError:
                        pass

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.handle(data, addr, "udp")

    def handle(self, data: bytes, addr: Any, via: str) -> None:
        """One frame from `addr`, received on the socket ("udp") or taken from the XDP ring ("xdp",
        validated by the program and checked again here); replies leave through the socket."""
        m = self.server.metrics.frames
        transport = self.transport
        if transport is None or transport.is_closing():
            return

        def send(out: bytes) -> None:
            transport.sendto(out, addr)

        if len(data) < frames.HEADER_SIZE or int.from_bytes(data[:4], "little") != frames.MAGIC:
            m.labels(via, "malformed").inc()
            return
        try:
            h = frames.parse_header(data, self.limit)
            if h.flags & FrameFlag.AUTH:
                raise frames.FrameError("AUTH is for TCP; a UDP datagram carries its own tag (MAC)")
            if len(data) != h.size:
                raise frames.FrameError(f"datagram is {len(data)} bytes; its header says {h.size}")
        except frames.FrameError:
            m.labels(via, "malformed").inc()
            rid = int.from_bytes(data[8:16], "little")
            send(frames.encode_error(rid, FrameErrorCode.MALFORMED, 2 if data[4:6] == b"\x02\x00" else 1))
            return
        end = frames.HEADER_SIZE + 4 * h.n_tokens
        if self.key is not None and not self._tagged(data, h):
            return self.sub.refuse(h, FrameErrorCode.UNAUTHORIZED, send, "unauthorized", via)
        if not h.flags & FrameFlag.CANCEL and not self._may_reply(data, h, addr, end):
            m.labels(via, "verify").inc()
            send(frames.encode_error(h.request_id, FrameErrorCode.VERIFY, h.version, self.cookies.issue(addr)))
            return
        tokens = frames.tokens_from(memoryview(data)[frames.HEADER_SIZE:end])
        self.sub.submit(h, tokens, send, (addr, h.request_id), via)

    def _tagged(self, data: bytes, h: frames.FrameHeader) -> bool:
        if not h.flags & FrameFlag.MAC:
            return False
        body = memoryview(data)[:-frame_auth.TAG_BYTES]
        return frame_auth.same(memoryview(data)[-frame_auth.TAG_BYTES:], frame_auth.udp_tag(self.key or b"", body))

    def _may_reply(self, data: bytes, h: frames.FrameHeader, addr: Any, end: int) -> bool:
        """Within the amplification bound, or from a source whose cookie shows it receives."""
        if frame_auth.reply_allowed(len(data), frames.RESULT_SIZE * self.sub.max_tokens(h)):
            return True
        if h.flags & FrameFlag.COOKIE:
            return self.cookies.valid(addr, memoryview(data)[end:end + frame_auth.COOKIE_BYTES])
        return False

    def error_received(self, exc: Exception) -> None:  # e.g. ICMP port unreachable from a gone client
        pass
