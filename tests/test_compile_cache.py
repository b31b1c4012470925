"""`zlc compile` through the compile cache (codegen/kcache.py), end to end on the tiny model: a
bundle whose libraries (and cubins) came from the cache is byte for byte the bundle the compilers
built (kernel artifacts and task tables); a corrupted entry is found by its hash, said in one line
and rebuilt; --no-cache neither reads nor writes it; `zlc inspect BUNDLE` says what came from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import zlc
from zlc.cli import cli
from zlc.codegen.native import find_compiler

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")

# what a bundle's kernels are made of: sources, libraries, cubins, PTX, tables
ARTIFACTS = ("kernel.py", "native", "kernels", "tables")


def artifacts(bundle: Path) -> dict[str, bytes]:
    return {str(p.relative_to(bundle)): p.read_bytes() for top in ARTIFACTS if (bundle / top).exists()
            for p in sorted((bundle / top).rglob("*")) if p.is_file()}


def kernel_entries(man: dict[str, Any]) -> dict[str, Any]:
    """The manifest's native and target entries less the wall times of this compile."""
    native = {k: v for k, v in man["native"].items() if k != "compile_seconds"}
    return {"native": native, "targets": man["targets"]}


def compile_cli(model: Path, out: Path, *extra: str) -> tuple[dict[str, Any], str]:
    r = CliRunner().invoke(cli, ["compile", str(model), "--max-seq", "64", "--skip-verify", "-o", str(out),
                                 *extra])
    assert r.exit_code == 0, r.output
    return json.loads((out / "manifest.json").read_text()), r.output


def test_cached_bundle_equals_the_built_one(tiny_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "kc"
    monkeypatch.setenv("ZLC_KERNEL_CACHE", str(cache))
    cold = zlc.compile(tiny_onnx, targets=["cpu"], out=tmp_path / "cold.zlc", max_seq=64, verify=False)
    libs = sorted(lv["library"] for lv in cold.manifest["native"]["levels"].values())
    assert cold.manifest["cache"] == {"dir": str(cache), "off": None, "hits": [], "built": libs}

    warm, said = compile_cli(tiny_onnx, tmp_path / "warm.zlc")
    assert warm["cache"] == {"dir": str(cache), "off": None, "hits": libs, "built": []}
    assert artifacts(tmp_path / "warm.zlc") == artifacts(tmp_path / "cold.zlc")
    assert kernel_entries(warm) == kernel_entries(cold.manifest)
    r = CliRunner().invoke(cli, ["inspect", str(tmp_path / "warm.zlc")])
    assert r.exit_code == 0 and f"compile cache {cache}: {len(libs)} of {len(libs)} libraries and cubins from it" \
        in " ".join(r.output.split())

    # one level's library flipped in the cache: found by its sha256, said once, rebuilt, stored again
    entry = next(p for p in cache.glob("??/*/lib.so"))
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    fixed, said = compile_cli(tiny_onnx, tmp_path / "fixed.zlc")
    lines = [ln for ln in said.splitlines() if "is corrupted" in ln]
    assert len(lines) == 1 and "fails its sha256): rebuilding it" in lines[0], said
    assert len(fixed["cache"]["built"]) == 1 and len(fixed["cache"]["hits"]) == len(libs) - 1
    assert artifacts(tmp_path / "fixed.zlc") == artifacts(tmp_path / "cold.zlc")

    # --no-cache: every library built by the compiler, nothing stored
    before = sorted(p.name for p in cache.glob("??/*"))
    plain, said = compile_cli(tiny_onnx, tmp_path / "plain.zlc", "--no-cache")
    assert plain["cache"] == {"dir": None, "off": "--no-cache", "hits": [], "built": libs}
    assert sorted(p.name for p in cache.glob("??/*")) == before
    assert artifacts(tmp_path / "plain.zlc") == artifacts(tmp_path / "cold.zlc")
    assert "not used (--no-cache)" in " ".join(
        CliRunner().invoke(cli, ["inspect", str(tmp_path / "plain.zlc")]).output.split())


@pytest.mark.slow
def test_cached_cubins_equal_the_built_ones(tiny_onnx: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The a10 decode and prefill kernels: built once (ptxas), then from the cache; the cubins,
    PTX and the targets' manifest entries (resources, metadata, toolkits) are the same."""
    pytest.importorskip("triton")
    monkeypatch.setenv("ZLC_KERNEL_CACHE", str(tmp_path / "kc"))
    said: list[tuple[str, str]] = []
    kw: dict[str, Any] = {"targets": ["cpu", "a10"], "max_seq": 64, "verify": False}
    cold = zlc.compile(tiny_onnx, out=tmp_path / "cold.zlc", progress=lambda s, d: said.append((s, d)), **kw)
    warm = zlc.compile(tiny_onnx, out=tmp_path / "warm.zlc", progress=lambda s, d: said.append((s, d)), **kw)
    cubins = ["kernels/a10.cubin", "kernels/a10.prefill.cubin"]
    assert [p for p in cold.manifest["cache"]["built"] if p.startswith("kernels/")] == cubins
    assert [p for p in warm.manifest["cache"]["hits"] if p.startswith("kernels/")] == cubins
    assert ("aot", "decode kernel: a10 (cached)") in said and ("aot", "decode kernel: a10 (ptxas)") in said
    a, b = artifacts(tmp_path / "cold.zlc"), artifacts(tmp_path / "warm.zlc")
    assert {k for k in a if k.startswith("kernels/")} >= {*cubins, "kernels/a10.ptx"}
    assert a == b
    assert kernel_entries(warm.manifest) == kernel_entries(cold.manifest)
    assert '.file\t1 "kernel.py"' in (tmp_path / "warm.zlc" / "kernels" / "a10.ptx").read_text()


def test_read_only_cache_directory_compiles_and_says_so_once(tiny_onnx: Path, tmp_path: Path) -> None:
    """`zlc compile` with its cache directory on a read-only mount (a tmpfs in a private mount
    namespace): the bundle is built, and stderr says once that the cache is not used."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) on this host")
    cache, out = tmp_path / "kc", tmp_path / "ro.zlc"
    cache.mkdir()
    env = {**os.environ, "ZLC_KERNEL_CACHE": str(cache), "ZLC_CC": "none"}  # no library to build: quick
    flags = ["-m"] if os.geteuid() == 0 else ["-rm"]
    cmd = ["unshare", *flags, "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$1" && shift && exec "$@"', "sh", str(cache),
           sys.executable, "-m", "zlc.cli", "compile", str(tiny_onnx), "--max-seq", "64", "--skip-verify", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0 and "mount" in proc.stderr and "Traceback" not in proc.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    said = [ln.strip() for ln in proc.stderr.splitlines() if "kernel cache" in ln]
    assert said == [f"kernel cache {cache} is not writable (Read-only file system): compiling without it"], proc.stderr
    man = json.loads((out / "manifest.json").read_text())
    assert man["cache"]["off"] == f"{cache} is not writable (Read-only file system)"
