"""The zoo's export cache: every graph exports once, then comes from disk.

Everything exports once per (kind, family, opset, seed, torch/transformers/builder versions) into
``$ZLC_CACHE_DIR`` (default ``~/.cache/zlc/zoo``): see :func:`cached`. Files are written to a temp
file and renamed into place under a per-key file lock, so parallel test workers never see a
half-written export and export each graph once.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from zlc.testing.export import export_optimum_kv, export_stateless
from zlc.testing.families import FAMILIES
from zlc.testing.genai import build_genai

log = logging.getLogger(__name__)

#: Bump when the export code changes in a way that alters the produced graphs (invalidates caches).
ZOO_VERSION = 1


_KINDS: dict[str, Callable[[str, Path, int, int], Path]] = {
    "stateless": lambda f, p, o, s: export_stateless(f, p, o, seed=s),
    "stateless_sdpa": lambda f, p, o, s: export_stateless(f, p, o, seed=s, attn_implementation="sdpa"),
    "stateless_f16": lambda f, p, o, s: export_stateless(f, p, o, seed=s, dtype="float16"),
    "stateless_bf16": lambda f, p, o, s: export_stateless(f, p, o, seed=s, dtype="bfloat16"),
    "optimum_kv": lambda f, p, o, s: export_optimum_kv(f, p, o, seed=s, exporter="torchscript"),
    "optimum_kv_dynamo": lambda f, p, o, s: export_optimum_kv(f, p, o, seed=s, exporter="dynamo"),
    "genai": lambda f, p, o, s: build_genai(f, p, variant="gqa", seed=s),
    "genai_rope": lambda f, p, o, s: build_genai(f, p, variant="gqa_rope", seed=s),
    "genai_mha": lambda f, p, o, s: build_genai(f, p, variant="mha", seed=s),
    "genai_int4": lambda f, p, o, s: build_genai(f, p, variant="int4", seed=s),
}
#: Every kind :func:`cached` accepts.
KINDS: tuple[str, ...] = tuple(_KINDS)


def cache_dir() -> Path:
    """``$ZLC_CACHE_DIR`` or ``~/.cache/zlc/zoo``."""
    env = os.environ.get("ZLC_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zlc" / "zoo"


def versions(kind: str) -> str:
    """The tool versions an export of ``kind`` depends on, as a file-name part (cache keys)."""
    import torch
    import transformers

    parts = [f"torch{torch.__version__}", f"tf{transformers.__version__}", f"zoo{ZOO_VERSION}"]
    if kind.startswith("genai"):
        parts.append(f"ortgenai{importlib.metadata.version('onnxruntime-genai')}")
    return "-".join(parts).replace("+", "_").replace("/", "_")


def cache_key(kind: str, family: str, opset: int = 20, seed: int = 0) -> str:
    """File name (without directory) :func:`cached` uses for this export."""
    op = "opNA" if kind.startswith("genai") else f"op{opset}"
    return f"{kind}-{family}-{op}-s{seed}-{versions(kind)}.onnx"


def cached(kind: str, family: str, opset: int = 20, *, seed: int = 0) -> Path:
    """Path to the ``kind`` export of ``family`` at ``opset``, exporting it on first use.

    ``kind`` is one of :data:`KINDS`; ``opset`` is ignored by the genai kinds (the builder picks
    it). Files live in :func:`cache_dir`, keyed by kind, family, opset, seed and the versions of
    torch, transformers (and onnxruntime-genai). Written atomically (temp file + rename) under a
    per-key file lock, so parallel test workers export each graph once.
    """
    if kind not in _KINDS:
        raise KeyError(f"unknown kind {kind!r}; known: {KINDS}")
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / cache_key(kind, family, opset, seed)
    if path.exists():
        return path
    with file_lock(path.with_suffix(".lock")):
        if path.exists():
            return path
        fd, tmp_name = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=d)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            log.info("zoo: exporting %s %s opset %s -> %s", kind, family, opset, path)
            _KINDS[kind](family, tmp, opset, seed)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (created if missing), so parallel test workers export
    each graph once."""
    try:
        import fcntl
    except ImportError:  # not POSIX: atomic rename alone still keeps the cache consistent
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)

