"""The GGUF frontend: a llama.cpp model file -> the IR, built directly at the transformer level
(Embedding, RMSNorm, Linear, SplitHeads, RoPE, Attention, GatedMLP, LMHead) from the file's
architecture metadata and tensors, the form raising produces from an ONNX or torch export, so
KV-cache synthesis, the decode-vs-prefill check, scheduling and both kernels run unchanged.

Architectures: `llama` (SmolLM, TinyLlama, Mistral: llama.cpp writes those as llama), `qwen2`
(q/k/v biases), `qwen3` (per-head q/k RMSNorm). What llama.cpp's converter did to the weights is
undone here: llama-arch Q/K rows are permuted for its interleaved-pair rotary (`permute` in
convert_hf_to_gguf.py), so they are permuted back to Hugging Face's rotate-half order; a file
without `output.weight` ties the LM head to the token embedding. Weights are dequantized to f32
at import (gguf_file.GgufFile.weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from zlc.ir import Graph, Value
from zlc.ir.types import DType, TensorType

from .gguf_file import GgufFile

#: Architectures this frontend builds, and whether llama.cpp permuted their Q/K rows.
ARCHITECTURES: dict[str, bool] = {"llama": True, "qwen2": False, "qwen3": False}


@dataclass(frozen=True)
class HParams:
    """The hyper-parameters the graph is built from, all from the file's metadata."""

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

    @staticmethod
    def read(f: GgufFile) -> HParams:
        hidden = f.meta_int("{arch}.embedding_length")
        heads = f.meta_int("{arch}.attention.head_count")
        kv_heads = f.meta_int("{arch}.attention.head_count_kv", heads)
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
        if scaling not in ("none", ""):
            raise f.error(f"metadata '{f.arch}.rope.scaling.type' = {scaling!r}: rotary scaling is not supported")
        if f.has("{arch}.attention.sliding_window"):
            raise f.error(f"metadata '{f.arch}.attention.sliding_window': sliding-window GGUF models "
                          "are not supported")
        tokens = f.reader.get_field("tokenizer.ggml.tokens")
        vocab_default = len(tokens.data) if tokens is not None else f.shape("token_embd.weight")[0]
        return HParams(
            layers=f.meta_int("{arch}.block_count"), hidden=hidden,
            ffn=f.meta_int("{arch}.feed_forward_length"), heads=heads, kv_heads=kv_heads,
            head_dim=head_dim, rope_dim=rope_dim,
            rope_theta=f.meta_float("{arch}.rope.freq_base", 10000.0),
            eps=f.meta_float("{arch}.attention.layer_norm_rms_epsilon"),
            vocab=f.meta_int("{arch}.vocab_size", vocab_default), context=f.meta_int("{arch}.context_length"))


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's `permute` (rows of each head: rotate-half order -> pairs):
    back to Hugging Face's order, so RoPE is the rotate-half form (interleaved=0) raising produces."""
    n = w.shape[0]
    return np.ascontiguousarray(w.reshape(heads, n // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def rope_tables(hp: HParams, rows: int, freq_factors: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [rows, rope_dim/2] as Hugging Face's default rotary computes them (f32 torch), with
    llama.cpp's per-frequency divisors (`rope_freqs.weight`, Llama 3's scaling) when present."""
    inv = 1.0 / (hp.rope_theta ** (torch.arange(0, hp.rope_dim, 2, dtype=torch.int64).float() / hp.rope_dim))
    if freq_factors is not None:
        inv = inv / torch.from_numpy(freq_factors)
    ang = torch.arange(rows, dtype=torch.int64).float()[:, None] * inv[None, :]
    return ang.cos().numpy(), ang.sin().numpy()


class _Builder:
    def __init__(self, f: GgufFile, hp: HParams, max_seq: int):
        self.f, self.hp = f, hp
        self.g = Graph(Path(f.name).stem.replace(".", "_") or "gguf")
        self.max_seq = max_seq
        self.permuted = ARCHITECTURES[f.arch]

    def const(self, name: str, shape: tuple[int, ...]) -> Value:
        return self.g.add_const(name, self.f.weight(name, shape))

    def opt_const(self, name: str, shape: tuple[int, ...]) -> Value | None:
        return self.const(name, shape) if name in self.f.tensors else None

    def qk_weight(self, name: str, heads: int, shape: tuple[int, ...]) -> Value:
        w = self.f.weight(name, shape)
        return self.g.add_const(name, unpermute_qk(w, heads) if self.permuted else w)

    def qk_bias(self, name: str, heads: int, n: int) -> Value | None:
        if name not in self.f.tensors:
            return None
        b = self.f.weight(name, (n,))
        return self.g.add_const(name, unpermute_qk(b, heads) if self.permuted else b)

    def linear(self, x: Value, w: Value, b: Value | None) -> Value:
        return self.g.op("Linear", x, w, *([b] if b is not None else []))

    def build(self) -> Graph:
        g, hp, f = self.g, self.hp, self.f
        g.metadata["frontend"] = "gguf"
        g.metadata["gguf"] = {"architecture": f.arch, "context_length": hp.context}
        ids = g.add_input("input_ids", TensorType(DType.i64, (1, "seq")))
        embed = self.const("token_embd.weight", (hp.vocab, hp.hidden))
        x = g.op("Embedding", embed, ids)
        pos = g.op("Positions", ids)  # 0..T-1; KV-cache synthesis gives it the cache's past length
        factors = f.weight("rope_freqs.weight", (hp.rope_dim // 2,)) if "rope_freqs.weight" in f.tensors else None
        cos, sin = rope_tables(hp, self.max_seq, factors)
        cos_v, sin_v = g.add_const("rope.cos", cos), g.add_const("rope.sin", sin)
        for i in range(hp.layers):
            x = self.block(i, x, pos, cos_v, sin_v)
        x = g.op("RMSNorm", x, self.const("output_norm.weight", (hp.hidden,)), eps=hp.eps)
        if "output.weight" in f.tensors:
            head = self.const("output.weight", (hp.vocab, hp.hidden))
        else:  # llama.cpp omits the head of tied-embedding models (SmolLM2): it reads token_embd
            head, g.metadata["tied_embeddings"] = embed, True
        logits = g.add_node("LMHead", [x, head], name="lm_head", out_names=["logits"]).output
        g.outputs.append(logits)
        return g

    def block(self, i: int, x: Value, pos: Value, cos: Value, sin: Value) -> Value:
        g, hp = self.g, self.hp
        p = f"blk.{i}."
        qn, kvn = hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim
        h = g.op("RMSNorm", x, self.const(p + "attn_norm.weight", (hp.hidden,)), eps=hp.eps)
        q = self.linear(h, self.qk_weight(p + "attn_q.weight", hp.heads, (qn, hp.hidden)),
                        self.qk_bias(p + "attn_q.bias", hp.heads, qn))
        k = self.linear(h, self.qk_weight(p + "attn_k.weight", hp.kv_heads, (kvn, hp.hidden)),
                        self.qk_bias(p + "attn_k.bias", hp.kv_heads, kvn))
        v = self.linear(h, self.const(p + "attn_v.weight", (kvn, hp.hidden)),
                        self.opt_const(p + "attn_v.bias", (kvn,)))
        qh = g.op("SplitHeads", q, heads=hp.heads)
        kh = g.op("SplitHeads", k, heads=hp.kv_heads)
        vh = g.op("SplitHeads", v, heads=hp.kv_heads)
        q_norm = self.opt_const(p + "attn_q_norm.weight", (hp.head_dim,))  # Qwen3: per-head norms
        k_norm = self.opt_const(p + "attn_k_norm.weight", (hp.head_dim,))
        if q_norm is not None:
            qh = g.op("RMSNorm", qh, q_norm, eps=hp.eps)
        if k_norm is not None:
            kh = g.op("RMSNorm", kh, k_norm, eps=hp.eps)
        qh = g.op("RoPE", qh, cos, sin, pos, interleaved=0)
        kh = g.op("RoPE", kh, cos, sin, pos, interleaved=0)
        a = g.op("Attention", qh, kh, vh, causal=1, scale=1.0 / float(np.sqrt(hp.head_dim)))
        o = self.linear(g.op("MergeHeads", a), self.const(p + "attn_output.weight", (hp.hidden, qn)),
                        self.opt_const(p + "attn_output.bias", (hp.hidden,)))
        x = g.op("Add", x, o)
        h = g.op("RMSNorm", x, self.const(p + "ffn_norm.weight", (hp.hidden,)), eps=hp.eps)
        m = g.op("GatedMLP", h, self.const(p + "ffn_gate.weight", (hp.ffn, hp.hidden)),
                 self.const(p + "ffn_up.weight", (hp.ffn, hp.hidden)),
                 self.const(p + "ffn_down.weight", (hp.hidden, hp.ffn)), activation="silu")
        return g.op("Add", x, m)


def read_gguf(path: str | Path) -> tuple[GgufFile, HParams]:
    """The file and its hyper-parameters; ModelFormatError for an architecture zlc does not build."""
    f = GgufFile(path)
    if f.arch not in ARCHITECTURES:
        raise f.error(f"metadata 'general.architecture' = {f.arch!r} is not supported "
                      f"(GGUF architectures: {', '.join(ARCHITECTURES)})")
    hp = HParams.read(f)
    if ARCHITECTURES[f.arch] and hp.rope_dim != hp.head_dim:
        raise f.error(f"metadata '{f.arch}.rope.dimension_count' ({hp.rope_dim}) != the head size "
                      f"{hp.head_dim}: partial rotary on permuted llama weights is not supported")
    return f, hp


def import_gguf(path: str | Path, max_seq: int = 2048) -> Graph:
    """The IR of a GGUF model: input_ids [1, seq] -> logits [1, seq, vocab], rotary tables for
    `max_seq` positions."""
    f, hp = read_gguf(path)
    return _Builder(f, hp, max_seq).build()
