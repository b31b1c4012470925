"""Binary token frames: the wire format for callers that tokenize themselves (TCP, UDP, and the XDP
ingress program, which parses the same header). Layout in docs/frames.md.

Every frame is a 24-byte little-endian header followed by ``n_tokens`` u32 token ids:

    offset  size  field
    0       4     magic       b"ZLCF" (0x46434C5A as a u32)
    4       2     version     1
    6       2     flags       request: CANCEL=1; result: EOS=1, ERROR=2, LAST=4
    8       8     request_id  chosen by the caller; results echo it
    16      4     max_tokens  request: tokens to generate (>= 1); result: 0
    20      4     n_tokens    token ids that follow (request: the prompt; result: the new tokens,
                              or one error code with ERROR)

A result frame carries one token as it is produced (n_tokens 1), or the error code with
ERROR|LAST. Parsing is `struct` on a fixed header: the payload is copied once into an array of
u32 without a per-token Python loop.
"""

from __future__ import annotations

import enum
import struct
import sys
from array import array
from dataclasses import dataclass

MAGIC = 0x46434C5A  # b"ZLCF" read as a little-endian u32
VERSION = 1
HEADER = struct.Struct("<IHHQII")
HEADER_SIZE = HEADER.size  # 24
#: Largest UDP payload over IPv4; bounds the prompt a UDP frame can carry.
MAX_UDP_PAYLOAD = 65507
MAX_UDP_TOKENS = (MAX_UDP_PAYLOAD - HEADER_SIZE) // 4

_U32 = "I" if array("I").itemsize == 4 else "L"
_SWAP = sys.byteorder != "little"


class FrameFlag(enum.IntFlag):
    CANCEL = 1  # request: stop request_id (no tokens)
    EOS = 1  # result: the token ends the sequence
    ERROR = 2  # result: the request failed; the payload is one error code
    LAST = 4  # result: no more frames for this request_id


class FrameErrorCode(enum.IntEnum):
    """Codes in an ERROR result frame (1..4 are the engine's `EngineError`)."""

    OVERLOADED = 1
    BAD_REQUEST = 2
    INTERNAL = 3
    CANCELLED = 4
    MALFORMED = 5  # the frame itself was invalid (UDP; TCP closes the connection instead)


class FrameError(ValueError):
    """A malformed frame; the message says what is wrong."""


@dataclass(slots=True)
class FrameHeader:
    flags: int
    request_id: int
    max_tokens: int
    n_tokens: int


def parse_header(buf: bytes | bytearray | memoryview, max_tokens_per_frame: int) -> FrameHeader:
    """The header at the start of ``buf`` (at least HEADER_SIZE bytes); FrameError if the magic,
    version or token count is wrong."""
    magic, version, flags, request_id, max_tokens, n_tokens = HEADER.unpack_from(buf)
    if magic != MAGIC:
        raise FrameError(f"bad magic 0x{magic:08x} (expected 0x{MAGIC:08x}, b'ZLCF')")
    if version != VERSION:
        raise FrameError(f"unsupported frame version {version} (this server speaks {VERSION})")
    if n_tokens > max_tokens_per_frame:
        raise FrameError(f"n_tokens {n_tokens} exceeds the limit {max_tokens_per_frame}")
    if flags & FrameFlag.CANCEL:
        if n_tokens:
            raise FrameError("a CANCEL frame carries no tokens")
    elif n_tokens == 0 or max_tokens == 0:
        raise FrameError("a request frame needs n_tokens >= 1 and max_tokens >= 1")
    return FrameHeader(flags, request_id, max_tokens, n_tokens)


def tokens_from(payload: bytes | bytearray | memoryview) -> array[int]:
    """The u32 little-endian token ids in ``payload`` (a multiple of 4 bytes)."""
    out = array(_U32)
    out.frombytes(payload)
    if _SWAP:
        out.byteswap()
    return out


def encode_request(request_id: int, tokens: list[int] | array[int], max_tokens: int, *, flags: int = 0) -> bytes:
    """A request frame (what a client sends)."""
    body = tokens if isinstance(tokens, array) and tokens.typecode == _U32 else array(_U32, tokens)
    if _SWAP:
        body = array(_U32, body)
        body.byteswap()
    return HEADER.pack(MAGIC, VERSION, flags, request_id, max_tokens, len(body)) + body.tobytes()


def encode_cancel(request_id: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, FrameFlag.CANCEL, request_id, 0, 0)


def encode_result(request_id: int, token: int, flags: int) -> bytes:
    """One result frame with one token (or, with ERROR, one error code)."""
    return HEADER.pack(MAGIC, VERSION, flags, request_id, 0, 1) + struct.pack("<I", token)


@dataclass(slots=True)
class ResultFrame:
    flags: int
    request_id: int
    tokens: list[int]


def decode_results(buf: bytearray) -> list[ResultFrame]:
    """Complete result frames from the front of ``buf`` (consumed in place); for clients and tests."""
    out = []
    while len(buf) >= HEADER_SIZE:
        magic, version, flags, rid, _, n = HEADER.unpack_from(buf)
        if magic != MAGIC or version != VERSION:
            raise FrameError(f"bad result frame header (magic 0x{magic:08x}, version {version})")
        end = HEADER_SIZE + 4 * n
        if len(buf) < end:
            break
        out.append(ResultFrame(flags, rid, list(tokens_from(bytes(buf[HEADER_SIZE:end])))))
        del buf[:end]
    return out
