"""Golden-IR tests for constant folding: weight layouts, shape arithmetic, size cap, no aliasing."""

from __future__ import annotations

import numpy as np
import torch

from zlc.ir import parse_graph
from zlc.passes.fold_constants import fold_constants
from zlc.reference.executor import run_graph

W = np.arange(12 * 8, dtype=np.float32).reshape(12, 8)


def test_weight_layouts_fold_into_named_constants(golden):
    w = W.copy()
    w.flags.writeable = False  # mmapped weights are read-only: folding must not need to write
    r = golden(fold_constants, """
graph "g" {
  input %x: f32[2, 12]
  input %v: f32[12, 3]
  const %w: f32[12, 8]
  %wt: f32[8, 12] = Transpose(%w) {perm=[1, 0]} @wt
  %wh: f16[8, 12] = Cast(%wt) {to="f16"} @wh
  %wf: f32[8, 12] = Cast(%wh) {to="f32"} @wf
  %y: f32[2, 8] = MatMul(%x, %w) @y
  %z: f32[8, 3] = MatMul(%wf, %v) @z
  output %y, %z
}""", """
graph "g" {
  input %x: f32[2, 12]
  input %v: f32[12, 3]
  const %w: f32[12, 8]
  const %w.T.f16.f32: f32[8, 12]
  %y: f32[2, 8] = MatMul(%x, %w) @y
  %z: f32[8, 3] = MatMul(%w.T.f16.f32, %v) @z
  output %y, %z
}""", weights={"w": w}, expected_weights={
        "w": W, "w.T.f16.f32": W.T.astype(np.float16).astype(np.float32)})
    assert r.stats == {"folded_nodes": 3, "weight_consts": 3, "dropped_consts": 2}
    assert np.array_equal(w, W)


def test_folded_weight_owns_its_memory():
    g = parse_graph("""
graph "g" {
  input %x: f32[96]
  const %w: f32[12, 8]
  const %s: i64[1] = [96]
  %r: f32[96] = Reshape(%w, %s) @r
  %y: f32[96] = Add(%x, %r) @y
  output %y
}""", {"w": W})
    fold_constants(g)
    r = g.consts["w.reshape"].data
    assert list(g.consts) == ["w.reshape"]
    assert isinstance(r, np.ndarray) and r.shape == (96,) and not np.shares_memory(r, W)


def test_shape_arithmetic_becomes_constants(golden):
    # Static parts of the shape computation fold; the part that depends on `seq` stays.
    golden(fold_constants, """
graph "g" {
  input %x: f32[2, seq, 8]
  const %i: i64[] = 2
  const %heads: i64[1] = [2]
  const %zero: i64[1] = [0]
  const %m1: i64[1] = [-1]
  %s: i64[3] = Shape(%x) @s
  %d: i64[] = Gather(%s, %i) {axis=0} @d
  %du: i64[1] = Unsqueeze(%d) {axes=[0]} @du
  %hd: i64[1] = Div(%du, %heads) @hd
  %b: i64[2] = Slice(%s, %zero, %m1) @b
  %shape: i64[4] = Concat(%b, %heads, %hd) {axis=0} @shape
  %y: f32[2, seq, 2, 4] = Reshape(%x, %shape) @y
  %n: i64[1] = Shape(%y) {start=-1} @n
  output %y, %n
}""", """
graph "g" {
  input %x: f32[2, seq, 8]
  const %heads: i64[1] = [2]
  const %zero: i64[1] = [0]
  const %m1: i64[1] = [-1]
  const %hd: i64[1] = [4]
  const %n: i64[1] = [4]
  %s: i64[3] = Shape(%x) @s
  %b: i64[2] = Slice(%s, %zero, %m1) @b
  %shape: i64[4] = Concat(%b, %heads, %hd) {axis=0} @shape
  %y: f32[2, seq, 2, 4] = Reshape(%x, %shape) @y
  output %y, %n
}""")


def test_large_results_stay_computed(golden):
    text = """
graph "g" {
  const %one: f32[] = 1.0
  const %shape: i64[2] = [4096, 8192]
  %big: f32[4096, 8192] = Expand(%one, %shape) @big
  output %big
}"""
    r = golden(lambda g: fold_constants(g, max_elements=2**24), text, text)
    assert r.stats == {"skipped_large": 1} and not r.changed


def test_folding_matches_the_reference_executor():
    g = parse_graph("""
graph "g" {
  input %x: f32[3, 4]
  const %a: f32[4] = [1.0, -2.0, 3.5, 0.25]
  const %b: f32[] = 2.0
  const %axes: i64[1] = [0]
  %m: f32[4] = Mul(%a, %b) @m
  %e: f32[4] = Exp(%m) @e
  %s: f32[1, 4] = Unsqueeze(%e) {axes=[0]} @s
  %t: f32[1, 4] = Softmax(%s) {axis=-1} @t
  %y: f32[3, 4] = Mul(%x, %t) @y
  output %y
}""")
    x = torch.randn(3, 4)
    want = run_graph(g, {"x": x})["y"]
    r = fold_constants(g)
    assert r.stats["folded_nodes"] == 4 and [n.op for n in g.nodes] == ["Mul"]
    assert torch.allclose(run_graph(g, {"x": x})["y"], want)


def test_bf16_weights_stay_torch_tensors():
    g = parse_graph("""
graph "g" {
  input %x: f32[2, 80]
  const %w: bf16[80, 2]
  %wt: bf16[2, 80] = Transpose(%w) {perm=[1, 0]} @wt
  %wf: f32[2, 80] = Cast(%wt) {to="f32"} @wf
  %y: f32[2, 80] = Add(%x, %wf) @y
  output %y
}""", {"w": torch.randn(80, 2).to(torch.bfloat16)})
    w = g.consts["w"].data.clone()
    fold_constants(g)
    assert list(g.consts) == ["w.T.f32"]
    got = g.consts["w.T.f32"].data
    assert isinstance(got, np.ndarray) and np.array_equal(got, w.float().numpy().T)
