"""Peak memory of `zlc compile DIR` on a Hugging Face checkpoint directory (issue 33's aim: peak
RSS <= 1.5x the weights' bytes), and where it goes.

    python bench/hf_dir_memory.py                          # a random bf16 Llama, ~250 MB of weights
    python bench/hf_dir_memory.py --dtype float32 --layers 4

Writes a random-weight Llama-shaped checkpoint (config.json + model.safetensors, written tensor
by tensor with safetensors; no transformers model is built), then compiles it for --target cpu
in a child process (`zlc.compile`, verification included) and reads the child's peak resident
set (getrusage RUSAGE_CHILDREN, ru_maxrss: file-backed pages of the mapped weights count too).
The child also records its resident set (VmRSS) and high-water mark (VmHWM) at the start of
each compile stage, so the table says which stage raised the peak. A second child only imports
zlc, torch and transformers: the interpreter's baseline, which the ratio leaves in. Output is
markdown, ready for docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_memory import peak_of  # noqa: E402  (the bench folder is no package)


def write_checkpoint(d: Path, dtype: str, layers: int, hidden: int, ffn: int, vocab: int, seed: int = 0) -> int:
    """A random Llama checkpoint at `d` (zlc.testing.random_models); returns the weights' bytes."""
    from zlc.testing.random_models import write_llama_checkpoint

    path = write_llama_checkpoint(d, dtype, layers, hidden, ffn, vocab, seed) / "model.safetensors"
    with path.open("rb") as f:  # safetensors: an 8-byte header length, the JSON header, then the tensors' bytes
        header = int.from_bytes(f.read(8), "little")
    return path.stat().st_size - 8 - header


def _status() -> tuple[int, int]:
    """(VmRSS, VmHWM) of this process in bytes."""
    f = {k: v for k, _, v in (ln.partition(":") for ln in Path("/proc/self/status").read_text().splitlines())}
    return int(f["VmRSS"].split()[0]) * 1024, int(f["VmHWM"].split()[0]) * 1024


def child(model: str, out: str, wdtype: str) -> None:
    import zlc

    marks: list[tuple[str, int, int]] = []
    seen: set[str] = set()

    def progress(stage: str, detail: str) -> None:
        if stage not in seen:
            seen.add(stage)
            marks.append((stage, *_status()))

    res = zlc.compile(model, targets=["cpu"], out=out, dtype=wdtype, max_seq=256, progress=progress, force=True)
    marks.append(("end", *_status()))
    print(json.dumps({"marks": marks, "verification": res.manifest["verification"]["status"],
                      "seconds": round(sum(res.seconds.values()) - res.seconds.get("total", 0), 1)}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--wdtype", default="auto", help="zlc compile --dtype (auto, fp32, bf16)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--child", nargs=3, metavar=("DIR", "OUT", "WDTYPE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "ckpt"
        nbytes = write_checkpoint(d, a.dtype, a.layers, a.hidden, a.ffn, a.vocab)
        base, _ = peak_of([sys.executable, "-c", "import zlc, zlc.build, torch, transformers, safetensors; print(1)"])
        t = time.perf_counter()
        peak, out = peak_of([sys.executable, __file__, "--child", str(d), str(Path(tmp) / "b.zlc"), a.wdtype])
        wall = time.perf_counter() - t
    rep = json.loads(out.strip().splitlines()[-1])
    mb = 1 / 2**20
    print(f"Llama-shaped random checkpoint, {a.dtype}: {a.layers} layers, hidden {a.hidden}, ffn {a.ffn}, "
          f"vocab {a.vocab}; weights {nbytes * mb:.0f} MiB; `zlc.compile(DIR, targets=['cpu'], dtype="
          f"'{a.wdtype}', max_seq=256)`; verification {rep['verification']}; {wall:.0f} s wall; "
          f"{platform.processor() or platform.machine()}\n")
    print(f"peak RSS of the compile: **{peak * mb:.0f} MiB = {peak / nbytes:.2f}x the weights** "
          f"(interpreter + imports alone: {base * mb:.0f} MiB)\n")
    print("| stage starts | RSS (MiB) | peak so far (MiB) |\n|---|---:|---:|")
    for stage, rss, hwm in rep["marks"]:
        print(f"| {stage} | {rss * mb:.0f} | {hwm * mb:.0f} |")


if __name__ == "__main__":
    main()
