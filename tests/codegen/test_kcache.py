"""The compile cache (codegen/kcache.py) on real directories: entries checked by their sha256
(a corrupted one is removed and reported), LRU eviction past the size limit, and a read-only or
full cache directory (real tmpfs mounts in a private mount namespace) turning the cache off in
one line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zlc.codegen.kcache import KernelCache, content_key, default_root, parse_size


def test_roundtrip_and_keys(tmp_path: Path) -> None:
    said: list[str] = []
    c = KernelCache.open(root=tmp_path / "kc", say=said.append)
    assert c.on and said == []
    k = content_key("native", "src", "cc 13")
    assert k != content_key("native", "srccc 13") and k != content_key("native", "src", "cc 14")
    assert c.get(k, "x") is None
    c.put(k, {"lib.so": b"\x7fELF" + bytes(range(256))}, {"kind": "native"})
    assert c.get(k, "x") == {"lib.so": b"\x7fELF" + bytes(range(256))}
    assert not [p for p in (tmp_path / "kc").rglob(".*") if p.is_dir()]  # no temporary entry left behind
    assert said == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "metadata"])
def test_corrupted_entry_is_found_by_its_hash(tmp_path: Path, damage: str) -> None:
    said: list[str] = []
    c = KernelCache.open(root=tmp_path, say=said.append)
    k = content_key("aot", "kernel")
    c.put(k, {"sm_86.ptx": b"ptx " * 100, "sm_86.0.cubin": b"cubin" * 100})
    d = tmp_path / k[:2] / k
    f = d / ("entry.json" if damage == "metadata" else "sm_86.0.cubin")
    if damage == "flip":
        data = bytearray(f.read_bytes())
        data[17] ^= 1
        f.write_bytes(bytes(data))
    elif damage == "truncate":
        f.write_bytes(f.read_bytes()[:-1])
    elif damage == "delete":
        f.unlink()
    else:
        f.write_text("{not json")
    assert c.get(k, "decode for a10") is None
    assert len(said) == 1 and said[0].startswith(f"kernel cache: entry {k[:12]} (decode for a10) is corrupted")
    assert "rebuilding it" in said[0] and "\n" not in said[0]
    assert not d.exists()  # removed: the rebuild stores a good one
    c.put(k, {"sm_86.ptx": b"ptx", "sm_86.0.cubin": b"good"})
    assert c.get(k, "x") == {"sm_86.ptx": b"ptx", "sm_86.0.cubin": b"good"}


def test_lru_eviction_past_the_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZLC_KERNEL_CACHE_SIZE", "10K")
    c = KernelCache.open(root=tmp_path)
    assert c.limit == 10 << 10
    keys = [content_key(str(i)) for i in range(4)]
    for i, k in enumerate(keys[:3]):
        c.put(k, {"f": bytes(3000)})
        os.utime(tmp_path / k[:2] / k / "entry.json", (1000 + i, 1000 + i))  # used in that order
    assert c.get(keys[0], "x") is not None  # now the most recently used
    c.put(keys[3], {"f": bytes(3000)})  # 4 x ~3 KB > 10 KB: the least recently used (keys[1]) goes
    assert [c.get(k, "x") is not None for k in keys] == [True, False, True, True]
    assert sum(s for _, s, _ in c.entries()) <= c.limit


def test_sizes_and_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_size("2G") == 2 << 30 and parse_size("500m") == 500 << 20 and parse_size("1024") == 1024
    with pytest.raises(ValueError, match="ZLC_KERNEL_CACHE_SIZE='lots' is not a size"):
        parse_size("lots")
    monkeypatch.delenv("ZLC_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_root() == tmp_path / "xdg" / "zlc" / "kernels"
    monkeypatch.setenv("ZLC_KERNEL_CACHE", str(tmp_path / "mine"))
    assert default_root() == tmp_path / "mine"
    monkeypatch.setenv("ZLC_KERNEL_CACHE", "none")
    assert default_root() is None and KernelCache.open().off == "ZLC_KERNEL_CACHE=none"
    assert KernelCache.open(enabled=False).off == "--no-cache"


# Runs in a private mount namespace: the cache directory is a tmpfs mounted read-only, or one
# too small for the entry. Prints what the cache said and whether it is still on.
_MOUNTED = """
import sys
from pathlib import Path
from zlc.codegen.kcache import KernelCache, content_key
said = []
c = KernelCache.open(root=Path(sys.argv[1]), say=said.append)
c.put(content_key("big"), {"lib.so": bytes(1 << 20)})
print(repr((c.on, said, c.get(content_key("big"), "x") is None)))
"""


def _in_mount(tmp_path: Path, options: str) -> tuple[bool, list[str], bool]:
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this host")
    d = tmp_path / "kc"
    d.mkdir()
    script = tmp_path / "probe.py"
    script.write_text(_MOUNTED)
    # unshare -r: a user namespace when we are not root, so the mount needs no privileges
    flags = ["-m"] if os.geteuid() == 0 else ["-rm"]
    cmd = ["unshare", *flags, "sh", "-c", f'mount -t tmpfs -o {options} tmpfs "$1" && exec "$2" "$3" "$1"',
           "sh", str(d), sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    on, said, missed = eval(proc.stdout.strip().splitlines()[-1])
    return on, said, missed


def test_read_only_cache_directory_compiles_without_it(tmp_path: Path) -> None:
    on, said, missed = _in_mount(tmp_path, "ro,size=1m")
    assert not on and missed
    assert said == [f"kernel cache {tmp_path / 'kc'} is not writable (Read-only file system): compiling without it"]


def test_full_cache_directory_compiles_without_it(tmp_path: Path) -> None:
    on, said, missed = _in_mount(tmp_path, "size=256k")  # room for the probe, not for a 1 MB library
    assert not on and missed
    assert said == [f"kernel cache {tmp_path / 'kc'} is not writable (No space left on device): compiling without it"]


def test_concurrent_writers_of_one_key(tmp_path: Path) -> None:
    """Two compiles storing the same entry at once: a reader sees one whole entry."""
    from concurrent.futures import ThreadPoolExecutor

    c = KernelCache.open(root=tmp_path)
    k = content_key("same")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: c.put(k, {"a": b"x" * 50_000, "b": b"y" * 50_000}), range(8)))
    assert c.get(k, "x") == {"a": b"x" * 50_000, "b": b"y" * 50_000}
    assert c.on
