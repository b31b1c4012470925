"""What the megakernel's tests share across its two executors (tests/codegen: the Triton kernel in
the interpreter; tests/native: the C kernel): the zoo models, one per architecture switch, the
prompt and the tolerance against the reference executor, the decode-equals-prefill check, a
request's greedy logits run alone (the batch tests' oracle), and the wait the negative controls drop."""

from __future__ import annotations

from typing import Any

import numpy as np

from zlc import bundle as fmt
from zlc.codegen.program import Task
from zlc.codegen.schedule import signalers

ATOL = 1e-4  # kernel against kernel (the same f32 math in another order: threads, rows, chunks)

# The kernel-against-reference oracle's tolerance, derived rather than tuned to one CPU: a kernel
# computing in f32 lands some distance from exact arithmetic, set by the model's summation lengths
# and magnitudes, and so does the reference executor's own f32 computation (torch's summation
# order, which differs between CPUs: MKL/oneDNN pick kernels per machine). Both distances are
# measured against the reference in f64 (zlc.reference.executor.in_f64) on each launch; the
# kernel may be at most NOISE_FACTOR times as far from it as the f32 reference is (measured: 0.5-1.4
# on the tiny families at every ISA level, AMD EPYC; see derived_tolerance), and never needs to be
# closer than a few ulps of the largest logit. A kernel that computes something else (a wrong
# normalization, a dropped term, a half-precision rounding) is orders of magnitude farther.
NOISE_FACTOR = 8.0
ULP = 2.0 ** -24


def derived_tolerance(ref32: np.ndarray, exact: np.ndarray) -> float:
    """The largest abs distance from `exact` (the reference in f64) an f32 kernel's logits may have
    on this launch: NOISE_FACTOR x the f32 reference's own distance (or 4 ulps of the largest
    logit, when that distance happens to be smaller)."""
    e_ref = float(np.abs(ref32.astype(np.float64) - exact).max())
    return NOISE_FACTOR * max(e_ref, 4 * ULP * float(np.abs(exact).max()))
PROMPT = [1, 5, 9, 200, 17, 33, 2]
MODELS = {  # id -> (zoo kind, family, opset)
    "llama": ("stateless", "llama", 20),  # GQA, SwiGLU, RMSNorm, RoPE, untied head
    "gpt2": ("stateless", "gpt2", 20),  # MHA, GELU MLP + biases, LayerNorm, learned positions, tied head
    "gemma": ("stateless", "gemma", 20),  # GQA, gelu-tanh gated MLP, embedding scale, tied head
    "phi3-genai": ("genai", "phi3", None),  # onnxruntime-genai route (GroupQueryAttention), untied
    "qwen2-optimum": ("optimum_kv", "qwen2", 20),  # optimum KV-cache export, q/k/v biases, untied
    "bloom": ("stateless", "bloom", 20),  # ALiBi slopes, LayerNorm on the embeddings, MHA, tied head
}


def guarded_read(tasks: list[Task]) -> tuple[int, int]:
    """(task, wait) of the first layer's first attention task and its wait on the q projection:
    without it, attention reads q before it is written."""
    sig = signalers(tasks)
    i = next(k for k, t in enumerate(tasks) if t.op == fmt.OP_ATTENTION)
    w = next(k for k, (e, _) in enumerate(tasks[i].waits) if all(tasks[j].op == fmt.OP_LINEAR for j in sig[e]))
    return i, w


def assert_decode_equals_prefill(s: Any, prompt: list[int], split: int, atol: float = ATOL) -> None:
    """Session `s` prefilling `prompt[:split]` and stepping through the rest gives, at every step,
    the logits of one prefill of the whole prompt (leaves `s` mid-sequence)."""
    s.reset()
    _, whole = s.prefill(prompt, all_logits=True, want_logits=True)
    s.reset()
    s.prefill(prompt[:split])
    for i, t in enumerate(prompt[split:]):
        _, lg = s.step(t, want_logits=True)
        np.testing.assert_allclose(lg[0], whole[split + i], atol=atol, rtol=0)


def greedy_logits(s: Any, prompt: list[int], steps: int) -> list[np.ndarray]:
    """Session `s` (a MegakernelSession) run on `prompt` alone: [vocab] logits after the prompt,
    then after each of `steps` greedy tokens."""
    s.reset()
    _, lg = s.prefill(prompt, want_logits=True)
    assert lg is not None
    out = [lg[-1]]
    for _ in range(steps):
        _, lg = s.step(int(np.argmax(out[-1])), want_logits=True)
        assert lg is not None
        out.append(lg[0])
    return out
