"""Tiny GGUF files of the Qwen2, Qwen3, Gemma (1, 2, 3) and Phi-3 zoo families, written as llama.cpp's
convert_hf_to_gguf.py writes them: Gemma's RMSNorm gains stored as 1 + w, its post-norms under
llama.cpp's names, soft-capping and the sliding window in the metadata; Phi-3's fused `attn_qkv`
and `ffn_up` ([gate; up]) kept fused. What llama.cpp does not write (Gemma 2's layer pattern,
Gemma 3's local rope base) is left out, so the frontend's defaults are what the oracle checks;
Gemma 3's two-layer pattern differs from llama.cpp's default of six, so it is listed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .gguf_files import byte_tokens

if TYPE_CHECKING:
    import torch

#: Hugging Face model_type -> GGUF architecture.
GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}

_LLAMA_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                "post_attention_layernorm": "ffn_norm"}
_QWEN3_NAMES = {**_LLAMA_NAMES, "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_SANDWICH_NAMES = {**_LLAMA_NAMES, "post_attention_layernorm": "post_attention_norm",
                   "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
                   "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_PHI3_NAMES = {"self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def rope_theta(cfg: Any, kind: str = "full_attention") -> float:
    """A config's rope base (transformers 5 keeps it in rope_parameters, per layer type for Gemma 3)."""
    rp = getattr(cfg, "rope_parameters", None)
    if rp:
        return float(rp[kind]["rope_theta"] if kind in rp else rp["rope_theta"])
    return float(cfg.rope_theta)


def write_family_gguf(model: torch.nn.Module, path: str | Path, *, qtype: Any = None) -> Path:
    """Writes `model` (a Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3 or Phi-3 causal LM whose vocabulary holds
    byte_tokens) to `path` with a byte-level gpt2 tokenizer; `qtype`: every 2-D weight in that
    GGUF block format (gguf_files.quantize_model makes the matching reference)."""
    import gguf

    cfg: Any = model.config
    arch = GGUF_ARCH[cfg.model_type]
    path = Path(path)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope_theta(cfg))
    rp = getattr(cfg, "rope_parameters", None) or {}
    full = rp.get("full_attention", rp)
    if full.get("rope_type") == "linear":  # Gemma 3 4B+: the global layers' positions / factor
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(full["factor"]))
    w.add_rope_dimension_count(int(head_dim * (getattr(cfg, "partial_rotary_factor", None) or 1.0)))
    w.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if getattr(cfg, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    toks = byte_tokens(cfg.vocab_size)
    w.add_token_list(toks)
    w.add_token_types([3 if t.startswith("<|") else (5 if t.startswith("<pad") else 1) for t in toks])
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)

    gemma = arch.startswith("gemma")
    names = {"phi3": _PHI3_NAMES, "qwen3": _QWEN3_NAMES, "gemma2": _SANDWICH_NAMES,
             "gemma3": _SANDWICH_NAMES}.get(arch, _LLAMA_NAMES)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def add(name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if gemma and name.endswith("norm.weight"):  # convert_hf_to_gguf: Gemma's norm gains + 1
            a = a + np.float32(1.0)
        if qtype is not None and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            for kind in ("weight", "bias"):  # Qwen2's q/k/v biases
                key = f"model.layers.{i}.{hf}.{kind}"
                if key in sd:
                    add(f"blk.{i}.{gg}.{kind}", sd[key])
    add("output_norm.weight", sd["model.norm.weight"])
    if not getattr(cfg, "tie_word_embeddings", False):
        add("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
