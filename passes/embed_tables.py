"""Packed embedding tables and GPU targets.

A token table may stay in its packed blocks (ir/quant.py PACKED_TABLES: a GGUF's token_embd, or
`--quantize`): the native kernel gathers a token's row of blocks and dequantizes it, and a tied LM
head streams the same blocks, so the bundle holds one packed table and no dense one. The Triton
kernel reads only dense embedding tables: with a GPU target in the compile every packed token table
becomes dense again (its data is already the exact dequantization), except that a tied LM head
whose format the Triton kernel streams (zlc.targets: Target.weight_formats) keeps the blocks as a copy of its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from zlc.ir import Graph
from zlc.ir.quant import PACKED_TABLES
from zlc.targets import streamed_by


def dense_tables_for_gpu(graphs: Sequence[Graph], gpu_targets: Sequence[str]) -> dict[str, str]:
    """With GPU targets, makes every packed embedding table of `graphs` (one model's graphs, which
    may share constants) dense, in place; returns {table: why it is dense} (empty without GPU
    targets or packed tables)."""
    if not gpu_targets:
        return {}
    why = f"dense for the embedding: the Triton kernel ({', '.join(gpu_targets)}) reads no packed embedding table"
    dense: dict[str, str] = {}
    for g in graphs:
        for n in g.nodes:
            for i in PACKED_TABLES.get(n.op, ()):
                v = n.inputs[i] if i < len(n.inputs) else None
                if v is None or v.quant is None:
                    continue
                other = [u for u in g.nodes if u is not n and any(x is v for x in u.inputs)]
                if other and streamed_by(v.quant.format.name, gpu_targets):  # the tied head keeps streaming the blocks
                    copy = g.consts.get(f"{v.name}.dense")
                    if copy is None:
                        copy = g.add_const(f"{v.name}.dense", v.data)
                    n.inputs[i] = copy
                    dense[copy.name] = f"{why}; the LM head streams '{v.name}' ({v.quant.format.name})"
                else:
                    dense[v.name] = f"{v.quant.format.name} {why}"
                    v.quant = None
    return dense
