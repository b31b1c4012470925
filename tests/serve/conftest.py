"""`zlc serve` tests' shared fixtures: one server per module on the fast CPU executor, the chat bundle
loaded in-process and a reference session of it (the oracles). `chat_bundle`, `start_server` and the
ServerProcess class live in tests/conftest.py; plain helpers (SDK clients, a refused `zlc serve`,
/metrics) in serve_helpers.py."""

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


@pytest.fixture(scope="module")
def bundle(chat_bundle: Path) -> Any:
    """The chat bundle loaded in this process (zlc.load): its tokenizer, EOS ids and executors."""
    import zlc

    return zlc.load(chat_bundle)


@pytest.fixture(scope="module")
def session(bundle: Any) -> Iterator[Any]:
    """A reference-executor session of `bundle`, shared by a module (stateful: stream() and reset()
    start each use afresh)."""
    with bundle.session("reference") as s:
        yield s
