"""The op descriptors' schema (part of zlc.abi): which word of a descriptor row means what, for each op.

A task names its op and a descriptor row: DESC_WORDS int64 words (DI) and DESC_FLOATS f32 words
(DF) holding the op instance's arena offsets, sizes and codes. The meaning of each word is
declared here, once, as a class per op with one `I` (int word) or `F` (float word) per field:

- the task builder writes rows by field name (`LinearDesc.row(x_off=..., k=...)`); a name the op
  does not have is an error, and every other word is zero;
- Python readers index rows by field (`di[LinearDesc.k]`: a field is its own index);
- the templates read named constants made from the fields (`constants()`: `DI_LINEAR_K` is
  `tl.constexpr(2)` in the Triton kernel and `#define DI_LINEAR_K 2` in the C kernel; Triton folds
  them, so the machine code is what a literal gave);
- docs/megakernel.md's descriptor tables are generated from it (`python docs/gen_tables.py`).

Some words hold one of two fields (a union): which one is set by another field of the row, said
in the field's `when`. Adding a field is one line here, then its writer and readers by name.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

from .tables import (
    DESC_FLOATS,
    DESC_WORDS,
    OP_ARGMAX,
    OP_ATTENTION,
    OP_ATTN_COMBINE,
    OP_CACHE_APPEND,
    OP_EMBED,
    OP_LINEAR,
    OP_NAMES,
    OP_ROW_NORM,
)


@dataclass(frozen=True)
class Field:
    """One word of a descriptor row: an int64 word of DI (`I`) or an f32 word of DF (`F`)."""

    word: int
    doc: str
    when: str = ""  # for a word two fields share: the condition under which this one holds
    is_float: bool = False
    name: str = ""  # set by the op's class
    op: str = ""

    def __index__(self) -> int:  # di[LinearDesc.k]
        return self.word

    @property
    def constant(self) -> str:
        """The templates' name for the word: DI_<OP>_<FIELD> or DF_<OP>_<FIELD>."""
        return f"{'DF' if self.is_float else 'DI'}_{self.op.upper()}_{self.name.upper()}"


def I(word: int, doc: str, when: str = "") -> Field:  # noqa: E743 (the schema's one-letter field kinds)
    return Field(word, doc, when)


def F(word: int, doc: str, when: str = "") -> Field:
    return Field(word, doc, when, is_float=True)


class Desc:
    """An op's descriptor layout. Subclasses declare `op` (the task op code) and their fields; a
    subclass without `op` declares fields that several ops share (their words must agree: the
    kernels' shared helpers read them for either op)."""

    op: ClassVar[int]
    fields: ClassVar[dict[str, Field]]

    def __init_subclass__(cls) -> None:
        if "op" not in vars(cls):
            return
        name = OP_NAMES[cls.op]
        cls.fields = {}
        for base in reversed(cls.__mro__):
            for attr, f in list(vars(base).items()):
                if isinstance(f, Field):
                    named = Field(f.word, f.doc, f.when, f.is_float, attr, name)
                    setattr(cls, attr, named)
                    cls.fields[attr] = named
        _check(cls)

    @classmethod
    def row(cls, **values: float) -> tuple[dict[int, int], dict[int, float]]:
        """(int words, float words) of a row with these fields set, for `pack.Layout.desc`."""
        ints: dict[int, int] = {}
        floats: dict[int, float] = {}
        for key, v in values.items():
            f = cls.fields.get(key)
            if f is None:
                raise KeyError(f"{cls.__name__} has no field {key!r} (fields: {', '.join(cls.fields)})")
            if f.is_float:
                floats[f.word] = float(v)
            else:
                ints[f.word] = int(v)
        return ints, floats


def _check(cls: type[Desc]) -> None:
    """Words in range; a word shared by two fields only where every holder says when it holds."""
    seen: dict[tuple[bool, int], list[Field]] = {}
    for f in cls.fields.values():
        limit = DESC_FLOATS if f.is_float else DESC_WORDS
        if not 0 <= f.word < limit:
            raise ValueError(f"{cls.__name__}.{f.name}: word {f.word} outside 0..{limit - 1}")
        seen.setdefault((f.is_float, f.word), []).append(f)
    for fs in seen.values():
        if len(fs) > 1 and not all(f.when for f in fs):
            raise ValueError(f"{cls.__name__}: word {fs[0].word} is "
                             f"{' and '.join(f.name for f in fs)} without saying when each holds")


# ---- the ops -----------------------------------------------------------------------------------

class EmbedDesc(Desc):
    """The embedding rows of the step's tokens (plus learned positions, an optional norm)."""

    op = OP_EMBED
    out_off = I(0, "A offset of the output rows")
    out_stride = I(1, "output row stride")
    hidden = I(2, "columns (the hidden size)")
    table = I(3, "W offset of the token table [vocab, hidden]; Q byte offset when table_format is set")
    pos_table = I(4, "W offset of the learned position table, -1 none (GPT-2)")
    norm = I(5, "a norm of the embedded rows, in place: NORM_NONE, NORM_RMS or NORM_LAYER (BLOOM)")
    norm_w = I(6, "P offset of that norm's gains")
    norm_b = I(7, "P offset of its bias, -1 none")
    table_format = I(8, "0: the token table is dense in W; else its packed format's code (zlc.abi.formats), "
                        "its rows of blocks gathered and dequantized (native kernel only)")
    vocab = I(9, "rows of the token table")
    scale = F(0, "the rows' scale (Gemma: sqrt(hidden))")
    eps = F(1, "the norm's epsilon")


class LinearDesc(Desc):
    """y = act(norm(x) @ W.T (* norm(x) @ W2.T) + bias) + residual, over a task's columns [a, b);
    also the LM head (logits and per-task argmax partials), a MoE expert's gate/up or down, and in
    decode the fused MLP down (split-K, float atomics into its output)."""

    op = OP_LINEAR
    x_off = I(0, "A offset of the input rows; the split-KV partials when norm is NORM_COMBINE")
    x_stride = I(1, "input row stride")
    k = I(2, "K: the reduction size")
    n = I(3, "N: the output columns")
    w = I(4, "W offset of the [N, K] weights (64-element aligned)")
    w2 = I(5, "W offset of the second matrix of a gated pair (act(x W.T) * x W2.T), -1 none")
    bias = I(6, "P offset of the bias, -1 none")
    res_off = I(7, "A offset of the residual rows added in the epilogue, -1 none")
    out_off = I(8, "A offset of the output rows")
    out_stride = I(9, "output row stride")
    norm = I(10, "how x is read: NORM_NONE, NORM_RMS or NORM_LAYER (the norm fused into the tile), "
                 "NORM_COMBINE (merged from split-KV attention partials, decode)")
    norm_w = I(11, "P offset of the fused norm's gains, -1 none", when="norm is not NORM_COMBINE")
    merge_splits = I(11, "split-KV partials per head to merge", when="norm is NORM_COMBINE")
    norm_b = I(12, "P offset of the fused LayerNorm's bias, -1 none", when="norm is not NORM_COMBINE")
    merge_head_dim = I(12, "head size of the merged partials", when="norm is NORM_COMBINE")
    act = I(13, "activation code (ACTIVATIONS)")
    lm = I(14, "1: the LM head (logits, then an argmax partial per task)")
    lm_partials = I(15, "A offset of the LM head's (max, argmax) partials, -1 none")
    route_logits = I(16, "A offset of the MoE router's logits [T, E]", when="route is not 0")
    down_w = I(16, "W offset of the fused MLP down's matrix (split-K)", when="route is 0 and down_rows > 0")
    route_experts = I(17, "E: the router's experts", when="route is not 0")
    down_out = I(17, "A offset of the fused down's output (the accumulator)", when="route is 0 and down_rows > 0")
    route_top_k = I(18, "top-k experts per row", when="route is not 0")
    down_bias = I(18, "P offset of the fused down's bias (added by the task holding column 0), -1 none",
                  when="route is 0 and down_rows > 0")
    route_expert = I(19, "e: this task's expert", when="route is not 0")
    copy_off = I(19, "A offset the decode output is also stored to (the fused down's accumulator init)",
                 when="route is 0 and copy is 1")
    route_normalize = I(20, "1: top-k weights renormalized to sum 1", when="route is not 0")
    w_format = I(20, "how w and w2 are stored: 0 dense in the W arena (offsets in elements); else a packed "
                     "format's code (zlc.abi.formats: 1 q8_0, 2 q4_0, 3 q4_1, ..., 8 q6_k, 9..15 nbits4_b16..b1024), offsets in bytes of the Q arena",
                 when="route is 0")
    route = I(21, "MoE routing: 0 none, 1 an expert's gate/up, 2 an expert's down")
    down_rows = I(22, "rows of the MLP down fused into these tasks (its output columns), 0 none")
    copy = I(23, "1: the decode output also initializes the fused down's accumulator (at copy_off)")
    eps = F(0, "the fused norm's epsilon")
    softcap = F(1, "the LM head's logit soft-cap (0 none; Gemma 2)")


class RowNormDesc(Desc):
    """A norm of whole rows no Linear fuses (post-norms), the residual add its epilogue."""

    op = OP_ROW_NORM
    x_off = I(0, "A offset of the input rows")
    x_stride = I(1, "input row stride")
    k = I(2, "columns")
    norm = I(3, "NORM_RMS or NORM_LAYER")
    norm_w = I(4, "P offset of the gains")
    norm_b = I(5, "P offset of the bias, -1 none")
    res_off = I(6, "A offset of the residual rows, -1 none")
    res_stride = I(7, "residual row stride")
    out_off = I(8, "A offset of the output rows")
    out_stride = I(9, "output row stride")
    eps = F(0, "epsilon")


class _HeadDesc(Desc):
    """What cache_append and attention share, on the same words: the head's geometry, its rotary
    tables and its q/k norm (load_roped / _load_roped, load_qk / _qk_norm_of read them for both)."""

    head_dim = I(6, "D: the head size")
    rope = I(7, "rotary kind: ROPE_NONE, ROPE_HALF or ROPE_INTERLEAVED")
    rope_cos = I(8, "P offset of the cos table [positions, half]")
    rope_sin = I(9, "P offset of the sin table")
    rope_half = I(10, "columns of a table row")
    rope_rot = I(11, "rotated columns of a head (partial rotary: fewer than D)")
    head_stride = I(12, "cache elements per KV head (max_seq * D)")
    qk_norm_whole = I(23, "bit 0: the loaded q's (cache_append: k's) norm is over the whole projection "
                          "row (OLMo 2), else per head; bit 1: the same for attention's fused append's k")
    qk_eps = F(3, "the q/k norms' epsilon")


class CacheAppendDesc(_HeadDesc):
    """The step's k and v rows of one KV head into its cache, k rotated (and q/k-normed) first."""

    op = OP_CACHE_APPEND
    k_off = I(0, "A offset of the k projection's rows")
    k_stride = I(1, "k row stride")
    v_off = I(2, "A offset of the v projection's rows")
    v_stride = I(3, "v row stride")
    k_cache = I(4, "A offset of the k cache [Hkv, max_seq, D]")
    v_cache = I(5, "A offset of the v cache")
    k_norm_w = I(21, "P offset of k's q/k-norm gains, -1 none (the word of attention's q_norm_w)")


class AttentionDesc(_HeadDesc):
    """One query head's attention over its KV head's cache (a block of query rows in prefill; in
    decode one split of the keys with split-KV), the step's k/v appended here when fused."""

    op = OP_ATTENTION
    q_off = I(0, "A offset of the q projection's rows")
    q_stride = I(1, "q row stride")
    k_cache = I(2, "A offset of the k cache")
    v_cache = I(3, "A offset of the v cache")
    out_off = I(4, "A offset of the output rows")
    out_stride = I(5, "output row stride")
    group = I(13, "query heads per KV head (GQA)")
    partials = I(14, "A offset of the split-KV partials [H * splits, D + 2], -1: no split")
    split_len = I(15, "keys per split (max_seq without split-KV)")
    k_new = I(16, "A offset of the step's k rows, read from the projection (fused append), -1 none")
    k_new_stride = I(17, "their row stride")
    v_new = I(18, "A offset of the step's v rows (fused append), -1 none")
    v_new_stride = I(19, "their row stride")
    window = I(20, "causal sliding window in keys, 0 none")
    q_norm_w = I(21, "P offset of q's q/k-norm gains, -1 none")
    k_norm_w = I(22, "P offset of the fused append's k-norm gains, -1 none")
    scale = F(0, "the scores' scale")
    softcap = F(1, "the scores' soft-cap, 0 none (Gemma 2)")
    alibi = F(2, "this head's ALiBi slope, 0 none (BLOOM, MPT)")


class CombineDesc(Desc):
    """Split-KV partials of one head merged into its output (decode, without fuse_combine)."""

    op = OP_ATTN_COMBINE
    partials = I(0, "A offset of the partials")
    out_off = I(1, "A offset of the output row")
    out_stride = I(2, "output row stride")
    head_dim = I(3, "D")
    splits = I(4, "partials per head")


class ArgmaxDesc(Desc):
    """The next token: the argmax over the LM head tasks' (max, argmax) partials."""

    op = OP_ARGMAX
    partials = I(0, "A offset of the partials")
    slots = I(1, "LM head tasks (partials)")


#: Every op's layout, in op-code order.
DESCS: tuple[type[Desc], ...] = (EmbedDesc, LinearDesc, CacheAppendDesc, AttentionDesc, CombineDesc, ArgmaxDesc,
                                 RowNormDesc)
assert [d.op for d in DESCS] == list(range(len(OP_NAMES)))

# _qk_norm_of reads the gains of norm `which` at word q_norm_w + which: cache_append's k is
# `which` 0, the fused append's k in attention 1.
assert CacheAppendDesc.k_norm_w.word == AttentionDesc.q_norm_w.word == AttentionDesc.k_norm_w.word - 1


def all_fields() -> Iterator[Field]:
    for d in DESCS:
        yield from d.fields.values()


def constants() -> dict[str, int]:
    """{DI_<OP>_<FIELD> or DF_<OP>_<FIELD>: word} for the templates."""
    return {f.constant: f.word for f in all_fields()}
