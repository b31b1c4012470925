"""The pattern language and the RuleSet driver: matching, refusal reasons, splicing, naming."""

from __future__ import annotations

import time

import numpy as np
import pytest

from zlc.errors import PassError
from zlc.ir import DType, Graph, TensorType, parse_graph, verify_graph
from zlc.passes.base import same_shape
from zlc.passes.rewrite import Match, P, Rule, RuleSet

SQUARE = """
graph "g" {
  input %x: f32[4]
  input %y: f32[4]
  %a: f32[4] = Mul(%x, %x) @a
  %b: f32[4] = Mul(%x, %y) @b
  %c: f32[4] = Add(%a, %b) @c
  output %c
}"""


def _pow2(m: Match, g: Graph):
    return g.make_node("Pow", [m["x"], g.const_scalar(2.0, DType.f32)]).output


def test_repeated_var_binds_the_same_value(golden):
    square = Rule("square", P.op("Mul", P.var("x"), P.var("x")), None, _pow2)
    golden(RuleSet("s", [square]).run, SQUARE, """
graph "g" {
  input %x: f32[4]
  input %y: f32[4]
  const %c_0: f32[] = 2.0
  %a: f32[4] = Pow(%x, %c_0) @a
  %b: f32[4] = Mul(%x, %y) @b
  %c: f32[4] = Add(%a, %b) @c
  output %c
}""")


def test_commutative_matching_and_named_nodes():
    # Add(Mul(x, y), Mul(x, x)): the Mul(x, x) operand sits on either side of the Add.
    pat = P.op("Add", P.op("Mul", P.var("x"), P.var("x"), name="sq"), P.var("rest"))
    rule = Rule("sq_plus", pat, None, lambda m, g: None)
    g = parse_graph(SQUARE)
    m = rule.match(g, g.nodes[2])
    assert isinstance(m, Match)
    assert m.node("sq").name == "a" and m["rest"].name == "b" and m["x"].name == "x"
    assert [n.name for n in m.matched] == ["c", "a"]
    g.nodes[2].inputs.reverse()
    assert isinstance(rule.match(g, g.nodes[2]), Match)
    strict = Rule("strict", P.op("Add", P.op("Mul", P.var("x"), P.var("x")), P.var("r"), commutative=False),
                  None, lambda m, g: None)
    assert strict.match(g, g.nodes[2]) == "'x' is bound to %x, not %y"


def test_attribute_constraints_values_and_predicates():
    g = parse_graph("""
graph "g" {
  input %x: f32[2, 3]
  %a: f32[3, 2] = Transpose(%x) {perm=[1, 0]} @a
  %b: f32[3] = ReduceSum(%a) {axes=[-1], keepdims=0} @b
  output %b
}""")
    exact = Rule("t", P.op("Transpose", P.var("x"), attrs={"perm": [1, 0]}), None, lambda m, g: None)
    other = Rule("t2", P.op("Transpose", P.var("x"), attrs={"perm": (0, 1)}), None, lambda m, g: None)
    pred = Rule("r", P.op("ReduceSum", P.any(), attrs={"axes": lambda a: a == [-1], "keepdims": 0}),
                None, lambda m, g: None)
    assert isinstance(exact.match(g, g.nodes[0]), Match)
    assert other.match(g, g.nodes[0]) == "'a' (Transpose) attribute perm=[1, 0] does not fit"
    assert isinstance(pred.match(g, g.nodes[1]), Match)


def test_const_single_use_output_and_or_patterns():
    g = parse_graph("""
graph "g" {
  input %x: f32[6]
  const %half: f32[] = 0.5
  %s: f32[2], %t: f32[4] = Split(%x) {axis=0, split=[2, 4]} @s
  %e: f32[4] = Exp(%t) @e
  %m: f32[4] = Mul(%e, %half) @m
  %n: f32[4] = Add(%m, %e) @n
  output %n, %s
}""")
    mul = g.nodes[2]
    half = Rule("half", P.op("Mul", P.var("x"), P.const("c", value=0.5)), None, lambda m, g: None)
    one = Rule("one", P.op("Mul", P.var("x"), P.const("c", value=1.0)), None, lambda m, g: None)
    assert isinstance(half.match(g, mul), Match)
    assert one.match(g, mul) == "constant %half is not all 1.0"
    single = Rule("single", P.op("Mul", P.op("Exp", P.any(), single_use=True), P.const()), None,
                  lambda m, g: None)
    assert single.match(g, mul) == "%e has 2 uses, pattern wants one"
    second = Rule("second", P.op("Exp", P.op("Split", P.var("x"), output=1)), None, lambda m, g: None)
    first = Rule("first", P.op("Exp", P.op("Split", P.var("x"), output=0)), None, lambda m, g: None)
    assert isinstance(second.match(g, g.nodes[1]), Match)
    assert first.match(g, g.nodes[1]) == "%t is not output 0 of 's'"
    either = Rule("either", P.op("Mul", P.or_(P.op("Neg", P.any()), P.op("Exp", P.any())), P.const()),
                  None, lambda m, g: None)
    assert isinstance(either.match(g, mul), Match)


def test_failed_check_reports_its_reason():
    def only_f16(m: Match) -> str | None:
        return None if m["x"].dtype == DType.f16 else f"x is {m['x'].dtype.value}, rule wants f16"

    rule = Rule("exp_f16", P.op("Exp", P.var("x")), only_f16, lambda m, g: m["x"])
    rs = RuleSet("r", [rule])
    g = parse_graph("""
graph "g" {
  input %x: f32[4]
  %e: f32[4] = Exp(%x) @e
  output %e
}""")
    stats = rs.apply(g)
    assert not stats.changed and stats.iterations == 1
    assert rs.last_reason == {"exp_f16": "e: x is f32, rule wants f16"}
    assert rs.explain(g, g.nodes[0]) == {"exp_f16": "check refused: x is f32, rule wants f16"}


def test_new_nodes_go_before_the_root_and_dead_producers_go(golden):
    # (x * s) * t -> x * (s * t): the inner Mul dies; new nodes are placed where the root was.
    def reassoc(m: Match, g: Graph):
        st = g.make_node("Mul", [m["s"], m["t"]]).output
        return g.make_node("Mul", [m["x"], st]).output

    rule = Rule("reassoc", P.op("Mul", P.op("Mul", P.var("x"), P.var("s"), single_use=True), P.var("t")),
                lambda m: None if m["s"].kind == "input" and m["t"].kind == "input" else "need inputs",
                reassoc)
    golden(RuleSet("r", [rule], max_iters=1).run, """
graph "g" {
  input %x: f32[4]
  input %s: f32[]
  input %t: f32[]
  %a: f32[4] = Exp(%x) @a
  %b: f32[4] = Mul(%a, %s) @b
  %c: f32[4] = Mul(%b, %t) @c
  %d: f32[4] = Neg(%c) @d
  output %d
}""", """
graph "g" {
  input %x: f32[4]
  input %s: f32[]
  input %t: f32[]
  %a: f32[4] = Exp(%x) @a
  %mul: f32[] = Mul(%s, %t) @mul
  %c: f32[4] = Mul(%a, %mul) @c
  %d: f32[4] = Neg(%c) @d
  output %d
}""")


def test_rewrite_may_use_graph_op_and_multi_output_roots(golden):
    # Split(x) into two halves -> two Slices built with graph.op (which appends; the driver moves them).
    def split_to_slices(m: Match, g: Graph):
        a, b = m.root.attrs["split"]
        s0, s1, s2 = (g.add_const(None, np.array([v], np.int64)) for v in (0, a, a + b))
        return [g.op("Slice", m["x"], s0, s1), g.op("Slice", m["x"], s1, s2)]

    rule = Rule("split", P.op("Split", P.var("x"), attrs={"axis": 0}), None, split_to_slices)
    golden(RuleSet("r", [rule]).run, """
graph "g" {
  input %x: f32[6]
  %p: f32[2], %q: f32[4] = Split(%x) {axis=0, split=[2, 4]} @sp
  %r: f32[4] = Exp(%q) @r
  output %p, %r
}""", """
graph "g" {
  input %x: f32[6]
  const %c: i64[1] = [0]
  const %c_0: i64[1] = [2]
  const %c_1: i64[1] = [6]
  %p: f32[2] = Slice(%x, %c, %c_0) @sp
  %q: f32[4] = Slice(%x, %c_0, %c_1) @slice_2
  %r: f32[4] = Exp(%q) @r
  output %p, %r
}""")


def test_declined_rewrite_leaves_no_trace(golden):
    def decline(m: Match, g: Graph):
        g.const_scalar(3.0, DType.f32)
        return None

    rs = RuleSet("r", [Rule("no", P.op("Exp", P.any()), None, decline)])
    text = """
graph "g" {
  input %x: f32[4]
  %e: f32[4] = Exp(%x) @e
  output %e
}"""
    golden(rs.run, text, text)
    assert rs.last_reason["no"] == "e: rewrite declined"


def test_type_changing_rewrite_is_an_error():
    rule = Rule("bad", P.op("Exp", P.var("x")), None,
                lambda m, g: g.make_node("Cast", [m["x"]], {"to": "f16"}).output)
    g = parse_graph("""
graph "g" {
  input %x: f32[4]
  %e: f32[4] = Exp(%x) @e
  output %e
}""")
    with pytest.raises(PassError, match="does not fit"):
        RuleSet("r", [rule]).apply(g)


def test_fixpoint_is_bounded_and_counts_matches():
    # Neg(Neg(Neg(Neg(x)))) needs two matches; a ping-pong rule stops at max_iters.
    g = parse_graph("""
graph "g" {
  input %x: f32[4]
  %a: f32[4] = Neg(%x) @a
  %b: f32[4] = Neg(%a) @b
  %c: f32[4] = Neg(%b) @c
  %d: f32[4] = Neg(%c) @d
  %e: f32[4] = Exp(%d) @e
  output %e
}""")
    rs = RuleSet("r", [Rule("nn", P.op("Neg", P.op("Neg", P.var("x"))), None, lambda m, g: m["x"])])
    st = rs.apply(g)
    assert st.matches == {"nn": 2} and [n.op for n in g.nodes] == ["Exp"] and st.nodes_removed == 4
    flip = Rule("flip", P.op("Exp", P.var("x")), None,
                lambda m, g: g.make_node("Exp", [m["x"]]).output)
    st = RuleSet("f", [flip], max_iters=3).apply(g)
    assert st.iterations == 3 and st.matches == {"flip": 3}
    verify_graph(g)


def test_duplicate_rule_names_are_rejected():
    r = Rule("x", P.op("Exp", P.any()), None, lambda m, g: None)
    with pytest.raises(PassError):
        RuleSet("dup", [r, r])


def test_driver_scales_to_thousands_of_nodes():
    # 6,000 nodes: Neg pairs and x*1 that all cancel, interleaved with ops that stay.
    g = Graph("big")
    x = g.add_input("x", TensorType(DType.f32, (4, 8)))
    one = g.const_scalar(1.0, DType.f32)
    v = x
    for _ in range(1000):
        v = g.op("Neg", g.op("Neg", v))
        v = g.op("Mul", v, one)
        v = g.op("Exp", g.op("Tanh", v))
        v = g.op("Add", v, v)
    g.outputs = [v]
    assert len(g.nodes) == 6000
    rs = RuleSet("r", [
        Rule("nn", P.op("Neg", P.op("Neg", P.var("x"))), None, lambda m, g: m["x"]),
        Rule("mul1", P.op("Mul", P.var("x"), P.const(value=1)),
             lambda m: None if same_shape(m.root.output.type, m["x"].type) else "shape", lambda m, g: m["x"]),
    ])
    t0 = time.perf_counter()
    st = rs.apply(g)
    dt = time.perf_counter() - t0
    assert st.matches == {"nn": 1000, "mul1": 1000} and len(g.nodes) == 3000
    verify_graph(g)
    assert dt < 5.0, f"rewriting 6,000 nodes took {dt:.2f}s"


def test_rewrite_that_wraps_the_root_goes_after_it(golden):
    wrap = Rule("wrap", P.op("Exp", P.any()), None,
                lambda m, g: g.make_node("Identity", [m.root.output]).output)
    golden(RuleSet("r", [wrap], max_iters=1).run, """
graph "g" {
  input %x: f32[4]
  %e: f32[4] = Exp(%x) @e
  %n: f32[4] = Neg(%e) @n
  output %n
}""", """
graph "g" {
  input %x: f32[4]
  %e: f32[4] = Exp(%x) @e
  %identity: f32[4] = Identity(%e) @identity
  %n: f32[4] = Neg(%identity) @n
  output %n
}""")


def test_new_constant_takes_the_graph_outputs_name(golden):
    def fold_neg(m: Match, g: Graph):
        return g.add_const("folded", -m.const("c"), unique=True)

    golden(RuleSet("r", [Rule("neg_const", P.op("Neg", P.const("c")), None, fold_neg)]).run, """
graph "g" {
  const %c: f32[2] = [1.0, -3.0]
  %y: f32[2] = Neg(%c) @y
  output %y
}""", """
graph "g" {
  const %y: f32[2] = [-1.0, 3.0]
  output %y
}""")
