"""Canonicalization: local simplifications that hold for every shape, and one canonical operand
order (constants on the right of Add/Mul) so that raising patterns see one spelling.

Every rule here is exact for all inputs the op accepts; rules that need shape facts check them and
say why they refuse. `Sqrt` then `Reciprocal` is deliberately left alone: raising recognizes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zlc.ir import Dim, Graph, Value

from .base import PassResult, is_unknown_dim, known_elements, same_shape
from .rewrite import Match, P, Rule, RuleSet

# ---- helpers --------------------------------------------------------------------------------------


def _same_dim(a: Dim, b: Dim) -> bool:
    return a == b and not is_unknown_dim(a)


def _keeps_shape(m: Match, x: str = "x") -> str | None:
    out, src = m.root.output, m[x]
    if out.dtype != src.dtype:
        return f"dtype changes ({src.dtype.value} -> {out.dtype.value})"
    if not same_shape(out.type, src.type):
        return f"shape {src.type} -> {out.type} is not provably the same"
    return None


def _rank(v: Value) -> int | None:
    return None if v.shape is None else len(v.shape)


def _perm(perm: Sequence[int] | None, rank: int | None) -> list[int] | None:
    if perm:
        return [int(p) for p in perm]
    return None if rank is None else list(reversed(range(rank)))  # ONNX default: reverse


# ---- rules ----------------------------------------------------------------------------------------

identity = Rule("identity", P.op("Identity", P.var("x")), None, lambda m, g: m["x"])

cast_same = Rule(
    "cast_same_dtype",
    P.op("Cast", P.var("x")),
    lambda m: None if m.root.attrs.get("to") == m["x"].dtype.value else
    f"casts {m['x'].dtype.value} to {m.root.attrs.get('to')}",
    lambda m, g: m["x"],
)


def _reshape_noop(m: Match) -> str | None:
    x, out = m["x"], m.root.output
    if x.type.is_static and out.type == x.type:
        return None
    target = known_elements(m["shape"])
    if target is None:
        return "target shape is not known"
    if x.shape is None or len(target) != len(x.shape):
        return f"rank changes ({_rank(x)} -> {len(target)})"
    allowzero = bool(m.root.attrs.get("allowzero", 0))
    minus = 0
    for t, d in zip(target, x.shape, strict=True):
        if t == -1:
            minus += 1  # with every other dim equal, -1 is forced to equal this one
        elif not (_same_dim(t, d) or (t == 0 and not allowzero)):
            return f"dim {t} differs from input dim {d}"
    return None if minus <= 1 else "more than one -1"


reshape_noop = Rule("reshape_noop", P.op("Reshape", P.var("x"), P.var("shape")), _reshape_noop,
                    lambda m, g: m["x"])


def _reshape_reshape_check(m: Match) -> str | None:
    if m.root.attrs.get("allowzero", 0):
        return None  # 0 means a zero-sized dim: nothing is copied from the intermediate shape
    target = known_elements(m["shape"])
    if target is None:
        return "outer target shape is not known (a 0 would copy a dim of the intermediate)"
    if any(t == 0 for t in target):
        return "outer target copies dims of the intermediate (0 entries)"
    return None


reshape_reshape = Rule(
    "reshape_reshape",
    P.op("Reshape", P.op("Reshape", P.var("x"), P.any()), P.var("shape")),
    _reshape_reshape_check,
    lambda m, g: g.make_node("Reshape", [m["x"], m["shape"]], dict(m.root.attrs)).output,
)


def _transpose_pair(m: Match) -> list[int] | None:
    inner = m.node("inner")
    p1 = _perm(inner.attrs.get("perm"), _rank(m["x"]))
    p2 = _perm(m.root.attrs.get("perm"), None if p1 is None else len(p1))
    if p1 is None or p2 is None:
        return None
    return [p1[i] for i in p2]  # out[i] = mid[p2[i]] = x[p1[p2[i]]]


def _transpose_transpose(m: Match, g: Graph) -> Value:
    perm = _transpose_pair(m)
    assert perm is not None
    if perm == list(range(len(perm))):
        return m["x"]
    return g.make_node("Transpose", [m["x"]], {"perm": perm}).output


transpose_transpose = Rule(
    "transpose_transpose",
    P.op("Transpose", P.op("Transpose", P.var("x"), name="inner")),
    lambda m: None if _transpose_pair(m) is not None else "rank unknown and a perm is implicit",
    _transpose_transpose,
)


def _identity_perm(m: Match) -> str | None:
    p = _perm(m.root.attrs.get("perm"), _rank(m["x"]))
    if p is None:
        return "rank unknown and the perm is implicit"
    return None if p == list(range(len(p))) else f"perm {p} moves axes"


transpose_identity = Rule("transpose_identity", P.op("Transpose", P.var("x")), _identity_perm,
                          lambda m, g: m["x"])


def _unsqueeze_squeeze(m: Match) -> str | None:
    sq, unsq = m.root, m.node("unsq")
    axes_u, axes_s = unsq.attrs.get("axes"), sq.attrs.get("axes")
    r = _rank(m["x"])
    if r is None:
        return "input rank unknown"
    if axes_s is None or axes_u is None:
        return "Squeeze without axes removes every size-1 dim"
    mid = r + len(axes_u)  # Unsqueeze axes and Squeeze axes both index the intermediate rank
    su = {int(a) % mid for a in axes_u}
    ss = {int(a) % mid for a in axes_s}
    return None if su == ss else f"unsqueezed axes {sorted(su)} != squeezed axes {sorted(ss)}"


unsqueeze_squeeze = Rule(
    "unsqueeze_squeeze",
    P.op("Squeeze", P.op("Unsqueeze", P.var("x"), name="unsq")),
    _unsqueeze_squeeze,
    lambda m, g: m["x"],
)

slice_noop = Rule("slice_noop", P.op("Slice", P.var("x"), rest=True), _keeps_shape, lambda m, g: m["x"])


def _empty_operands(m: Match) -> str | None:
    n = m.root
    rank = n.output.type.rank
    if rank is None:
        return "unknown rank"
    axis = n.attrs["axis"] % rank
    empty = [v for v in n.inputs if v is not None and v.shape is not None and v.shape[axis] == 0]
    if not empty:
        return "no zero-size operand"
    if len(empty) == len(n.inputs):
        return "every operand is empty"
    return None


def _drop_empty(m: Match, g: Graph) -> Value:
    n = m.root
    axis = n.attrs["axis"] % (n.output.type.rank or 1)
    keep = [v for v in n.inputs if v is not None and not (v.shape is not None and v.shape[axis] == 0)]
    return keep[0] if len(keep) == 1 else g.make_node("Concat", keep, dict(n.attrs)).output


# Partial-rotary exports with a full rotary dim concatenate an empty pass-through slice.
concat_empty = Rule("concat_empty", P.op("Concat", P.var("x"), rest=True), _empty_operands, _drop_empty)
concat_single = Rule("concat_single", P.op("Concat", P.var("x")), None, lambda m, g: m["x"])
neg_neg = Rule("neg_neg", P.op("Neg", P.op("Neg", P.var("x"))), None, lambda m, g: m["x"])

# x * 1, x / 1 and x - 0 are exact; x + 0 turns -0.0 into +0.0, which compares equal.
mul_one = Rule("mul_one", P.op("Mul", P.var("x"), P.const(value=1)), _keeps_shape, lambda m, g: m["x"])
div_one = Rule("div_one", P.op("Div", P.var("x"), P.const(value=1)), _keeps_shape, lambda m, g: m["x"])
add_zero = Rule("add_zero", P.op("Add", P.var("x"), P.const(value=0)), _keeps_shape, lambda m, g: m["x"])
sub_zero = Rule("sub_zero", P.op("Sub", P.var("x"), P.const(value=0)), _keeps_shape, lambda m, g: m["x"])


def _expand_noop(m: Match) -> str | None:
    x = m["x"]
    target = known_elements(m["shape"])
    if target is None:
        return "target shape is not known"
    if x.shape is None or len(target) > len(x.shape):
        return f"rank grows ({_rank(x)} -> {len(target)})"
    for t, d in zip(target, x.shape[len(x.shape) - len(target):], strict=True):
        if not (t == 1 or _same_dim(t, d)):
            return f"dim {d} expands to {t}"
    return None


expand_noop = Rule("expand_noop", P.op("Expand", P.var("x"), P.var("shape")), _expand_noop,
                   lambda m, g: m["x"])


def _const_left(m: Match) -> str | None:
    if m["x"].kind == "const":
        return "both operands are constants (folding's job)"
    if m["c"].dtype != m["x"].dtype:
        return "operand dtypes differ"
    return None


const_to_right = Rule(
    "const_to_right",
    P.op(("Add", "Mul"), P.const("c"), P.var("x"), commutative=False),
    _const_left,
    lambda m, g: g.make_node(m.root.op, [m["x"], m["c"]], dict(m.root.attrs)).output,
)

RULES: list[Rule] = [
    identity, cast_same, reshape_reshape, reshape_noop, transpose_transpose, transpose_identity,
    unsqueeze_squeeze, slice_noop, concat_empty, concat_single, neg_neg, mul_one, div_one, add_zero, sub_zero, expand_noop, const_to_right,
]


def canonicalize_rules() -> RuleSet:
    return RuleSet("canonicalize", RULES)


def canonicalize(graph: Graph) -> PassResult:
    return canonicalize_rules().run(graph)


@dataclass(frozen=True)
class Canonicalize:
    name: str = "canonicalize"

    def run(self, graph: Graph) -> PassResult:
        return canonicalize(graph)
