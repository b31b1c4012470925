"""Transformer-level definitions: what raising produces and what codegen tiles (Embedding, the
norms, Linear, RoPE, Attention, the MLPs, head splitting). ops.py assembles the op table from these
and the op-level definitions."""

from __future__ import annotations

from functools import partial

from zlc.errors import ShapeError

from .opdef import OpDef, define, dim_mul, is_int, norm_axis, type_of
from .types import Dim, DType, TensorType
from .values import Node, Value

DEFS: dict[str, OpDef] = {}
_def = partial(define, DEFS)


def _need_rank(v: Value | None, rank: int, node: Node, what: str) -> tuple[Dim, ...]:
    t = type_of(v)
    if t.shape is None or len(t.shape) != rank:
        raise ShapeError(f"{node.op} '{node.name}': {what} must have rank {rank}, got {t}")
    return t.shape


@_def("Embedding", "transformer", 2, 2, "inputs: weight[V, H], ids")
def _embedding(node: Node) -> list[TensorType]:
    w, ids = type_of(node.inputs[0]), type_of(node.inputs[1])
    ws = _need_rank(node.inputs[0], 2, node, "weight")
    return [TensorType(w.dtype, None if ids.shape is None else tuple(ids.shape) + (ws[1],))]


@_def("RMSNorm", "transformer", 2, 2,
      "inputs: x, weight; attrs: eps. Over the last axis; on split heads x[B, H, T, D] with weight[D] "
      "it is a per-head q/k norm (Qwen3, Gemma 3), which the megakernel applies where q/k are loaded")
def _rmsnorm(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]


@_def("LayerNorm", "transformer", 2, 3, "inputs: x, weight, bias?; attrs: eps")
def _layernorm(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]


def _linear_like(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
    ws = _need_rank(node.inputs[1], 2, node, "weight [out, in]")
    if x.shape is None:
        return [TensorType(x.dtype, None)]
    k = x.shape[-1]
    if is_int(k) and is_int(ws[1]) and k != ws[1]:
        raise ShapeError(f"{node.op} '{node.name}': input features {k} != weight in-features {ws[1]}")
    return [TensorType(x.dtype, tuple(x.shape[:-1]) + (ws[0],))]


_def("Linear", "transformer", 2, 3, "inputs: x[..., K], weight[N, K], bias[N]?")(_linear_like)
_def("LMHead", "transformer", 2, 3, "inputs: x[..., K], weight[V, K], bias[V]?; attrs: softcap (the "
     "logits become softcap * tanh(logits / softcap), Gemma 2's final-logit soft-capping; 0 or "
     "absent: none)")(_linear_like)


@_def("RoPE", "transformer", 3, 4,
      "inputs: x[B, H, T, D], cos, sin, positions?; with positions[B|1, T], cos/sin are tables "
      "[P, R/2] indexed by position; without, they are per-token [B|1, T, R/2]. R <= D rotates the "
      "first R features (partial rotary). attrs: interleaved")
def _rope(node: Node) -> list[TensorType]:
    _need_rank(node.inputs[0], 4, node, "x [B, H, T, D]")
    return [type_of(node.inputs[0])]


@_def("Attention", "transformer", 3, 6,
      "inputs: q[B, Hq, T, D], k[B, Hkv, S, D], v[B, Hkv, S, Dv], past_len?, k_cache?, v_cache?; "
      "attrs: scale, causal, softcap (scores become softcap * tanh(scores / softcap)), window "
      "(causal sliding window: the query at position p attends over keys p-window+1..p; 0 or "
      "absent: all earlier keys), alibi. With a cache, k/v are the new tokens: they are written at "
      "past_len and q attends over cache[:past_len+T] (within the window). alibi: per-query-head "
      "slopes [Hq] (ALiBi, BLOOM / MPT): the scaled score of key position j gains alibi[h] * j "
      "(absolute positions, so decode equals prefill; softmax ignores each row's constant).")
def _attention(node: Node) -> list[TensorType]:
    q = _need_rank(node.inputs[0], 4, node, "q [B, Hq, T, D]")
    k = _need_rank(node.inputs[1], 4, node, "k [B, Hkv, S, D]")
    v = _need_rank(node.inputs[2], 4, node, "v [B, Hkv, S, Dv]")
    if is_int(q[1]) and is_int(k[1]) and int(q[1]) % int(k[1]):
        raise ShapeError(f"Attention '{node.name}': {q[1]} query heads not a multiple of {k[1]} KV heads")
    if is_int(q[3]) and is_int(k[3]) and q[3] != k[3]:
        raise ShapeError(f"Attention '{node.name}': query head size {q[3]} != key head size {k[3]}")
    return [TensorType(type_of(node.inputs[0]).dtype, (q[0], q[1], q[2], v[3]))]


@_def("GatedMLP", "transformer", 4, 4,
      "inputs: x, w_gate[F, H], w_up[F, H], w_down[H, F]; attrs: activation (silu|gelu|gelu_tanh)")
def _gated_mlp(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]


@_def("MoE", "transformer", 5, 5,
      "mixture of experts: inputs: x[..., H], w_router[E, H], w_gate[E, F, H], w_up[E, F, H], "
      "w_down[E, H, F]; attrs: top_k, normalize (0|1), activation (silu|gelu|gelu_tanh). Per token: "
      "p = softmax(x w_router^T) over the E experts (in f32), its top_k largest p_i (ties: the lower "
      "expert), divided by their sum when normalize; out = sum_i p_i * GatedMLP(x, w_gate[e_i], "
      "w_up[e_i], w_down[e_i]) over the selected experts e_i only")
def _moe(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
    e, h = _need_rank(node.inputs[1], 2, node, "w_router [E, H]")
    for i, what in ((2, "w_gate [E, F, H]"), (3, "w_up [E, F, H]"), (4, "w_down [E, H, F]")):
        if _need_rank(node.inputs[i], 3, node, what)[0] != e:
            raise ShapeError(f"MoE '{node.name}': {what} does not have the router's {e} experts")
    k = int(node.attrs["top_k"])
    if is_int(e) and not 1 <= k <= int(e):
        raise ShapeError(f"MoE '{node.name}': top_k={k} outside 1..{e} experts")
    if x.shape is not None and is_int(x.shape[-1]) and is_int(h) and x.shape[-1] != h:
        raise ShapeError(f"MoE '{node.name}': input features {x.shape[-1]} != router in-features {h}")
    return [x]


@_def("MLP", "transformer", 5, 5,
      "inputs: x, w_up[F, H], b_up?, w_down[H, F], b_down?; attrs: activation", optional=(2, 4))
def _mlp(node: Node) -> list[TensorType]:
    return [type_of(node.inputs[0])]


@_def("Positions", "transformer", 1, 2,
      "inputs: ids[B, T] (or any activation with the tokens on axis `axis`: only that extent is "
      "read), past_len? (i64 scalar); attrs: axis (default 1); output i64[1, T] = past_len + "
      "arange(T): the absolute positions of the current tokens, what RoPE tables are indexed by")
def _positions(node: Node) -> list[TensorType]:
    x = type_of(node.inputs[0])
    if x.shape is None or len(x.shape) < 2:
        raise ShapeError(f"Positions '{node.name}': input must have a token axis, got {x}")
    return [TensorType(DType.i64, (1, x.shape[norm_axis(int(node.attrs.get("axis", 1)), len(x.shape), node)]))]


@_def("SplitHeads", "transformer", 1, 1, "x[B, T, H*D] -> [B, H, T, D]; attrs: heads")
def _split_heads(node: Node) -> list[TensorType]:
    b, t, hd = _need_rank(node.inputs[0], 3, node, "x [B, T, H*D]")
    h = int(node.attrs["heads"])
    if not is_int(hd) or int(hd) % h:
        raise ShapeError(f"SplitHeads '{node.name}': {hd} features do not split into {h} heads")
    return [TensorType(type_of(node.inputs[0]).dtype, (b, h, t, int(hd) // h))]


@_def("MergeHeads", "transformer", 1, 1, "x[B, H, T, D] -> [B, T, H*D]")
def _merge_heads(node: Node) -> list[TensorType]:
    b, h, t, d = _need_rank(node.inputs[0], 4, node, "x [B, H, T, D]")
    return [TensorType(type_of(node.inputs[0]).dtype, (b, t, dim_mul(h, d)))]
