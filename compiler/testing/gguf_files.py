"""Tiny GGUF files from the zoo's Hugging Face models, written as llama.cpp's convert_hf_to_gguf.py
writes them (gguf's GGUFWriter), the one writer of every family the GGUF frontend reads: Llama (Q/K
rows permuted for llama.cpp's interleaved rotary), Qwen2, Qwen3, Gemma 1/2/3 (RMSNorm gains stored
as 1 + w, post-norms under llama.cpp's names, soft-capping and the sliding window in the metadata)
and Phi-3 (fused `attn_qkv` and `ffn_up` = [gate; up] kept fused); no `output.weight` when the
embeddings are tied. What llama.cpp does not write (Gemma 2's layer pattern, Gemma 3's local rope
base) is left out, so the frontend's defaults are what the oracle checks; Gemma 3's two-layer
pattern differs from llama.cpp's default of six, so it is listed. Matrices optionally in GGUF
block formats: gguf's own quantizer, or random blocks for the K-quants (gguf has no quantizer for
them). The GGUF frontend's oracle is then Hugging Face on the same (round-tripped) weights, or the
reference executor on the file.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def permute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def round_trip(w: np.ndarray, qtype: Any) -> np.ndarray:
    """`w` as it reads back after gguf's quantizer: dequantize(quantize(w))."""
    from gguf.quants import dequantize, quantize

    return dequantize(quantize(w, qtype), qtype).reshape(w.shape).astype(np.float32)


#: where each block format keeps its f16 scales (byte offsets in a block) and how large its quants are
_F16_FIELDS = {"Q4_0": (0,), "Q8_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}
_QUANT_RANGE = {"Q4_0": 8, "Q8_0": 127, "Q5_0": 16, "Q4_1": 15, "Q5_1": 31, "Q4_K": 63 * 15, "Q5_K": 63 * 31,
                "Q6_K": 127 * 32}


def random_blocks(rows: int, cols: int, qtype: Any, seed: int, peak: float = 0.1) -> np.ndarray:
    """uint8 [rows, cols / block * bytes]: blocks of `qtype` with random quants and scale bytes and
    f16 scales drawn so that weights stay within about +-`peak` (some f16 scales subnormal). What a
    K-quant tensor of a test file is: gguf has no quantizer for the K-quants."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for o in _F16_FIELDS[qtype.name]:
        d = (rng.uniform(0.2, 1.0, b.shape[:2]) * peak / _QUANT_RANGE[qtype.name]).astype(np.float16)
        b[:, :, o:o + 2] = d[..., None].view(np.uint8).reshape(*d.shape, 2)
    return b.reshape(rows, -1)


def quantize_model(model: torch.nn.Module, qtype: Any) -> None:
    """Replaces every 2-D weight of `model` with its quantize/dequantize round trip (in place): the
    Hugging Face reference for a GGUF whose matrices are `qtype` (blocks lie along rows, so the
    Q/K row permutation does not change them)."""
    import torch

    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.from_numpy(round_trip(p.numpy(), qtype)))


def byte_tokens(vocab: int) -> list[str]:
    """A gpt2-style byte-level vocabulary: the 256 byte symbols, ChatML's specials, padding."""
    from .families import byte_alphabet

    toks = byte_alphabet() + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    return toks + [f"<pad{i}>" for i in range(vocab - len(toks))]


def add_byte_vocab(w: Any, vocab: int, pre: str) -> None:
    """byte_tokens(vocab) as a GGUF gpt2 tokenizer on writer `w` (no merges; BOS/EOS ChatML's)."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    toks = byte_tokens(vocab)
    w.add_token_list(toks)
    w.add_token_types([3 if t.startswith("<|") else (5 if t.startswith("<pad") else 1) for t in toks])
    w.add_token_scores([0.0] * len(toks))
    w.add_token_merges([])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_add_bos_token(False)


#: Hugging Face model_type -> GGUF architecture.
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}

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


def write_gguf(model: torch.nn.Module, path: str | Path, *, qtype: Any = None, types: dict[str, Any] | None = None,
               tokenizer: bool = False, chat_template: str | None = None, config: dict[str, Any] | None = None,
               raw_types: dict[str, Any] | None = None) -> Path:
    """Writes `model` (a Hugging Face Llama, Qwen2, Qwen3, Gemma 1/2/3 or Phi-3 causal LM) to `path`
    as llama.cpp's converter does.
    `qtype` (a GGMLQuantizationType): every 2-D weight in that block format (quantize_model makes
    the matching reference). `types`: GGUF tensor name -> its block format, over `qtype`; a format
    gguf cannot quantize (the K-quants) is written as random_blocks, so that tensor is not the
    model's (the kernels' oracle is then the reference executor on the file). `tokenizer`: a
    byte-level gpt2 vocabulary (byte_tokens; the model's vocabulary must hold it) and its ids.
    For bad-input tests: `config` overrides config fields in the metadata only (the tensors stay
    the model's), `raw_types` writes the named tensors as zero bytes of another block format."""
    from types import SimpleNamespace

    import gguf

    own: Any = model.config
    cfg: Any = SimpleNamespace(**{**own.to_dict(), **(config or {})})
    path = Path(path)
    arch = GGUF_ARCH[own.model_type]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    if arch != "llama":  # llama.cpp's converter writes the lengths where head_dim may differ
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
    if arch != "llama" and getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    if getattr(cfg, "attn_logit_softcapping", None):
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if getattr(cfg, "final_logit_softcapping", None):
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if tokenizer:
        add_byte_vocab(w, cfg.vocab_size, "default")
    if chat_template is not None:
        w.add_chat_template(chat_template)

    gemma = arch.startswith("gemma")
    names = {"phi3": _PHI3_NAMES, "qwen3": _QWEN3_NAMES, "gemma2": _SANDWICH_NAMES,
             "gemma3": _SANDWICH_NAMES}.get(arch, _LLAMA_NAMES)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def add(name: str, a: np.ndarray) -> None:
        a = np.ascontiguousarray(a, dtype=np.float32)
        if gemma and name.endswith("norm.weight"):  # convert_hf_to_gguf: Gemma's norm gains + 1
            a = a + np.float32(1.0)
        if types and name in types and a.ndim == 2:
            t = types[name]
            quantizable = "quantize_blocks" in vars(getattr(gguf.quants, t.name))
            blocks = gguf.quants.quantize(a, t) if quantizable else random_blocks(a.shape[0], a.shape[1], t,
                                                                                  zlib.crc32(name.encode()))
            w.add_tensor(name, blocks, raw_dtype=t)
        elif raw_types and name in raw_types:
            block, size = gguf.GGML_QUANT_SIZES[raw_types[name]]
            w.add_tensor(name, np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8),
                         raw_dtype=raw_types[name])
        elif qtype is not None and a.ndim == 2:
            w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, a)

    add("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf, gg in names.items():
            for kind in ("weight", "bias"):  # Qwen2's q/k/v biases
                a = sd.get(f"model.layers.{i}.{hf}.{kind}")
                if a is None:
                    continue
                if arch == "llama" and gg in ("attn_q", "attn_k"):  # by the model's own head counts
                    a = permute_qk(a, own.num_attention_heads if gg == "attn_q" else own.num_key_value_heads)
                add(f"blk.{i}.{gg}.{kind}", a)
    add("output_norm.weight", sd["model.norm.weight"])
    if not getattr(cfg, "tie_word_embeddings", False):
        add("output.weight", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def requantize_gguf(src: str | Path, dst: str | Path, qtype: Any = None,
                    fields: dict[str, tuple[Any, Any]] | None = None) -> Path:
    """`src` (a GGUF) rewritten to `dst` with every block-format tensor in `qtype` (gguf's
    quantizer on gguf's dequantization of the file's blocks; F32: that dequantization itself; None:
    the tensors as they are) and everything else as it was: the metadata (tokenizer, chat template)
    copied, `general.file_type` set to `qtype`'s, `fields` (key -> (value, GGUFValueType), arrays
    of strings) added or replaced. So two files hold the same weights up to the second rounding
    (F32: exactly), for benches and oracles of one model in two formats that both zlc and
    llama.cpp read (a Q8_0 file, or the f32 twin, of the shipped Q4_1 SmolLM2)."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    dense = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)
    w = gguf.GGUFWriter(str(dst), arch)
    fields = fields or {}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == gguf.Keys.General.ARCHITECTURE or field.name in fields or (
                qtype is not None and field.name == gguf.Keys.General.FILE_TYPE):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for key, (value, vtype) in fields.items():
        w.add_key_value(key, value, vtype, sub_type=gguf.GGUFValueType.STRING if vtype == gguf.GGUFValueType.ARRAY
                        else None)
    if qtype is not None:
        w.add_file_type({gguf.GGMLQuantizationType.F32: gguf.LlamaFileType.ALL_F32,
                         gguf.GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                         gguf.GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
                         gguf.GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    for t in reader.tensors:
        if t.tensor_type in dense:
            w.add_tensor(t.name, np.asarray(t.data))
        elif qtype is None:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
        else:
            f = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32)
            if qtype == gguf.GGMLQuantizationType.F32:
                w.add_tensor(t.name, f)
            else:
                w.add_tensor(t.name, gguf.quants.quantize(f, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
