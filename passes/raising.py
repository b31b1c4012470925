"""Raising: replaces op-level subgraphs with transformer-level ops (rules as data).

Each rule is a small declarative object: the op it anchors on, a `match` that returns the bound
values or the *reason* it refused (kept per rule, so `zlc inspect --explain` can say why a norm or
an attention block stayed op-level), and a `rewrite` that builds the replacement. The driver applies
rule sets in order; unmatched subgraphs stay op-level and still run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from zlc.ir import Graph, Node, Value

from .match import Users

Match = dict[str, Any]


@dataclass(frozen=True)
class RaiseRule:
    name: str
    anchor: str
    match: Callable[[Graph, Node, Users], Match | str]
    rewrite: Callable[[Graph, Match], list[tuple[Value, Value]]]
    doc: str = ""


@dataclass
class RaiseStats:
    applied: dict[str, int] = field(default_factory=dict)
    refused: dict[str, dict[str, int]] = field(default_factory=dict)  # rule -> reason -> count

    def refuse(self, rule: str, reason: str) -> None:
        r = self.refused.setdefault(rule, {})
        r[reason] = r.get(reason, 0) + 1


def remove_dead(g: Graph) -> int:
    """Drops nodes whose outputs nobody uses (nodes writing state are kept)."""
    live = {id(v) for v in g.outputs}
    keep: list[Node] = []
    for n in reversed(g.nodes):
        writes_state = any(v is not None and v.kind == "state" for v in n.inputs)
        if writes_state or any(id(o) in live for o in n.outputs):
            keep.append(n)
            live.update(id(v) for v in n.inputs if v is not None)
    removed = len(g.nodes) - len(keep)
    g.nodes = keep[::-1]
    g.drop_unused_consts()
    return removed


def keep_output_name(g: Graph, old: Value, new: Value) -> None:
    """A graph output keeps its name (logits, present.0.key) when its producer is replaced."""
    name = old.name
    old.name = g.fresh_name(name + ".old")
    new_name = new.name
    new.name = name
    g._names.discard(new_name)


def apply_rules(g: Graph, rules: Sequence[RaiseRule], stats: RaiseStats | None = None) -> RaiseStats:
    stats = stats or RaiseStats()
    for rule in rules:
        changed = True
        rounds = 0
        while changed and rounds < 4:
            changed = False
            rounds += 1
            users = Users(g)
            consumed: set[int] = set()
            for node in [n for n in g.nodes if n.op == rule.anchor]:
                if id(node) in consumed:
                    continue
                m = rule.match(g, node, users)
                if isinstance(m, str):
                    stats.refuse(rule.name, m)
                    continue
                if any(id(n) in consumed for n in m.get("_nodes", ())):
                    continue
                for old, new in rule.rewrite(g, m):
                    if any(old is o for o in g.outputs):
                        keep_output_name(g, old, new)
                    g.replace_uses(old, new)
                consumed.update(id(n) for n in m.get("_nodes", ()))
                consumed.add(id(node))
                stats.applied[rule.name] = stats.applied.get(rule.name, 0) + 1
                changed = True
            if changed:
                g.toposort()
                remove_dead(g)
    return stats


def new_node(g: Graph, op: str, inputs: Sequence[Value | None], name: str, **attrs: Any) -> Value:
    """Appends a node (the driver re-sorts topologically after each rule sweep)."""
    return g.add_node(op, list(inputs), attrs, name=name).output
