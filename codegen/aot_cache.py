"""Ahead-of-time kernels through the compile cache (kcache.py): `compile_cached` answers a
`compile_kernel` call from an entry keyed by everything the cubins depend on, or compiles and
stores them.

The key: the kernel source less its first line (it names the model and zlc version only, so
models with the same shapes and features share cubins), the entry, signature, constexprs, compute
capabilities, warps and stages; Triton's version and where it is installed (the PTX's line info
names its files); the release of every ptxas in its wheel; zlc's version and aot.py's own source
(the options it hands Triton and ptxas). Targets of one compute capability share an entry (their cubins are the same).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zlc.version import __version__

from . import aot
from .aot import AotResult, CubinBuild, Resources, compile_kernel
from .kcache import KernelCache, content_key
from .toolchain import ToolNotFoundError, find_tool

if TYPE_CHECKING:
    from zlc.targets import Target

__all__ = ["aot_key", "compile_cached"]


# aot.py itself: how it drives Triton and ptxas (flags, register cap, alignment hints) is in the key
_AOT_SOURCE = Path(aot.__file__).read_bytes()


def _toolchain() -> list[str]:
    """Triton's version and location, and each ptxas of its wheel with its release."""
    spec = importlib.util.find_spec("triton")
    parts = [importlib.metadata.version("triton"), str(spec.origin if spec else None)]
    for name in ("ptxas", "ptxas-blackwell"):
        try:
            tool = find_tool(name)
        except ToolNotFoundError:
            parts.append(f"{name}: none")
            continue
        parts.append(f"{tool}: {aot.ptxas_release(tool)}")
    return parts


def aot_key(source: str, fn_name: str, signature: Mapping[str, str], constexprs: Mapping[str, object],
            ccs: Sequence[int], num_warps: int, num_stages: int = 1, legacy_ptxas: bool = True) -> str:
    body = source.split("\n", 1)[1] if "\n" in source else source
    return content_key(
        "aot", body, fn_name, json.dumps(dict(signature), sort_keys=True),
        json.dumps(dict(constexprs), sort_keys=True), json.dumps(sorted(ccs)), str(num_warps), str(num_stages),
        str(legacy_ptxas), __version__, _AOT_SOURCE, *_toolchain())


def compile_cached(cache: KernelCache, kernel_path: Path, fn_name: str, signature: Mapping[str, str],
                   constexprs: Mapping[str, object], targets: Sequence[Target], *, num_warps: int = 4,
                   on_progress: Callable[[str], None] | None = None) -> tuple[list[AotResult], bool]:
    """`compile_kernel(kernel_path, ...)` through `cache`: (results, whether they came from it)."""
    ccs = sorted({int(t.compute_capability) for t in targets if t.compute_capability is not None})
    if not cache.on or not targets or any(t.compute_capability is None for t in targets):  # its errors
        return compile_kernel(kernel_path, fn_name, dict(signature), constexprs, targets, num_warps=num_warps,
                              on_progress=on_progress), False
    key = aot_key(Path(kernel_path).read_text(), fn_name, signature, constexprs, ccs, num_warps)
    got = cache.get(key, f"{fn_name} for {', '.join(t.name for t in targets)}")
    if got is not None:
        return _decode(got, targets), True
    results = compile_kernel(kernel_path, fn_name, dict(signature), constexprs, targets, num_warps=num_warps,
                             on_progress=on_progress)
    cache.put(key, _encode(results), {"kind": "aot", "fn": fn_name, "ccs": ccs})
    return results, False


def _encode(results: Sequence[AotResult]) -> dict[str, bytes]:
    """One record per compute capability (its PTX, every cubin, the rest as JSON)."""
    files: dict[str, bytes] = {}
    records: dict[str, Any] = {}
    for r in results:
        if r.arch in records:
            continue
        files[f"{r.arch}.ptx"] = r.ptx.encode()
        cubins = []
        for i, c in enumerate(r.cubins):
            files[f"{r.arch}.{i}.cubin"] = c.cubin
            cubins.append({k: v for k, v in asdict(c).items() if k != "cubin"})
        records[r.arch] = {"metadata": r.metadata, "params": r.params, "resources": asdict(r.resources),
                           "seconds": r.seconds, "fallback_skipped": r.fallback_skipped, "cubins": cubins}
    files["results.json"] = json.dumps(records).encode()
    return files


def _decode(files: Mapping[str, bytes], targets: Sequence[Target]) -> list[AotResult]:
    records = json.loads(files["results.json"])
    out = []
    for t in targets:
        rec = records[t.arch]
        cubins = [CubinBuild(cubin=files[f"{t.arch}.{i}.cubin"], **{**c, "resources": Resources(**c["resources"])})
                  for i, c in enumerate(rec["cubins"])]
        out.append(AotResult(target=t.name, arch=t.arch, cubin=cubins[0].cubin, ptx=files[f"{t.arch}.ptx"].decode(),
                             metadata=rec["metadata"], params=rec["params"], resources=Resources(**rec["resources"]),
                             seconds=rec["seconds"], cubins=cubins, fallback_skipped=rec["fallback_skipped"]))
    return out
