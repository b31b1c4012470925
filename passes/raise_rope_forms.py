"""Raising rules for the rotary embeddings beyond Llama's rotate-half: interleaved pairs (GPT-J,
CodeGen, Cohere), partial rotary (the first R of D features: StableLM, Phi-2, GPT-NeoX, GPT-J,
CodeGen), and rotary on [B, T, H, D] before the heads' transpose (GPT-J, CodeGen).

All end in one RoPE op over the whole head (R <= D, `interleaved`), which the reference executor
and both kernels run; the tables come from the same probing as the rotate-half rule's
(raise_attention.rotary_tables).
"""

from __future__ import annotations

from zlc.ir import Graph, Node, Value

from .match import slice_bounds
from .pattern import scalar
from .raise_attention import bind_rotary, rope_sum, rotary_tables, table_consts
from .raising import new_node
from .rewrite import Match, P, Rule

Pairs = list[tuple[Value, Value]]


# ---- RoPE (interleaved pairs: GPT-J, CodeGen, Cohere) ---------------------------------------------

def _strided(n: Node, start: int, rank: int, d: int) -> bool:
    """n is x[..., start::2] on the last of `rank` axes, `d` wide (a constant Slice)."""
    vals = [scalar(v) if (v := n.input(i)) is not None else None for i in (1, 2, 3, 4)]
    if any(v is None for v in vals):
        return False
    lo, hi, axis, step = (int(v) for v in vals)  # type: ignore[arg-type]
    return lo == start and hi >= d and axis % rank == rank - 1 and step == 2


_NO_ROPE_PAIRS = "no x*cos + rotate_pairs(x)*sin form"


def _check_rope_pairs(m: Match) -> str | None:
    x, g = m["x"], m.graph
    if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[-1], int) or x.shape[-1] % 2:
        return "rotated tensor is not [B, H, T, D] with D even"
    un_odd, un_even, pair = m.node("un_odd"), m.node("un_even"), m.node("pair")
    d = x.shape[-1]
    if not (_strided(m.node("odd"), 1, 4, d) and _strided(m.node("even"), 0, 4, d)):
        return _NO_ROPE_PAIRS
    if any(u.attrs.get("axes") not in ([-1], [4]) for u in (un_odd, un_even)) \
            or pair.attrs.get("axis", 0) % 5 != 4 or m.node("flat").output.shape != x.shape:
        return _NO_ROPE_PAIRS
    cs = m["cos"].shape
    tokens_first = cs is not None and len(cs) == 4 and cs[-3] == x.shape[-3] and cs[-2] == 1 \
        and isinstance(x.shape[-2], int) and not isinstance(x.shape[-3], int)
    if not tokens_first and (cs is None or len(cs) < 2 or cs[-2] != x.shape[-2]):
        return "cos/sin do not run along the rotated tensor's token axis ([B, H, T, D] or [B, T, H, D])"
    tabs = rotary_tables(g, m["cos"], m["sin"], x.shape[-1] // 2, interleaved=True, tokens_first=tokens_first)
    m.note("tokens_first", tokens_first)
    return bind_rotary(m, g, tabs)


_SWAP = [0, 2, 1, 3]


def _rw_rope_pairs(m: Match, g: Graph) -> Pairs:
    c, s = table_consts(g, m["cos"], m["sin"], m.fact("tabs"))
    if not m.fact("tokens_first"):
        return [(m.root.output, new_node(g, "RoPE", [m["x"], c, s, m["pos"]], "rope", interleaved=1))]
    # GPT-J, CodeGen rotate [B, T, H, D] before the heads' transpose: RoPE runs on [B, H, T, D]
    # between two transposes; the outer one cancels against the heads' (transpose_transpose).
    xt = new_node(g, "Transpose", [m["x"]], "rope_in", perm=_SWAP)
    r = new_node(g, "RoPE", [xt, c, s, m["pos"]], "rope", interleaved=1)
    return [(m.root.output, new_node(g, "Transpose", [r], "rope_out", perm=_SWAP))]


# x when v = flatten(stack(-x[..., 1::2], x[..., ::2])); read, not replaced
_ROTATE_PAIRS = P.op("Reshape", P.op("Concat", P.op("Unsqueeze", P.op("Neg", P.op("Slice", P.var("x"), rest=True,
                                                                                  name="odd")), name="un_odd"),
                                     P.op("Unsqueeze", P.op("Slice", P.var("x"), rest=True, name="even"),
                                          name="un_even"), name="pair", commutative=False),
                     P.any(), name="flat", keep=True)

ROPE_PAIRS = Rule(
    "rope_pairs",
    rope_sum(_ROTATE_PAIRS),
    _check_rope_pairs, _rw_rope_pairs, why=_NO_ROPE_PAIRS,
    doc="x*cos + rotate_pairs(x)*sin with position-only cos/sin -> RoPE(x, tables, positions, interleaved)")


# ---- partial rotary (StableLM, Phi-2, GPT-NeoX, GPT-J, CodeGen) ---------------------------------

_NOT_PARTIAL = "not Concat(RoPE(x[..., :R]), x[..., R:]) on the last axis"


def _check_rope_partial(m: Match) -> str | None:
    """The rotated slice is x's first R features, the passed one the rest, R is the tables' width."""
    x, rope, cat = m["x"], m.node("rope"), m.root
    if "tin" in m.nodes and any(m.node(n).attrs.get("perm") != _SWAP for n in ("tin", "tout")):
        return _NOT_PARTIAL
    if x.shape is None or len(x.shape) != 4 or not isinstance(x.shape[-1], int):
        return "rotated tensor is not [B, H, T, D]"
    d = x.shape[-1]
    if cat.attrs.get("axis", 0) % 4 != 3 or len(cat.inputs) != 2 or len(rope.inputs) < 4:
        return _NOT_PARTIAL
    rot, rest = slice_bounds(m.node("rot")), slice_bounds(m.node("pass"))
    cos = m["cos"]
    if rot is None or rest is None or cos.shape is None or not isinstance(cos.shape[-1], int):
        return _NOT_PARTIAL
    r = 2 * int(cos.shape[-1])
    if rot[2] % 4 != 3 or rest[2] % 4 != 3 or rot[:2] != (0, r) or rest[0] != r or rest[1] < d or r >= d:
        return _NOT_PARTIAL
    return None


def _rw_rope_partial(m: Match, g: Graph) -> Pairs:
    rope, x = m.node("rope"), m["x"]
    if "tin" in m.nodes:
        x = new_node(g, "Transpose", [x], "rope_in", perm=_SWAP)
    r = new_node(g, "RoPE", [x, m["cos"], m["sin"], m["pos"]], "rope", interleaved=rope.attrs.get("interleaved", 0))
    return [(m.root.output, new_node(g, "Transpose", [r], "rope_out", perm=_SWAP) if "tin" in m.nodes else r)]


# HF's partial rotary: cat(rope(x[..., :R]), x[..., R:]) is RoPE(x) with R-wide tables (R < D).
ROPE_PARTIAL = Rule(
    "rope_partial",
    P.op("Concat", P.op("RoPE", P.op("Slice", P.var("x"), rest=True, name="rot"), P.var("cos"), P.var("sin"),
                        P.var("pos"), name="rope", why=_NOT_PARTIAL),
         P.op("Slice", P.var("x"), rest=True, name="pass", why=_NOT_PARTIAL), commutative=False),
    _check_rope_partial, _rw_rope_partial, why=_NOT_PARTIAL,
    doc="Concat(RoPE(x[..., :R]), x[..., R:]) -> RoPE(x) rotating the first R features")

SWAP_PAIR = Rule(
    "swap_pair",
    P.op("Transpose", P.op("Transpose", P.var("x"), name="inner"), attrs={"perm": _SWAP}),
    lambda m: None if m.node("inner").attrs.get("perm") == _SWAP else "not two [0, 2, 1, 3] transposes",
    lambda m, g: [(m.root.output, m["x"])],
    doc="Transpose(Transpose(x, [0, 2, 1, 3]), [0, 2, 1, 3]) -> x (what rope_pairs leaves on [B, T, H, D])")

# The same on [B, T, H, D] (GPT-J, CodeGen), where rope_pairs left RoPE between two transposes.
ROPE_PARTIAL_TOKENS_FIRST = Rule(
    "rope_partial_tokens_first",
    P.op("Concat", P.op("Transpose", P.op("RoPE", P.op("Transpose", P.op("Slice", P.var("x"), rest=True, name="rot"),
                                                       name="tin"),
                                          P.var("cos"), P.var("sin"), P.var("pos"), name="rope"),
                        name="tout", why=_NOT_PARTIAL),
         P.op("Slice", P.var("x"), rest=True, name="pass", why=_NOT_PARTIAL), commutative=False),
    _check_rope_partial, _rw_rope_partial, why=_NOT_PARTIAL,
    doc="Concat(T(RoPE(T(x[..., :R]))), x[..., R:]) on [B, T, H, D] -> T(RoPE(T(x))) rotating the first R")
