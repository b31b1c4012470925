"""Golden-IR tests for the canonicalize rule set: one per rule, plus refusals that must hold."""

from __future__ import annotations

import numpy as np

from zlc.ir import parse_graph
from zlc.passes.canonicalize import canonicalize, canonicalize_rules


def test_identity_cast_same_and_neg_neg(golden):
    golden(canonicalize, """
graph "g" {
  input %x: f32[2, 3]
  %a: f32[2, 3] = Identity(%x) @a
  %b: f32[2, 3] = Cast(%a) {to="f32"} @b
  %c: f32[2, 3] = Neg(%b) @c
  %d: f32[2, 3] = Neg(%c) @d
  %e: f32[2, 3] = Exp(%d) @e
  output %e
}""", """
graph "g" {
  input %x: f32[2, 3]
  %e: f32[2, 3] = Exp(%x) @e
  output %e
}""")


def test_cast_to_other_dtype_stays(golden):
    text = """
graph "g" {
  input %x: f32[2, 3]
  %b: f16[2, 3] = Cast(%x) {to="f16"} @b
  output %b
}"""
    r = golden(canonicalize, text, text)
    assert not r.changed


def test_graph_output_keeps_its_name(golden):
    # Removing Identity would rename the output; the producer's value takes the output's name.
    golden(canonicalize, """
graph "g" {
  input %x: f32[4]
  %a: f32[4] = Exp(%x) @a
  %logits: f32[4] = Identity(%a) @id
  output %logits
}""", """
graph "g" {
  input %x: f32[4]
  %logits: f32[4] = Exp(%x) @a
  output %logits
}""")


def test_identity_of_input_that_is_an_output_stays(golden):
    text = """
graph "g" {
  input %x: f32[4]
  %y: f32[4] = Identity(%x) @id
  output %y
}"""
    golden(canonicalize, text, text)
    rs = canonicalize_rules()
    rs.apply(parse_graph(text))
    assert "graph output %y would lose its name" in rs.last_reason["identity"]


def test_transpose_pairs_compose(golden):
    golden(canonicalize, """
graph "g" {
  input %x: f32[2, 3, 4]
  %a: f32[4, 3, 2] = Transpose(%x) @a
  %b: f32[3, 4, 2] = Transpose(%a) {perm=[1, 0, 2]} @b
  %c: f32[2, 3, 4] = Transpose(%x) {perm=[0, 1, 2]} @c
  %d: f32[3, 2, 4] = Transpose(%c) {perm=[1, 0, 2]} @d
  %e: f32[2, 3, 4] = Transpose(%d) {perm=[1, 0, 2]} @e
  %f: f32[2, 3, 4] = Exp(%e) @f
  output %b, %f
}""", """
graph "g" {
  input %x: f32[2, 3, 4]
  %b: f32[3, 4, 2] = Transpose(%x) {perm=[1, 2, 0]} @b
  %f: f32[2, 3, 4] = Exp(%x) @f
  output %b, %f
}""")


def test_reshape_rules(golden):
    golden(canonicalize, """
graph "g" {
  input %x: f32[2, 3, 4]
  const %s1: i64[2] = [6, 4]
  const %s2: i64[3] = [2, 12, 1]
  const %same: i64[3] = [0, -1, 4]
  %a: f32[6, 4] = Reshape(%x, %s1) @a
  %b: f32[2, 12, 1] = Reshape(%a, %s2) @b
  %c: f32[2, 3, 4] = Reshape(%x, %same) @c
  %d: f32[2, 3, 4] = Exp(%c) @d
  output %b, %d
}""", """
graph "g" {
  input %x: f32[2, 3, 4]
  const %s2: i64[3] = [2, 12, 1]
  %b: f32[2, 12, 1] = Reshape(%x, %s2) @b
  %d: f32[2, 3, 4] = Exp(%x) @d
  output %b, %d
}""")


def test_reshape_with_symbolic_dims_is_a_noop_only_when_provable(golden):
    golden(canonicalize, """
graph "g" {
  input %x: f32[1, seq, 8]
  %s: i64[3] = Shape(%x) @s
  %a: f32[1, seq, 8] = Reshape(%x, %s) @a
  %b: f32[1, seq, 8] = Exp(%a) @b
  output %b
}""", """
graph "g" {
  input %x: f32[1, seq, 8]
  %b: f32[1, seq, 8] = Exp(%x) @b
  output %b
}""")


def test_reshape_reshape_refuses_zero_copy():
    text = """
graph "g" {
  input %x: f32[2, 3, 4]
  const %s1: i64[2] = [6, 4]
  const %s2: i64[2] = [0, 4]
  %a: f32[6, 4] = Reshape(%x, %s1) @a
  %b: f32[6, 4] = Reshape(%a, %s2) @b
  output %b
}"""
    g = parse_graph(text)
    rs = canonicalize_rules()
    why = rs.explain(g, g.nodes[1])
    assert why["reshape_reshape"] == "check refused: outer target copies dims of the intermediate (0 entries)"
    assert why["identity"] == "'b' is Reshape, not Identity"
    assert not rs.apply(g).matches["reshape_reshape"]


def test_unsqueeze_squeeze(golden):
    golden(canonicalize, """
graph "g" {
  input %x: f32[2, 3]
  %a: f32[2, 1, 3, 1] = Unsqueeze(%x) {axes=[1, -1]} @a
  %b: f32[2, 3] = Squeeze(%a) {axes=[3, 1]} @b
  %c: f32[1, 2, 3] = Unsqueeze(%x) {axes=[0]} @c
  %d: f32[1, 2, 3] = Exp(%c) @d
  %e: f32[1, 1, 2, 3] = Unsqueeze(%d) {axes=[0]} @e
  %f: f32[1, 2, 3] = Squeeze(%e) {axes=[-4]} @f
  %g: f32[1, 1, 2, 3] = Unsqueeze(%f) {axes=[0]} @g
  %h: f32[1, 2, 3] = Squeeze(%g) {axes=[1]} @h
  %y: f32[2, 3] = Exp(%b) @y
  output %y, %h
}""", """
graph "g" {
  input %x: f32[2, 3]
  %c: f32[1, 2, 3] = Unsqueeze(%x) {axes=[0]} @c
  %d: f32[1, 2, 3] = Exp(%c) @d
  %g: f32[1, 1, 2, 3] = Unsqueeze(%d) {axes=[0]} @g
  %h: f32[1, 2, 3] = Squeeze(%g) {axes=[1]} @h
  %y: f32[2, 3] = Exp(%x) @y
  output %y, %h
}""")


def test_arithmetic_identities_and_constant_on_the_right(golden):
    golden(canonicalize, """
graph "g" {
  input %x: f32[2, 3]
  const %one: f32[] = 1.0
  const %zero: f32[3] = [0.0, 0.0, 0.0]
  const %ones: f32[4, 2, 3]
  const %k: f32[] = 2.0
  %a: f32[2, 3] = Mul(%one, %x) @a
  %b: f32[2, 3] = Add(%a, %zero) @b
  %c: f32[2, 3] = Div(%b, %one) @c
  %d: f32[2, 3] = Sub(%c, %zero) @d
  %e: f32[4, 2, 3] = Mul(%d, %ones) @e
  %f: f32[2, 3] = Mul(%k, %d) @f
  output %e, %f
}""", """
graph "g" {
  input %x: f32[2, 3]
  const %ones: f32[4, 2, 3]
  const %k: f32[] = 2.0
  %e: f32[4, 2, 3] = Mul(%x, %ones) @e
  %f: f32[2, 3] = Mul(%x, %k) @f
  output %e, %f
}""", weights={"ones": np.ones((4, 2, 3), np.float32)})


def test_mul_by_broadcasting_ones_says_why():
    g = parse_graph("""
graph "g" {
  input %x: f32[3]
  const %ones: f32[2, 3] = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
  %e: f32[2, 3] = Mul(%x, %ones) @e
  output %e
}""")
    assert canonicalize_rules().explain(g, g.nodes[0])["mul_one"] == \
        "check refused: shape f32[3] -> f32[2, 3] is not provably the same"


def test_expand_to_own_shape(golden):
    golden(canonicalize, """
graph "g" {
  input %x: f32[1, seq, 4]
  const %s: i64[2] = [1, 4]
  const %big: i64[3] = [3, 1, 4]
  %a: f32[1, seq, 4] = Expand(%x, %s) @a
  %b: f32[1, seq, 4] = Exp(%a) @b
  %c: f32[3, seq, 4] = Expand(%x, %big) @c
  output %b, %c
}""", """
graph "g" {
  input %x: f32[1, seq, 4]
  const %big: i64[3] = [3, 1, 4]
  %b: f32[1, seq, 4] = Exp(%x) @b
  %c: f32[3, seq, 4] = Expand(%x, %big) @c
  output %b, %c
}""")


def test_sqrt_reciprocal_is_left_for_raising(golden):
    text = """
graph "g" {
  input %x: f32[4]
  %a: f32[4] = Sqrt(%x) @a
  %b: f32[4] = Reciprocal(%a) @b
  output %b
}"""
    assert not golden(canonicalize, text, text).changed
