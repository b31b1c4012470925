"""zlc: a static-graph fusion compiler for transformer LLMs."""

from .errors import ZlcError

__version__ = "0.1.0"

__all__ = ["ZlcError", "__version__"]
