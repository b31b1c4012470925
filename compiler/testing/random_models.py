"""Random-weight model files of real models' shapes, written tensor by tensor (no model is built in
memory): what the compile-memory bench and tests compile (bench/compile_memory.py,
tests/test_compile_memory.py). Their weights mean nothing; their sizes and formats are the point.

`write_qwen_gguf`: a Qwen2.5-0.5B-shaped GGUF by default (24 layers, hidden 896, ffn 4864, 14
query / 2 KV heads, tied embeddings, 151,936 tokens: a byte-level vocabulary, no merges; q/k/v
biases) in the mix llama.cpp's Q4_K_M makes for Qwen2.5-0.5B, whose 896-wide rows are no multiple
of 256: a Q8_0 token table, Q5_0 for the matrices with `hidden` columns (Q4_K's fallback), Q8_0
for attn_v (Q6_K's), Q6_K / Q4_K for ffn_down by layer; `tied=False` adds a Q6_K output.weight.
`write_llama_checkpoint`: a Hugging Face Llama checkpoint directory (config.json + one
model.safetensors) in f32, bf16 or f16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_files import add_byte_vocab, random_blocks

__all__ = ["write_llama_checkpoint", "write_qwen_gguf"]


def write_qwen_gguf(path: Path, layers: int = 24, hidden: int = 896, ffn: int = 4864, heads: int = 14,
                    kv_heads: int = 2, vocab: int = 151936, tied: bool = True) -> Path:
    import gguf

    T = gguf.GGMLQuantizationType
    hd = hidden // heads
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_vocab_size(vocab)
    add_byte_vocab(w, vocab, "qwen2")
    rng = np.random.default_rng(0)
    seeds = iter(range(1, 1 << 30))

    def mat(name: str, rows: int, cols: int, t: Any) -> None:
        w.add_tensor(name, random_blocks(rows, cols, t, next(seeds), peak=0.05), raw_dtype=t)

    def vec(name: str, n: int, base: float) -> None:
        w.add_tensor(name, (base + 0.02 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, hidden, T.Q8_0)
    for i in range(layers):
        p = f"blk.{i}."
        mat(p + "attn_q.weight", heads * hd, hidden, T.Q5_0)
        mat(p + "attn_k.weight", kv_heads * hd, hidden, T.Q5_0)
        mat(p + "attn_v.weight", kv_heads * hd, hidden, T.Q8_0)
        for n, rows in (("attn_q", heads * hd), ("attn_k", kv_heads * hd), ("attn_v", kv_heads * hd)):
            vec(p + n + ".bias", rows, 0.0)
        mat(p + "attn_output.weight", hidden, heads * hd, T.Q5_0)
        mat(p + "ffn_gate.weight", ffn, hidden, T.Q5_0)
        mat(p + "ffn_up.weight", ffn, hidden, T.Q5_0)
        mat(p + "ffn_down.weight", hidden, ffn, T.Q6_K if i % 3 == 0 else T.Q4_K)
        vec(p + "attn_norm.weight", hidden, 1.0)
        vec(p + "ffn_norm.weight", hidden, 1.0)
    vec("output_norm.weight", hidden, 1.0)
    if not tied:
        mat("output.weight", vocab, hidden, T.Q6_K if hidden % 256 == 0 else T.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_llama_checkpoint(d: Path, dtype: str = "bfloat16", layers: int = 6, hidden: int = 1024, ffn: int = 2816,
                           vocab: int = 32000, seed: int = 0) -> Path:
    """A random Llama checkpoint directory at `d` (weights ~ N(0, 1/K), untied head)."""
    import torch
    from safetensors.torch import save_file

    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": ffn, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "head_dim": 64, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
           "torch_dtype": dtype}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)

    def m(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g) * k ** -0.5).to(dt)

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": m(vocab, hidden), "lm_head.weight": m(vocab, hidden),
                                  "model.norm.weight": torch.ones(hidden, dtype=dt)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "self_attn.q_proj.weight": m(heads * 64, hidden), p + "self_attn.k_proj.weight": m(kv_heads * 64, hidden),
              p + "self_attn.v_proj.weight": m(kv_heads * 64, hidden), p + "self_attn.o_proj.weight": m(hidden, heads * 64),
              p + "mlp.gate_proj.weight": m(ffn, hidden), p + "mlp.up_proj.weight": m(ffn, hidden),
              p + "mlp.down_proj.weight": m(hidden, ffn), p + "input_layernorm.weight": torch.ones(hidden, dtype=dt),
              p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=dt)}
    save_file(t, str(d / "model.safetensors"))
    return d
