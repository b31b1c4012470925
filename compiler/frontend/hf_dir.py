"""The Hugging Face checkpoint-directory frontend: a folder with `config.json` and safetensors
weights (one `*.safetensors` file, or shards listed by `model.safetensors.index.json`) -> the IR.

The families the GGUF frontend builds (hf_config.NATIVE: llama, mistral, qwen2, qwen3, gemma,
gemma2, gemma3_text, phi3) are built the same way, by gguf.GraphBuilder: the transformer-level graph
from the config's architecture, no trace. Each weight is the safetensors file's memory map
(`safe_open(framework="pt")` hands out tensors over the mapped file): no copy, no f32 widening. A
bf16 or f16 checkpoint gives a graph in that dtype (activations too, as Hugging Face runs it;
rotary tables and Gemma's embedding scale rounded to it, as Hugging Face rounds them), which zlc
verifies and compiles as it does a half ONNX model (f32 math on the half weights). Other model
types that transformers knows go through transformers + torch.export (zlc.frontend.fx, the
module in f32); anything else is one error line naming the architecture.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zlc.errors import ModelFormatError, ZlcError

if TYPE_CHECKING:  # the checks below (is_checkpoint_dir, checkpoint_dtype) import neither torch nor the IR
    import numpy as np

    from zlc.ir import Graph

    from .hf_config import Config

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
#: safetensors dtypes a graph can hold, and the torch dtype of each
DTYPES = ("F32", "BF16", "F16")


def is_checkpoint_dir(path: Any) -> bool:
    """Whether `path` names a directory with a config.json that is not a zlc bundle."""
    if not isinstance(path, (str, Path)):
        return False
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file() and not (p / "manifest.json").is_file()


def checkpoint_tokenizer(model: Any) -> Path | None:
    """`model` itself when it is a checkpoint directory with a tokenizer.json (what `zlc compile` bundles)."""
    return Path(model) if is_checkpoint_dir(model) and (Path(model) / "tokenizer.json").is_file() else None


def checkpoint_dtype(model: Any) -> str | None:
    """The safetensors dtype of a checkpoint directory's token embedding ("BF16", "F16", "F32"),
    read from the file's header only; None for anything else or an unreadable directory."""
    if not is_checkpoint_dir(model):
        return None
    try:
        from safetensors import safe_open

        p = Path(model)
        index = p / INDEX
        name = "model.embed_tokens.weight"
        files = ([p / json.loads(index.read_text())["weight_map"][name]] if index.is_file()
                 else sorted(p.glob("*.safetensors")))
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                if name in h.keys():
                    return str(h.get_slice(name).get_dtype())
    except Exception:  # the frontend reports a damaged directory in one line when it builds it
        return None
    return None


def auto_wdtype(model: Any) -> str:
    """`zlc compile --dtype auto`'s weight dtype for CPU targets: bf16 for a bf16 checkpoint
    directory (an fp32 arena would double its bytes and change no value), else fp32."""
    return "bf16" if checkpoint_dtype(model) == "BF16" else "fp32"


def read_config(path: Path) -> Config:
    from .hf_config import Config

    where = path.name
    if not path.is_dir():
        raise ModelFormatError(f"{path}: not a directory")
    if not (path / CONFIG).is_file():
        raise ModelFormatError(f"{where}: no {CONFIG} (a Hugging Face checkpoint directory needs one)")
    try:
        d = json.loads((path / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{where}/{CONFIG}: not readable JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(d, dict):
        raise ModelFormatError(f"{where}/{CONFIG}: not a JSON object")
    return Config(d, f"{where}/{CONFIG}")


@functools.lru_cache(maxsize=16)
def _open(path: str, mtime_ns: int, size: int) -> Any:
    """One safetensors file of a version, opened once: each handle maps the file anew, and a page
    of the weights counts in the resident set once per mapping that touched it (a compile lowers
    the model twice: the build and its verification)."""
    from safetensors import safe_open

    return safe_open(path, framework="pt")


class Checkpoint:
    """The weights of a checkpoint directory, by the GGUF tensor names the builder asks for.

    `weight(name, shape)` is the mapped tensor (torch, the file's dtype, widened or narrowed to
    the graph's dtype only where the checkpoint mixes dtypes), `packed` says why it is dense.
    """

    frontend = "hf"

    def __init__(self, path: Path, config: Config, arch: str, rope_factors: np.ndarray | None):
        self.path, self.config, self.arch = path, config, arch
        self.name = self.stem = path.resolve().name
        self._factors = rope_factors
        files = self._files()
        self._where: dict[str, Any] = {}  # HF name -> its open file
        self._open: list[Any] = []
        for f in files:
            try:
                st = f.stat()
                h = _open(str(f.resolve()), st.st_mtime_ns, st.st_size)
            except Exception as e:  # safetensors_rust.SafetensorError: a damaged header
                raise self.error(f"{f.name}: not a readable safetensors file ({str(e).splitlines()[0]})") from None
            self._open.append(h)
            for k in h.keys():
                self._where[k] = h
        if "model.embed_tokens.weight" not in self._where:
            raise self.error("tensor 'model.embed_tokens.weight' is missing (the weights are not a "
                             f"{config.d.get('model_type')} causal LM's)")
        self.dtype = self._dtype("model.embed_tokens.weight")
        self.used: set[str] = set()  # the Hugging Face tensors the builder read
        # tensors the builder may ask for: GGUF name -> HF name (membership is what `in` checks)
        self.tensors = _GgufView(self)

    def _files(self) -> list[Path]:
        index = self.path / INDEX
        if index.is_file():
            try:
                wm = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                names = sorted(set(wm.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                raise self.error(f"{INDEX}: not a safetensors index (no 'weight_map')") from None
            missing = [n for n in names if not (self.path / n).is_file()]
            if missing:
                raise self.error(f"{INDEX} lists {missing[0]}, which is not in the directory")
            return [self.path / n for n in names]
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            bins = sorted(p.name for p in self.path.glob("*.bin")) + sorted(p.name for p in self.path.glob("*.pth"))
            extra = f" (only {bins[0]}: pickled weights are not read; save with safe_serialization)" if bins else ""
            raise self.error(f"no *.safetensors weights{extra}")
        return files

    def error(self, what: str) -> ModelFormatError:
        return ModelFormatError(f"{self.name}: {what}")

    def _dtype(self, hf: str) -> Any:
        import torch

        kind = self._where[hf].get_slice(hf).get_dtype()
        if kind not in DTYPES:
            raise self.error(f"tensor '{hf}' has dtype {kind}; supported: {', '.join(DTYPES)}")
        return {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[kind]

    @property
    def half(self) -> Any:
        """The graph's torch dtype when it is not f32 (the builder rounds its tables to it)."""
        import torch

        return None if self.dtype == torch.float32 else self.dtype

    def weight(self, name: str, shape: tuple[int, ...]) -> Any:
        """GGUF-named tensor `name` as a torch tensor over the mapped file, its shape checked."""

        from .hf_config import hf_name

        if name == "rope_freqs.weight" and self._factors is not None:  # Llama 3 scaling (hf_config.llama3_factors)
            return self._factors
        hf = hf_name(self.arch, name)
        if hf not in self._where:
            raise self.error(f"tensor '{hf}' is missing (the {self.config.d.get('model_type')} architecture needs it)")
        dt = self._dtype(hf)
        t = self._where[hf].get_tensor(hf)
        self.used.add(hf)
        if tuple(t.shape) != tuple(shape):
            raise self.error(f"tensor '{hf}' has shape {list(t.shape)} but config.json implies {list(shape)}")
        if self.arch.startswith("gemma") and name.endswith("norm.weight"):  # Hugging Face's Gemma norm: x * (1 + w)
            return (t.float() + 1.0).to(self.dtype)
        return t if dt == self.dtype else t.to(self.dtype)  # a checkpoint mixing dtypes (f32 norms)

    def packed(self, name: str, shape: tuple[int, int]) -> tuple[None, str]:
        return None, str(self.dtype).removeprefix("torch.")


class _GgufView:
    """`name in ckpt.tensors` for the GGUF names the builder probes (optional tensors)."""

    def __init__(self, ck: Checkpoint):
        self.ck = ck

    def __contains__(self, name: object) -> bool:
        from .hf_config import hf_name

        if name == "rope_freqs.weight":
            return self.ck._factors is not None
        return isinstance(name, str) and hf_name(self.ck.arch, name) in self.ck._where


def import_hf_dir(path: str | Path, max_seq: int = 2048) -> Graph:
    """The IR of a checkpoint directory: input_ids [1, seq] -> logits [1, seq, vocab]."""
    from .gguf import GraphBuilder
    from .hf_config import NATIVE, hparams, spec_for

    p = Path(path)
    c = read_config(p)
    model_type = c.get("model_type")
    if not isinstance(model_type, str):
        raise c.error("config field 'model_type' is missing")
    if c.get("quantization_config") is not None:
        method = (c.get("quantization_config") or {}).get("quant_method", "?")
        raise c.error(f"a quantized checkpoint ({method}) is not supported; give its bf16/f16/f32 weights "
                      "(or a GGUF file)")
    if model_type not in NATIVE:
        return _torch_route(p, c, model_type)
    arch = NATIVE[model_type]
    hp, act, factors = hparams(c, model_type)
    spec = spec_for(arch)
    spec = type(spec)(**{**spec.__dict__, "activation": act})
    ck = Checkpoint(p, c, arch, factors)
    if hp.window >= max_seq:  # a window no sequence reaches (Mistral's 4096 at --max-seq 2048): none
        hp = dataclasses.replace(hp, window=0, local_layers=tuple(False for _ in hp.local_layers))
    g = GraphBuilder(ck, hp, max_seq, spec).build()
    # a tensor the graph does not read is a feature it would silently drop (an MLP bias, a norm's bias)
    unused = sorted(n for n in set(ck._where) - ck.used if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ck.error(f"tensor '{unused[0]}' ({len(unused)} unused in all) is not part of the {model_type} "
                       "graph zlc builds; the checkpoint has a feature it does not support")
    g.metadata["hf"].update(model_type=model_type, dtype=str(ck.dtype).removeprefix("torch."))
    return g


def _torch_route(p: Path, c: Config, model_type: str) -> Graph:
    """A model type the builder does not know: transformers loads it (f32) and torch.export traces it."""
    from .hf_config import NATIVE

    try:
        import torch
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        raise c.error(f"model_type '{model_type}' needs transformers (pip install 'zlc[hf]'); "
                      f"built without it: {', '.join(NATIVE)}") from None
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise c.error(f"model_type '{model_type}' is not a causal LM zlc or transformers knows "
                      f"(built directly: {', '.join(NATIVE)}; others through transformers + torch.export)")
    from transformers import AutoModelForCausalLM

    from .fx import import_module

    try:
        model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32, attn_implementation="eager").eval()
    except Exception as e:
        raise c.error(f"transformers cannot load model_type '{model_type}': {str(e).splitlines()[0][:200]}") from None
    vocab = int(getattr(model.config, "vocab_size", 0) or 4)
    ids = torch.tensor([[i % vocab for i in (1, 2, 3, 4)]])
    try:
        g = import_module(model, (ids,))
    except ZlcError:  # an op the fx frontend names
        raise
    except Exception as e:  # an export failure deep in torch.export: one line naming the architecture
        why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise c.error(f"model_type '{model_type}' ({type(model).__name__}) does not export with "
                      f"torch.export: {why}") from None
    g.metadata["hf"] = {"model_type": model_type, "route": "torch.export"}
    return g
