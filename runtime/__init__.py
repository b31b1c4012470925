"""zlc runtime: executors for compiled graphs (the reference executor is the oracle), and the
request/result rings between ingress and the kernel (``zlc.runtime.rings``).

The reference executor pulls in torch; it loads on first use (PEP 562 module ``__getattr__``), so
processes that only need the rings (ingress) import this package in milliseconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["ReferenceExecutor", "run_graph"]

if TYPE_CHECKING:  # static checkers see the real names
    from .reference import ReferenceExecutor, run_graph


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import reference

        return getattr(reference, name)
    raise AttributeError(f"module 'zlc.runtime' has no attribute '{name}'")
