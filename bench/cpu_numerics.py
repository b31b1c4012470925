"""zlc's native kernel, `--numerics exact` against `--numerics fast` (issue 36), on SmolLM2's GGUF
files: prefill and decode speed, and whether fast keeps exact's greedy tokens.

    python bench/cpu_numerics.py --threads 2 --rounds 5 --markdown

Per file (the shipped Q4_1 file; the Q8_0 file requantized from it, as bench/cpu_decode.py makes
it) and per numerics, a bundle compiled from the file (`--dtype bf16 --max-seq 1024`, cached in
--workdir). Speed, llama-bench's terms: pp = a --prompt-token prompt (fixed pseudo-random ids) in
one prefill, tok/s; tg = --decode greedy steps after it, tok/s. All sessions live in this process
and are measured interleaved, the order rotating each round, --pause seconds apart (a shared
machine's load falls on all alike); medians over --rounds after one warm-up round.

Agreement: fast teacher-forced with exact's greedy tokens on the probe prompts (the reference
accuracy check's: zlc.reference.accuracy's PROBES prompts of PROMPT_LEN random ids, STEPS steps;
and the chat prompt of bench/cpu_decode.py with 32 steps): the share of positions whose argmax is
the same, and the largest logit difference. With --markdown a docs table (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_decode import gguf_file, prompt_ids  # noqa: E402  (the bench folder is no package)

FILES = ("q4_1", "q8_0")
NUMERICS = ("exact", "fast")


def bundle(workdir: Path, fmt: str, numerics: str) -> Path:
    import zlc

    out = workdir / f"smollm2-gguf-{fmt}-{numerics}-1024.zlc"
    if not (out / "manifest.json").is_file():
        zlc.compile(gguf_file(workdir, fmt), targets=["cpu"], dtype="bf16", max_seq=1024, out=out, verify=False,
                    name="smollm2", numerics=numerics)
    return out


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
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--markdown", action="store_true")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    import zlc
    from zlc.reference.accuracy import PROBES, PROMPT_LEN, STEPS

    files = a.files.split(",")
    sessions = {(f, n): zlc.load(bundle(a.workdir, f, n)).session("cpu", threads=a.threads)
                for f in files for n in NUMERICS}
    vocab = int(next(iter(sessions.values())).vocab)
    rng = np.random.default_rng(0)
    long_prompt = [int(t) for t in rng.integers(0, vocab, a.prompt_tokens)]
    probes = [([int(t) for t in np.random.default_rng(p).integers(0, vocab, PROMPT_LEN)], STEPS)
              for p in range(PROBES)] + [(prompt_ids(a.workdir), 32)]
    results: dict[str, Any] = {}
    for (f, n), s in sessions.items():
        results[f"{f} {n}"] = {"pp": [], "tg": [], "level": s.backend.level, "qdot": s.backend.qdot}
    keys = list(sessions)
    for rnd in range(a.rounds + 1):
        for i in range(len(keys)):
            f, n = keys[(i + rnd) % len(keys)]
            s = sessions[f, n]
            time.sleep(a.pause)
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
              "decode": a.decode, "results": results, "agreement": agree, "load_average": os.getloadavg()}
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    if not a.markdown:
        print(json.dumps(report, indent=1))
        return
    print(f"{cpu}, {a.threads} threads, medians of {a.rounds} rounds, load average {os.getloadavg()}")
    print(f"| file | numerics | level (dot path) | pp{a.prompt_tokens} tok/s | tg{a.decode} tok/s "
          "| fast / exact pp | fast / exact tg | greedy agreement fast vs exact |")
    print("|---|---|---|---|---|---|---|---|")
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


if __name__ == "__main__":
    main()
