"""What each GGUF architecture the frontend builds means, beyond the llama layout: the conventions
llama.cpp's converter (convert_hf_to_gguf.py) wrote into the file and the ones llama.cpp's own
graph builder applies without writing them (llama-model.cpp), so the IR computes what llama.cpp
and Hugging Face compute.

- llama: Q/K rows permuted for llama.cpp's interleaved-pair rotary (undone by gguf.unpermute_qk).
- qwen2 (q/k/v biases), qwen3 (per-head q/k norms): Hugging Face's rotate-half order, unpermuted.
- gemma, gemma2, gemma3: the converter stored every RMSNorm gain as 1 + w (Hugging Face's Gemma
  norm multiplies by 1 + w), so the gains are used as they are; the embeddings are scaled by
  sqrt(hidden) in llama.cpp's graph, not in the file; GELU (tanh) gated MLP; tied head.
  gemma2/gemma3 add post-attention and post-MLP norms (`post_attention_norm`, `post_ffw_norm`) and
  sliding-window layers: llama.cpp's pattern is every other layer for gemma2 (even layers local)
  and five local layers of six for gemma3, unless the file lists them
  (`{arch}.attention.sliding_window_pattern`). gemma2 soft-caps attention scores and logits.
  gemma3's local layers rotate with base 10000 (`rope.freq_base_swa` when written) and without
  the file's linear rope scaling, which only its global layers use. Scores are scaled by
  head_dim^-0.5 except on the 27B models (llama.cpp: (hidden / heads)^-0.5), unless
  `{arch}.attention.scale` is written.
- phi3: one fused `attn_qkv` ([q; k; v] rows) and `ffn_up` holding [gate; up]; an optional
  sliding window on every layer; LongRoPE factor tensors are refused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    """One GGUF architecture's deviations from the llama layout."""

    permuted_qk: bool = False  # llama.cpp permuted Q/K rows for its interleaved rotary
    activation: str = "silu"  # the gated MLP's activation (GatedMLP attr)
    embed_scale: bool = False  # embeddings * sqrt(hidden) (Gemma)
    sandwich_norms: bool = False  # post-attention / post-MLP RMSNorms before each residual add
    fused: bool = False  # Phi-3: attn_qkv and ffn_up = [gate; up]
    #: llama.cpp's sliding-window layer pattern when the file lists none: every `swa_pattern`-th
    #: layer is global, the others local (0: the window, if any, is on every layer)
    swa_pattern: int = 0
    window: bool = False  # whether llama.cpp applies `{arch}.attention.sliding_window` at all
    #: rope base of the local layers when the file has no `rope.freq_base_swa` (None: the global base)
    local_rope_base: float | None = None
    #: layer count of the model whose scores llama.cpp scales by (hidden / heads)^-0.5 (Gemma 27B)
    wide_scale_layers: int | None = None


ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec(permuted_qk=True),
    "qwen2": ArchSpec(),
    "qwen3": ArchSpec(),
    "gemma": ArchSpec(activation="gelu_tanh", embed_scale=True),
    "gemma2": ArchSpec(activation="gelu_tanh", embed_scale=True, sandwich_norms=True, swa_pattern=2,
                       window=True, wide_scale_layers=46),
    "gemma3": ArchSpec(activation="gelu_tanh", embed_scale=True, sandwich_norms=True, swa_pattern=6,
                       window=True, local_rope_base=10000.0, wide_scale_layers=62),
    "phi3": ArchSpec(fused=True, window=True),
}
