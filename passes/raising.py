"""Raising: replaces op-level subgraphs with transformer-level ops (rules as data).

Raising rules are rules of the one rewrite engine (rewrite.py) canonicalization uses. A rule anchors
on the op where the subgraph it recognizes starts (the ReduceMean of an RMSNorm, the Softmax of
attention, the MatMul of a linear layer); its pattern states the structure and its check what
patterns cannot say: shapes and axes, constant values, and what a position-only subgraph computes
(masks, rotary tables, activations, found by evaluating it: probe.py). A rule that does not fire
says why, and the reasons are counted per rule and reason, so `zlc inspect --explain` can say why a
norm or an attention block stayed op-level. Rewrites return (old, new) value pairs and land through
`SubgraphEdits`. The rule sets run in a fixed order (raise_all.RAISING), each rule to its own
fixpoint; unmatched subgraphs stay op-level and still run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from zlc.ir import Graph, Value

from .rewrite import RewriteStats, Rule, RuleSet, SubgraphEdits

RULE_SWEEPS = 4  # per rule: a rewrite rarely exposes more than one further match of the same rule


@dataclass
class RaiseStats:
    """What raising did over all rule sets: rule -> times applied, rule -> reason -> times refused."""

    applied: dict[str, int] = field(default_factory=dict)
    refused: dict[str, dict[str, int]] = field(default_factory=dict)

    def add(self, s: RewriteStats) -> None:
        for rule, n in s.applied.items():
            self.applied[rule] = self.applied.get(rule, 0) + n
        for rule, reasons in s.refused.items():
            r = self.refused.setdefault(rule, {})
            for reason, n in reasons.items():
                r[reason] = r.get(reason, 0) + n


def raising_rules(name: str, rules: Sequence[Rule]) -> RuleSet:
    """A raising rule set: each rule in turn, to its fixpoint, with subgraph edits."""
    return RuleSet(name, rules, max_iters=RULE_SWEEPS, per_rule=True, edits=SubgraphEdits)


def new_node(g: Graph, op: str, inputs: Sequence[Value | None], name: str, **attrs: Any) -> Value:
    """Appends a node (the engine re-sorts topologically after each sweep)."""
    return g.add_node(op, list(inputs), attrs, name=name).output
