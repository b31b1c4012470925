"""The XDP ingress program: its C source (templates/ebpf/zlc_xdp.c, shipped in the package) and its
build into a BTF-carrying BPF object with `clang -target bpf`, for a bundle's deploy/ebpf/.

The object is built where clang is (compile or `zlc deploy build` time); serving hosts only load it
(runtime/serve/ingress/xdp.py). Without clang the source is still written and the reason is reported: nothing
pretends an object exists.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SOURCE_NAME = "zlc_xdp.c"
OBJECT_NAME = "zlc_xdp.o"
#: Prompt tokens one ring record holds; longer frames go through the UDP socket instead.
DEFAULT_MAX_TOKENS = 1024
#: BPF ring buffer size (power of two, page multiple): ~1000 records of the default size.
DEFAULT_RING_BYTES = 1 << 22


@dataclass
class XdpBuild:
    source: Path
    object: Path | None  # None when it could not be built; `reason` says why
    reason: str
    max_tokens: int
    ring_bytes: int


def source_text() -> str:
    return resources.files("zlc.deploy").joinpath("templates", "ebpf", SOURCE_NAME).read_text()


def find_clang() -> str | None:
    return os.environ.get("CLANG") or shutil.which("clang")


def _include_flags() -> list[str]:
    """clang -target bpf does not search the multiarch folder that holds <asm/types.h>."""
    multiarch = sysconfig.get_config_var("MULTIARCH")
    flags = []
    for d in ([f"/usr/include/{multiarch}"] if multiarch else []) + ["/usr/include/x86_64-linux-gnu",
                                                                       "/usr/include/aarch64-linux-gnu"]:
        if Path(d, "asm", "types.h").exists():
            flags.append(f"-I{d}")
            break
    return flags


def build(out_dir: Path, *, max_tokens: int = DEFAULT_MAX_TOKENS, ring_bytes: int = DEFAULT_RING_BYTES) -> XdpBuild:
    """Writes the source into out_dir and compiles it there (when clang is present)."""
    if max_tokens < 1 or ring_bytes & (ring_bytes - 1) or ring_bytes < 4096:
        raise ValueError("max_tokens must be >= 1 and ring_bytes a power of two >= 4096")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / SOURCE_NAME
    src.write_text(source_text())
    clang = find_clang()
    if clang is None:
        return XdpBuild(src, None, "clang not found (apt install clang libbpf-dev; or set $CLANG)", max_tokens,
                        ring_bytes)
    obj = out_dir / OBJECT_NAME
    cmd = [clang, "-O2", "-g", "-target", "bpf", *_include_flags(), f"-DZLC_MAX_TOKENS={max_tokens}",
           f"-DZLC_RING_BYTES={ring_bytes}", "-c", str(src), "-o", str(obj)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        missing = "bpf/bpf_helpers.h" in p.stderr
        hint = " (install libbpf-dev for <bpf/bpf_helpers.h>)" if missing else ""
        return XdpBuild(src, None, f"clang failed{hint}: {last}", max_tokens, ring_bytes)
    return XdpBuild(src, obj, "built with " + clang, max_tokens, ring_bytes)


def build_into_bundle(bundle: Path, **kw: int) -> XdpBuild:
    """(Re)builds the program into BUNDLE/deploy/ebpf, registering the files in its manifest (for a
    bundle compiled where clang was missing, or with other record/ring sizes)."""
    import tempfile

    from .files import add_bundle_files

    with tempfile.TemporaryDirectory(prefix="zlc-ebpf-") as d:
        built = build(Path(d), **kw)
        files = {f"deploy/ebpf/{SOURCE_NAME}": built.source.read_bytes()}
        if built.object is not None:
            files[f"deploy/ebpf/{OBJECT_NAME}"] = built.object.read_bytes()
        add_bundle_files(bundle, files)
    out = Path(bundle) / "deploy" / "ebpf"
    return XdpBuild(out / SOURCE_NAME, out / OBJECT_NAME if built.object else None, built.reason, built.max_tokens,
                    built.ring_bytes)
