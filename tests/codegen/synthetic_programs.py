"""Synthetic programs for the kernel source's tests: one task per descriptor, with the fields a
scheduler would set, so a test can turn on any combination of the kernel's features without a
model that has them (test_megakernel_features.py renders them; test_gpu_every_feature.py builds the
every-feature kernel for GPU targets)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from zlc import bundle as fmt
from zlc.abi import AttentionDesc, CacheAppendDesc, Desc, EmbedDesc, LinearDesc
from zlc.codegen import program as pg
from zlc.ir.quant import FORMATS
from zlc.targets import TRITON_WEIGHT_FORMATS

Fields = dict[str, float]


def program(*descs: tuple[type[Desc], Fields]) -> SimpleNamespace:
    """A program whose decode table has one task per (op, fields): the fields a scheduler would
    set, the rest as pack.py leaves them (0), plus a plain Llama's -1 "none"s."""
    plain: dict[type[Desc], Fields] = {AttentionDesc: dict(q_norm_w=-1, k_norm_w=-1),
                                       CacheAppendDesc: dict(k_norm_w=-1), LinearDesc: dict(bias=-1, w2=-1),
                                       EmbedDesc: dict(pos_table=-1)}
    di = np.zeros((len(descs), fmt.DESC_WORDS), np.int64)
    df = np.zeros((len(descs), fmt.DESC_FLOATS), np.float32)
    tasks = []
    for i, (schema, values) in enumerate(descs):
        ints, floats = schema.row(**{**plain.get(schema, {}), **values})
        for k, v in ints.items():
            di[i, k] = v
        for k, fv in floats.items():
            df[i, k] = fv
        tasks.append(SimpleNamespace(op=schema.op, desc=i, a=0, b=16))
    return SimpleNamespace(model="synthetic", tables={"prefill": [], "decode": tasks}, desc_int=di, desc_float=df,
                           tiling=SimpleNamespace(block_n=16, lm_block_n=0, kv_splits=1))


PLAIN: list[tuple[type[Desc], Fields]] = [
    (EmbedDesc, dict(scale=1.0)), (AttentionDesc, dict(scale=0.25)), (CacheAppendDesc, {}),
    (LinearDesc, dict(k=64, norm=pg.NORM_RMS, eps=1e-5)),
    (LinearDesc, dict(k=64, w2=4096, norm=pg.NORM_RMS, act=1, eps=1e-5))]

# One task that turns each feature on (its descriptor fields as tasks.py writes them).
ONE: dict[str, tuple[type[Desc], Fields]] = {
    "window": (AttentionDesc, dict(window=4)),
    "attn_softcap": (AttentionDesc, dict(softcap=50.0)),
    "alibi": (AttentionDesc, dict(alibi=-0.25)),
    "qk_norm": (CacheAppendDesc, dict(k_norm_w=128, qk_eps=1e-6)),
    "qk_norm_whole": (AttentionDesc, dict(q_norm_w=128, k_norm_w=192, qk_norm_whole=3, qk_eps=1e-6)),
    "moe_route": (LinearDesc, dict(k=64, route_logits=0, route_experts=4, route_top_k=2, route_expert=1, route=2)),
    "lm_softcap": (LinearDesc, dict(k=64, lm=1, softcap=30.0)),
    "bias": (LinearDesc, dict(k=64, bias=256)),
    "embed_norm": (EmbedDesc, dict(norm=pg.NORM_LAYER, norm_w=0, norm_b=64, scale=1.0, eps=1e-5)),
    "embed_pos": (EmbedDesc, dict(pos_table=4096, scale=1.0)),
    "mlp_split_k": (LinearDesc, dict(k=64, n=128, w2=4096, norm=pg.NORM_RMS, act=1, down_w=8192, down_out=512,
                                     down_bias=-1, down_rows=64)),
}


def every_feature_packed() -> list[tuple[type[Desc], Fields]]:
    """A Linear task per weight format the Triton kernel streams (the packed bodies)."""
    return [(LinearDesc, dict(k=64, w_format=q.code)) for q in FORMATS.values() if q.name in TRITON_WEIGHT_FORMATS]


def every_feature() -> SimpleNamespace:
    """A program with every optional feature of the kernel on: each ONE task, every activation and
    every packed format."""
    acts = [(LinearDesc, dict(k=64, act=code)) for code in sorted(set(pg.ACTIVATIONS.values()) - {0})]
    return program(*PLAIN, *ONE.values(), *acts, *every_feature_packed())
