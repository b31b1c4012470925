"""The IR verifier: rejects malformed graphs with a message that names the node."""

from __future__ import annotations

from zlc.errors import IRError, ShapeError

from .graph import Graph
from .ops import OPS, infer_types
from .quant import PACKED_INPUTS, PACKED_TABLES
from .types import DType, TensorType
from .values import Value


def compatible_types(a: TensorType, b: TensorType) -> bool:
    """Could be the same tensor type: dtype equal, and no two static dims disagree."""
    if a.dtype != b.dtype:
        return False
    if a.shape is None or b.shape is None:
        return True
    if len(a.shape) != len(b.shape):
        return False
    return all(x == y or isinstance(x, str) or isinstance(y, str) for x, y in zip(a.shape, b.shape, strict=False))


def verify_graph(g: Graph, *, check_types: bool = True) -> None:
    """Raises IRError on: unknown ops, wrong arity, values used before definition or never
    defined, duplicate definitions, outputs that are not defined, and (with check_types) stored
    output types that disagree with shape inference."""
    defined: set[int] = set()
    names: set[str] = set()
    for v in list(g.inputs) + list(g.consts.values()) + list(g.state):
        if v.name in names:
            raise IRError(f"value name '%{v.name}' defined twice")
        names.add(v.name)
        defined.add(id(v))
        if v.kind == "const" and v.data is None:
            raise IRError(f"constant '%{v.name}' has no data (missing weight)")
        if v.quant is not None:
            _check_packed(g, v)
    for n in g.nodes:
        d = OPS.get(n.op)
        if d is None:
            raise IRError(f"node '{n.name}': unknown op '{n.op}'")
        for i, inp in enumerate(n.inputs):
            if inp is None:
                if i < d.min_inputs and i not in d.optional:
                    raise IRError(f"node '{n.name}' ({n.op}): required input {i} is missing")
                continue
            if id(inp) not in defined:
                raise IRError(f"node '{n.name}' ({n.op}): input '%{inp.name}' is used before it is "
                              "defined (or never defined; the graph may have a cycle)")
        if check_types:
            try:
                expect = infer_types(n, len(n.outputs))
            except ShapeError as e:
                raise ShapeError(f"node '{n.name}' ({n.op}): {e}") from None
            if len(expect) != len(n.outputs):
                raise IRError(f"node '{n.name}' ({n.op}): has {len(n.outputs)} outputs, op defines {len(expect)}")
            for o, t in zip(n.outputs, expect, strict=False):
                if not compatible_types(o.type, t):
                    raise ShapeError(f"node '{n.name}' ({n.op}): output '%{o.name}' is {o.type} "
                                     f"but inference gives {t}")
        for o in n.outputs:
            if o.name in names:
                raise IRError(f"node '{n.name}' ({n.op}): value name '%{o.name}' defined twice")
            if o.producer is not n:
                raise IRError(f"node '{n.name}' ({n.op}): output '%{o.name}' has a wrong producer link")
            names.add(o.name)
            defined.add(id(o))
    if not g.outputs:
        raise IRError(f"graph '{g.name}' has no outputs")
    for v in g.outputs:
        if id(v) not in defined:
            raise IRError(f"graph output '%{v.name}' is not defined by any node, input or constant")


def _check_packed(g: Graph, v: Value) -> None:
    """A packed weight (ir/quant.py): f32 [N, K] data, blocks of exactly that matrix, read only as
    matrix of a Linear-like op (quant.PACKED_INPUTS: the kernels dequantize it in a Linear's weight
    stream) or as an embedding's table (quant.PACKED_TABLES: rows gathered and dequantized)."""
    shape = v.shape or ()
    if v.kind != "const" or v.dtype != DType.f32 or len(shape) != 2 or not all(isinstance(d, int) for d in shape):
        raise IRError(f"'%{v.name}': a {v.quant.format.name} weight must be an f32 [N, K] constant, got {v.type}")
    if (int(shape[0]), int(shape[1])) != (v.quant.n, v.quant.k):  # type: ignore[arg-type]
        raise IRError(f"'%{v.name}': {v.quant.format.name} blocks are for [{v.quant.n}, {v.quant.k}], "
                      f"the constant is {v.type}")
    v.quant.check(f"'%{v.name}'")
    for n in g.nodes:
        for i, inp in enumerate(n.inputs):
            if inp is v and i not in PACKED_INPUTS.get(n.op, ()) + PACKED_TABLES.get(n.op, ()):
                raise IRError(f"node '{n.name}' ({n.op}) reads the {v.quant.format.name} weight '%{v.name}' as "
                              f"input {i}; a packed weight is only a Linear's matrix or an embedding's table "
                              f"({', '.join(f'{o} {list(ix)}' for o, ix in {**PACKED_INPUTS, **PACKED_TABLES}.items())})")
