"""Binary token frames: the wire format for callers that tokenize themselves (TCP, UDP, and the XDP
ingress program, which parses the same header). Layout in docs/frames.md.

Every frame is a 24-byte little-endian header followed by ``n_tokens`` u32 token ids:

    offset  size  field
    0       4     magic       b"ZLCF" (0x46434C5A as a u32)
    4       2     version     1 or 2
    6       2     flags       request: CANCEL=1 (v2 also COOKIE=16, MAC=32, AUTH=64);
                              result: EOS=1, ERROR=2, LAST=4 (v2 also CHALLENGE=8)
    8       8     request_id  chosen by the caller; results echo it
    16      4     max_tokens  request: tokens to generate (>= 1); result: 0
    20      4     n_tokens    token ids that follow (request: the prompt; result: the new tokens,
                              or the error code with ERROR)

Version 2 adds authentication and UDP source verification (frame_auth.py): a UDP request may end
in a 16-byte cookie (flag COOKIE) and then a 16-byte tag (flag MAC); on TCP, the server's
CHALLENGE and the client's AUTH frame carry a nonce / a proof as their payload. A frame that uses
none of that is the same bytes as in version 1, and may say version 1: both are accepted, and
results carry the version of the request they answer.

A result frame carries one token as it is produced (n_tokens 1), or the error code with
ERROR|LAST (VERIFY adds the cookie after the code). Parsing is `struct` on a fixed header: the
payload is copied once into an array of u32 without a per-token Python loop.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from dataclasses import dataclass

from . import frame_auth

MAGIC = 0x46434C5A  # b"ZLCF" read as a little-endian u32
VERSION = 2  # what this module speaks; VERSIONS are accepted
VERSIONS = (1, 2)
HEADER = struct.Struct("<IHHQII")
HEADER_SIZE = HEADER.size  # 24
#: Largest UDP payload over IPv4; bounds the prompt a UDP frame can carry.
MAX_UDP_PAYLOAD = 65507
MAX_UDP_TOKENS = (MAX_UDP_PAYLOAD - HEADER_SIZE) // 4
RESULT_SIZE = HEADER_SIZE + 4  # one result frame: what each generated token costs on the wire
NONCE_WORDS = frame_auth.NONCE_BYTES // 4
PROOF_WORDS = frame_auth.PROOF_BYTES // 4

_U32 = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


class FrameFlag(enum.IntFlag):
    CANCEL = 1  # request: stop request_id (no tokens)
    EOS = 1  # result: the token ends the sequence
    ERROR = 2  # result: the request failed; the payload is one error code
    LAST = 4  # result: no more frames for this request_id
    CHALLENGE = 8  # result (v2, TCP, request_id 0): the payload is the connection's nonce
    COOKIE = 16  # request (v2, UDP): a 16-byte cookie follows the tokens
    MAC = 32  # request (v2, UDP): a 16-byte tag ends the datagram
    AUTH = 64  # request (v2, TCP): the payload is the proof for the connection's CHALLENGE


_V1_REQUEST = FrameFlag.CANCEL
_V2_REQUEST = FrameFlag.CANCEL | FrameFlag.COOKIE | FrameFlag.MAC | FrameFlag.AUTH
TRAILERS = FrameFlag.COOKIE | FrameFlag.MAC


class FrameErrorCode(enum.IntEnum):
    """Codes in an ERROR result frame (1..4, 8 and 9 are protocol.EngineError's, forwarded as they are)."""

    OVERLOADED = 1
    BAD_REQUEST = 2
    INTERNAL = 3
    CANCELLED = 4
    MALFORMED = 5  # the frame itself was invalid (UDP; TCP closes the connection instead)
    UNAUTHORIZED = 6  # --api-key is set and the frame (UDP) or connection (TCP) did not prove it
    VERIFY = 7  # UDP: send the request again with the cookie that follows this code
    UNAVAILABLE = 8  # the engine stopped (crashed, hung) or the server is shutting down: retry
    KV_BUDGET = 9  # the prompt needs more KV cache than the engine's whole budget (--kv-pages)


class FrameError(ValueError):
    """A malformed frame; the message says what is wrong."""


@dataclass(slots=True)
class FrameHeader:
    flags: int
    request_id: int
    max_tokens: int
    n_tokens: int
    version: int = VERSION

    @property
    def trailer_bytes(self) -> int:
        """Bytes after the tokens: the cookie and the tag (UDP, version 2)."""
        return (frame_auth.COOKIE_BYTES if self.flags & FrameFlag.COOKIE else 0) + (
            frame_auth.TAG_BYTES if self.flags & FrameFlag.MAC else 0)

    @property
    def size(self) -> int:
        """The whole frame's length."""
        return HEADER_SIZE + 4 * self.n_tokens + self.trailer_bytes


def parse_header(buf: bytes | bytearray | memoryview, max_tokens_per_frame: int) -> FrameHeader:
    """The header at the start of ``buf`` (at least HEADER_SIZE bytes); FrameError if the magic,
    version, flags or token count is wrong."""
    magic, version, flags, request_id, max_tokens, n_tokens = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x}, b'ZLCF')")
    if version not in VERSIONS:
        speaks = ", ".join(map(str, VERSIONS))
        raise FrameError(f"unsupported frame version {version} (this server speaks {speaks})")
    allowed = _V1_REQUEST if version == 1 else _V2_REQUEST
    if flags & ~allowed:
        raise FrameError(f"flags 0x{flags:x} are not request flags of frame version {version}")
    if n_tokens > max_tokens_per_frame:
        raise FrameError(f"n_tokens {n_tokens} exceeds the limit {max_tokens_per_frame}")
    if flags & FrameFlag.AUTH:
        if flags != FrameFlag.AUTH or n_tokens != PROOF_WORDS or max_tokens:
            raise FrameError(f"an AUTH frame has no other flag, max_tokens 0 and n_tokens {PROOF_WORDS}")
    elif flags & FrameFlag.CANCEL:
        if n_tokens:
            raise FrameError("a CANCEL frame carries no tokens")
    elif n_tokens == 0 or max_tokens == 0:
        raise FrameError("a request frame needs n_tokens >= 1 and max_tokens >= 1")
    return FrameHeader(flags, request_id, max_tokens, n_tokens, version)


def tokens_from(payload: bytes | bytearray | memoryview) -> array[int]:
    """The u32 little-endian token ids in ``payload`` (a multiple of 4 bytes)."""
    out = array(_U32)
    out.frombytes(payload)
    if _SWAP:
        out.byteswap()
    return out


def _words(values: list[int] | array[int]) -> bytes:
    body = values if isinstance(values, array) and values.typecode == _U32 else array(_U32, values)
    if _SWAP:
        body = array(_U32, body)
        body.byteswap()
    return body.tobytes()


def _finish(frame: bytes, cookie: bytes | None, key: bytes | None) -> bytes:
    if cookie is not None:
        frame += bytes(cookie)
    if key is not None:
        frame += frame_auth.udp_tag(key, frame)
    return frame


def encode_request(request_id: int, tokens: list[int] | array[int], max_tokens: int, *, flags: int = 0,
                   cookie: bytes | None = None, key: bytes | None = None) -> bytes:
    """A request frame (what a client sends). For UDP: `cookie` from a VERIFY answer, `key` (the
    API key's bytes) to add the tag. Without either, the frame is version 1's bytes."""
    flags |= (FrameFlag.COOKIE if cookie is not None else 0) | (FrameFlag.MAC if key is not None else 0)
    body = _words(tokens)
    version = 2 if flags & ~_V1_REQUEST else 1
    return _finish(HEADER.pack(MAGIC, version, flags, request_id, max_tokens, len(body) // 4) + body, cookie, key)


def encode_cancel(request_id: int, *, cookie: bytes | None = None, key: bytes | None = None) -> bytes:
    return encode_request(request_id, [], 0, flags=FrameFlag.CANCEL, cookie=cookie, key=key)


def encode_auth(key: bytes, nonce: bytes) -> bytes:
    """The AUTH frame answering a connection's CHALLENGE (TCP)."""
    proof = frame_auth.tcp_proof(key, nonce)
    return HEADER.pack(MAGIC, 2, FrameFlag.AUTH, 0, 0, PROOF_WORDS) + proof


def encode_challenge(nonce: bytes) -> bytes:
    return HEADER.pack(MAGIC, 2, FrameFlag.CHALLENGE, 0, 0, len(nonce) // 4) + nonce


def encode_result(request_id: int, token: int, flags: int, version: int = 1) -> bytes:
    """One result frame with one token (or, with ERROR, one error code)."""
    return HEADER.pack(MAGIC, version, flags, request_id, 0, 1) + struct.pack("<I", token)


def encode_error(request_id: int, code: int, version: int = 1, extra: bytes = b"") -> bytes:
    """An ERROR|LAST result: the code, then `extra` (VERIFY's cookie), a multiple of 4 bytes."""
    return (HEADER.pack(MAGIC, version, FrameFlag.ERROR | FrameFlag.LAST, request_id, 0, 1 + len(extra) // 4)
            + struct.pack("<I", code) + extra)


@dataclass(slots=True)
class ResultFrame:
    flags: int
    request_id: int
    tokens: list[int]

    def payload(self) -> bytes:
        """The payload as bytes (a CHALLENGE's nonce)."""
        return _words(self.tokens)

    def cookie(self) -> bytes | None:
        """The cookie of a VERIFY error (send the request again with it), else None."""
        if self.flags & FrameFlag.ERROR and self.tokens and self.tokens[0] == FrameErrorCode.VERIFY:
            return _words(self.tokens[1:])
        return None


def decode_results(buf: bytearray) -> list[ResultFrame]:
    """Complete result frames from the front of ``buf`` (consumed in place); for clients and tests."""
    out = []
    while len(buf) >= HEADER_SIZE:
        magic, version, flags, rid, _, n = HEADER.unpack_from(buf)
        if magic != MAGIC or version not in VERSIONS:
            raise FrameError(f"bad result frame header (magic 0x{magic:08x}, version {version})")
        end = HEADER_SIZE + 4 * n
        if len(buf) < end:
            break
        out.append(ResultFrame(flags, rid, list(tokens_from(bytes(buf[HEADER_SIZE:end])))))
        del buf[:end]
    return out
