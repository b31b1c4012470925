"""Who may use the frame ports, and how much a UDP source may be sent: the MACs and cookies of
frame version 2 (docs/frames.md, "Authentication" and "Amplification").

- **TCP, per connection.** With ``--api-key``, the server's first frame on a connection is a
  CHALLENGE carrying 32 random bytes; the client answers with an AUTH frame whose payload is
  ``HMAC-SHA256(key, "zlc-frames/tcp\\0" + nonce)``. A fresh nonce per connection: a recorded
  answer is worth nothing on another connection.
- **UDP, per datagram.** With ``--api-key``, every datagram ends in a 16-byte tag,
  ``HMAC-SHA256(key, "zlc-frames/udp\\0" + every byte before the tag)`` cut to 16 bytes (the
  truncation HMAC allows, RFC 2104 §5).
- **UDP amplification.** A source address that has not shown it receives what is sent to it gets
  at most ``AMPLIFICATION`` times the bytes of its datagram back (QUIC's bound, RFC 9000 §8.1). A
  request whose reply could be longer is answered with a VERIFY error carrying a cookie; the same
  request sent again with the cookie is served in full. A cookie is a MAC of the source address
  and the current period under a secret of this process, so the server keeps no state per source
  (a spoofed flood costs it nothing but the MACs), and it is good for one to two periods.

The domain prefixes keep a TCP proof from ever being a valid UDP tag and vice versa. ``hmac`` and
``hashlib`` are the standard library's; comparisons are constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from typing import Any

TAG_BYTES = 16  # a UDP datagram's tag
NONCE_BYTES = 32  # a TCP challenge
PROOF_BYTES = 32  # a TCP AUTH frame's payload (a whole HMAC-SHA256)
COOKIE_BYTES = 16
AMPLIFICATION = 3  # reply bytes per request byte for a source not yet verified
COOKIE_PERIOD_S = 60.0

_TCP = b"zlc-frames/tcp\0"
_UDP = b"zlc-frames/udp\0"
_COOKIE = b"zlc-frames/cookie\0"


def key_bytes(key: str | bytes) -> bytes:
    """The API key as the HMAC key (UTF-8 for a str)."""
    return key.encode() if isinstance(key, str) else bytes(key)


def tcp_proof(key: bytes, nonce: bytes) -> bytes:
    """What an AUTH frame carries for the connection whose CHALLENGE was `nonce`."""
    return hmac.digest(key, _TCP + nonce, hashlib.sha256)


def udp_tag(key: bytes, data: bytes | memoryview) -> bytes:
    """The tag that ends a UDP datagram whose other bytes are `data`."""
    return hmac.digest(key, _UDP + bytes(data), hashlib.sha256)[:TAG_BYTES]


def same(a: bytes | memoryview, b: bytes) -> bool:
    """Constant-time equality of a received MAC and the expected one."""
    return hmac.compare_digest(bytes(a), b)


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _address(addr: Any) -> bytes:
    """A source address as bytes: (host, port) for IPv4, (host, port, flow, scope) for IPv6."""
    return f"{addr[0]}|{addr[1]}".encode()


class Cookies:
    """Stateless cookies for UDP source addresses: ``issue(addr)`` now, ``valid(addr, cookie)``
    for a cookie issued in this period or the one before."""

    def __init__(self, period_s: float = COOKIE_PERIOD_S, clock: Callable[[], float] = time.monotonic):
        self.period_s = period_s
        self.clock = clock
        self._secret = secrets.token_bytes(32)  # per process: a restarted server re-verifies everyone

    def _make(self, addr: Any, period: int) -> bytes:
        msg = _COOKIE + period.to_bytes(8, "little") + _address(addr)
        return hmac.digest(self._secret, msg, hashlib.sha256)[:COOKIE_BYTES]

    def _period(self) -> int:
        return int(self.clock() // self.period_s)

    def issue(self, addr: Any) -> bytes:
        return self._make(addr, self._period())

    def valid(self, addr: Any, cookie: bytes | memoryview) -> bool:
        now = self._period()
        return any(same(cookie, self._make(addr, p)) for p in (now, now - 1))


def reply_allowed(request_bytes: int, reply_bytes: int) -> bool:
    """Whether an unverified source may be sent `reply_bytes` for a datagram of `request_bytes`."""
    return reply_bytes <= AMPLIFICATION * request_bytes
