"""Type declarations (for mypy and editors) of the C extension zlc.runtime._rings (runtime/_rings.c; layout: docs/rings.md)."""

from collections.abc import Sequence
from types import TracebackType
from typing import Final

from typing_extensions import Buffer, Self

MAGIC: Final[int]
VERSION: Final[int]
HEADER_SIZE: Final[int]
CONTROL_SIZE: Final[int]
HEAD_OFFSET: Final[int]
TAIL_OFFSET: Final[int]
REQUEST_HEADER_SIZE: Final[int]
RESULT_SLOT_SIZE: Final[int]
DEFAULT_CHUNK_TOKENS: Final[int]
MAX_CHUNK_TOKENS: Final[int]
MAX_CAPACITY: Final[int]
REQUEST_CONTINUE: Final[int]

# (request_id, tokens, max_tokens, temperature, top_p, seed, flags[, top_k, frequency_penalty,
# presence_penalty, top_logprobs]); popped tokens are the u32s as bytes, and all 11 fields come back
RequestTuple = (tuple[int, Sequence[int] | Buffer, int, float, float, int, int]
                | tuple[int, Sequence[int] | Buffer, int, float, float, int, int, int, float, float, int])
PoppedRequest = tuple[int, bytes, int, float, float, int, int, int, float, float, int]
# (request_id, token, flags, t_ns, logprob); pushes may leave out the last ones (t_ns 0: stamped at push)
ResultTuple = tuple[int, int, int, int, float]

def region_size(request_capacity: int, result_capacity: int, chunk_tokens: int = ...) -> int: ...
def init_region(region: Buffer, request_capacity: int, result_capacity: int, chunk_tokens: int = ...) -> int: ...
def region_info(region: Buffer) -> dict[str, int]: ...

class _Ring:
    @property
    def capacity(self) -> int: ...
    @property
    def released(self) -> bool: ...
    @property
    def chunk_tokens(self) -> int: ...
    def occupancy(self) -> int: ...
    def counters(self) -> tuple[int, int]: ...
    def release(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None, /
    ) -> None: ...

class RequestRing(_Ring):
    def __init__(self, region: Buffer) -> None: ...
    def push(
        self,
        request_id: int,
        tokens: Sequence[int] | Buffer,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int,
        flags: int,
        top_k: int = ...,
        frequency_penalty: float = ...,
        presence_penalty: float = ...,
        top_logprobs: int = ...,
        /,
    ) -> bool: ...
    def push_many(self, requests: Sequence[RequestTuple], /) -> int: ...
    def pop(self) -> PoppedRequest | None: ...
    def pop_many(self, max_n: int, /) -> list[PoppedRequest]: ...
    def slots_needed(self, n_tokens: int, /) -> int: ...

class ResultRing(_Ring):
    def __init__(self, region: Buffer) -> None: ...
    def push(self, request_id: int, token: int, flags: int = 0, t_ns: int = 0, logprob: float = 0.0, /) -> bool: ...
    def push_many(
        self,
        results: Sequence[tuple[int, int] | tuple[int, int, int] | tuple[int, int, int, int] | ResultTuple],
        /,
    ) -> int: ...
    def pop(self) -> ResultTuple | None: ...
    def pop_many(self, max_n: int, /) -> list[ResultTuple]: ...
