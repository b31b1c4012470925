"""The raising rule sets, in the order the driver applies them, and `raise_graph`.

Each rule set is a `RuleSet` of the rewrite engine and can be run (and its result dumped) on its
own; `raise_graph` applies them all in order, up to `RAISE_SWEEPS` times.
"""

from __future__ import annotations

from collections.abc import Callable

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
from .raise_blocks import HEADS_GATHER, HEADS_QKV, PARALLEL_RESIDUAL, ROPE_OF_REPEAT
from .raise_layers import (
    EMBEDDING,
    GATED_MLP,
    GATED_MLP_FUSED,
    LINEAR,
    LINEAR_RESHAPE,
    LM_HEAD,
    LM_HEAD_SOFTCAP,
    MLP,
    RMSNORM,
    RMSNORM_CASTS,
    SLICE_LINEAR,
    SPLIT_LINEAR,
)
from .raise_moe import MOE
from .raise_rope_forms import ROPE_PAIRS, ROPE_PARTIAL, ROPE_PARTIAL_TOKENS_FIRST, SWAP_PAIR
from .raise_rows import CENTRED_RMSNORM, HEADS_NORM, LINEAR_DIVIDE, LINEAR_SCALE, UNFLATTEN_ROWS
from .raise_scores import SQUEEZE_ROUNDTRIP, UNBATCH_MATMUL
from .raising import RaiseStats, raising_rules
from .rewrite import RewriteStats, RuleSet

# Order matters: Linear before MLPs (they match Linear nodes); LM head last among layers so that
# an MLP's down projection is never mistaken for the head.
RAISING: list[tuple[str, RuleSet]] = [(name, raising_rules(name, rules)) for name, rules in (
    ("raise-norms", [RMSNORM, RMSNORM_CASTS]),
    ("raise-embedding", [EMBEDDING]),
    ("raise-linear", [LINEAR, LINEAR_RESHAPE]),
    ("raise-rope", [ROPE, ROPE_PAIRS, ROPE_TABLES, ROPE_PARTIAL, ROPE_PARTIAL_TOKENS_FIRST,
                    SWAP_PAIR, ROPE_OF_REPEAT]),
    ("raise-attention", [UNBATCH_MATMUL, ATTENTION, ATTENTION_GQA, STATIC_SELECT, SQUEEZE_ROUNDTRIP]),
    ("raise-moe", [MOE]),
    ("raise-mlp", [GATED_MLP, GATED_MLP_FUSED, MLP]),
    ("raise-fused-projections", [SPLIT_LINEAR, SLICE_LINEAR]),
    ("raise-heads", [SPLIT_HEADS, MERGE_HEADS, HEADS_ROUNDTRIP]),
    ("raise-rows", [LINEAR_SCALE, LINEAR_DIVIDE, CENTRED_RMSNORM, UNFLATTEN_ROWS, HEADS_NORM]),
    ("raise-lm-head", [LM_HEAD_SOFTCAP, LM_HEAD]),
    ("raise-blocks", [HEADS_QKV, HEADS_GATHER, PARALLEL_RESIDUAL]),
)]

# A second sweep picks up what one rule set's rewrite exposes to an earlier one (e.g. GPT-2's
# merged heads are flattened for a Linear that `linear_reshape` can only fold afterwards).
RAISE_SWEEPS = 2


def raise_graph(g: Graph, observer: Callable[[str, Graph, RewriteStats], None] | None = None, *,
                stop_after: str | None = None) -> RaiseStats:
    """Applies the RAISING rule sets in order, again while a sweep raised something (at most
    RAISE_SWEEPS sweeps). `observer(name, graph, stats)` sees the graph after each rule set, with
    what that set did; `stop_after=NAME` ends right after rule set NAME's first application."""
    if stop_after is not None and stop_after not in {name for name, _ in RAISING}:
        raise ValueError(f"unknown raising rule set {stop_after!r}")
    stats = RaiseStats()
    for _ in range(RAISE_SWEEPS):
        before = sum(stats.applied.values())
        for name, rules in RAISING:
            s = rules.apply(g)
            stats.add(s)
            if observer is not None:
                observer(name, g, s)
            if name == stop_after:
                return stats
        if sum(stats.applied.values()) == before:
            break
    return stats
