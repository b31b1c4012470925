"""zlc's native kernel, `--numerics exact` against `--numerics fast` (issue 36), on SmolLM2's GGUF
files: prefill and decode speed, and whether fast keeps exact's greedy tokens.

    python bench/cpu_numerics.py --threads 2 --rounds 5 --markdown

Per file (the shipped Q4_1 file; the Q8_0 file requantized from it, as bench/cpu_decode.py makes
it) and per numerics, a bundle compiled from the file (`--dtype bf16 --max-seq 1024`, cached in
--workdir). Speed, llama-bench's terms: pp = a --prompt-token prompt (fixed pseudo-random ids) in
one prefill, tok/s; tg = --decode greedy steps after it, tok/s. All sessions live in this process
and are measured interleaved, the order rotating each round, --pause seconds apart (a shared
machine's load falls on all alike); medians over --rounds after one warm-up round.

The peer: llama.cpp's own `llama-bench` (--llama-bench PATH, else llama-bench on PATH; skipped, and
said, when there is none: it is built from the llama.cpp sources outside CI, docs/performance.md) on
the same file, `-p <prompt-tokens> -n <decode> -t <threads> -r 1` once per round inside the same
rotation, so both see the same load. The Q4_K_M file needs llama.cpp's quantizer: llama-cpp-python,
or --llama-quantize PATH (the `llama-quantize` binary of the same build).

Agreement: fast teacher-forced with exact's greedy tokens on the probe prompts (the reference
accuracy check's: zlc.reference.accuracy's PROBES prompts of PROMPT_LEN random ids, STEPS steps;
and the chat prompt of bench/cpu_decode.py with 32 steps): the share of positions whose argmax is
the same, and the largest logit difference. With --markdown a docs table (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_decode import gguf_file, prompt_ids  # noqa: E402  (the bench folder is no package)

FILES = ("q4_1", "q8_0")
NUMERICS = ("exact", "fast")


def bundle(workdir: Path, fmt: str, numerics: str, quantize: str | None = None) -> Path:
    import zlc

    out = workdir / f"smollm2-gguf-{fmt}-{numerics}-1024.zlc"
    if not (out / "manifest.json").is_file():
        zlc.compile(model_file(workdir, fmt, quantize), targets=["cpu"], dtype="bf16", max_seq=1024, out=out, verify=False,
                    name="smollm2", numerics=numerics)
    return out


def quantize_q4_k_m(workdir: Path, quantize: str) -> Path:
    """SmolLM2's Q4_K_M file made by llama.cpp's `llama-quantize` binary from its f32 twin (what
    bench/cpu_decode.py's gguf_file does through llama-cpp-python, for machines with only the binary)."""
    import gguf

    from zlc.testing import zoo
    from zlc.testing.gguf_files import requantize_gguf

    src = zoo.smollm2_gguf_path()
    out = workdir / src.name.replace(".Q4_1.", ".Q4_K_M.")
    if not out.is_file():
        f32 = requantize_gguf(src, workdir / "f32.part", gguf.GGMLQuantizationType.F32)
        tmp = out.with_suffix(".part")
        subprocess.run([quantize, str(f32), str(tmp), "Q4_K_M", "2"], check=True, capture_output=True)
        f32.unlink()
        tmp.rename(out)
    return out


def model_file(workdir: Path, fmt: str, quantize: str | None) -> Path:
    if fmt == "q4_k_m" and quantize:
        return quantize_q4_k_m(workdir, quantize)
    return gguf_file(workdir, fmt)


def llama_bench(binary: str, path: Path, prompt: int, decode: int, threads: int) -> tuple[float, float]:
    """One llama-bench run (pp`prompt`, tg`decode`, one repetition): (pp tok/s, tg tok/s)."""
    out = subprocess.run([binary, "-m", str(path), "-p", str(prompt), "-n", str(decode), "-t", str(threads),
                          "-r", "1", "-o", "json"], check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] and not r["n_gen"])
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] and not r["n_prompt"])
    return float(pp), float(tg)


def agreement(exact: Any, fast: Any, prompts: list[tuple[list[int], int]]) -> dict[str, Any]:
    """fast teacher-forced with exact's greedy tokens on `prompts` ((ids, steps) each)."""
    agree = n = 0
    worst = 0.0
    for ids, steps in prompts:
        rows = []
        for s in (exact, fast):
            s.reset()
            rows.append([np.asarray(s.prefill(ids, all_logits=True, want_logits=True)[1])])
        for _ in range(steps):
            tok = int(rows[0][-1][-1].argmax())
            for r, s in zip(rows, (exact, fast), strict=True):
                r.append(np.asarray(s.step(tok, want_logits=True)[1]).reshape(1, -1))
        a, b = (np.concatenate(r) for r in rows)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += a.shape[0]
        worst = max(worst, float(np.abs(a - b).max()))
    return {"positions": n, "agree": agree, "greedy_agreement": round(agree / n, 4), "max_abs_logit_delta": worst}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--pause", type=float, default=0.5)
    ap.add_argument("--files", default=",".join(FILES))
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("ZLC_BENCH_DIR", "out/bench-cpu")))
    ap.add_argument("--llama-bench", default=shutil.which("llama-bench"), help="llama.cpp's llama-bench binary")
    ap.add_argument("--llama-quantize", default=shutil.which("llama-quantize"),
                    help="llama.cpp's llama-quantize binary (makes the q4_k_m file without llama-cpp-python)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    import zlc
    from zlc.reference.accuracy import PROBES, PROMPT_LEN, STEPS

    files = a.files.split(",")
    sessions = {(f, n): zlc.load(bundle(a.workdir, f, n, a.llama_quantize)).session("cpu", threads=a.threads)
                for f in files for n in NUMERICS}
    peer = {f: {"pp": [], "tg": []} for f in files} if a.llama_bench else {}
    if not a.llama_bench:
        print("llama.cpp: skipped: no llama-bench (--llama-bench, or llama-bench on PATH); it is built from the "
              "llama.cpp sources outside CI (docs/performance.md)", file=sys.stderr)
    vocab = int(next(iter(sessions.values())).vocab)
    rng = np.random.default_rng(0)
    long_prompt = [int(t) for t in rng.integers(0, vocab, a.prompt_tokens)]
    probes = [([int(t) for t in np.random.default_rng(p).integers(0, vocab, PROMPT_LEN)], STEPS)
              for p in range(PROBES)] + [(prompt_ids(a.workdir), 32)]
    results: dict[str, Any] = {}
    for (f, n), s in sessions.items():
        results[f"{f} {n}"] = {"pp": [], "tg": [], "level": s.backend.level, "qdot": s.backend.qdot}
    keys: list[tuple[str, str]] = list(sessions) + [(f, "llama.cpp") for f in peer]
    for rnd in range(a.rounds + 1):
        for i in range(len(keys)):
            f, n = keys[(i + rnd) % len(keys)]
            time.sleep(a.pause)
            if n == "llama.cpp":
                pp_ts, tg_ts = llama_bench(a.llama_bench, model_file(a.workdir, f, a.llama_quantize),
                                           a.prompt_tokens, a.decode, a.threads)
                if rnd:
                    peer[f]["pp"].append(pp_ts)
                    peer[f]["tg"].append(tg_ts)
                continue
            s = sessions[f, n]
            s.reset()
            t0 = time.perf_counter()
            tok = s.prefill(long_prompt)[0]
            t1 = time.perf_counter()
            for _ in range(a.decode):
                tok = s.step(tok)[0]
            t2 = time.perf_counter()
            if rnd:  # round 0 warms up
                results[f"{f} {n}"]["pp"].append(a.prompt_tokens / (t1 - t0))
                results[f"{f} {n}"]["tg"].append(a.decode / (t2 - t1))
    agree = {f: agreement(sessions[f, "exact"], sessions[f, "fast"], probes) for f in files}
    for s in sessions.values():
        s.close()
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), "?")
    report = {"cpu": cpu, "threads": a.threads, "rounds": a.rounds, "prompt_tokens": a.prompt_tokens,
              "decode": a.decode, "results": results, "llama.cpp": peer, "agreement": agree, "load_average": os.getloadavg()}
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    if not a.markdown:
        print(json.dumps(report, indent=1))
        return
    print(f"{cpu}, {a.threads} threads, medians of {a.rounds} rounds, load average {os.getloadavg()}")
    print(f"| file | numerics | level (dot path) | pp{a.prompt_tokens} tok/s | tg{a.decode} tok/s "
          "| fast / exact pp | fast / exact tg | greedy agreement fast vs exact |")
    print("|---|---|---|---|---|---|---|---|")
    for f, r in peer.items():
        print(f"| SmolLM2 {f.upper()} | llama.cpp (llama-bench) | | {statistics.median(r['pp']):.0f} "
              f"(best {max(r['pp']):.0f}) | {statistics.median(r['tg']):.1f} (best {max(r['tg']):.1f}) | | | |")
    for f in files:
        ex = results[f"{f} exact"]
        for n in NUMERICS:
            r = results[f"{f} {n}"]
            pp, tg = statistics.median(r["pp"]), statistics.median(r["tg"])
            ratio = n == "fast"
            ag = agree[f]
            print(f"| SmolLM2 {f.upper()} | {n} | {r['level']} ({r['qdot']}) | {pp:.0f} (best {max(r['pp']):.0f}) "
                  f"| {tg:.1f} (best {max(r['tg']):.1f}) "
                  f"| {pp / statistics.median(ex['pp']):.2f}x | {tg / statistics.median(ex['tg']):.2f}x |" if ratio else
                  f"| SmolLM2 {f.upper()} | {n} | {r['level']} ({r['qdot']}) | {pp:.0f} (best {max(r['pp']):.0f}) "
                  f"| {tg:.1f} (best {max(r['tg']):.1f}) | | |", end="")
            print(f" {ag['agree']}/{ag['positions']} (max logit delta {ag['max_abs_logit_delta']:.3f}) |"
                  if ratio else " |")
    if peer:
        print()
        print(f"| file | numerics | zlc / llama.cpp pp{a.prompt_tokens} | zlc / llama.cpp tg{a.decode} |")
        print("|---|---|---|---|")
        for f in files:
            for n in NUMERICS:
                r = results[f"{f} {n}"]
                print(f"| SmolLM2 {f.upper()} | {n} | {statistics.median(r['pp']) / statistics.median(peer[f]['pp']):.2f}x "
                      f"| {statistics.median(r['tg']) / statistics.median(peer[f]['tg']):.2f}x |")


if __name__ == "__main__":
    main()
