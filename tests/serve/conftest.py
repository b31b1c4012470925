"""`zlc serve` tests: one server per module on the fast CPU executor (fixtures `chat_bundle`,
`start_server` and the ServerProcess class live in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def server(chat_bundle: Path, server_process: Any) -> Iterator[Any]:
    """A server on the fast CPU executor (the bundle's IR with torch), shared by a test module."""
    s = server_process(chat_bundle, "--device", "reference", "--request-timeout", "2")
    yield s
    s.stop()
