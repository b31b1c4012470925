"""zlc's error types. Everything zlc raises on bad input derives from ZlcError, so the CLI can
print one clear line (no traceback unless --debug) and callers can catch one type."""

from __future__ import annotations


class ZlcError(Exception):
    """Base class for every error zlc reports to a user."""

    exit_code = 1


class ModelFormatError(ZlcError):
    """The model file is unreadable, truncated, or not a valid ONNX/torch model."""


class UnsupportedOpError(ZlcError):
    """An op the frontend cannot lower: names the op, domain, opset and node."""

    def __init__(self, op: str, domain: str, opset: int, node: str, supported: list[str] | None = None):
        self.op, self.domain, self.opset, self.node = op, domain, opset, node
        dom = domain or "ai.onnx"
        msg = f"unsupported op {dom}::{op} (opset {opset}) at node '{node}'"
        if supported:
            msg += f"; supported in {dom}: {', '.join(sorted(supported))}"
        super().__init__(msg)


class IRError(ZlcError):
    """A malformed IR graph (verifier failure, cycle, dangling value, bad text form)."""


class ShapeError(IRError):
    """Shapes or dtypes of a node's inputs do not fit the op."""


class NotADecoderError(ZlcError):
    """The model does not look like a decoder-only language model (token ids in, logits out)."""


class PassError(ZlcError):
    """A compiler pass could not complete (e.g. KV-cache synthesis on un-raised attention)."""


class VerificationError(ZlcError):
    """zlc's result differs from the reference beyond tolerance."""

    exit_code = 3  # distinct from 2, click's usage errors, so CI can tell the two apart
