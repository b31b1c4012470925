"""Golden-IR tests for dead-code elimination and common-subexpression elimination."""

from __future__ import annotations

import numpy as np

from zlc.ir import parse_graph
from zlc.passes.cse import cse
from zlc.passes.dce import dce

ATTENTION_WITH_CACHE = """
graph "g" {
  input %q: f32[1, 2, 3, 4]
  input %k: f32[1, 2, 3, 4]
  input %v: f32[1, 2, 3, 4]
  input %past: i64[]
  input %unused_input: f32[2]
  state %kc: f32[1, 2, 16, 4]
  state %vc: f32[1, 2, 16, 4]
  %o: f32[1, 2, 3, 4] = Attention(%q, %k, %v, %past, %kc, %vc) {causal=1} @attn
  %y: f32[1, 2, 3, 4] = Exp(%q) @y
  output %y
}"""


def test_dce_removes_dead_chains_and_unused_constants(golden):
    r = golden(dce, """
graph "g" {
  input %x: f32[4]
  const %c: f32[] = 2.0
  const %never: f32[2] = [1.0, 2.0]
  %a: f32[4] = Mul(%x, %c) @a
  %b: f32[4] = Exp(%a) @b
  %s: f32[2], %t: f32[2] = Split(%x) {axis=0, split=[2, 2]} @split
  %u: f32[2] = Neg(%t) @u
  output %u
}""", """
graph "g" {
  input %x: f32[4]
  %s: f32[2], %t: f32[2] = Split(%x) {axis=0, split=[2, 2]} @split
  %u: f32[2] = Neg(%t) @u
  output %u
}""")
    assert r.stats == {"nodes_removed": 2, "consts_removed": 2}


def test_dce_keeps_state_writes_and_the_interface(golden):
    r = golden(dce, ATTENTION_WITH_CACHE, ATTENTION_WITH_CACHE)
    assert not r.changed


def test_cse_merges_nodes_including_commutative_operands(golden):
    r = golden(cse, """
graph "g" {
  input %x: f32[4]
  input %y: f32[4]
  %a: f32[4] = Mul(%x, %y) @a
  %b: f32[4] = Mul(%y, %x) @b
  %c: f32[4] = Sub(%x, %y) @c
  %d: f32[4] = Sub(%y, %x) @d
  %e: f32[4] = Exp(%a) @e
  %f: f32[4] = Exp(%b) @f
  %g: f32[4] = Add(%e, %f) @g
  %h: f32[4] = Softmax(%g) {axis=0} @h
  %i: f32[4] = Softmax(%g) {axis=-1} @i
  %j: f32[4] = Softmax(%g) {axis=0} @j
  output %c, %d, %h, %i, %j
}""", """
graph "g" {
  input %x: f32[4]
  input %y: f32[4]
  %a: f32[4] = Mul(%x, %y) @a
  %c: f32[4] = Sub(%x, %y) @c
  %d: f32[4] = Sub(%y, %x) @d
  %e: f32[4] = Exp(%a) @e
  %g: f32[4] = Add(%e, %e) @g
  %h: f32[4] = Softmax(%g) {axis=0} @h
  %i: f32[4] = Softmax(%g) {axis=-1} @i
  %j: f32[4] = Softmax(%g) {axis=0} @j
  output %c, %d, %h, %i, %j
}""")
    assert r.stats == {"nodes_merged": 2}  # %h and %j are both outputs: two names, kept apart


def test_cse_gives_a_duplicate_outputs_name_to_the_survivor(golden):
    golden(cse, """
graph "g" {
  input %x: f32[4]
  %a: f32[4] = Exp(%x) @a
  %b: f32[4] = Exp(%x) @b
  %c: f32[4] = Neg(%a) @c
  output %c, %b
}""", """
graph "g" {
  input %x: f32[4]
  %b: f32[4] = Exp(%x) @a
  %c: f32[4] = Neg(%b) @c
  output %c, %b
}""")


def test_cse_merges_small_constants_by_value_and_weights_by_identity(golden):
    w = np.ones((16, 16), np.float32)
    r = golden(cse, """
graph "g" {
  input %x: f32[16, 16]
  const %c1: f32[] = 2.0
  const %c2: f32[] = 2.0
  const %c3: f64[] = 2.0
  const %z1: f32[] = 0.0
  const %z2: f32[] = -0.0
  const %w1: f32[16, 16]
  const %w2: f32[16, 16]
  const %w3: f32[16, 16]
  %a: f32[16, 16] = Mul(%x, %c1) @a
  %b: f32[16, 16] = Mul(%x, %c2) @b
  %p: f32[16, 16] = Add(%a, %z1) @p
  %q: f32[16, 16] = Add(%b, %z2) @q
  %m1: f32[16, 16] = MatMul(%p, %w1) @m1
  %m2: f32[16, 16] = MatMul(%q, %w2) @m2
  %m3: f32[16, 16] = MatMul(%q, %w3) @m3
  %c: f64[] = Neg(%c3) @c
  output %m1, %m2, %m3, %c
}""", """
graph "g" {
  input %x: f32[16, 16]
  const %c1: f32[] = 2.0
  const %c3: f64[] = 2.0
  const %z1: f32[] = 0.0
  const %z2: f32[] = -0.0
  const %w1: f32[16, 16]
  const %w3: f32[16, 16]
  %a: f32[16, 16] = Mul(%x, %c1) @a
  %p: f32[16, 16] = Add(%a, %z1) @p
  %q: f32[16, 16] = Add(%a, %z2) @q
  %m1: f32[16, 16] = MatMul(%p, %w1) @m1
  %m2: f32[16, 16] = MatMul(%q, %w1) @m2
  %m3: f32[16, 16] = MatMul(%q, %w3) @m3
  %c: f64[] = Neg(%c3) @c
  output %m1, %m2, %m3, %c
}""", weights={"w1": w, "w2": w, "w3": w.copy()})
    assert r.stats == {"nodes_merged": 1, "consts_merged": 2}


def test_cse_never_merges_state_writes(golden):
    text = ATTENTION_WITH_CACHE.replace(
        "  %y: f32[1, 2, 3, 4] = Exp(%q) @y",
        "  %o2: f32[1, 2, 3, 4] = Attention(%q, %k, %v, %past, %kc, %vc) {causal=1} @attn2\n"
        "  %y: f32[1, 2, 3, 4] = Add(%o, %o2) @y")
    golden(cse, text, text)


def test_cse_on_parsed_graph_keeps_unused_constants_for_dce():
    g = parse_graph("""
graph "g" {
  input %x: f32[4]
  const %unused: f32[] = 1.0
  %a: f32[4] = Exp(%x) @a
  output %a
}""")
    assert not cse(g).changed and "unused" in g.consts
