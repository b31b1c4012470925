"""The GGUF frontend: a llama.cpp model file -> the IR, built directly at the transformer level
(Embedding, RMSNorm, Linear, SplitHeads, RoPE, Attention, GatedMLP, LMHead) from the file's
architecture metadata and tensors, the form raising produces from an ONNX or torch export, so
KV-cache synthesis, the decode-vs-prefill check, scheduling and both kernels run unchanged.

Architectures (gguf_arch.ARCHITECTURES, which also says what llama.cpp's converter did to each
and what llama.cpp's graph applies without writing it): `llama` (SmolLM, TinyLlama, Mistral:
llama.cpp writes those as llama; Q/K rows permuted for its interleaved-pair rotary, permuted back
here to Hugging Face's rotate-half order), `qwen2` (q/k/v biases), `qwen3` (per-head q/k
RMSNorm), `gemma`, `gemma2`, `gemma3` (scaled embeddings, sandwich norms, sliding-window layers,
soft-caps, two rope bases), `phi3` (fused projections, split at import). A file without
`output.weight` ties the LM head to the token embedding.

Weights stay in the file's blocks where the kernels stream them: a matrix read by a Linear, the
MLP or the LM head whose tensor type is a packed format (ir/quant.py: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
Q4_K, Q5_K, Q6_K) becomes a constant whose `quant` is those blocks (row-permuted or split as the
matrix is: blocks lie along K) and whose data is their exact dequantization (what the reference
executor reads). So does the token embedding's table (the native kernel gathers a token's row of
blocks; a tied LM head reads the same constant: one packed table, no dense copy). Dense, with the
reason in `metadata["gguf"]["dense"]`: norms and biases, other block types (dequantized to f32 by
gguf).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zlc.ir import Graph, Value
from zlc.ir.quant import Dequantized
from zlc.ir.types import DType, TensorType

from .gguf_arch import ARCHITECTURES, ArchSpec
from .gguf_file import GgufFile


@dataclass(frozen=True)
class HParams:
    """The hyper-parameters the graph is built from, all from the file's metadata (and, where
    llama.cpp does not write them, its defaults: gguf_arch)."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_dim: int
    rope_theta: float
    eps: float
    vocab: int
    context: int
    rope_linear: float = 1.0  # linear rope scaling factor (positions / factor) of the global layers
    rope_theta_local: float | None = None  # the local (sliding-window) layers' rope base, if different
    window: int = 0  # sliding window of the local layers (0: none)
    local_layers: tuple[bool, ...] = ()  # per layer: whether it is a local (windowed) one
    attn_scale: float = 0.0  # score scale (0: head_dim^-0.5)
    attn_softcap: float = 0.0
    final_softcap: float = 0.0

    @staticmethod
    def read(f: GgufFile) -> HParams:
        spec = ARCHITECTURES[f.arch]
        hidden = f.meta_int("{arch}.embedding_length")
        heads = f.meta_int("{arch}.attention.head_count")
        kv_heads = f.meta_int("{arch}.attention.head_count_kv", heads)
        layers = f.meta_int("{arch}.block_count")
        if heads % kv_heads:
            raise f.error(f"metadata '{f.arch}.attention.head_count' ({heads}) is not a multiple of "
                          f"'{f.arch}.attention.head_count_kv' ({kv_heads})")
        if not f.has("{arch}.attention.key_length") and hidden % heads:
            raise f.error(f"metadata '{f.arch}.embedding_length' ({hidden}) does not split into "
                          f"{heads} heads and '{f.arch}.attention.key_length' is absent")
        head_dim = f.meta_int("{arch}.attention.key_length", hidden // heads)
        if f.meta_int("{arch}.attention.value_length", head_dim) != head_dim:
            raise f.error(f"metadata '{f.arch}.attention.value_length' differs from the key length {head_dim}")
        rope_dim = f.meta_int("{arch}.rope.dimension_count", head_dim)
        if rope_dim > head_dim or rope_dim % 2:
            raise f.error(f"metadata '{f.arch}.rope.dimension_count' ({rope_dim}) must be even and <= the "
                          f"head size {head_dim}")
        scaling = f.meta("{arch}.rope.scaling.type", "none")
        linear = 1.0
        if scaling == "linear":
            linear = f.meta_float("{arch}.rope.scaling.factor")
        elif scaling not in ("none", ""):
            raise f.error(f"metadata '{f.arch}.rope.scaling.type' = {scaling!r}: only linear rotary "
                          "scaling is supported")
        window, local = 0, tuple(False for _ in range(layers))
        if f.has("{arch}.attention.sliding_window"):
            if not spec.window:  # llama.cpp's llama/qwen graphs have no window; zlc would differ from it
                raise f.error(f"metadata '{f.arch}.attention.sliding_window': sliding-window {f.arch} "
                              "models are not supported")
            window = f.meta_int("{arch}.attention.sliding_window")
            local = _local_layers(f, layers, spec.swa_pattern)
        theta = f.meta_float("{arch}.rope.freq_base", 10000.0)
        local_theta = spec.local_rope_base if spec.local_rope_base is not None else theta
        local_theta = f.meta_float("{arch}.rope.freq_base_swa", local_theta)
        wide = spec.wide_scale_layers is not None and layers == spec.wide_scale_layers
        scale = f.meta_float("{arch}.attention.scale", (hidden / heads if wide else head_dim) ** -0.5)
        tokens = f.reader.get_field("tokenizer.ggml.tokens")
        vocab_default = len(tokens.data) if tokens is not None else f.shape("token_embd.weight")[0]
        return HParams(
            layers=layers, hidden=hidden,
            ffn=f.meta_int("{arch}.feed_forward_length"), heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, rope_dim=rope_dim, rope_theta=theta,
            eps=f.meta_float("{arch}.attention.layer_norm_rms_epsilon"),
            vocab=f.meta_int("{arch}.vocab_size", vocab_default), context=f.meta_int("{arch}.context_length"),
            rope_linear=linear,
            rope_theta_local=(local_theta if spec.local_rope_base is not None or f.has("{arch}.rope.freq_base_swa")
                              else None),
            window=window, local_layers=local, attn_scale=scale,
            attn_softcap=float(f.meta("{arch}.attn_logit_softcapping", 0.0) or 0.0),
            final_softcap=float(f.meta("{arch}.final_logit_softcapping", 0.0) or 0.0))


def _local_layers(f: GgufFile, layers: int, pattern: int) -> tuple[bool, ...]:
    """Which layers are sliding-window ones: the file's per-layer list or period, else the
    architecture's llama.cpp default period (every `pattern`-th layer global; 0: all local)."""
    key = f"{f.arch}.attention.sliding_window_pattern"
    v = f.meta(key, pattern)
    if isinstance(v, list):
        if len(v) != layers:
            raise f.error(f"metadata '{key}' lists {len(v)} layers, not the {layers} of '{f.arch}.block_count'")
        return tuple(bool(x) for x in v)
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or int(v) < 0:
        raise f.error(f"metadata '{key}' must be a per-layer list or a period >= 0, got {v!r}")
    n = int(v)
    return tuple(n == 0 or i % n < n - 1 for i in range(layers))


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute` (rows of each head: rotate-half order -> pairs):
    back to Hugging Face's order, so RoPE is the rotate-half form (interleaved=0) raising produces."""
    n = w.shape[0]
    return np.ascontiguousarray(w.reshape(heads, n // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def rope_tables(hp: HParams, rows: int, theta: float, linear: float,
                freq_factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [rows, rope_dim/2] as Hugging Face's default rotary computes them (f32 torch) for
    base `theta`, its linear scaling (frequencies / `linear`), and llama.cpp's per-frequency
    divisors (`rope_freqs.weight`, Llama 3's scaling) when present."""
    inv = 1.0 / (theta ** (torch.arange(0, hp.rope_dim, 2, dtype=torch.int64).float() / hp.rope_dim))
    if freq_factors is not None:
        inv = inv / torch.from_numpy(freq_factors)
    inv = inv / linear
    ang = torch.arange(rows, dtype=torch.int64).float()[:, None] * inv[None, :]
    return ang.cos().numpy(), ang.sin().numpy()


class GraphBuilder:
    """The graph of `f`: a GgufFile, or a source with its interface (hf_dir.Checkpoint: a Hugging
    Face checkpoint directory, built with that family's `spec`; its `half` dtype, if any, is the
    graph's: the rotary tables and scalars are rounded to it, as Hugging Face rounds them)."""

    def __init__(self, f: Any, hp: HParams, max_seq: int, spec: ArchSpec | None = None):
        self.f, self.hp = f, hp
        self.spec = spec or ARCHITECTURES[f.arch]
        self.g = Graph(getattr(f, "stem", Path(f.name).stem).replace(".", "_") or "gguf")
        self.half = getattr(f, "half", None)  # torch dtype of a half-precision graph, else None (f32)
        self.max_seq = max_seq
        self.packed: dict[str, str] = {}  # constant -> its format (metadata["gguf"]["packed"])
        self.dense: dict[str, str] = {}  # matrix constant -> why it is not packed

    def const(self, name: str, shape: tuple[int, ...]) -> Value:
        return self.g.add_const(name, self.f.weight(name, shape))

    def matrix(self, name: str, shape: tuple[int, int], rows: np.ndarray | slice | None = None,
               as_name: str | None = None) -> Value:
        """A Linear's [N, K] weight, its rows `rows` of the file's tensor (a permutation, a split),
        kept in the file's blocks where the kernels stream them."""
        q, why = self.f.packed(name, shape)
        as_name = as_name or name
        if q is None:
            w = self.f.weight(name, shape)
            self.dense[as_name] = why
            if rows is not None:  # a row permutation or split: a view where rows are a slice
                w = w[rows] if isinstance(rows, slice) or isinstance(w, np.ndarray) else w[torch.from_numpy(rows)]
            return self.g.add_const(as_name, np.ascontiguousarray(w) if isinstance(w, np.ndarray) else w)
        if rows is not None:
            q = q.rows(rows)
        v = self.g.add_const(as_name, Dequantized(q))  # f32 where read, never kept: the blocks are the data
        v.quant = q
        self.packed[as_name] = q.format.name
        return v

    def opt_const(self, name: str, shape: tuple[int, ...]) -> Value | None:
        return self.const(name, shape) if name in self.f.tensors else None

    def qk_weight(self, name: str, heads: int, shape: tuple[int, int]) -> Value:
        """A Q or K weight, un-permuted where llama.cpp permuted it."""
        return self.matrix(name, shape, unpermute_qk(np.arange(shape[0]), heads) if self.spec.permuted_qk else None)

    def qk_bias(self, name: str, heads: int, n: int) -> Value | None:
        if name not in self.f.tensors:
            return None
        w = self.f.weight(name, (n,))
        return self.g.add_const(name, unpermute_qk(w, heads) if self.spec.permuted_qk else w)

    def linear(self, x: Value, w: Value, b: Value | None) -> Value:
        return self.g.op("Linear", x, w, *([b] if b is not None else []))

    def rope(self, name: str, theta: float, linear: float) -> tuple[Value, Value]:
        f, hp = self.f, self.hp
        factors = f.weight("rope_freqs.weight", (hp.rope_dim // 2,)) if "rope_freqs.weight" in f.tensors else None
        cos, sin = rope_tables(hp, self.max_seq, theta, linear, factors)
        return self.g.add_const(f"{name}.cos", self.table(cos)), self.g.add_const(f"{name}.sin", self.table(sin))

    def table(self, a: np.ndarray) -> Any:
        """An f32 table or scalar the builder computes, in the graph's dtype."""
        return a if self.half is None else torch.from_numpy(np.asarray(a)).to(self.half)

    def build(self) -> Graph:
        g, hp, f = self.g, self.hp, self.f
        for t in ("rope_factors_long.weight", "rope_factors_short.weight"):
            if t in f.tensors:
                raise f.error(f"tensor '{t}': LongRoPE scaling is not supported")
        source = getattr(f, "frontend", "gguf")
        g.metadata["frontend"] = source
        g.metadata[source] = {"architecture": f.arch, "context_length": hp.context,
                              "packed": self.packed, "dense": self.dense}
        ids = g.add_input("input_ids", TensorType(DType.i64, (1, "seq")))
        # the token table stays in the file's blocks where they are packed: the native kernel
        # gathers a token's row of blocks, a tied LM head streams the same ones (one copy)
        embed = self.matrix("token_embd.weight", (hp.vocab, hp.hidden))
        x = g.op("Embedding", embed, ids)
        if self.spec.embed_scale:  # Gemma: llama.cpp's graph scales, as HF does (the scalar in f32)
            x = g.op("Mul", x, g.add_const("embed_scale", self.table(np.array(hp.hidden ** 0.5, dtype=np.float32))))
        pos = g.op("Positions", ids)  # 0..T-1; KV-cache synthesis gives it the cache's past length
        tables = {False: self.rope("rope", hp.rope_theta, hp.rope_linear)}
        if hp.rope_theta_local is not None and any(hp.local_layers):  # Gemma 3: local layers, own base, unscaled
            tables[True] = self.rope("rope_local", hp.rope_theta_local, 1.0)
        for i in range(hp.layers):
            local = bool(hp.local_layers[i]) if hp.local_layers else False
            cos_v, sin_v = tables.get(local, tables[False])
            x = self.block(i, x, pos, cos_v, sin_v, hp.window if local else 0)
        x = g.op("RMSNorm", x, self.const("output_norm.weight", (hp.hidden,)), eps=hp.eps)
        if "output.weight" in f.tensors:
            head = self.matrix("output.weight", (hp.vocab, hp.hidden))
        else:  # llama.cpp omits the head of tied-embedding models (SmolLM2, Gemma): it reads token_embd
            g.metadata["tied_embeddings"] = True
            head = embed
        attrs = {"softcap": hp.final_softcap} if hp.final_softcap else {}
        logits = g.add_node("LMHead", [x, head], attrs, name="lm_head", out_names=["logits"]).output
        g.outputs.append(logits)
        return g

    def qkv(self, p: str, h: Value) -> tuple[Value, Value, Value]:
        """The block's q, k, v projections ([B, T, heads*head_dim] each)."""
        hp = self.hp
        qn, kvn = hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim
        if self.spec.fused:  # Phi-3: one [q; k; v] matrix, split here into three Linears
            name, shape = p + "attn_qkv.weight", (qn + 2 * kvn, hp.hidden)
            q, k, v = (self.linear(h, self.matrix(name, shape, slice(a, b), f"{p}attn_{n}.weight"), None)
                       for n, a, b in (("q", 0, qn), ("k", qn, qn + kvn), ("v", qn + kvn, qn + 2 * kvn)))
            return q, k, v
        q = self.linear(h, self.qk_weight(p + "attn_q.weight", hp.heads, (qn, hp.hidden)),
                        self.qk_bias(p + "attn_q.bias", hp.heads, qn))
        k = self.linear(h, self.qk_weight(p + "attn_k.weight", hp.kv_heads, (kvn, hp.hidden)),
                        self.qk_bias(p + "attn_k.bias", hp.kv_heads, kvn))
        v = self.linear(h, self.matrix(p + "attn_v.weight", (kvn, hp.hidden)),
                        self.opt_const(p + "attn_v.bias", (kvn,)))
        return q, k, v

    def mlp(self, p: str, h: Value) -> Value:
        hp = self.hp
        if self.spec.fused:  # Phi-3: ffn_up holds [gate; up]
            name, shape = p + "ffn_up.weight", (2 * hp.ffn, hp.hidden)
            wg = self.matrix(name, shape, slice(0, hp.ffn), p + "ffn_gate.weight")
            wu = self.matrix(name, shape, slice(hp.ffn, 2 * hp.ffn), p + "ffn_up.weight")
        else:
            wg = self.matrix(p + "ffn_gate.weight", (hp.ffn, hp.hidden))
            wu = self.matrix(p + "ffn_up.weight", (hp.ffn, hp.hidden))
        if (wg.quant is None) != (wu.quant is None) or (wg.quant and wu.quant and wg.quant.format != wu.quant.format):
            for v, other in ((wg, wu), (wu, wg)):  # one descriptor word holds the gated pair's format
                self.dense[v.name] = (f"{v.quant.format.name if v.quant else 'dense'}, but its gated pair "
                                      f"'{other.name}' is {other.quant.format.name if other.quant else 'dense'}")
                self.packed.pop(v.name, None)
                v.quant = None
        return self.g.op("GatedMLP", h, wg, wu, self.matrix(p + "ffn_down.weight", (hp.hidden, hp.ffn)),
                         activation=self.spec.activation)

    def post_norm(self, name: str, x: Value) -> Value:
        """Gemma 2/3's norm on a sublayer's output, before the residual add."""
        if not self.spec.sandwich_norms:
            return x
        return self.g.op("RMSNorm", x, self.const(name, (self.hp.hidden,)), eps=self.hp.eps)

    def block(self, i: int, x: Value, pos: Value, cos: Value, sin: Value, window: int) -> Value:
        g, hp = self.g, self.hp
        p = f"blk.{i}."
        h = g.op("RMSNorm", x, self.const(p + "attn_norm.weight", (hp.hidden,)), eps=hp.eps)
        q, k, v = self.qkv(p, h)
        qh = g.op("SplitHeads", q, heads=hp.heads)
        kh = g.op("SplitHeads", k, heads=hp.kv_heads)
        vh = g.op("SplitHeads", v, heads=hp.kv_heads)
        q_norm = self.opt_const(p + "attn_q_norm.weight", (hp.head_dim,))  # Qwen3, Gemma 3: per-head norms
        k_norm = self.opt_const(p + "attn_k_norm.weight", (hp.head_dim,))
        if q_norm is not None:
            qh = g.op("RMSNorm", qh, q_norm, eps=hp.eps)
        if k_norm is not None:
            kh = g.op("RMSNorm", kh, k_norm, eps=hp.eps)
        qh = g.op("RoPE", qh, cos, sin, pos, interleaved=0)
        kh = g.op("RoPE", kh, cos, sin, pos, interleaved=0)
        attrs: dict[str, float | int] = {"causal": 1, "scale": hp.attn_scale}
        if window:
            attrs["window"] = window
        if hp.attn_softcap:
            attrs["softcap"] = hp.attn_softcap
        a = g.op("Attention", qh, kh, vh, **attrs)
        qn = hp.heads * hp.head_dim
        o = self.linear(g.op("MergeHeads", a), self.matrix(p + "attn_output.weight", (hp.hidden, qn)),
                        self.opt_const(p + "attn_output.bias", (hp.hidden,)))
        x = g.op("Add", x, self.post_norm(p + "post_attention_norm.weight", o))
        h = g.op("RMSNorm", x, self.const(p + "ffn_norm.weight", (hp.hidden,)), eps=hp.eps)
        return g.op("Add", x, self.post_norm(p + "post_ffw_norm.weight", self.mlp(p, h)))


def read_gguf(path: str | Path) -> tuple[GgufFile, HParams]:
    """The file and its hyper-parameters; ModelFormatError for an architecture zlc does not build."""
    f = GgufFile(path)
    if f.arch not in ARCHITECTURES:
        raise f.error(f"metadata 'general.architecture' = {f.arch!r} is not supported "
                      f"(GGUF architectures: {', '.join(ARCHITECTURES)})")
    hp = HParams.read(f)
    if ARCHITECTURES[f.arch].permuted_qk and hp.rope_dim != hp.head_dim:
        raise f.error(f"metadata '{f.arch}.rope.dimension_count' ({hp.rope_dim}) != the head size "
                      f"{hp.head_dim}: partial rotary on permuted llama weights is not supported")
    return f, hp


def import_gguf(path: str | Path, max_seq: int = 2048) -> Graph:
    """The IR of a GGUF model: input_ids [1, seq] -> logits [1, seq, vocab], rotary tables for
    `max_seq` positions."""
    f, hp = read_gguf(path)
    return GraphBuilder(f, hp, max_seq).build()
