"""The `zlc` command line (click + rich): compile, verify, inspect, run and serve models and bundles,
and set up hosts to serve them (deploy).

One module per command family (verify, inspect, compile, run, serve, deploy); each registers its
commands on the `cli` group of `common`, which also holds the error handling (one line per error,
exit codes), the consoles and the shared options. Importing the families here registers them.

Heavy imports (torch, ONNX, ONNX Runtime, the compiler) happen inside the commands, so `zlc --help`
is instant.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import compile, deploy, inspect, run, serve, verify  # noqa: F401 - registers the commands
from .common import (
    EXIT_BROKEN_PIPE,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    STAGE_NAMES,
    ZlcGroup,
    cli,
)

__all__ = ["cli", "main", "ZlcGroup", "STAGE_NAMES", "EXIT_USAGE", "EXIT_INTERNAL", "EXIT_INTERRUPTED",
           "EXIT_BROKEN_PIPE"]


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (`zlc = zlc.cli:main`)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="zlc")
