"""The artifact bundle: a directory with the megakernel, its tables, weights and a manifest.

    manifest.json            format version, model, IR hash, dtypes, kernel entry + parameters,
                             tilings (task tables, arena layout), targets (cubins, resources,
                             roofline), native (libraries), verification, tokenizer, sha256 of
                             every other file
    kernel.py                the generated Triton source: both kernels (STEP: prefill, decode),
                             every tiling
    weights.safetensors      W (matrix weights, bf16 or f32) and P (f32 norms, biases, rotary)
                             arenas, laid out as the kernel reads them
    tables/<tiling>.safetensors   task table, op descriptors (int64, f32); tilings cpu, gpu, native
    tables/<tiling>.json     the same tables, readable (labels, waits, signals)
    kernels/<target>.cubin, .ptx, .prefill.cubin, .prefill.ptx   per GPU target: decode, prefill
    native/<isa level>.so    the native CPU kernel per ISA level, and its C source
    native/<level>.weights   with --target cpu: W and Q in that level's panel layout, mapped by its
                             sessions instead of copied (one level: the compiling host's best)
    ir/prefill.zir, ir/decode.zir the raised IR the kernels were scheduled from
    tokenizer/               tokenizer.json + tokenizer_config.json (optional)
    deploy/                  the XDP program; host setup files from `zlc deploy build`

`load()` refuses a bundle whose format version it does not know or whose files do not match
their checksums: a tampered or half-copied bundle never reaches a GPU. At load every file's size is
checked, small files are hashed whole and large ones (the weights) by a sample of their blocks
(`quick_check`: hashing SmolLM2's weights alone takes longer than a session start may);
`verify_checksums` (`zlc inspect BUNDLE`, `zlc.load(path, full_check=True)`) hashes everything.

This module is the whole format: the files and their checksums; the encoding of the task tables and
the control block that the kernel and every executor share is zlc.abi's (re-exported here). Codegen
writes the bundle, executors read it; neither imports the other.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

# The layouts the kernels and every executor share (op kinds, the task table, the control block,
# the batch block, the counters) are declared in zlc.abi; the bundle's readers find them here too.
from .abi.tables import (  # noqa: F401, E402 (re-exported)
    BATCH_CAP,
    BATCH_HEADER,
    BATCH_KV_BASE,
    BATCH_N_DESC,
    BATCH_N_LROWS,
    BATCH_PAGE_SIZE,
    BATCH_TOK_FLOATS,
    CNT_EVENTS,
    CNT_EXIT,
    CNT_QUEUE,
    CTRL_ALL_LOGITS,
    CTRL_AUTO_ADVANCE,
    CTRL_BATCH,
    CTRL_ERR_EVENT,
    CTRL_ERR_ROW,
    CTRL_ERR_SEEN,
    CTRL_ERR_TARGET,
    CTRL_ERROR,
    CTRL_MODE,
    CTRL_OUT_TOKEN,
    CTRL_PAST,
    CTRL_T,
    CTRL_TOKENS,
    DESC_FLOATS,
    DESC_WORDS,
    ERROR_WAIT_TIMEOUT,
    HEADER_WORDS,
    MAX_WAITS,
    MODE_DECODE,
    MODE_PREFILL,
    OP_ARGMAX,
    OP_ATTENTION,
    OP_ATTN_COMBINE,
    OP_CACHE_APPEND,
    OP_EMBED,
    OP_LINEAR,
    OP_NAMES,
    OP_ROW_NORM,
    TASK_WORDS,
    TRACE_WORDS,
)
from .errors import ZlcError

# ---- files ----------------------------------------------------------------------------------

FORMAT = "zlc-bundle"
# 2: two kernels per GPU target (targets.<t> is the decode kernel, targets.<t>.prefill the
# prefill one), descriptors of DESC_WORDS = 24
FORMAT_VERSION = 2
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


# The quick check (`quick_check`, at every load): files up to WHOLE_LIMIT bytes are hashed whole;
# larger ones by sha256 of their size and SAMPLES blocks of SAMPLE_BYTES spread evenly from the
# first byte to the last (1 MiB of each of SmolLM2's 270 MB weight files, instead of all 540 MB).
WHOLE_LIMIT = 16 << 20
SAMPLES, SAMPLE_BYTES = 64, 16 << 10


def sampled_sha256(path: Path) -> str:
    """sha256 of the file's size and SAMPLES blocks spread over it (first and last included):
    catches a truncated, extended, replaced or half-copied file, not a few bytes changed
    between the samples (the full check does)."""
    size = path.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    last = max(size - SAMPLE_BYTES, 0)
    with open(path, "rb") as f:
        for i in range(SAMPLES):
            f.seek(last * i // (SAMPLES - 1))
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def quick_sums(root: Path, rels: Iterable[str]) -> tuple[dict[str, int], dict[str, str]]:
    """(size of each file, sampled sha256 of each file over WHOLE_LIMIT): the manifest's
    `file_bytes` and `file_samples`."""
    sizes = {rel: (root / rel).stat().st_size for rel in rels}
    return sizes, {rel: sampled_sha256(root / rel) for rel, n in sizes.items() if n > WHOLE_LIMIT}


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """Adds the checksums of every file in the bundle and writes manifest.json."""
    manifest = dict(manifest, format=FORMAT, format_version=FORMAT_VERSION)
    manifest["files"] = {p.relative_to(root).as_posix(): sha256_file(p) for p in bundle_files(root)}
    manifest["file_bytes"], manifest["file_samples"] = quick_sums(root, manifest["files"])
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")


def read_manifest(root: Path, *, check: bool = False, full: bool = False) -> dict[str, Any]:
    """The bundle's manifest; `check`: after `quick_check` (sizes, small files hashed, large ones
    sampled), `full`: after `verify_checksums` (every byte hashed)."""
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
    if full:
        verify_checksums(root, man)
    elif check:
        quick_check(root, man)
    return man


def quick_check(root: Path, man: dict[str, Any]) -> None:
    """What a load checks: every listed file is there with its recorded size and nothing else is;
    files the manifest has a sampled sha256 for (`file_samples`, over WHOLE_LIMIT) match it, every
    other file matches its full sha256 (a bundle from before the samples is hashed whole)."""
    verify_checksums(root, man, full=False)


def verify_checksums(root: Path, man: dict[str, Any], *, full: bool = True) -> None:
    """Every listed file is present, has its size and sha256 (`full=False`: the sampled sha256
    where the manifest has one), and no file is unlisted. One-line BundleError otherwise."""
    files = man.get("files")
    if not isinstance(files, dict) or not files:
        raise BundleError(f"{root}: the manifest lists no files")
    sizes: dict[str, int] = man.get("file_bytes") or {}
    samples: dict[str, str] = {} if full else (man.get("file_samples") or {})
    for rel, digest in files.items():
        p = root / rel
        if not p.is_file():
            raise BundleError(f"{root}: {rel} is missing (the bundle is incomplete)")
        if rel in sizes and p.stat().st_size != sizes[rel]:
            raise BundleError(f"{root}: {rel} does not match its sha256 in the manifest: {p.stat().st_size} "
                              f"bytes, it says {sizes[rel]} (truncated or modified)")
        if rel in samples:
            if sampled_sha256(p) != samples[rel]:
                raise BundleError(f"{root}: {rel} does not match its sampled sha256 in the manifest "
                                  "(modified or corrupt)")
        elif sha256_file(p) != digest:
            raise BundleError(f"{root}: {rel} does not match its sha256 in the manifest (modified or corrupt)")
    extra = [p.relative_to(root).as_posix() for p in bundle_files(root)
             if p.relative_to(root).as_posix() not in files]
    if extra:
        raise BundleError(f"{root}: {extra[0]} is not listed in the manifest (the bundle was modified)")


def atomic_write(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Writes a file so that a reader sees the old content or the new, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_files(bundle: Path | str, files: Mapping[str, bytes], *, remove: Iterable[str] = (),
              modes: Mapping[str, int] | None = None) -> None:
    """Writes `files` ({relative path: bytes}) into a finished bundle and records their sha256 in
    its manifest, after deleting the files in `remove` (and their manifest entries), so `zlc.load`
    still verifies the bundle. The bundle's checksums are checked first: a tampered bundle is
    refused, never re-blessed. Replacing the weights file removes the native kernel's mapped
    layouts derived from it. Modes default to 0644."""
    root = Path(bundle)
    man = read_manifest(root)
    verify_checksums(root, man)
    if man.get("weights", {}).get("file") in files:
        # the native kernel's mapped layouts are derived from the weights: stale once they change,
        # so they go, and sessions lay the new weights out themselves (docs/artifact.md)
        for entry in man.get("native", {}).get("levels", {}).values():
            if "weights" in entry:
                remove = [*remove, entry.pop("weights")["file"]]
    listed: dict[str, str] = dict(man["files"])
    for rel in [*remove, *files]:
        parts = Path(rel).parts
        if Path(rel).is_absolute() or ".." in parts or not parts or rel == MANIFEST:
            raise BundleError(f"not a path inside a bundle: {rel!r}")
    for rel in remove:
        (root / rel).unlink(missing_ok=True)
        listed.pop(rel, None)
    for rel, data in files.items():
        atomic_write(root / rel, data, (modes or {}).get(rel, 0o644))
        listed[rel] = sha256_file(root / rel)
    # empty folders a removal left behind (rmdir only succeeds on empty ones)
    for d in sorted({(root / r).parent for r in remove}, key=lambda d: -len(d.parts)):
        while d != root and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
    man["files"] = dict(sorted(listed.items()))
    man["file_bytes"], man["file_samples"] = quick_sums(root, man["files"])
    atomic_write(root / MANIFEST, (json.dumps(man, indent=1) + "\n").encode())


# ---- numerics (shared/DESIGN.md "numerics") --------------------------------------------------------
# What a bundle computes, one option for every target (`zlc compile --numerics`, the manifest's
# `numerics`, shown by `zlc inspect`). exact: f32 math on the stored weights (the CI oracle). fast:
# what the hardware's servers do; on the CPU, llama.cpp's arithmetic for block-quantized matrices:
# each Linear input row rounded to 8 bits per block of 32 (Q8_0), integer dot products against the
# blocks' quants, f32 per-block scaling. The reference executor emulates the same rounding
# (reference/numerics.py), so each mode has its oracle. Here, below codegen, the runtime and the
# reference, so that all of them read one definition.
NUMERICS = ("exact", "fast")
#: the packed formats (ir/quant.py names) whose Linears take 8-bit activations under `fast` on the
#: CPU; the other formats and dense matrices stay exact
CPU_FAST_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def check_numerics(name: str, gpu_targets: Iterable[str] = ()) -> str:
    """`name` when it is one of NUMERICS (and `fast` has no GPU target yet), else a one-line ZlcError."""
    if name not in NUMERICS:
        raise ZlcError(f"unknown numerics '{name}'; choose one of {', '.join(NUMERICS)}")
    gpus = list(gpu_targets)
    if name == "fast" and gpus:
        raise ZlcError(f"--numerics fast is built for the native CPU kernel only so far: compile {', '.join(gpus)} "
                       "without it")
    return name
