"""The raising rule sets, in the order the driver applies them."""

from __future__ import annotations

from zlc.ir import Graph

from .raise_attention import ATTENTION, ROPE, ROPE_TABLES
from .raise_layers import (
    EMBEDDING,
    GATED_MLP,
    GATED_MLP_FUSED,
    LINEAR,
    LINEAR_RESHAPE,
    LM_HEAD,
    MLP,
    RMSNORM,
)
from .raising import RaiseStats, apply_rules

# Order matters: Linear before MLPs (they match Linear nodes); LM head last among layers so that
# an MLP's down projection is never mistaken for the head.
RULE_SETS = [
    ("norms", [RMSNORM]),
    ("embedding", [EMBEDDING]),
    ("linear", [LINEAR, LINEAR_RESHAPE]),
    ("rope", [ROPE, ROPE_TABLES]),
    ("attention", [ATTENTION]),
    ("mlp", [GATED_MLP, GATED_MLP_FUSED, MLP]),
    ("lm_head", [LM_HEAD]),
]


def raise_graph(g: Graph) -> RaiseStats:
    stats = RaiseStats()
    for _, rules in RULE_SETS:
        apply_rules(g, rules, stats)
    return stats
