"""zlc: a static-graph fusion compiler for transformer LLMs.

    import zlc
    lowered = zlc.lower("model.onnx", options=zlc.CompileOptions(max_seq=256))
    report = zlc.verify("model.onnx", steps=32)          # against ONNX Runtime
    ids = zlc.ReferenceSession.from_lowered(lowered).generate([1, 2, 3], max_new_tokens=8)
    zlc.compile("model.onnx", targets=["a10", "h100"], out="model.zlc")   # the artifact bundle
    new_ids = zlc.load("model.zlc").generate([1, 2, 3], max_new_tokens=8, device="cpu")

Only the error types are imported eagerly: the rest pulls in torch, ONNX and ONNX Runtime, which
take seconds to import, so `import zlc` (and `zlc --help`) stay fast and the heavy modules load on
first use (PEP 562 module `__getattr__`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    IRError,
    ModelFormatError,
    NotADecoderError,
    PassError,
    ShapeError,
    UnsupportedOpError,
    VerificationError,
    ZlcError,
)
from .version import __version__

# public name -> (module, attribute), resolved on first access
_LAZY: dict[str, tuple[str, str]] = {
    "lower": ("zlc.driver", "lower"),
    "load_model": ("zlc.driver", "load_model"),
    "CompileOptions": ("zlc.driver", "CompileOptions"),
    "Lowered": ("zlc.driver", "Lowered"),
    "STAGES": ("zlc.driver", "STAGES"),
    "verify": ("zlc.verifier", "verify"),
    "VerifyReport": ("zlc.verifier", "VerifyReport"),
    "ReferenceSession": ("zlc.reference.session", "ReferenceSession"),
    "compile": ("zlc.build", "compile"),
    "CompileResult": ("zlc.build", "CompileResult"),
    "load": ("zlc.runtime.loader", "load"),
    "Bundle": ("zlc.runtime.loader", "Bundle"),
}

if TYPE_CHECKING:  # static checkers see the real names
    from zlc.reference.session import ReferenceSession
    from zlc.runtime.loader import Bundle, load

    from .build import CompileResult, compile
    from .driver import STAGES, CompileOptions, Lowered, load_model, lower
    from .verifier import VerifyReport, verify


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'zlc' has no attribute '{name}'")
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "__version__", "lower", "load_model", "CompileOptions", "Lowered", "STAGES", "verify", "VerifyReport",
    "ReferenceSession", "compile", "CompileResult", "load", "Bundle", "ZlcError", "ModelFormatError", "UnsupportedOpError", "IRError", "ShapeError",
    "NotADecoderError", "PassError", "VerificationError",
]
