"""The raising rule sets, in the order the driver applies them."""

from __future__ import annotations

from zlc.ir import Graph

from .raise_attention import (
    ATTENTION,
    ATTENTION_GQA,
    HEADS_ROUNDTRIP,
    MERGE_HEADS,
    ROPE,
    ROPE_TABLES,
    SPLIT_HEADS,
    STATIC_SELECT,
)
from .raise_layers import (
    EMBEDDING,
    GATED_MLP,
    GATED_MLP_FUSED,
    LINEAR,
    LINEAR_RESHAPE,
    LM_HEAD,
    MLP,
    RMSNORM,
    SLICE_LINEAR,
    SPLIT_LINEAR,
)
from .raising import RaiseStats, apply_rules

# Order matters: Linear before MLPs (they match Linear nodes); LM head last among layers so that
# an MLP's down projection is never mistaken for the head.
RULE_SETS = [
    ("norms", [RMSNORM]),
    ("embedding", [EMBEDDING]),
    ("linear", [LINEAR, LINEAR_RESHAPE]),
    ("rope", [ROPE, ROPE_TABLES]),
    ("attention", [ATTENTION, ATTENTION_GQA, STATIC_SELECT]),
    ("mlp", [GATED_MLP, GATED_MLP_FUSED, MLP]),
    ("fused_projections", [SPLIT_LINEAR, SLICE_LINEAR]),
    ("heads", [SPLIT_HEADS, MERGE_HEADS, HEADS_ROUNDTRIP]),
    ("lm_head", [LM_HEAD]),
]


def raise_graph(g: Graph) -> RaiseStats:
    stats = RaiseStats()
    # A second sweep picks up what one rule set's rewrite exposes to an earlier one (e.g. GPT-2's
    # merged heads are flattened for a Linear that `linear_reshape` can only fold afterwards).
    for _ in range(2):
        before = sum(stats.applied.values())
        for _, rules in RULE_SETS:
            apply_rules(g, rules, stats)
        if sum(stats.applied.values()) == before:
            break
    return stats
