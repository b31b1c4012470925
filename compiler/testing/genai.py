"""The onnxruntime-genai exports of the zoo's families: the real model builder, driven offline.

``genai`` / ``genai_rope`` / ``genai_mha`` / ``genai_int4`` -- :func:`build_genai`
    The real onnxruntime-genai model builder (``onnxruntime-genai==0.18.0``, run offline on a local
    ``save_pretrained`` directory, in a subprocess; opset ai.onnx 22 + com.microsoft 1). Families:
    llama, qwen2, mistral, phi3, gemma (the builder has no GPT-2). Inputs ``input_ids[B, S]``,
    ``attention_mask[B, total]`` (int64; GQA's ``seqlens_k = ReduceSum(mask) - 1`` and
    ``total_sequence_length = Shape(mask)[1]`` are computed inside the graph),
    [``position_ids[B, S]``, only for ``genai_rope``/``genai_mha``], ``past_key_values.{i}.key/value
    [B, kv_heads, past, head_dim]``; outputs ``logits``, ``present.{i}.key/value[B, kv_heads,
    total, head_dim]``. Past length 0 works for prefill; decode feeds ``present`` back as ``past``.

    * ``genai``: Gather embedding, ``SimplifiedLayerNormalization`` (default domain, first norm),
      ``com.microsoft.SkipSimplifiedLayerNormalization`` (residual add + norm, 2 per layer), one
      packed QKV ``MatMul``, ``com.microsoft.GroupQueryAttention`` with ``do_rotary=1`` and the
      ``cos_cache``/``sin_cache`` initializers as inputs 7/8 (RoPE fused), SiLU as Sigmoid*Mul.
    * ``genai_rope``: unpacked Q/K/V MatMuls, separate ``com.microsoft.RotaryEmbedding``
      (inputs: input, position_ids, cos_cache, sin_cache) on Q and K, GQA with ``do_rotary=0``.
    * ``genai_mha``: ``com.microsoft.MultiHeadAttention`` (q, k, v, -, -, additive 4-D mask) with
      separate RotaryEmbedding; the builder expands KV heads with a repeat_kv subgraph and
      concatenates the cache itself; the causal/padding mask is an explicit subgraph.
    * ``genai_int4``: like ``genai`` but every MatMul is ``com.microsoft.MatMulNBits`` (4 bits,
      block 32); logits agree with torch only to quantization error (~0.1), not 1e-4.

    Builder quirks handled here: tiny models need ``original_max_position_embeddings`` for phi3,
    and the builder's lm_head detection (any Linear with ``out_features == vocab``) misfires on
    phi3's fused ``gate_up_proj`` (2*128 == 256), so the driver patches it to the real lm_head.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from zlc.testing.families import save_hf_dir

log = logging.getLogger(__name__)

#: Families the onnxruntime-genai builder supports.
GENAI_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral", "phi3", "gemma")
GENAI_VARIANTS: tuple[str, ...] = ("gqa", "gqa_rope", "mha", "int4")
#: onnxruntime-genai version the genai kinds were built and checked with.
GENAI_BUILDER_VERSION = "0.18.0"


# The builder is run in a child process: it appends its own directory to sys.path (top-level
# modules named `builders`, `quantization`, `loaders`, ...), prints freely, and the variants need
# class patches that must not leak into the caller.
_GENAI_DRIVER = r"""
import sys
hf_dir, out_dir, variant, cache_dir = sys.argv[1:5]
import onnxruntime_genai.models.builder as B
from builders.base import Model

_orig_has_lm_head = Model.has_lm_head
def _has_lm_head(self, module):
    lm = getattr(self.weights, "lm_head", None)
    if lm is not None:
        return module is lm
    return _orig_has_lm_head(self, module)
Model.has_lm_head = _has_lm_head

options = []
precision = "fp32"
if variant == "mha":
    Model.is_gqa_supported = lambda self: False
    Model.is_packed_attn_supported = lambda self: False
elif variant == "gqa_rope":
    Model.is_fused_rope_supported = lambda self: False
    options = ["fuse_qkv=false"]
elif variant == "int4":
    precision = "int4"
elif variant != "gqa":
    raise SystemExit(f"unknown variant {variant}")
extra = B.parse_extra_options(None, hf_dir, out_dir, precision, "cpu", cache_dir, options)
B.create_model(None, hf_dir, out_dir, precision, "cpu", cache_dir, **extra)
"""


def genai_available() -> bool:
    """Whether the onnxruntime-genai model builder is importable."""
    try:
        importlib.metadata.version("onnxruntime-genai")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def build_genai(
    family: str, out_path: str | os.PathLike[str], *, variant: str = "gqa", seed: int = 0
) -> Path:
    """Build an onnxruntime-genai graph for ``family`` with the real model builder, offline.

    ``variant``: ``"gqa"`` (builder default for CPU fp32: packed QKV, GroupQueryAttention with fused
    RoPE), ``"gqa_rope"`` (separate com.microsoft.RotaryEmbedding), ``"mha"``
    (com.microsoft.MultiHeadAttention), ``"int4"`` (MatMulNBits). Writes one self-contained
    ``.onnx`` file at ``out_path`` (weights inlined) and returns it. Requires
    ``pip install onnxruntime-genai==0.18.0``.
    """
    import onnx

    if family not in GENAI_FAMILIES:
        raise ValueError(f"onnxruntime-genai's builder does not support {family!r}")
    if variant not in GENAI_VARIANTS:
        raise ValueError(f"variant must be one of {GENAI_VARIANTS}, not {variant!r}")
    if not genai_available():
        raise ImportError(
            "build_genai needs the onnxruntime-genai model builder: "
            f"pip install onnxruntime-genai=={GENAI_BUILDER_VERSION}"
        )
    out = Path(out_path)
    with tempfile.TemporaryDirectory(prefix="zlc-genai-") as tmp:
        hf_dir = save_hf_dir(family, Path(tmp) / "hf", seed)
        build_dir = Path(tmp) / "onnx"
        env = dict(os.environ)
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            TQDM_DISABLE="1",
            PYTHONWARNINGS="ignore",
        )
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _GENAI_DRIVER,
                str(hf_dir),
                str(build_dir),
                variant,
                str(Path(tmp) / "cache"),
            ],
            env=env,
            cwd=tmp,
            capture_output=True,
            text=True,
        )
        log.debug("genai builder output (%s/%s):\n%s%s", family, variant, proc.stdout, proc.stderr)
        if proc.returncode != 0:
            raise RuntimeError(
                f"onnxruntime-genai builder failed for {family}/{variant} (rc {proc.returncode}):\n"
                + (proc.stdout + proc.stderr)[-4000:]
            )
        model = onnx.load(str(build_dir / "model.onnx"), load_external_data=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(out), save_as_external_data=False)
    return out

