"""The IR's textual form. It round-trips: parse_graph(print_graph(g), weights) equals g.

    graph "tiny" {
      input %input_ids: i64[1, seq]
      const %embed: f32[256, 64]                  # large constants: data kept aside
      const %axes: i64[1] = [-1]                  # small constants: data inline
      state %cache.k.0: f32[1, 2, max_seq, 16]
      %x: f32[1, seq, 64] = Embedding(%embed, %input_ids) @embedding
      %a: f32[1, seq, 32], %b: f32[1, seq, 32] = Split(%x) {axis=-1, split=[32, 32]} @split
      output %logits
    }

The printer is graph.py's (a graph prints itself: `str(g)`); it is re-exported here, beside the
parser that reads it back.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import torch

from zlc.errors import IRError

from .graph import Graph, print_graph
from .ops import infer_sym
from .quant import QuantizedWeight, get_format
from .types import Dim, DType, TensorType
from .values import Node, Value

__all__ = ["graphs_equal", "parse_graph", "print_graph"]

# ---- parser ---------------------------------------------------------------------------------

_NAME = r"[A-Za-z0-9_.:/\-\[\]<>#@]+?"
_TYPE_RE = re.compile(r"^(\w+)\[(.*)\]$")


def _parse_type(s: str, lineno: int) -> TensorType:
    m = _TYPE_RE.match(s.strip())
    if not m:
        raise IRError(f"line {lineno}: bad type '{s}'")
    try:
        dt = DType(m.group(1))
    except ValueError:
        raise IRError(f"line {lineno}: unknown dtype '{m.group(1)}'") from None
    body = m.group(2).strip()
    if body == "*":
        return TensorType(dt, None)
    dims: list[Dim] = []
    if body:
        for d in _split_top(body):
            d = d.strip()
            dims.append(int(d) if re.fullmatch(r"-?\d+", d) else d)
    return TensorType(dt, tuple(dims))


def _split_top(s: str, sep: str = ",") -> list[str]:
    """Splits on `sep` outside brackets, braces, parentheses and strings."""
    parts, depth, cur, in_str, esc = [], 0, [], False, False
    for ch in s:
        if in_str:
            cur.append(ch)
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur or parts:
        parts.append("".join(cur))
    return parts


def _parse_value_json(s: str, lineno: int) -> Any:
    try:
        return json.loads(s.replace("NaN", "NaN"))
    except json.JSONDecodeError as e:
        raise IRError(f"line {lineno}: bad literal '{s}': {e.msg}") from None


def parse_graph(text: str, weights: dict[str, Any] | None = None) -> Graph:
    """Parses the text form. Large constants take their data from `weights` (name -> array)."""
    weights = weights or {}
    lines = text.splitlines()
    g: Graph | None = None
    env: dict[str, Value] = {}

    def lookup(name: str, lineno: int) -> Value:
        if name not in env:
            raise IRError(f"line {lineno}: use of undefined value '%{name}'")
        return env[name]

    for lineno, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if g is None:
            m = re.match(r'^graph\s+(".*")\s*\{$', line)
            if not m:
                raise IRError(f"line {lineno}: expected 'graph \"name\" {{'")
            g = Graph(json.loads(m.group(1)))
            continue
        if line == "}":
            return g
        if line.startswith("meta "):
            g.metadata = _parse_value_json(line[5:], lineno)
            continue
        m = re.match(r"^(input|const|state)\s+%(\S+?):\s*(\w+\[[^\]]*\])(?:\s+(q\d_[0-9k]|nbits4_b\d+))?(?:\s*=\s*(.*))?$", line)
        if m:
            kind, name, ty = m.group(1), m.group(2), _parse_type(m.group(3), lineno)
            if kind == "input":
                env[name] = g.add_input(name, ty)
            elif kind == "state":
                env[name] = g.add_state(name, ty)
            else:
                packed = None
                if m.group(4) is not None:  # a packed weight: `weights` holds its QuantizedWeight
                    get_format(m.group(4))
                    packed = weights.get(name)
                    if not isinstance(packed, QuantizedWeight) or packed.format.name != m.group(4):
                        raise IRError(f"line {lineno}: constant '%{name}' is {m.group(4)} but its weight is not "
                                      f"{m.group(4)} blocks")
                    data: Any = packed.dequantize()
                elif m.group(5) is not None:
                    flat = _parse_value_json(m.group(5), lineno)
                    shape = tuple(int(d) for d in (ty.shape or ()))
                    if ty.dtype == DType.bf16:
                        data = torch.tensor(flat, dtype=torch.bfloat16).reshape(shape)
                    else:
                        data = np.array(flat, dtype=ty.dtype.numpy).reshape(shape)
                elif name in weights:
                    data = weights[name]
                else:
                    raise IRError(f"line {lineno}: constant '%{name}' has no inline data and no weight")
                v = g.add_const(name, data)
                v.quant = packed
                if v.type != ty:
                    raise IRError(f"line {lineno}: constant '%{name}' is {v.type}, text says {ty}")
                env[name] = v
            continue
        if line.startswith("output"):
            names = [s.strip().lstrip("%") for s in line[len("output"):].split(",") if s.strip()]
            g.outputs = [lookup(n, lineno) for n in names]
            continue
        m = re.match(r"^(.*?)\s=\s(\w+)\((.*?)\)(\s*\{.*\})?\s*@(\S+)$", line)
        if not m:
            raise IRError(f"line {lineno}: cannot parse '{line}'")
        outs_s, op, ins_s, attrs_s, node_name = m.groups()
        ins: list[Value | None] = []
        for s in _split_top(ins_s):
            s = s.strip()
            if not s:
                continue
            ins.append(None if s == "_" else lookup(s.lstrip("%"), lineno))
        attrs: dict[str, Any] = {}
        if attrs_s:
            body = attrs_s.strip()[1:-1]
            for kv in _split_top(body):
                k, _, val = kv.partition("=")
                attrs[k.strip()] = _parse_value_json(val.strip(), lineno)
        out_decl = []
        for s in _split_top(outs_s):
            nm, _, ty_s = s.strip().partition(":")
            out_decl.append((nm.strip().lstrip("%"), _parse_type(ty_s, lineno)))
        node = Node(op, ins, [], attrs, g.claim_node_name(node_name))
        for nm, ty in out_decl:
            v = Value(g.claim_name(nm), ty, "node", producer=node)
            node.outputs.append(v)
            env[nm] = v
        infer_sym(node)
        g.nodes.append(node)
    raise IRError("unexpected end of text: missing closing '}'")


def graphs_equal(a: Graph, b: Graph) -> bool:
    """Structural equality: same text form and the same constant data."""
    if print_graph(a) != print_graph(b):
        return False
    for k, va in a.consts.items():
        vb = b.consts.get(k)
        if vb is None:
            return False
        xa, xb = va.const_array(), vb.const_array()
        if xa is None or xb is None or xa.shape != xb.shape or not np.array_equal(xa, xb, equal_nan=True):
            return False
    return True
