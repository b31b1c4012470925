"""KV-cache synthesis: from a raised graph derive a prefill graph (T tokens, writes the cache) and a
decode graph (one token, reads and appends the cache), with the cache owned by the compiler.

Two input shapes are handled the same way:
- stateless graphs (input_ids -> logits): each causal Attention's K/V are the current tokens';
- graphs that carry their cache (Optimum `past_key_values.*`/`present.*`, genai GQA lowered by the
  frontend): Attention reads Concat(past, new); the past inputs and present outputs are dropped
  and `new` goes to the compiler's cache instead.
Afterwards every graph takes `input_ids` and `past_len` (tokens already in the cache) and returns
`logits`; positions are `past_len + arange(T)`, and so is any position arithmetic raising left
op-level (`Range(0, T)`, `CumSum` of the mask, tables gathered at either: positions.py rebases it).
An attention mask input is assumed all ones (zlc owns the cache: no padding) and must be unused once
attention is raised. The driver then checks decode against prefill (kv_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zlc.errors import PassError
from zlc.ir import DType, Graph, Node, TensorType, Value
from zlc.ir.graph import reinfer

from . import positions, probe
from .dce import dce
from .match import prod


@dataclass
class CachedModel:
    prefill: Graph
    decode: Graph
    max_seq: int
    cache: list[tuple[str, TensorType]]  # state buffers: name, type
    rebased: list[str] = field(default_factory=list)  # position nodes rebased on past_len


def _unraised_attention(g: Graph) -> Node | None:
    """An op-level node that mixes tokens the way attention does (would ignore the cache)."""
    for n in g.nodes:
        if n.op == "Softmax":
            return n
        if n.op == "MatMul" and all(v is not None and v.data is None for v in n.inputs):
            return n
    return None


def _cache_split(kv: Value, past_role: str, roles: dict[str, str]) -> tuple[Value, Value | None]:
    """(new, past_input) for kv = Concat(past_input, new, axis=2); (kv, None) otherwise."""
    cat = prod(kv, "Concat")
    if cat is not None and len(cat.inputs) == 2 and cat.attrs.get("axis") in (2, -2):
        past, new = cat.inputs
        if past is not None and past.kind == "input" and roles.get(past.name) == past_role:
            assert new is not None
            return new, past
    return kv, None


def synthesize_kv_cache(g: Graph, max_seq: int) -> CachedModel:
    g = g.clone()
    roles = probe.classify_inputs(g)
    ids = next((v for v in g.inputs if roles.get(v.name) == probe.IDS), None)
    if ids is None or ids.shape is None or len(ids.shape) != 2:
        raise PassError("KV-cache synthesis needs a [batch, seq] token-id input")
    attn = [n for n in g.nodes if n.op == "Attention"]
    bad = _unraised_attention(g)
    if bad is not None and not attn:
        raise PassError("KV-cache synthesis found no raised Attention; the model's attention "
                        f"stayed op-level (node '{bad.name}', {bad.op}; see `zlc inspect --explain`)")
    if bad is not None:
        raise PassError(f"node '{bad.name}' ({bad.op}) looks like attention that was not raised; "
                        "a compiler-owned KV cache would silently skip it")
    # No attention and nothing that mixes tokens (e.g. embedding -> LM head): a model whose
    # cache is empty; each position depends on its own token only.
    past_len = g.add_input("past_len", TensorType(DType.i64, ()))
    cache: list[tuple[str, TensorType]] = []
    dropped_inputs: set[int] = set()
    for i, n in enumerate(attn):
        if not n.attrs.get("causal", 0):
            raise PassError(f"attention '{n.name}' is not causal; a decoder KV cache needs causal attention")
        if n.input(3) is not None:
            raise PassError(f"attention '{n.name}' already has a cache")
        q, k, v = n.inputs[0], n.inputs[1], n.inputs[2]
        assert q is not None and k is not None and v is not None
        k_new, k_past = _cache_split(k, probe.PAST_KEY, roles)
        v_new, v_past = _cache_split(v, probe.PAST_VALUE, roles)
        if (k_past is None) != (v_past is None):
            raise PassError(f"attention '{n.name}': only one of K/V reads a past-cache input")
        for p in (k_past, v_past):
            if p is not None:
                dropped_inputs.add(id(p))
        kt, vt = k_new.type, v_new.type
        if kt.shape is None or vt.shape is None or not all(isinstance(d, int) for d in (kt.shape[1], kt.shape[3], vt.shape[3])):
            raise PassError(f"attention '{n.name}': K/V head count and size must be static, got {kt} / {vt}")
        kc = g.add_state(f"cache.{i}.key", TensorType(kt.dtype, (1, kt.shape[1], max_seq, kt.shape[3])))
        vc = g.add_state(f"cache.{i}.value", TensorType(vt.dtype, (1, vt.shape[1], max_seq, vt.shape[3])))
        cache += [(kc.name, kc.type), (vc.name, vc.type)]
        n.inputs = [q, k_new, v_new, past_len, kc, vc]
    # Present outputs (Concat(past, new)) are not returned: the cache lives in state.
    g.outputs = [o for o in g.outputs
                 if not (o.producer is not None and o.producer.op == "Concat"
                         and any(x is not None and id(x) in dropped_inputs for x in o.producer.inputs))]
    if not g.outputs:
        raise PassError("the model has no outputs besides its cache")
    # Positions become past_len-relative; a position_ids input is replaced by them.
    pos_node: Value | None = None
    for n in list(g.nodes):
        if n.op == "Positions":
            if pos_node is None:  # one positions vector for the whole step, from the token ids
                n.inputs = [ids, past_len]
                n.attrs.pop("axis", None)
                pos_node = n.output
            else:
                g.replace_uses(n.output, pos_node)
    for v in list(g.inputs):
        if roles.get(v.name) == probe.POSITIONS:
            if pos_node is None:
                pn = g.make_node("Positions", [ids, past_len], name="positions")
                g.nodes.insert(0, pn)
                pos_node = pn.output
            g.replace_uses(v, pos_node)
            dropped_inputs.add(id(v))
    dce(g)
    # Position arithmetic raising did not absorb (Range(0, T), CumSum of the mask, tables gathered
    # at either) counts from 0 in every decode step: rebase it on past_len (positions.py).
    rebased, pos_node = positions.rebase_positions(g, ids, past_len, pos_node)
    folded = positions.fold_table_offsets(g)
    if rebased or folded:
        dce(g)
    users = g.users()
    for v in g.inputs:
        if roles.get(v.name) in (probe.MASK, probe.PAST_KEY, probe.PAST_VALUE, probe.PAST_LEN) and users.get(v):
            raise PassError(f"input '{v.name}' is still used by node '{users[v][0].name}' "
                            f"({users[v][0].op}) after attention was raised; cannot own the cache")
    g.inputs = [v for v in g.inputs if v is ids or v is past_len]
    g.toposort()
    g.metadata["max_seq"] = max_seq
    prefill = g
    prefill.name = "prefill"
    decode = g.clone()
    decode.name = "decode"
    d_ids = decode.inputs[0] if decode.inputs[0].name == ids.name else decode.value(ids.name)
    d_ids.type = TensorType(d_ids.dtype, (d_ids.shape[0], 1))  # type: ignore[index]
    reinfer(decode)
    return CachedModel(prefill, decode, max_seq, cache, rebased)
