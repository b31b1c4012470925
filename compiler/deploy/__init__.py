"""TEMPORARY face during the house move (split pending)."""
from typing import Any

from . import host


def __getattr__(name: str) -> Any:
    return getattr(host, name)
