"""Renders the megakernel's Triton source from `templates/megakernel.py.jinja`.

The dispatch chain holds only the op kinds the program uses, so a model without split-KV (or the
CPU target) does not carry the combine body's registers. Every model dimension is known here, so
the matrix-vector product (a decode step's whole weight stream) gets one body per row length K
the model has (gemv_plan.GemvBody, written by gemv_source.py): unrolled, unmasked along K, with a
chosen number of weight chunks in flight. The model's optional code paths (sliding window, soft-caps, ALiBi, q/k norms, MoE routing,
the embedding's norm and positions, biases, activations) are compiled in only where some task uses
them (`Features`): each is a runtime branch read from the descriptors otherwise, paid by every model
in registers, instructions and descriptor round trips. The source is a real `.py` file because
Triton reads kernels with `inspect`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from zlc import abi
from zlc.abi import FORMATS, AttentionDesc, CacheAppendDesc, EmbedDesc, LinearDesc
from zlc.targets import TRITON_WEIGHT_FORMATS

from . import gemv_source
from . import program as pg
from .gemv_plan import DOWN_MAX_ROWS, MAX_CHUNK, PREFETCH_BYTES, gemv_bodies
from .program import Program

ENTRY = "zlc_megakernel"


def kernel_constants() -> dict[str, int | str]:
    """Both templates' `c`: the ABI's constants (zlc.abi: table words, codes, format codes and the
    C block-size initializer)."""
    return {**abi.constants(), **abi.format_constants()}
TEMPLATES = Path(__file__).resolve().parent / "templates"

# How the loop calls each op body (the names are the kernel's locals).
_CALLS = {
    abi.OP_EMBED: "op_embed(DI, DF, CTRL, W, P, A, d, T, past, bat, BLOCK_T, BLOCK_E)",
    abi.OP_LINEAR: "op_linear(DI, DF, CNT, CTRL, W, Q, P, A, row, d, a, b, c, T, all_logits, bat, BLOCK_N, BLOCK_K, BLOCK_KD,\n"
                   "                      BLOCK_T, DOT_PRECISION, KV_SPLITS, DEBUG, STEP)",
    abi.OP_CACHE_APPEND: "op_cache_append(DI, DF, P, A, d, a, T, past, bat, BLOCK_T, HEAD_P2)",
    abi.OP_ATTENTION: "op_attention(DI, DF, P, A, d, a, b, c, T, past, bat, BLOCK_T, BLOCK_KV, HEAD_P2, KV_SPLITS,\n                                 DOT_PRECISION)",
    abi.OP_ATTN_COMBINE: "op_attn_combine(DI, A, d, a, HEAD_P2, KV_SPLITS)",
    abi.OP_ARGMAX: "op_argmax(DI, CTRL, A, d)",
    abi.OP_ROW_NORM: "op_row_norm(DI, DF, P, A, d, a, b, T, BLOCK_T, BLOCK_K)",
}

# The decode kernel's own bodies (STEP == MODE_DECODE: one query row; docs/megakernel.md, "Two kernels").
_DECODE_CALLS = {
    abi.OP_ATTENTION: "op_attention_row(DI, DF, CNT, CTRL, P, A, row, d, a, c, past, BLOCK_KV, HEAD_P2, KV_SPLITS,\n"
                      "                                 DEBUG)",
}

_DECODE_WAITS_ITSELF = frozenset({abi.OP_ATTENTION})

# A debug build's waits give up after this long and raise the error flag instead of hanging.
DEBUG_WAIT_TIMEOUT_NS = 2_000_000_000


@dataclass(frozen=True)
class _Kind:
    code: int
    call: str
    waits_itself: bool = False  # the body waits for its inputs after requesting its weights
    decode_call: str = ""  # the decode kernel's body instead, when it has its own
    decode_waits_itself: bool = False  # that body waits itself (after requesting what no wait orders)


@dataclass(frozen=True)
class Features:
    """The optional code paths some task of the programs (every tiling, both modes) needs, read off
    their descriptors: the template compiles each one in only when it is set, so a model without it
    carries none of its loads, math or registers. Field by field, what sets it (descriptors.py):"""

    window: bool = False  # AttentionDesc.window > 0: a sliding window
    attn_softcap: bool = False  # AttentionDesc.softcap > 0: the scores' soft-cap (Gemma 2)
    alibi: bool = False  # AttentionDesc.alibi != 0: an ALiBi slope (BLOOM, MPT)
    qk_norm: bool = False  # Attention q_norm_w / k_norm_w, CacheAppend k_norm_w >= 0: q/k norm gains (Qwen3, OLMo 2)
    qk_norm_whole: bool = False  # their qk_norm_whole != 0: a q/k norm over the whole projection row (OLMo 2)
    moe_route: bool = False  # LinearDesc.route != 0: a routed MoE expert (Mixtral, Qwen3-MoE)
    lm_softcap: bool = False  # LinearDesc.softcap > 0: the LM head's soft-cap (Gemma 2)
    bias: bool = False  # LinearDesc.bias >= 0: a Linear bias
    activations: tuple[int, ...] = ()  # LinearDesc.act: the activation codes used (0 none is free)
    embed_norm: bool = False  # EmbedDesc.norm != 0: a norm of the embedding rows (BLOOM)
    embed_pos: bool = False  # EmbedDesc.pos_table >= 0: a learned position table (GPT-2)
    mlp_split_k: bool = False  # LinearDesc.down_rows > 0 (a fused MLP down) or copy != 0 (its accumulator's init)
    packed: tuple[int, ...] = ()  # LinearDesc.w_format (route 0): the packed weight formats streamed (ir/quant.py codes)

    @classmethod
    def of(cls, programs: Sequence[Program]) -> Features:
        f: dict[str, Any] = {}
        acts: set[int] = set()
        packed: set[int] = set()

        def on(name: str, cond: Any) -> None:
            if bool(cond):
                f[name] = True

        for p in programs:
            di_all, df_all = p.desc_int, p.desc_float
            for tasks in p.tables.values():
                for t in tasks:
                    di, df = di_all[t.desc], df_all[t.desc]
                    if t.op == abi.OP_ATTENTION:
                        on("window", di[AttentionDesc.window] > 0)
                        on("attn_softcap", df[AttentionDesc.softcap] > 0)
                        on("alibi", df[AttentionDesc.alibi] != 0)
                        on("qk_norm", di[AttentionDesc.q_norm_w] >= 0 or di[AttentionDesc.k_norm_w] >= 0)
                        on("qk_norm_whole", di[AttentionDesc.qk_norm_whole] != 0)
                    elif t.op == abi.OP_CACHE_APPEND:
                        on("qk_norm", di[CacheAppendDesc.k_norm_w] >= 0)
                        on("qk_norm_whole", di[CacheAppendDesc.qk_norm_whole] != 0)
                    elif t.op == abi.OP_LINEAR:
                        on("moe_route", di[LinearDesc.route] != 0)
                        on("mlp_split_k", di[LinearDesc.down_rows] > 0 or di[LinearDesc.copy] != 0)
                        on("lm_softcap", df[LinearDesc.softcap] > 0)
                        on("bias", di[LinearDesc.bias] >= 0)
                        acts.add(int(di[LinearDesc.act]))
                        if di[LinearDesc.route] == 0 and di[LinearDesc.w_format]:
                            packed.add(int(di[LinearDesc.w_format]))
                    elif t.op == abi.OP_EMBED:
                        on("embed_norm", di[EmbedDesc.norm] != 0)
                        on("embed_pos", di[EmbedDesc.pos_table] >= 0)
        return cls(**f, activations=tuple(sorted(acts - {0})), packed=tuple(sorted(packed)))

    def flags(self) -> dict[str, bool]:
        """The kernel's constexpr feature flags: HAS_<FEATURE> for each feature, HAS_ACT_<NAME> for
        each activation (Triton folds `if HAS_X:`, so code behind a False flag is not compiled)."""
        out = {f"HAS_{k.upper()}": v for k, v in vars(self).items() if isinstance(v, bool)}
        out.update({f"HAS_ACT_{name.upper()}": code in self.activations
                    for name, code in pg.ACTIVATIONS.items() if code})
        # HAS_PACKED: some Linear streams packed blocks from Q; HAS_<FORMAT>: that format's bodies
        out["HAS_PACKED"] = bool(self.packed)
        out.update({f"HAS_{q.name.upper()}": q.code in self.packed for q in FORMATS.values()
                    if q.name in TRITON_WEIGHT_FORMATS})
        return out

    def used(self) -> list[str]:
        """The features set, by name (the manifest's `kernel.features`)."""
        names = {v: k for k, v in pg.ACTIVATIONS.items()}
        formats = {q.code: q.name for q in FORMATS.values()}
        return ([k for k, v in vars(self).items() if v is True] + [names.get(a, str(a)) for a in self.activations]
                + [formats.get(c, str(c)) for c in self.packed])


def signature(weight_dtype: str) -> dict[str, str]:
    """The kernel's pointer parameters, as `triton.compile` wants them."""
    w = {"fp32": "*fp32", "bf16": "*bf16"}[weight_dtype]
    return {"TASKS": "*i32", "DI": "*i64", "DF": "*fp32", "CTRL": "*i32", "CNT": "*i32",
            "W": w, "Q": "*u8", "P": "*fp32", "A": "*fp32"}


def render(programs: Program | Sequence[Program], *, weight_dtype: str, version: str,
           gemv_block_n: int | None = None, max_chunk: int = MAX_CHUNK,
           prefetch_bytes: int = PREFETCH_BYTES, max_down_rows: int = DOWN_MAX_ROWS) -> str:
    """One kernel source for every tiling in `programs` (its dispatch chain covers every op kind
    any of them uses); `gemv_block_n` sizes the specialized matrix-vector bodies (default: the
    widest BLOCK_N of a GPU-sized tiling, i.e. the last program's)."""
    progs = [programs] if isinstance(programs, Program) else list(programs)
    kinds = sorted({t.op for p in progs for tasks in p.tables.values() for t in tasks})
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)
    # the decode matrix-vector bodies, planned here and written out by gemv_source
    gemv = gemv_bodies(progs, weight_dtype, gemv_block_n or progs[-1].tiling.block_n, max_chunk, prefetch_bytes,
                       max_down_rows)
    f = Features.of(progs)
    # the ABI's numbers (zlc.abi: table words, codes, formats), as constexprs
    consts = kernel_constants()
    return env.get_template("megakernel.py.jinja").render(
        version=version, model=progs[0].model, weight_dtype=weight_dtype, entry=ENTRY, c=consts, desc=abi.desc_constants(),
        wait_timeout_ns=DEBUG_WAIT_TIMEOUT_NS,
        op_kinds=[_Kind(k, _CALLS[k], waits_itself=k == abi.OP_LINEAR, decode_call=_DECODE_CALLS.get(k, ""),
                       decode_waits_itself=k in _DECODE_WAITS_ITSELF)
                  for k in kinds],
        gemv_sources=[gemv_source.body(g) for g in gemv],
        gemv_dispatch=gemv_source.dispatch(gemv, moe_route=f.moe_route), f=f)
