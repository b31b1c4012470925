"""Silence for the exporters: torch.onnx, transformers and onnxscript print, warn and draw progress
bars freely, which would bury test output; the zoo runs them under :func:`quiet` and keeps what they
said at debug level."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings
from collections.abc import Iterator

log = logging.getLogger(__name__)

_NOISY = ("torch.onnx", "torch.export", "torch._dynamo", "torch.fx", "transformers", "onnxscript", "onnx_ir")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence exporter/transformers chatter: warnings, noisy loggers, progress bars, stray prints."""
    saved = {n: logging.getLogger(n).level for n in _NOISY}
    env_saved = {k: os.environ.get(k) for k in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    out, err = io.StringIO(), io.StringIO()
    try:
        for n in _NOISY:
            logging.getLogger(n).setLevel(logging.ERROR)
        os.environ["TQDM_DISABLE"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("ignore")
            yield
    finally:
        for n, lvl in saved.items():
            logging.getLogger(n).setLevel(lvl)
        for k, v in env_saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        text = (out.getvalue() + err.getvalue()).strip()
        if text:
            log.debug("suppressed output:\n%s", text[-8000:])
