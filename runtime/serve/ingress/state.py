"""What the request paths see of the server: the `ServerState` protocol that generate.py (HTTP)
and frame_ingress.py (TCP/UDP frames) work against. server.py's `Server` provides it; naming it
here, rather than importing `Server`, keeps the imports one-way (server -> request paths -> state)."""

from __future__ import annotations

from typing import Any, Protocol

from .api_common import ApiError
from .http import HttpRequest
from .metrics import ServerMetrics
from .pool import EnginePool


class FrameOptions(Protocol):
    frame_timeout_s: float  # a partial TCP frame older than this closes the connection


class ServerState(Protocol):
    @property
    def options(self) -> FrameOptions:
        """The server's options (read-only here)."""

    model: str
    max_seq: int
    tokenizer: Any  # the bundle's BundleTokenizer, or None
    encoder: Any  # prompts.PromptEncoder, or None without a tokenizer
    grammars: Any  # constraints.Grammars: grammars checked against the tokenizer, or None (none constrain)
    frame_key: bytes | None  # the frame MAC key (from --api-key), or None
    engine: EnginePool  # the engines (one per --devices part), routed between
    metrics: ServerMetrics
    per_api: dict[str, Any]  # metric children per API
    tokenizing: set[Any]  # generate.HttpGeneration: requests whose prompt is being tokenized
    frame_connections: set[Any]

    @property
    def accepting(self) -> bool:
        """The engine is up and the server is not draining."""

    def unavailable(self) -> ApiError:
        """The 503 for a request the engine cannot take now, saying why."""

    def check_accepting(self) -> None:
        """Raises `unavailable()` unless accepting."""

    def id_headers(self, reply_id: str) -> bytes:
        """The request-id headers of one reply."""

    def authorized(self, req: HttpRequest) -> bool:
        """The request carries the API key (or none is set)."""
