"""Host cost per token of the per-row sampling options (runtime/serve/engine/sampling.py) against the plain
path the scheduler keeps for rows without them, measured in the same run: greedy (np.argmax) and
seeded temperature/top_p sampling (zlc.reference.sampling.sample), on one row of logits of
SmolLM2's vocabulary (49,152; standard-normal values: the cost does not depend on them).

    python bench/sampling_options.py            # ~30 s on 2 cores
    python bench/sampling_options.py --vocab 151936 --repeat 7

Rows: microseconds per token (median of --repeat runs of --n tokens) and the ratio to the plain
path of the same kind (greedy or sampled). A row without options pays none of this: the
scheduler tests `job.sampler is None` and takes the plain path. Output is markdown, ready for
docs/performance.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np

from zlc.reference.sampling import generator, sample
from zlc.runtime.serve.engine.sampling import RowSampler


def per_token_us(fn: Callable[[], object], n: int, repeat: int) -> float:
    fn()  # warm up
    runs = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter_ns() - t0) / n / 1e3)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    logits = np.random.default_rng(0).standard_normal(args.vocab).astype(np.float32)
    gen = generator(1)
    history = list(range(0, 64 * 7, 7))  # 64 generated tokens so far, for the penalties

    def with_options(top_k: int, freq: float, pres: float, logprobs: bool, top: int, sampled: bool
                     ) -> Callable[[], object]:
        s = RowSampler.of(top_k, freq, pres, logprobs, top)
        assert s is not None
        for t in history:
            s.counts[t] = s.counts.get(t, 0) + 1

        def run() -> object:
            tok = s.pick(logits, 0.8 if sampled else 0.0, 0.95 if sampled else 1.0, gen if sampled else None)
            s.counts[tok] -= 1  # keep the history as it was: every call sees the same 64 tokens
            return s.logprobs_of(logits, tok) if logprobs else tok
        return run

    plain_greedy = per_token_us(lambda: int(np.argmax(logits)), args.n, args.repeat)
    plain_sampled = per_token_us(lambda: sample(logits, 0.8, 0.95, gen), args.n, args.repeat)
    rows = [
        ("greedy, plain path (np.argmax)", plain_greedy, plain_greedy),
        ("greedy + frequency/presence penalties", per_token_us(with_options(0, 0.5, 0.5, False, 0, False),
                                                               args.n, args.repeat), plain_greedy),
        ("greedy + logprobs", per_token_us(with_options(0, 0.0, 0.0, True, 0, False), args.n, args.repeat),
         plain_greedy),
        ("greedy + logprobs, top_logprobs 20", per_token_us(with_options(0, 0.0, 0.0, True, 20, False),
                                                            args.n, args.repeat), plain_greedy),
        ("sampled, plain path (temperature 0.8, top_p 0.95)", plain_sampled, plain_sampled),
        ("sampled + top_k 40", per_token_us(with_options(40, 0.0, 0.0, False, 0, True), args.n, args.repeat),
         plain_sampled),
        ("sampled + top_k 40 + penalties + top_logprobs 5",
         per_token_us(with_options(40, 0.5, 0.5, True, 5, True), args.n, args.repeat), plain_sampled),
    ]
    print(f"vocab {args.vocab}, {args.n} tokens x {args.repeat} runs, median; {platform.processor() or platform.machine()}\n")
    print("| row | us per token | x plain path |")
    print("|---|---:|---:|")
    for name, us, base in rows:
        print(f"| {name} | {us:.1f} | {us / base:.2f} |")


if __name__ == "__main__":
    main()
