"""The compile cache: native libraries and cubins stored by a content key (the rendered kernel
source, the toolchain's versions, flags and target), so that compiling a model again, or another
model with the same shapes and features, copies them instead of running the C compiler or ptxas.

Where: $ZLC_KERNEL_CACHE, else $XDG_CACHE_HOME/zlc/kernels, else ~/.cache/zlc/kernels
("none" turns it off, as `zlc compile --no-cache` does). Size: $ZLC_KERNEL_CACHE_SIZE (bytes, or
with a K/M/G suffix; default 2G); past it the least recently used entries go.

An entry is a directory `<key[:2]>/<key>/` with its files and `entry.json`, which records each
file's sha256: a reader checks them, so a corrupted entry is found, removed and rebuilt, never
copied into a bundle. Writers build an entry in a temporary directory and rename it into place
(a reader sees the whole entry or none). A cache directory that is read-only or full turns the
cache off for the rest of the compile, said in one line; the compile goes on without it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_LIMIT", "KernelCache", "content_key", "default_root", "parse_size"]

ENTRY = "entry.json"
DEFAULT_LIMIT = 2 << 30
FORMAT = 1  # bump when an entry's layout changes: old entries become misses


def default_root() -> Path | None:
    """The cache directory the environment names (None: turned off)."""
    env = os.environ.get("ZLC_KERNEL_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "none") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zlc" / "kernels"


def parse_size(text: str) -> int:
    """'2G', '500M', '64k', '1048576' -> bytes; ValueError naming the text otherwise."""
    s = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    try:
        n = float(s[:-1] if mult > 1 else s) * mult
    except ValueError:
        raise ValueError(f"ZLC_KERNEL_CACHE_SIZE={text!r} is not a size (bytes, or a number with K, M or G)") from None
    if n < 0:
        raise ValueError(f"ZLC_KERNEL_CACHE_SIZE={text!r} is negative")
    return int(n)


def content_key(*parts: str | bytes) -> str:
    """sha256 over the parts (each ended by a NUL, so ('ab', 'c') and ('a', 'bc') differ)."""
    h = hashlib.sha256(str(FORMAT).encode() + b"\0")
    for p in parts:
        h.update((p if isinstance(p, bytes) else p.encode()) + b"\0")
    return h.hexdigest()


@dataclass
class KernelCache:
    """One compile's view of the cache: lookups, stores, and what came from where (`record`)."""

    root: Path | None
    limit: int = DEFAULT_LIMIT
    say: Callable[[str], None] | None = None  # one line for the user (read-only, full, corrupted)
    off: str | None = None  # why the cache is not used (None: it is)
    record: dict[str, bool] = field(default_factory=dict)  # bundle path -> came from the cache
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def open(cls, enabled: bool = True, say: Callable[[str], None] | None = None,
             root: Path | None = None) -> KernelCache:
        """The cache for one compile: `enabled` False (--no-cache) or the environment's "none"
        give one that is off; a directory that cannot be created or written gives one that is off
        and says why in one line."""
        if not enabled:
            return cls(None, off="--no-cache")
        root = root if root is not None else default_root()
        if root is None:
            return cls(None, off="ZLC_KERNEL_CACHE=none")
        env = os.environ.get("ZLC_KERNEL_CACHE_SIZE")
        cache = cls(root, parse_size(env) if env else DEFAULT_LIMIT, say)
        try:  # a write, not os.access: a read-only mount refuses root too, and a full disk only a write
            root.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=root, prefix=".probe.") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            cache._turn_off(e)
        return cache

    @property
    def on(self) -> bool:
        return self.root is not None and self.off is None

    def _turn_off(self, e: OSError) -> None:
        with self._lock:
            if self.off is not None:
                return
            self.off = f"{self.root} is not writable ({e.strerror or e})"
        if self.say is not None:
            self.say(f"kernel cache {self.off}: compiling without it")

    def _dir(self, key: str) -> Path:
        assert self.root is not None
        return self.root / key[:2] / key

    def get(self, key: str, what: str) -> dict[str, bytes] | None:
        """The entry's files by name, each checked against its recorded sha256, or None (a miss,
        a corrupted entry: removed, so the caller's rebuild replaces it). `what` names it in the
        line a corrupted entry gets."""
        if not self.on:
            return None
        d = self._dir(key)
        try:
            text = (d / ENTRY).read_text()
        except FileNotFoundError:
            return None  # a miss
        except OSError:
            text = ""
        files: dict[str, bytes] = {}
        try:
            listed: dict[str, Any] = json.loads(text)["files"]
            for name in listed:
                with contextlib.suppress(OSError):
                    files[name] = (d / name).read_bytes()
            bad = [n for n, info in listed.items()
                   if n not in files or hashlib.sha256(files[n]).hexdigest() != info["sha256"]]
        except (ValueError, KeyError, TypeError, AttributeError):  # unreadable metadata
            bad = []
        if bad or not files:
            if self.say is not None:
                self.say(f"kernel cache: entry {key[:12]} ({what}) is corrupted ({', '.join(bad) or ENTRY} "
                         "fails its sha256): rebuilding it")
            shutil.rmtree(d, ignore_errors=True)
            return None
        try:
            os.utime(d / ENTRY)  # last use, for the LRU eviction
        except OSError:
            pass
        return files

    def put(self, key: str, files: Mapping[str, bytes], info: Mapping[str, Any] | None = None) -> None:
        """Stores an entry atomically, then evicts past the size limit. A read-only or full cache
        turns the cache off (one line); another writer that got there first wins."""
        if not self.on:
            return
        d = self._dir(key)
        meta = {"format": FORMAT, "info": dict(info or {}),
                "files": {n: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for n, b in files.items()}}
        try:
            d.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=d.parent, prefix=f".{key[:12]}."))
        except OSError as e:
            self._turn_off(e)
            return
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            (tmp / ENTRY).write_text(json.dumps(meta, indent=1))
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            self._turn_off(e)
            return
        try:
            os.rename(tmp, d)  # fails when another compile stored the same entry first: theirs stays
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
        self.evict()

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, directory) of every entry."""
        out: list[tuple[float, int, Path]] = []
        if self.root is None or not self.root.is_dir():
            return out
        for d in self.root.glob("??/*"):
            try:
                if d.name.startswith("."):
                    continue
                size = sum(f.stat().st_size for f in d.iterdir())
                out.append(((d / ENTRY).stat().st_mtime, size, d))
            except OSError:  # being written or removed by another compile
                continue
        return out

    def evict(self) -> None:
        """Removes the least recently used entries until the cache is within its limit."""
        with self._lock:
            found = sorted(self.entries())
            total = sum(s for _, s, _ in found)
            for _, size, d in found:
                if total <= self.limit:
                    break
                shutil.rmtree(d, ignore_errors=True)
                total -= size

    def note(self, path: str, hit: bool) -> None:
        with self._lock:
            self.record[path] = hit

    def manifest(self) -> dict[str, Any]:
        """The manifest's `cache` entry: where, whether on, and which artifacts came from it."""
        return {"dir": str(self.root) if self.root is not None else None, "off": self.off,
                "hits": sorted(p for p, h in self.record.items() if h),
                "built": sorted(p for p, h in self.record.items() if not h)}
