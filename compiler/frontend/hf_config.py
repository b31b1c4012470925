"""What a Hugging Face checkpoint's config.json means for the transformer-level builder that the
GGUF frontend uses (gguf.GraphBuilder): the GGUF architecture a `model_type` builds as, the tensor
names of each, and the hyper-parameters (gguf.HParams) read from the config as transformers
reads them (transformers 4 keys `rope_theta`/`rope_scaling`, transformers 5 `rope_parameters`,
per layer type for Gemma 3).

What differs from a GGUF file of the same model (convert_hf_to_gguf.py's work, undone or done
here): Q/K rows are in Hugging Face's rotate-half order (never permuted), Gemma's RMSNorm gains
are stored as w (the builder reads 1 + w, as llama.cpp's converter writes them), Llama 3's rotary
scaling is a config entry (the builder reads it as llama.cpp's `rope_freqs.weight` divisors),
sliding-window layers are listed (`layer_types`) or follow the family's transformers default.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from zlc.errors import ModelFormatError

from .gguf import HParams
from .gguf_arch import ARCHITECTURES, ArchSpec

#: Hugging Face model_type -> the GGUF architecture it is built as.
NATIVE: dict[str, str] = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                          "gemma": "gemma", "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3"}

_LLAMA = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_SANDWICH = {**_LLAMA, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_PHI3 = {**_LLAMA, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
#: per GGUF architecture: the block's GGUF tensor stem -> its Hugging Face module under model.layers.N
BLOCK_NAMES: dict[str, dict[str, str]] = {"gemma2": _SANDWICH, "gemma3": _SANDWICH, "phi3": _PHI3}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
                "gelu": "gelu"}


def hf_name(arch: str, gguf_name: str) -> str:
    """The Hugging Face tensor name of a GGUF tensor name (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`)."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, i, part = stem.split(".", 2)
        return f"model.layers.{i}.{BLOCK_NAMES.get(arch, _LLAMA).get(part, part)}.{kind}"
    return f"{TOP_NAMES.get(stem, stem)}.{kind}"


class Config:
    """config.json, read with one-line errors naming the field."""

    def __init__(self, d: dict[str, Any], where: str):
        self.d, self.where = d, where

    def error(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.where}: {what}")

    def get(self, key: str, default: Any = None) -> Any:
        v = self.d.get(key)
        return default if v is None else v

    def int(self, key: str, default: Any = ..., minimum: int = 1) -> int:
        v = self.get(key, None if default is ... else default)
        if v is None:
            raise self.error(f"config field '{key}' is missing")
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.error(f"config field '{key}' must be an integer >= {minimum}, got {v!r}")
        return v

    def float(self, key: str, default: Any = ...) -> float:
        v = self.get(key, None if default is ... else default)
        if v is None:
            raise self.error(f"config field '{key}' is missing")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise self.error(f"config field '{key}' must be a number >= 0, got {v!r}")
        return float(v)

    def rope(self, kind: str = "full_attention") -> dict[str, Any]:
        """The rotary parameters (theta, type, factors) of layers of `kind`: transformers 5's
        `rope_parameters` (per layer type for Gemma 3), else transformers 4's `rope_theta` and
        `rope_scaling`."""
        rp = self.d.get("rope_parameters")
        if isinstance(rp, dict) and rp:
            if kind in rp or "full_attention" in rp:
                rp = rp.get(kind) or rp["full_attention"]
            return dict(rp)
        out = dict(self.d.get("rope_scaling") or {})
        if kind == "sliding_attention" and "rope_local_base_freq" in self.d:  # Gemma 3 in transformers 4
            return {"rope_theta": self.d["rope_local_base_freq"]}
        out.setdefault("rope_theta", self.d.get("rope_theta", 10000.0))
        return out


def spec_for(arch: str) -> ArchSpec:
    """The GGUF architecture's spec without llama.cpp's Q/K permutation (Hugging Face weights)."""
    s = ARCHITECTURES[arch]
    return ArchSpec(**{**s.__dict__, "permuted_qk": False})


def _rope_type(c: Config, rp: dict[str, Any]) -> str:
    return str(rp.get("rope_type") or rp.get("type") or "default").lower()


def llama3_factors(c: Config, rp: dict[str, Any], rope_dim: int) -> np.ndarray:
    """Llama 3's rotary scaling as per-frequency divisors (convert_hf_to_gguf's `rope_freqs`):
    long wavelengths divided by `factor`, short ones kept, the band between smoothed."""
    theta = float(rp["rope_theta"])
    factor = float(rp.get("factor", 8.0))
    low, high = float(rp.get("low_freq_factor", 1.0)), float(rp.get("high_freq_factor", 4.0))
    old = float(rp.get("original_max_position_embeddings", c.get("original_max_position_embeddings", 8192)))
    if high <= low:
        raise c.error(f"config rope scaling 'llama3': high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    out = []
    for i in range(0, rope_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / rope_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _local_layers(c: Config, model_type: str, layers: int) -> tuple[bool, ...]:
    """Which layers use the sliding window: the config's `layer_types`, else the family's
    transformers default."""
    types = c.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise c.error(f"config field 'layer_types' must list the {layers} layers, got {types!r}")
        return tuple(t == "sliding_attention" for t in types)
    if model_type in ("qwen2", "qwen3"):
        first = c.int("max_window_layers", layers, minimum=0)
        return tuple(bool(c.get("use_sliding_window", False)) and i >= first for i in range(layers))
    if model_type == "gemma2":
        return tuple(i % 2 == 0 for i in range(layers))
    if model_type == "gemma3_text":
        n = c.int("sliding_window_pattern", c.get("_sliding_window_pattern", 6))
        return tuple((i + 1) % n != 0 for i in range(layers))
    return tuple(True for _ in range(layers))  # mistral, phi3: the window (if any) is on every layer


def hparams(c: Config, model_type: str) -> tuple[HParams, str, np.ndarray | None]:
    """The builder's hyper-parameters, the gated MLP's activation, and Llama 3's rotary divisors
    (None without that scaling)."""
    hidden, heads, layers = c.int("hidden_size"), c.int("num_attention_heads"), c.int("num_hidden_layers")
    kv_heads = c.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise c.error(f"config field 'num_attention_heads' ({heads}) is not a multiple of "
                      f"'num_key_value_heads' ({kv_heads})")
    if c.get("head_dim") is None and hidden % heads:
        raise c.error(f"config field 'hidden_size' ({hidden}) does not split into {heads} heads")
    head_dim = c.int("head_dim", hidden // heads)
    rp = c.rope()
    partial = float(rp.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0)))
    rope_dim = int(head_dim * partial)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise c.error(f"config field 'partial_rotary_factor' ({partial}) gives {rope_dim} rotary dims of "
                      f"{head_dim}: must be even and positive")
    kind, linear, factors = _rope_type(c, rp), 1.0, None
    if kind == "linear":
        linear = float(rp.get("factor", 1.0))
    elif kind == "llama3":
        factors = llama3_factors(c, rp, rope_dim)
    elif kind != "default":
        raise c.error(f"config rope scaling '{kind}' is not supported (default, linear and llama3 are)")
    local = _local_layers(c, model_type, layers)
    window = int(c.get("sliding_window", 0) or 0)
    if not window or not any(local):
        window, local = 0, tuple(False for _ in range(layers))
    local_theta = None
    if model_type == "gemma3_text":
        local_rp = c.rope("sliding_attention")
        if _rope_type(c, local_rp) not in ("default", "linear"):
            raise c.error(f"config rope scaling '{_rope_type(c, local_rp)}' of the sliding layers is not supported")
        local_theta = float(local_rp.get("rope_theta", 10000.0))
    gemma = model_type.startswith("gemma")
    scale = c.float("query_pre_attn_scalar", head_dim) ** -0.5 if gemma and model_type != "gemma" else head_dim ** -0.5
    act = c.get("hidden_activation") or c.get("hidden_act") or "silu"
    if act not in _ACTIVATIONS:
        raise c.error(f"config field 'hidden_act' = {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    hp = HParams(layers=layers, hidden=hidden, ffn=c.int("intermediate_size"), heads=heads, kv_heads=kv_heads,
                 head_dim=head_dim, rope_dim=rope_dim, rope_theta=float(rp.get("rope_theta", 10000.0)),
                 eps=c.float("rms_norm_eps", 1e-6), vocab=c.int("vocab_size"),
                 context=c.int("max_position_embeddings", 2048), rope_linear=linear, rope_theta_local=local_theta,
                 window=window, local_layers=local, attn_scale=scale,
                 attn_softcap=c.float("attn_logit_softcapping", 0.0) if gemma else 0.0,
                 final_softcap=c.float("final_logit_softcapping", 0.0) if gemma else 0.0)
    return hp, _ACTIVATIONS[act], factors
