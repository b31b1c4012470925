"""Semantic probing: evaluate a position-only subgraph (causal masks, rotary tables, activation
chains) with the reference kernels (zlc.reference.evaluate) to learn what it computes.

Exporters spell the same thing many ways (a causal mask as Trilu, as Range/LessOrEqual, as
transformers' cumsum-and-GatherND packing check; GELU as Erf, Tanh or a Gelu op; rotary tables
with every scaling scheme). Matching all spellings structurally is endless; evaluating the
subgraph on probe inputs and comparing against the canonical definition is exact for every
spelling, as long as the subgraph depends only on *positions*: the shapes of the token inputs,
position ids, and an attention mask assumed all ones (zlc owns the cache: no padding).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from zlc.errors import ZlcError
from zlc.ir import Graph, Node, Value
from zlc.reference.evaluate import evaluate as run_nodes
from zlc.reference.kernels import const_tensor

# Roles of graph inputs, assigned by name and type (see classify_inputs).
IDS, MASK, POSITIONS, PAST_KEY, PAST_VALUE, PAST_LEN = (
    "input_ids", "attention_mask", "position_ids", "past_key", "past_value", "past_len")


def classify_inputs(g: Graph) -> dict[str, str]:
    """Maps input name -> role for decoder LM graphs (HF, Optimum and genai naming)."""
    roles: dict[str, str] = {}
    for v in g.inputs:
        n = v.name.lower()
        if v.dtype.is_float and ("past" in n or "cache" in n):
            # "past_key_values.0.key": the suffix decides, not the "values" in the prefix
            tail = n.replace("past_key_values", "").replace("key_values", "")
            roles[v.name] = PAST_VALUE if ("value" in tail or tail.endswith(("_v", ".v"))) else PAST_KEY
        elif "mask" in n:
            roles[v.name] = MASK
        elif "position" in n:
            roles[v.name] = POSITIONS
        elif "past_len" in n or "seqlens" in n:
            roles[v.name] = PAST_LEN
        elif not v.dtype.is_float and ("ids" in n or "input" in n or "token" in n):
            roles[v.name] = IDS
    return roles


def closure(g: Graph, targets: Sequence[Value]) -> list[Node]:
    """Nodes the targets depend on, in dependency order (rewrites in progress may have appended
    nodes out of order to g.nodes, so the order is computed here, not taken from the graph)."""
    order: list[Node] = []
    state: dict[int, int] = {}
    for t in targets:
        root = t.producer
        if root is None or id(root) in state:
            continue
        stack: list[tuple[Node, int]] = [(root, 0)]
        state[id(root)] = 1
        while stack:
            n, i = stack.pop()
            if i < len(n.inputs):
                stack.append((n, i + 1))
                v = n.inputs[i]
                p = v.producer if v is not None else None
                if p is not None and id(p) not in state:
                    state[id(p)] = 1
                    stack.append((p, 0))
            else:
                order.append(n)
    return order


def value_inputs(g: Graph, targets: Sequence[Value]) -> tuple[set[str], set[str]]:
    """Graph inputs the targets read by value, and those they read only through shapes.

    Walks backward from the targets: a value is needed by value unless every path to the targets
    goes through a Shape/Size node (e.g. Concat(past) -> Shape reads only the past's length) or
    the ids of a Positions node (a learned table raised to Embedding(W, Positions(ids)) first)."""
    by_value_ids: set[int] = {id(t) for t in targets}
    by_shape_ids: set[int] = set()
    for n in reversed(closure(g, targets)):
        if not any(id(o) in by_value_ids for o in n.outputs):
            if any(id(o) in by_shape_ids for o in n.outputs):
                by_shape_ids.update(id(v) for v in n.inputs if v is not None)
            continue
        if n.op == "Positions":  # reads its ids' extent only (and a past length by value)
            by_shape_ids.add(id(n.inputs[0]))
            by_value_ids.update(id(v) for v in n.inputs[1:] if v is not None)
            continue
        dest = by_shape_ids if n.op in ("Shape", "Size") else by_value_ids
        dest.update(id(v) for v in n.inputs if v is not None)
    by_value = {v.name for v in g.inputs if id(v) in by_value_ids}
    by_shape = {v.name for v in g.inputs if id(v) in by_shape_ids} - by_value
    return by_value, by_shape


def is_position_only(g: Graph, targets: Sequence[Value],
                     allowed: Iterable[str | None] = (POSITIONS, MASK)) -> str | None:
    """None if the targets depend on token inputs only through shapes; else the reason."""
    roles = classify_inputs(g)
    allowed = set(allowed)
    by_value, _ = value_inputs(g, targets)
    for name in by_value:
        role = roles.get(name)
        if role not in allowed:
            return f"depends on the values of input '{name}' ({role or 'unknown role'})"
    for n in closure(g, targets):
        if any(v is not None and v.kind == "state" for v in n.inputs):
            return f"depends on compiler state through '{n.name}'"
    return None


def past_dims(g: Graph, v: Value) -> list[int]:
    """Static dims of a past-cache input [B, H, past, D]. Exporters may name the head dims
    symbolically (genai's `kv_cache_dim`); the new K/V concatenated onto it knows them."""
    dims = [d if isinstance(d, int) else 1 for d in (v.shape or ())]
    for n in g.nodes:
        if n.op == "Concat" and any(x is v for x in n.inputs):
            for x in n.inputs:
                if x is not v and x is not None and x.shape is not None and len(x.shape) == len(dims):
                    axis = n.attrs.get("axis", 0) % len(dims)
                    dims = [int(o) if (i != axis and isinstance(o, int)) else d
                            for i, (d, o) in enumerate(zip(dims, x.shape, strict=False))]
            break
    return dims


@dataclass(frozen=True)
class Probe:
    past: int
    seq: int


def probe_feeds(g: Graph, names: Iterable[str], probe: Probe) -> dict[str, torch.Tensor]:
    """Synthesizes inputs for a probe: ids zeros, mask ones, positions past..past+seq, caches 0."""
    roles = classify_inputs(g)
    feeds: dict[str, torch.Tensor] = {}
    for v in g.inputs:
        if v.name not in names:
            continue
        role = roles.get(v.name)
        shape = list(v.shape or ())
        dt = v.dtype.torch
        if role == IDS:
            dims = [probe.seq if i == len(shape) - 1 else 1 for i in range(len(shape))]
            feeds[v.name] = torch.zeros(dims, dtype=dt)
        elif role == MASK:
            dims = [probe.past + probe.seq if i == len(shape) - 1 else 1 for i in range(len(shape))]
            feeds[v.name] = torch.ones(dims, dtype=dt)
        elif role == POSITIONS:
            pos = torch.arange(probe.past, probe.past + probe.seq, dtype=dt)
            feeds[v.name] = pos.reshape([1] * (len(shape) - 1) + [probe.seq])
        elif role in (PAST_KEY, PAST_VALUE):
            dims = past_dims(g, v)
            if len(dims) == 4:
                dims[2] = probe.past
            feeds[v.name] = torch.zeros(dims, dtype=dt)
        elif role == PAST_LEN:
            feeds[v.name] = torch.tensor(probe.past, dtype=dt).reshape([1] * len(shape))
        else:
            raise ZlcError(f"cannot synthesize probe input '{v.name}' (unknown role)")
    return feeds


def _probe_fetch(v: Value) -> torch.Tensor:
    if v.data is None:
        raise ZlcError(f"probe cannot evaluate '{v.name}'")
    return const_tensor(v)


def evaluate(g: Graph, targets: Sequence[Value], probe: Probe) -> list[torch.Tensor]:
    """Runs just the targets' closure on probe inputs."""
    by_value, by_shape = value_inputs(g, targets)
    env: dict[int, torch.Tensor] = {}
    feeds = probe_feeds(g, by_value | by_shape, probe)
    for v in g.inputs:
        if v.name in feeds:
            env[id(v)] = feeds[v.name]
    run_nodes(closure(g, targets), env, fetch=_probe_fetch)
    return [env[id(t)] if id(t) in env else const_tensor(t) for t in targets]


def try_evaluate(g: Graph, targets: Sequence[Value], probe: Probe) -> list[torch.Tensor] | str:
    try:
        return evaluate(g, targets, probe)
    except (ZlcError, RuntimeError, IndexError, ValueError, KeyError) as e:
        return f"probe failed: {str(e).splitlines()[0] if str(e) else type(e).__name__}"


PROBES = (Probe(0, 1), Probe(0, 5), Probe(0, 12), Probe(3, 1), Probe(9, 1), Probe(7, 4))


def optional_probe(p: Probe) -> bool:
    """A chunk after a past: some exporters' masks only exist for prefill or one-token decode
    (genai's MHA graph cannot run such a chunk in ONNX Runtime either). Where the source graph
    cannot express a case, its meaning is defined by the cases it can."""
    return p.past > 0 and p.seq > 1


def _keep_mask(m: torch.Tensor, p: Probe, additive: bool, inverted: bool = False) -> torch.Tensor | str:
    """The [N, seq, total] boolean keep-mask of a probed mask, or why it is not one."""
    total = p.past + p.seq
    if m.dim() < 2 or m.shape[-1] not in (1, total) or m.shape[-2] not in (1, p.seq):
        return f"mask shape {tuple(m.shape)} does not fit {p.seq} queries x {total} keys"
    m2 = m.reshape(-1, m.shape[-2], m.shape[-1])
    m2 = m2.expand(m2.shape[0], p.seq, total)
    if not additive:
        return ~m2.bool() if inverted else m2.bool()
    keep = m2 > -1.0
    if not torch.all(m2[keep] == 0) or not torch.all(m2[~keep] <= -1e4):
        return "additive mask has values other than 0 and a large negative number"
    return keep


def causal_keep(seq: int, total: int, window: int = 0) -> torch.Tensor:
    """[seq, total] keep-mask of bottom-right aligned causal attention; with `window` > 0, query i
    (at position total - seq + i) keeps only the `window` keys ending at its own (HF's sliding
    window: key j is kept when i_pos - window < j <= i_pos)."""
    keep = torch.ones(seq, total, dtype=torch.bool).tril(total - seq)
    return keep.triu(total - seq - window + 1) if window > 0 else keep


def mask_window(g: Graph, mask: Value, additive: bool, max_seq: int, inverted: bool = False) -> int | str:
    """0 if `mask` is a causal mask (bottom-right aligned) on every probe, W > 0 if it is a causal
    sliding window of W keys (each query's own and the W - 1 before it); else the reason.

    The window is read off one prefill of `max_seq` tokens (its last query row keeps min(W,
    max_seq) keys: a window of max_seq or more never bites in the compiled context, so it is plain
    causal), then every probe is checked against it. additive: 0 where attending and <= -1e4 (or
    -inf) where masked; else boolean keep-mask (with `inverted`, a boolean drop-mask:
    masked_fill(mask, -inf))."""
    why = is_position_only(g, [mask])
    if why:
        return f"mask {why}"
    window = 0
    longest = Probe(0, max_seq)
    res = try_evaluate(g, [mask], longest)
    if not isinstance(res, str):
        keep = _keep_mask(res[0], longest, additive, inverted)
        if isinstance(keep, str):
            return keep
        kept = int(keep[0, -1].sum())
        window = kept if 0 < kept < max_seq else 0
        if not torch.equal(keep, causal_keep(max_seq, max_seq, window).expand_as(keep)):
            what = f"a sliding window of {window}" if window else "causal"
            return f"mask is not {what} over {max_seq} tokens"
    roles = set(classify_inputs(g).values())
    probes = PROBES if (PAST_KEY in roles or MASK in roles or POSITIONS in roles) else \
        tuple(p for p in PROBES if p.past == 0)
    for p in probes:
        res = try_evaluate(g, [mask], p)
        if isinstance(res, str):
            if optional_probe(p):
                continue
            return res
        keep = _keep_mask(res[0], p, additive, inverted)
        if isinstance(keep, str):
            return keep
        if not torch.equal(keep, causal_keep(p.seq, p.past + p.seq, window).expand_as(keep)):
            what = f"a sliding window of {window}" if window else "causal"
            return f"mask is not {what} at past={p.past}, seq={p.seq}"
    return window
