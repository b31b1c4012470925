"""Aggregate decode throughput of the native kernel's batched steps (runtime/batch.py NativeBatch)
at 1, 4, 16 decode rows against MegakernelSession at batch 1, same process, same run.

    python bench/batch_decode.py                      # SmolLM2-135M bf16, 2 threads, 3 rounds
    python bench/batch_decode.py --rows 1 4 16 64 --threads 2 --rounds 5 --steps 32

The bundle is bench/cpu_decode.py's (SmolLM2-135M-Instruct, `--dtype bf16`, max_seq 512, cached in
--workdir). Each engine prefills one chat prompt per sequence (the rows' prompts differ in their
last token, so the rows are distinct requests), then --steps decode steps are timed; a batched step
carries one decode row per sequence. Engines alternate round by round (order rotating), the
machine's load falls on all alike; medians are printed with each one's ratio to batch 1.
Aggregate tok/s = rows * steps / seconds. Greedy: a row's next id is the argmax of its logits.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np


def bundle(workdir: Path) -> Path:
    import zlc
    from zlc.testing import zoo

    out = workdir / "smollm2-bf16.zlc"
    if not (out / "manifest.json").is_file():
        zlc.compile(zoo.cached_smollm2(), targets=["cpu"], dtype="bf16", max_seq=512,
                    tokenizer=zoo.smollm2_gguf_path(), out=out, verify=False, name="smollm2")
    return out


def time_session(s: object, ids: list[int], steps: int) -> float:
    """MegakernelSession: prefill, then `steps` greedy steps timed; tok/s."""
    s.reset()  # type: ignore[attr-defined]
    tok = s.prefill(ids)[0]  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    for _ in range(steps):
        tok = s.step(tok)[0]  # type: ignore[attr-defined]
    return steps / (time.perf_counter() - t0)


def time_batch(nb: object, prompts: list[list[int]], steps: int) -> float:
    """NativeBatch: every prompt prefilled (as many per step as max_rows allows), then `steps`
    steps of one decode row per sequence timed; aggregate tok/s."""
    from zlc.runtime.batch import NativeBatch

    assert isinstance(nb, NativeBatch)
    seqs = [nb.open() for _ in prompts]
    last: dict[int, int] = {}
    i = 0
    while i < len(prompts):  # pack whole prompts into steps of up to max_rows rows
        rows, used = [], 0
        while i < len(prompts) and used + len(prompts[i]) <= nb.max_rows:
            rows.append((seqs[i], prompts[i]))
            used += len(prompts[i])
            i += 1
        for (s, _), lg in zip(rows, nb.step(rows, [True] * len(rows)), strict=True):
            last[s] = int(np.argmax(lg))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = nb.step([(s, [last[s]]) for s in seqs], [True] * len(seqs))
        for s, lg in zip(seqs, out, strict=True):
            last[s] = int(np.argmax(lg))
    dt = time.perf_counter() - t0
    for s in seqs:
        nb.close(s)
    return len(seqs) * steps / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("ZLC_BENCH_DIR", "out/bench-cpu")))
    a = ap.parse_args()
    import zlc
    from zlc.runtime.batch import NativeBatch
    from zlc.testing import zoo

    path = bundle(a.workdir)
    b = zlc.load(path)
    ids = list(b.tokenizer.encode_chat(zoo.SMOLLM2_PROMPT))
    vocab = int(b.manifest["model"]["vocab"])
    prompts = [ids[:-1] + [(ids[-1] + k) % vocab] for k in range(max(a.rows))]
    s = b.session("cpu", threads=a.threads)
    nb = NativeBatch(path, b.manifest, threads=a.threads)
    print(f"SmolLM2-135M bf16, {a.threads} threads, prompt {len(ids)} tokens, {a.steps} timed steps, "
          f"{a.rounds} rounds; KV pages {nb.pages_total} x {nb.page_size} tokens, max_rows {nb.max_rows}")
    engines = ["session"] + [f"batch{r}" for r in a.rows]
    res: dict[str, list[float]] = {e: [] for e in engines}
    for rnd in range(a.rounds + 1):  # round 0 warms up
        order = engines[rnd % len(engines):] + engines[:rnd % len(engines)]
        for e in order:
            time.sleep(0.05)
            v = time_session(s, ids, a.steps) if e == "session" else \
                time_batch(nb, prompts[:int(e[5:])], a.steps)
            if rnd:
                res[e].append(v)
    base = statistics.median(res["session"])
    print(f"{'engine':<28}{'tok/s (median)':>16}{'x batch 1':>11}   rounds")
    print(f"{'MegakernelSession batch 1':<28}{base:>16.1f}{1.0:>11.2f}   " + " ".join(f"{x:.1f}" for x in res["session"]))
    for r in a.rows:
        m = statistics.median(res[f"batch{r}"])
        print(f"{f'NativeBatch {r} rows':<28}{m:>16.1f}{m / base:>11.2f}   "
              + " ".join(f"{x:.1f}" for x in res[f"batch{r}"]))
    nb.close_all()
    s.close()


if __name__ == "__main__":
    main()
