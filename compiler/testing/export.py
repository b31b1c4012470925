"""The torch.onnx exports of the zoo's families: what ``torch.onnx.export`` users get.

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

    * mixture of experts (``mixtral``, ``qwen3_moe``): exported with transformers' ``batched_mm``
      experts implementation (the family's ``experts_implementation``, set as
      ``config._experts_implementation``): every token repeated top_k times, the experts' stacked
      weights gathered by the top-k indices (``GatherND``), batched matrix-vector ``MatMul`` nodes,
      ``TopK`` on the softmax of the router; all static-shaped. transformers' default
      (``grouped_mm``) fails: on CPU it is the opaque custom op ``transformers::grouped_mm_fallback``,
      which torch.onnx cannot translate ("No ONNX function found"); ``eager`` loops over
      ``nonzero()`` of the expert mask, a data-dependent guard torch.export refuses. ``batched_mm``
      is what a user exporting the model gets by passing ``experts_implementation="batched_mm"``.

``stateless_f16`` / ``stateless_bf16`` -- :func:`export_stateless` with ``dtype``
    The same export of the same weights cast to float16 / bfloat16: half-precision graphs (weights,
    activations and logits in that type), for the checks that must hold at any precision.

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
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zlc.testing.families import hf_model, kv_spec
from zlc.testing.quiet import quiet

if TYPE_CHECKING:  # heavy imports stay lazy: importing the zoo must not import torch/transformers
    import torch


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
    dtype: str = "float32",
) -> Path:
    """Export ``input_ids[1, seq] -> logits[1, seq, vocab]`` with ``torch.onnx.export(dynamo=True)``.

    ``seq`` is a dynamic axis (named ``"seq"``); batch is static 1. Saved as one file (no external
    data). ``attn_implementation="sdpa"`` at opset >= 23 yields the standard ``Attention`` op.
    ``dtype`` ("float16", "bfloat16"): the same weights cast, so the graph computes in that type.
    """
    import torch

    model = hf_model(family, seed, attn_implementation=attn_implementation).to(getattr(torch, dtype))
    return export_dynamo_stateless(model, Path(out_path), opset, example_len=7, external_data=False)


def export_dynamo_stateless(
    model: torch.nn.Module,
    out: Path,
    opset: int,
    *,
    example_len: int,
    external_data: bool,
    example: torch.Tensor | None = None,
) -> Path:
    """``torch.onnx.export(dynamo=True)`` of ``model`` as ``input_ids[1, seq] -> logits[1, seq, vocab]``
    (``seq`` dynamic) into ``out``; the example input is ``example`` or ``example_len`` tokens.
    ``external_data``: the weights go to a ``<out>.data`` file next to it."""
    import torch

    if example is None:
        cfg: Any = model.config
        vocab: int = cfg.vocab_size
        example = (torch.arange(example_len, dtype=torch.int64) * 37 % vocab)[None]
    with quiet(), torch.no_grad():
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
    with quiet(), torch.no_grad():
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


