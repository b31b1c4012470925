"""The zoo's model families: tiny, deterministic, random-weight Hugging Face decoders.

Families (:data:`FAMILIES`): the core ones every export route is tested on (:data:`CORE_FAMILIES`:
``llama``, ``qwen2``, ``mistral``, ``gpt2``, ``phi3``, ``gemma``, ``llama-chat``), the families whose
positions are arithmetic the KV cache must rebase (:data:`POSITION_FAMILIES`: ``opt``, ``gptj``,
``codegen``, ``cohere``), and more that compile (:data:`EXTRA_FAMILIES`: ``granite``, ``starcoder2``,
``olmo``, and the partial-rotary ``stablelm``, ``phi``, ``gpt_neox``), the sliding-window
``mistral_win``, ``qwen2_win``, ``starcoder2_win`` (a window of 4), ``gemma2``, ``gemma3``
(local and global layers, soft-capping), the q/k-norm and post-norm families ``qwen3``, ``olmo2``,
``gemma2_nowin``, ``gemma3_nowin`` (tests/test_family_norms.py), ``codegen_8h`` (CodeGen with 2 heads
per mp_num group, 8 heads of 8 dims: tests/test_family_torch_rotary.py), the ALiBi families ``bloom``
and ``mpt`` and Falcon (``falcon``: multi-query, ``falcon_new``: GQA with two LayerNorms). 2 layers, hidden 64, 4 heads
(head_dim 16), 2 KV heads (GQA; GPT-2, OPT, GPT-J, CodeGen and GPT-NeoX have no GQA, so 4), vocab 256, intermediate 128, 256 positions, fp32,
``attn_implementation="eager"``. Weights are drawn from ``torch.manual_seed(seed)`` and then re-drawn
at a scale that makes the tests discriminating: every matrix ~ N(0, 1/8) (unit-scale activations,
attention that is far from uniform), every vector (norm weights, biases) is its HF init plus
N(0, 0.1), so biases and norm gains are non-trivial (a dropped norm, bias or offset shows).

``llama-chat`` is the tiny Llama with room for :func:`save_chat_tokenizer`'s byte-level ChatML
tokenizer (vocab :data:`CHAT_VOCAB`): what ``zlc serve``'s tests talk to.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zlc.testing.quiet import quiet

if TYPE_CHECKING:  # heavy imports stay lazy: importing the zoo must not import torch/transformers
    import torch

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=2,
    vocab_size=256,
    intermediate_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

#: Vocabulary of the "llama-chat" family and of :func:`save_chat_tokenizer`'s tokenizer.
CHAT_VOCAB = 264
#: ChatML, as SmolLM2 and Qwen use it (no default system prompt).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

#: Tiny Hugging Face decoder configs, ``AutoConfig.for_model(**FAMILIES[name])``.
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", **_COMMON),
    "qwen2": dict(model_type="qwen2", **_COMMON),  # q/k/v biases
    "mistral": dict(model_type="mistral", **_COMMON),  # sliding_window=4096 (> max positions)
    # fused qkv_proj / gate_up_proj; original_max_position_embeddings keeps it plain (not LongRoPE)
    "phi3": dict(model_type="phi3", original_max_position_embeddings=256, **_COMMON),
    # head_dim would default to 256; tied embeddings, sqrt(hidden) embedding scale, (1 + w) RMSNorm
    "gemma": dict(model_type="gemma", **_COMMON),
    # the tiny Llama with room for a byte-level chat tokenizer (256 bytes + 3 specials, padded to
    # 264): what `zlc serve`'s tests talk to through the Anthropic and OpenAI SDKs
    "llama-chat": dict(model_type="llama", **{**_COMMON, "vocab_size": CHAT_VOCAB}),
    # MHA only (n_head KV heads), learned positions, LayerNorm, Conv1D (Gemm), tied embeddings
    "gpt2": dict(
        model_type="gpt2",
        n_embd=64,
        n_head=4,
        n_layer=2,
        n_inner=128,
        n_positions=256,
        vocab_size=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # learned positions at CumSum(mask) - 1 + 2 (the table has 2 extra rows), LayerNorm with bias,
    # ReLU MLP with biases, tied embeddings
    "opt": dict(
        model_type="opt",
        hidden_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        ffn_dim=128,
        word_embed_proj_dim=64,
        vocab_size=256,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # parallel attention + MLP off one LayerNorm, partial interleaved rotary (the first 8 of 16
    # head dims) from a sin/cos table gathered at the positions, no attention biases
    "gptj": dict(
        model_type="gptj",
        n_embd=64,
        n_head=4,
        n_layer=2,
        n_inner=128,
        n_positions=256,
        rotary_dim=8,
        vocab_size=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # GPT-J's block with a fused qkv projection laid out in 4 groups (mp_num)
    "codegen": dict(
        model_type="codegen",
        n_embd=64,
        n_head=4,
        n_layer=2,
        n_inner=128,
        n_positions=256,
        n_ctx=256,
        rotary_dim=8,
        vocab_size=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # CodeGen with 2 heads per mp_num group (8 heads of 8 dims in 4 groups; rotary on the first 4)
    "codegen_8h": dict(
        model_type="codegen",
        n_embd=64,
        n_head=8,
        n_layer=2,
        n_inner=128,
        n_positions=256,
        n_ctx=256,
        rotary_dim=4,
        vocab_size=256,
        bos_token_id=1,
        eos_token_id=2,
    ),
    # parallel attention + MLP, LayerNorm without bias, interleaved rotary, logit scale 0.0625
    "cohere": dict(model_type="cohere", **_COMMON),
    # Llama with scalar multipliers on the embeddings, each residual branch, the attention scores
    # (instead of head_dim^-0.5) and the logits (divided), none of them 1
    "granite": dict(model_type="granite", embedding_multiplier=3.5, residual_multiplier=0.3,
                    attention_multiplier=0.15, logits_scaling=2.5, **_COMMON),
    # LayerNorm with bias, GELU MLP (c_fc/c_proj) and q/k/v/o with biases, GQA, RoPE; no window
    # (a window shorter than the context is a feature of its own)
    "starcoder2": dict(model_type="starcoder2", sliding_window=None, **_COMMON),
    # OLMo (v1): LayerNorm with neither gain nor bias, SwiGLU, RoPE
    "olmo": dict(model_type="olmo", **_COMMON),
    # partial rotary (rotate-half on the first 4 of 16 head dims), LayerNorm with bias, SwiGLU,
    # sequential residuals (use_parallel_residual=False, StableLM 2's default)
    "stablelm": dict(model_type="stablelm", **_COMMON),
    # Phi-2: partial rotary (8 of 16 dims), parallel attention + GELU MLP off one LayerNorm, biases
    # everywhere, LM head with bias
    "phi": dict(model_type="phi", **_COMMON),
    # sliding-window attention shorter than the context: each query attends over the last 4
    # positions (itself included); Qwen2 windows only the layers from max_window_layers on (layer 1)
    "mistral_win": dict(model_type="mistral", sliding_window=4, **_COMMON),
    "qwen2_win": dict(model_type="qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1, **_COMMON),
    "starcoder2_win": dict(model_type="starcoder2", sliding_window=4, **_COMMON),
    # Gemma 2: local (window 4) and global layers alternating (layer_types: layer 0 sliding),
    # attention-logit and final-logit soft-capping (c * tanh(x / c)), scores scaled by
    # query_pre_attn_scalar^-0.5, sandwich (1 + w) RMSNorms around attention and MLP
    "gemma2": dict(model_type="gemma2", sliding_window=4, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, query_pre_attn_scalar=16, **_COMMON),
    # Gemma 3: Gemma 2's layout without soft-capping, per-head q/k norms, a local rope theta on the
    # sliding layer (layer_types spelled out: the default pattern windows every layer of two)
    "gemma3": dict(model_type="gemma3_text", sliding_window=4, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "full_attention"], **_COMMON),
    # GPT-NeoX / Pythia: one query_key_value projection laid out per head ([q_h k_h v_h] for each
    # head h), partial rotary (4 of 16 dims), parallel attention + MLP off two LayerNorms
    "gpt_neox": dict(model_type="gpt_neox", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                     intermediate_size=128, vocab_size=256, max_position_embeddings=256, bos_token_id=1,
                     eos_token_id=2),
    # Qwen3: per-head q/k RMSNorm (over head_dim, after the heads' split, before RoPE); no biases
    "qwen3": dict(model_type="qwen3", **_COMMON),
    # OLMo 2: q/k RMSNorm over the whole projections (before the heads' split), no pre-norms, and
    # post-norms on the attention and MLP outputs before each residual add
    "olmo2": dict(model_type="olmo2", **_COMMON),
    # Gemma 2's sandwich norms ((1 + w) RMSNorm before and after attention and MLP) with the window
    # at the positions' length and no soft-capping (those are features of their own)
    "gemma2_nowin": dict(model_type="gemma2", sliding_window=256, attn_logit_softcapping=None,
                         final_logit_softcapping=None, query_pre_attn_scalar=16, **_COMMON),
    # Gemma 3: the sandwich norms, per-head (1 + w) q/k norm, and a local rope theta on its sliding
    # layer (10k) that differs from the full layer's (1M); the window at the positions' length
    "gemma3_nowin": dict(model_type="gemma3_text", sliding_window=256, query_pre_attn_scalar=16,
                         layer_types=["sliding_attention", "full_attention"], **_COMMON),
    # BLOOM: ALiBi (no rotary, no learned positions), LayerNorm on the embeddings
    # (word_embeddings_layernorm), one query_key_value projection laid out per head, GELU MLP, biases
    "bloom": dict(model_type="bloom", hidden_size=64, n_head=4, n_layer=2, vocab_size=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # MPT: ALiBi, fused Wqkv ([q k v] blocks), LayerNorm without bias, no linear biases, GELU MLP
    "mpt": dict(model_type="mpt", d_model=64, n_heads=4, n_layers=2, expansion_ratio=2, vocab_size=256,
                max_seq_len=256, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # Falcon-7B style: multi-query attention (one KV head), rotary, parallel attention + MLP off one
    # LayerNorm, no linear biases
    "falcon": dict(model_type="falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                   vocab_size=256, multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                   bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # Falcon-40B style ("new decoder architecture"): GQA (2 KV heads), two LayerNorms (ln_attn,
    # ln_mlp) feeding the parallel attention and MLP
    "falcon_new": dict(model_type="falcon", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                       vocab_size=256, new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True,
                       bias=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # Mixture of experts (MoE): a router Linear, softmax, top-2 of 4 experts (renormalised), each
    # expert a SwiGLU MLP; "batched_mm" is the experts implementation torch.onnx.export can trace
    # (transformers' default "grouped_mm" is an opaque custom op on CPU, "eager" loops over
    # nonzero(): data-dependent), see zlc.testing.export
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    experts_implementation="batched_mm", **_COMMON),
    # Qwen3-MoE: top-2 of 4 experts with moe_intermediate_size 32, softmax weights NOT renormalised
    # (norm_topk_prob=False, the HF default), every layer sparse; per-head q/k RMSNorm
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, experts_implementation="batched_mm", **_COMMON),
}

#: Mixture-of-experts families: router, top-k, the selected experts' gated MLPs.
MOE_FAMILIES: tuple[str, ...] = ("mixtral", "qwen3_moe")
#: The families every export route is tested on (stateless at several opsets, Optimum KV, genai).
CORE_FAMILIES: tuple[str, ...] = ("gemma", "gpt2", "llama", "llama-chat", "mistral", "phi3", "qwen2")
#: Families whose positions are arithmetic the cache must rebase (learned table at an offset, sin/cos
#: rows gathered at Range, frequencies times Range). All four compile.
POSITION_FAMILIES: tuple[str, ...] = ("opt", "gptj", "codegen", "cohere")
#: More families the megakernel runs: Granite's scalar multipliers (raising folds them into weights),
#: Starcoder2's biases and GELU MLP, OLMo's parameter-free LayerNorm; StableLM, Phi-2 and GPT-NeoX
#: with partial rotary (Phi-2 and GPT-NeoX with parallel blocks, GPT-NeoX with per-head fused QKV).
EXTRA_FAMILIES: tuple[str, ...] = ("granite", "starcoder2", "olmo", "stablelm", "phi", "gpt_neox")

_WEIGHT_STD = 0.125  # 1/sqrt(hidden): unit-scale activations
_VECTOR_STD = 0.1


@dataclass(frozen=True)
class KVSpec:
    """Shape of one family's KV cache: ``past_key_values.{i}.key`` is ``[1, num_kv_heads, past, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def hf_config(family: str, **overrides: Any) -> Any:
    """The ``transformers`` config of a zoo family (eager attention); `overrides` replace its fields
    (e.g. ``vocab_size=CHAT_VOCAB`` for room for the byte-level chat tokenizer)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    kw = {**FAMILIES[family], **overrides}
    experts = kw.pop("experts_implementation", None)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "eager"
    if experts is not None:
        cfg._experts_implementation = experts
    return cfg


def kv_spec(family: str) -> KVSpec:
    """KV-cache geometry of a family (see :class:`KVSpec`)."""
    cfg = hf_config(family)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "num_kv_heads", None) or heads
    if cfg.model_type == "falcon" and cfg.multi_query and not cfg.new_decoder_architecture:
        kv = 1  # Falcon-7B's multi-query attention: one KV head whatever num_kv_heads says
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVSpec(cfg.num_hidden_layers, kv, head_dim, cfg.vocab_size)


def hf_model(family: str, seed: int = 0, attn_implementation: str = "eager", **overrides: Any) -> torch.nn.Module:
    """A tiny random-weight ``AutoModelForCausalLM`` of ``family`` in eval mode, fp32.

    Deterministic in ``seed``; the global torch RNG state is left untouched.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(family, **overrides)
    with quiet(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                if p.dim() >= 2:
                    p.normal_(0.0, _WEIGHT_STD)
                else:
                    p.add_(torch.randn_like(p) * _VECTOR_STD)
    return model.float().eval()


def hf_greedy(model: str | torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    """Hugging Face's own greedy generation (its KV cache, its positions), the families' oracle:
    ``new_tokens`` ids after ``prompt`` from ``generate(do_sample=False)`` of ``model`` (a family
    name, or a module such as a half-precision copy). EOS does not stop it, as it does not stop
    ``zlc run --prompt-ids`` or zlc's reference session."""
    import torch

    m: Any = hf_model(model) if isinstance(model, str) else model
    m.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


def save_hf_dir(family: str, out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """``save_pretrained`` the family's model plus a trivial 256-token word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model: Any = hf_model(family, seed)
    with quiet():
        model.save_pretrained(out)
        vocab = {f"<{i}>": i for i in range(model.config.vocab_size)}
        tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="<0>", pad_token="<0>", bos_token="<1>", eos_token="<2>"
        ).save_pretrained(out)
    return out


def save_chat_tokenizer(out_dir: str | os.PathLike[str]) -> Path:
    """A byte-level BPE tokenizer without merges (every UTF-8 byte one token, ids 0..255) plus
    ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` (256..258) and a ChatML template, written as a
    Hugging Face tokenizer folder (tokenizer.json + tokenizer_config.json) for the "llama-chat"
    family: any text round-trips, so a random-weight model's replies decode deterministically."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet(), key=lambda ch: _BYTE_OF[ch])
    tok = Tokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.save(str(out / "tokenizer.json"))
    config = {"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "bos_token": None, "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def byte_alphabet() -> list[str]:
    """The 256 ByteLevel symbols in byte order: ids 0..255 of the byte-level chat vocabulary."""
    return sorted(_BYTE_OF, key=lambda ch: _BYTE_OF[ch])


def _byte_of() -> dict[str, int]:
    """GPT-2's byte -> printable-character map, inverted (the ByteLevel alphabet's order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_OF = _byte_of()
