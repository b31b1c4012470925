"""Renders the megakernel's Triton source from `templates/megakernel.py.jinja`.

The dispatch chain holds only the op kinds the program uses, so a model without split-KV (or the
CPU target) does not carry the combine body's registers. The source is a real `.py` file because
Triton reads kernels with `inspect`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2

from zlc import bundle as fmt

from . import program as pg
from .program import Program

ENTRY = "zlc_megakernel"
TEMPLATES = Path(__file__).resolve().parent / "templates"

# How the loop calls each op body (the names are the kernel's locals).
_CALLS = {
    fmt.OP_EMBED: "op_embed(DI, DF, CTRL, W, A, d, T, past, BLOCK_T, BLOCK_E)",
    fmt.OP_LINEAR: "op_linear(DI, DF, CTRL, W, P, A, d, a, b, c, T, BLOCK_N, BLOCK_K, BLOCK_KD, BLOCK_T, DOT_PRECISION)",
    fmt.OP_CACHE_APPEND: "op_cache_append(DI, P, A, d, a, T, past, BLOCK_T, HEAD_P2)",
    fmt.OP_ATTENTION: "op_attention(DI, DF, P, A, d, a, b, c, T, past, BLOCK_T, BLOCK_KV, HEAD_P2, KV_SPLITS,\n                                 DOT_PRECISION)",
    fmt.OP_ATTN_COMBINE: "op_attn_combine(DI, A, d, a, HEAD_P2, KV_SPLITS)",
    fmt.OP_ARGMAX: "op_argmax(DI, CTRL, A, d, BLOCK_K)",
}

# A debug build's waits give up after this long and raise the error flag instead of hanging.
DEBUG_WAIT_TIMEOUT_NS = 2_000_000_000


@dataclass(frozen=True)
class _Kind:
    code: int
    call: str


def signature(weight_dtype: str) -> dict[str, str]:
    """The kernel's pointer parameters, as `triton.compile` wants them."""
    w = {"fp32": "*fp32", "bf16": "*bf16"}[weight_dtype]
    return {"TASKS": "*i32", "DI": "*i64", "DF": "*fp32", "CTRL": "*i32", "CNT": "*i32",
            "W": w, "P": "*fp32", "A": "*fp32"}


def render(p: Program, *, weight_dtype: str, version: str) -> str:
    kinds = sorted({t.op for tasks in p.tables.values() for t in tasks})
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    # the table format's numbers (zlc.bundle) and the descriptor codes (program.py), as constexprs
    consts = {k: getattr(m, k) for m in (fmt, pg) for k in dir(m) if k.isupper() and isinstance(getattr(m, k), int)}
    return env.get_template("megakernel.py.jinja").render(
        version=version, model=p.model, weight_dtype=weight_dtype, entry=ENTRY, c=consts,
        wait_timeout_ns=DEBUG_WAIT_TIMEOUT_NS, op_kinds=[_Kind(k, _CALLS[k]) for k in kinds])
