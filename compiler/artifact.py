"""The artifact bundle: a directory with the megakernel, its tables, weights and a manifest.

    manifest.json            format version, model, IR hash, dtypes, kernel entry + parameters,
                             tilings (task tables, arena layout), targets (cubin, resources,
                             roofline), verification, tokenizer, sha256 of every other file
    kernel.py                the generated Triton source (one kernel for every tiling)
    weights.safetensors      W (matrix weights, bf16 or f32) and P (f32 norms, biases, rotary)
                             arenas, laid out as the kernel reads them
    tables/<tiling>.safetensors   task table, op descriptors (int64, f32)
    tables/<tiling>.json     the same tables, readable (labels, waits, signals)
    kernels/<target>.cubin, .ptx  per GPU target
    ir/prefill.zir, ir/decode.zir the raised IR the kernel was scheduled from
    tokenizer/               tokenizer.json + tokenizer_config.json (optional)

`load()` refuses a bundle whose format version it does not know or whose files do not match
their checksums: a tampered or half-copied bundle never reaches a GPU.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import ZlcError

FORMAT = "zlc-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class BundleError(ZlcError):
    """A bundle that is missing, from an unknown format version, or does not match its checksums."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def bundle_files(root: Path) -> Iterator[Path]:
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            yield p


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Adds the checksums of every file in the bundle and writes manifest.json."""
    manifest = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION)
    manifest["files"] = {p.relative_to(root).as_posix(): sha256_file(p) for p in bundle_files(root)}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")


def read_manifest(root: Path, *, check: bool = False) -> dict[str, Any]:
    root = Path(root)
    mpath = root / MANIFEST
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory (run `zlc compile MODEL -o {root}`)")
    if not mpath.is_file():
        raise BundleError(f"{root}: no {MANIFEST}; not a zlc bundle")
    try:
        man = json.loads(mpath.read_text())
    except (OSError, ValueError) as e:
        raise BundleError(f"{mpath}: unreadable manifest ({e})") from e
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise BundleError(f"{mpath}: not a zlc bundle manifest")
    if man.get("format_version") != FORMAT_VERSION:
        raise BundleError(f"{root}: bundle format version {man.get('format_version')!r}; this zlc reads "
                          f"version {FORMAT_VERSION} (recompile the model with this zlc)")
    if check:
        verify_checksums(root, man)
    return man


def verify_checksums(root: Path, man: dict[str, Any]) -> None:
    files = man.get("files")
    if not isinstance(files, dict) or not files:
        raise BundleError(f"{root}: the manifest lists no files")
    for rel, digest in files.items():
        p = root / rel
        if not p.is_file():
            raise BundleError(f"{root}: {rel} is missing (the bundle is incomplete)")
        if sha256_file(p) != digest:
            raise BundleError(f"{root}: {rel} does not match its sha256 in the manifest (modified or corrupt)")
    extra = [p.relative_to(root).as_posix() for p in bundle_files(root)
             if p.relative_to(root).as_posix() not in files]
    if extra:
        raise BundleError(f"{root}: {extra[0]} is not listed in the manifest (the bundle was modified)")
