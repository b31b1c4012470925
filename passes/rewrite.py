"""Rules as data: one rewrite engine for every rule-based pass (canonicalization, raising).

    mul_one = Rule(
        "mul_one",
        P.op("Mul", P.var("x"), P.const("c", value=1)),         # Add/Mul match both operand orders
        check=lambda m: None if same_shape(m.root.output.type, m["x"].type) else "broadcasts x",
        rewrite=lambda m, g: m["x"],
    )
    stats = RuleSet("canonicalize", [mul_one, ...]).apply(graph)

A rule is a pattern (pattern.py: `P.op` / `P.var` / `P.const` / `P.scalar` / `P.any` / `P.or_`), a
`check(match)` that returns None to accept or a *reason* to refuse (what patterns cannot say: shape
and axis conditions, constant values, semantic probing), and a `rewrite(match, graph)`. A rule that
does not fire says why: its check's reason or the `why` of the pattern part that rejected the
candidate. `RuleSet.apply` counts refusals per rule and reason (`RewriteStats.refused`, what
`zlc inspect --explain` prints for raising); `RuleSet.last_reason` and `RuleSet.explain` answer for
one node.

One driver loop, two ways for edits to land (`edits=`):
- `InPlaceEdits` (canonicalization): the rewrite returns the values that replace the root's outputs;
  new nodes go where the root was and inherit its names.
- `SubgraphEdits` (raising): a match covers a subgraph anchored anywhere in it, and the rewrite
  returns (old, new) value pairs, several if it replaces several values; new nodes keep their own
  names and the graph is re-sorted and cleaned (dce) after each sweep.
Rules are tried node by node in one sweep (the first that fires at a node wins), or with
`per_rule=True` each rule in turn to its own fixpoint, which makes the order of a rule set an order
of application. Either way at most `max_iters` sweeps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

from zlc.errors import PassError
from zlc.ir import Graph, Node, Value

from .base import (
    PassResult,
    compatible,
    drop_consts,
    has_side_effects,
    precision,
    release_value_name,
    rename_node,
    rename_value,
)
from .dce import dce
from .pattern import COMMUTATIVE, Match, MatchState, OpPattern, P, Uses

__all__ = ["COMMUTATIVE", "InPlaceEdits", "Match", "P", "Rule", "RuleSet", "RewriteStats", "SubgraphEdits"]

Check = Callable[[Match], "str | None"]
# values replacing the root's outputs (in-place), or (old, new) pairs (subgraph); None declines
Rewrite = Callable[[Match, Graph], "Value | Sequence[Value] | Sequence[tuple[Value, Value]] | None"]


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: OpPattern
    check: Check | None
    rewrite: Rewrite
    # the reason when the pattern does not match and none of its parts said why (None: not counted)
    why: str | None = None
    doc: str = ""

    def _search(self, node: Node, uses: Uses,
                why: list[tuple[int, str]] | None) -> tuple[Match | None, str | None, str | None]:
        """(a match whose check passes, the last check's reason, the pattern's declared reason)."""
        st = MatchState(node, uses, why)
        reason: str | None = None
        for _ in self.pattern.match_node(node, st):
            m = st.snapshot()
            reason = self.check(m) if self.check is not None else None
            if reason is None:
                return m, None, None
        if reason is not None:
            return None, reason, None
        return None, None, st.refusal() or self.why

    def attempt(self, node: Node, uses: Uses) -> Match | str | None:
        """A match whose check passes; else the refusal reason (str); None: no match and no reason."""
        m, checked, declared = self._search(node, uses, None)
        return m if m is not None else (checked or declared)

    def match(self, graph: Graph, node: Node) -> Match | str:
        """Matches at `node` (for tests and --explain): the Match, or the reason there is none."""
        why: list[tuple[int, str]] = []
        m, checked, declared = self._search(node, Uses(graph), why)
        if m is not None:
            return m
        if checked is not None:
            return f"check refused: {checked}"
        if declared is not None:
            return declared
        if not why:
            return "no match"
        # the failure that got furthest (most bindings) explains best; ties: the order as written
        best = max(p for p, _ in why)
        return next(msg for p, msg in why if p == best)


# ---- the driver ------------------------------------------------------------------------------------

@dataclass
class RewriteStats:
    matches: dict[str, int] = field(default_factory=dict)
    refused: dict[str, dict[str, int]] = field(default_factory=dict)  # rule -> reason -> count
    iterations: int = 0
    nodes_added: int = 0
    nodes_removed: int = 0

    @property
    def changed(self) -> bool:
        return any(self.matches.values())

    @property
    def applied(self) -> dict[str, int]:
        """Rules that fired, with their counts."""
        return {k: v for k, v in self.matches.items() if v}

    def refuse(self, rule: str, reason: str) -> None:
        r = self.refused.setdefault(rule, {})
        r[reason] = r.get(reason, 0) + 1


class Edits(Protocol):
    """How one sweep's rewrites land in the graph (see the module docstring)."""

    uses: Uses
    added: int
    removed: int

    def skip(self, node: Node) -> bool: ...
    def blocked(self, m: Match) -> bool: ...
    def apply(self, rule: Rule, m: Match) -> str | None: ...
    def commit(self) -> None: ...


class InPlaceEdits:
    """Canonicalization's edits: the rewrite returns the values that replace the root's outputs; new
    nodes take the root's place (and its node and value names), and producers that lost their last
    use go at once. New nodes wait in `before`/`after` lists keyed by their root and are spliced in at
    the end, so a sweep costs O(nodes) plus the work of the rules that fire."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.uses = Uses(graph)
        self.known = {id(n) for n in graph.nodes}
        self.dead: set[int] = set()
        self.before: dict[int, list[Node]] = {}
        self.after: dict[int, list[Node]] = {}
        self.added = 0
        self.removed = 0

    def skip(self, node: Node) -> bool:
        return id(node) in self.dead

    def blocked(self, m: Match) -> bool:
        return False  # uses are kept current: a match always sees the graph as it now is

    def apply(self, rule: Rule, m: Match) -> str | None:
        """Runs the rule's rewrite and splices the result in; returns a reason if it declined."""
        g, root = self.graph, m.root
        n_nodes, n_consts = len(g.nodes), len(g.consts)
        out = rule.rewrite(m, g)
        del g.nodes[n_nodes:]  # nodes a rewrite appended with graph.op: placed below like the rest
        new_consts = list(islice(g.consts.values(), n_consts, None))
        if out is None:
            return self._decline(new_consts, "rewrite declined")
        news = [x for x in ([out] if isinstance(out, Value) else out) if isinstance(x, Value)]
        if len(news) != len(root.outputs):
            raise PassError(f"rule '{rule.name}' at '{root.name}': rewrite returned {len(news)} "
                            f"values for {len(root.outputs)} outputs")
        fresh_nodes = self._fresh_nodes(rule, root, news)
        fresh = {id(o) for n in fresh_nodes for o in n.outputs} | {id(c) for c in new_consts}
        pairs = [(o, n) for o, n in zip(root.outputs, news, strict=True) if n is not o]
        if not pairs:
            return self._decline(new_consts, "rewrite returned the root's own outputs")
        uses_root = any(v is not None and v.producer is root for n in fresh_nodes for v in n.inputs)
        # the root goes away (its names can be reused) unless the rewrite wraps it or keeps an output
        whole = len(pairs) == len(root.outputs) and not uses_root
        for old, new in pairs:
            if not compatible(old.type, new.type):
                raise PassError(f"rule '{rule.name}' at '{root.name}': replacement %{new.name}: "
                                f"{new.type} does not fit %{old.name}: {old.type}")
            if id(old) in self.uses.out_ids and not (whole and (id(new) in fresh or (
                    new.kind == "node" and id(new) not in self.uses.out_ids))):
                return self._decline(new_consts, f"graph output %{old.name} would lose its name "
                                                 f"to %{new.name}")
        was_output = {id(old) for old, _ in pairs if id(old) in self.uses.out_ids}
        (self.after if uses_root else self.before).setdefault(id(root), []).extend(fresh_nodes)
        for old, new in pairs:
            if id(new) in fresh and precision(old.type) > precision(new.type):
                new.type = old.type  # same tensor: keep what downstream inference already knew
            self._replace(old, new)
        for n in fresh_nodes:  # after _replace, so a node wrapping the root keeps reading it
            self.known.add(id(n))
            for v in n.inputs:
                if v is not None:
                    self.uses.add(v, n)
        self.added += len(fresh_nodes)
        if whole:
            self._kill(root)
            renamed_node = False
            for old, new in pairs:
                if id(new) in fresh or id(old) in was_output:
                    rename_value(g, new, old.name)
                p = new.producer
                if not renamed_node and id(new) in fresh and p is not None and p.outputs[0] is new:
                    rename_node(g, p, root.name)
                    renamed_node = True
        return None

    def _decline(self, new_consts: list[Value], reason: str) -> str:
        for c in new_consts:
            if self.graph.consts.get(c.name) is c:
                del self.graph.consts[c.name]
        return reason

    def _fresh_nodes(self, rule: Rule, root: Node, news: list[Value]) -> list[Node]:
        """Nodes the rewrite created (reachable from its results, not yet placed), in topo order."""
        order: list[Node] = []
        seen: set[int] = set()

        def visit(v: Value | None) -> None:
            if v is None or v.kind != "node" or v.producer is None:
                return
            p = v.producer
            if id(p) in self.known or id(p) in seen:
                return
            if id(p) in self.dead:
                raise PassError(f"rule '{rule.name}' at '{root.name}': result uses %{v.name} of "
                                f"removed node '{p.name}'")
            seen.add(id(p))
            for x in p.inputs:
                visit(x)
            order.append(p)

        for v in news:
            visit(v)
        return order

    def _replace(self, old: Value, new: Value) -> None:
        us = self.uses.users.pop(old, [])
        for u in us:
            u.inputs = [new if x is old else x for x in u.inputs]
        if us:
            self.uses.users.setdefault(new, []).extend(us)
        if id(old) in self.uses.out_ids:
            self.graph.outputs = [new if x is old else x for x in self.graph.outputs]
            self.uses.out_ids.discard(id(old))
            self.uses.out_ids.add(id(new))

    def _kill(self, root: Node) -> None:
        """Removes the root, then every producer that lost its last use (never state writers)."""
        stack = [root]
        while stack:
            n = stack.pop()
            if id(n) in self.dead:
                continue
            self.dead.add(id(n))
            self.known.discard(id(n))
            self.removed += 1
            for v in n.inputs:
                if v is None:
                    continue
                self.uses.remove(v, n)
                p = v.producer
                if (v.kind == "node" and p is not None and id(p) in self.known
                        and not has_side_effects(p) and all(self.uses.count(o) == 0 for o in p.outputs)):
                    stack.append(p)

    def commit(self) -> None:
        if not (self.before or self.after or self.dead):
            return
        out: list[Node] = []
        for n in self.graph.nodes:
            out.extend(f for f in self.before.get(id(n), ()) if id(f) not in self.dead)
            if id(n) not in self.dead:
                out.append(n)
            out.extend(f for f in self.after.get(id(n), ()) if id(f) not in self.dead)
        self.graph.nodes = out


def _pairs(root: Node, out: Value | Sequence[Value] | Sequence[tuple[Value, Value]]) -> list[tuple[Value, Value]]:
    """(old, new) pairs; a bare value or a list of values replaces the root's outputs in order."""
    if isinstance(out, Value):
        return [(root.outputs[0], out)]
    pairs: list[tuple[Value, Value]] = []
    for i, x in enumerate(out):
        pairs.append(x if isinstance(x, tuple) else (root.outputs[i], x))
    return pairs


class SubgraphEdits:
    """Raising's edits: uses of each replaced value move to its replacement at once; new nodes are
    appended and keep their own names (a graph output keeps its name: the replaced value gives it
    up); after the sweep the graph is sorted and dead code removed. Matches read the uses as they
    were when the sweep began, and nodes one match consumed are not matched again until the next."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.uses = Uses(graph)
        self.consumed: set[int] = set()
        self.changed = False
        self.added = 0
        self.removed = 0

    def skip(self, node: Node) -> bool:
        return id(node) in self.consumed

    def blocked(self, m: Match) -> bool:
        return any(id(n) in self.consumed for n in m.consumed)

    def apply(self, rule: Rule, m: Match) -> str | None:
        g = self.graph
        n_nodes = len(g.nodes)
        out = rule.rewrite(m, g)
        if out is None:
            return "rewrite declined"
        for old, new in _pairs(m.root, out):
            if any(old is o for o in g.outputs):
                _keep_output_name(g, old, new)
            g.replace_uses(old, new)
        self.consumed.update(id(n) for n in m.consumed)
        self.consumed.add(id(m.root))
        self.added += len(g.nodes) - n_nodes
        self.changed = True
        return None

    def commit(self) -> None:
        if self.changed:
            self.graph.toposort()
            self.removed += dce(self.graph).stats.get("nodes_removed", 0)


def _keep_output_name(g: Graph, old: Value, new: Value) -> None:
    """A graph output keeps its name (logits, present.0.key) when its producer is replaced."""
    name = old.name
    old.name = g.fresh_name(name + ".old")
    new_name = new.name
    new.name = name
    release_value_name(g, new_name)


class RuleSet:
    """Applies rules to a fixpoint (at most `max_iters` sweeps). In a sweep, rules are tried in order
    on each node whose op a rule's root accepts; the first that matches, passes its check and
    rewrites wins. With `per_rule`, each rule runs its own sweeps in turn. A RuleSet is a Pass."""

    def __init__(self, name: str, rules: Sequence[Rule], *, max_iters: int = 16, per_rule: bool = False,
                 edits: Callable[[Graph], Edits] = InPlaceEdits):
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise PassError(f"rule set '{name}' has duplicate rule names")
        self.name = name
        self.rules = list(rules)
        self.max_iters = max_iters
        self.per_rule = per_rule
        self.edits = edits
        # rule name -> "node: reason" of the last refusal (check, pattern or rewrite), for --explain
        self.last_reason: dict[str, str] = {}

    def apply(self, graph: Graph) -> RewriteStats:
        stats = RewriteStats(matches={r.name: 0 for r in self.rules})
        initial = {id(c) for c in graph.consts.values()}
        used = {id(v) for n in graph.nodes for v in n.inputs if v is not None} | {id(v) for v in graph.outputs}
        used_before = initial & used
        for group in ([[r] for r in self.rules] if self.per_rule else [self.rules]):
            by_op: dict[str, list[Rule]] = {}
            for r in group:
                for op in sorted(r.pattern.ops):
                    by_op.setdefault(op, []).append(r)
            for _ in range(self.max_iters):
                stats.iterations += 1
                if not self._sweep(graph, by_op, stats):
                    break
        # constants this rule set made unused or made and dropped; older unused ones are DCE's business
        drop_consts(graph, [c for c in graph.consts.values() if id(c) in used_before or id(c) not in initial])
        return stats

    def _sweep(self, graph: Graph, by_op: dict[str, list[Rule]], stats: RewriteStats) -> int:
        ed = self.edits(graph)
        fired = 0
        for node in list(graph.nodes):
            if ed.skip(node):
                continue
            for rule in by_op.get(node.op, ()):
                res = rule.attempt(node, ed.uses)
                if res is None:
                    continue
                if isinstance(res, str):
                    self._refused(stats, rule, node, res)
                    continue
                if ed.blocked(res):
                    continue  # overlaps what this sweep already rewrote: the next sweep sees it anew
                declined = ed.apply(rule, res)
                if declined is not None:
                    self._refused(stats, rule, node, declined)
                    continue
                stats.matches[rule.name] += 1
                fired += 1
                break
        ed.commit()
        stats.nodes_added += ed.added
        stats.nodes_removed += ed.removed
        return fired

    def _refused(self, stats: RewriteStats, rule: Rule, node: Node, reason: str) -> None:
        stats.refuse(rule.name, reason)
        self.last_reason[rule.name] = f"{node.name}: {reason}"

    def run(self, graph: Graph) -> PassResult:
        s = self.apply(graph)
        stats = {f"rule.{k}": v for k, v in s.matches.items() if v}
        stats.update(iterations=s.iterations, nodes_added=s.nodes_added, nodes_removed=s.nodes_removed)
        return PassResult(s.changed, stats)

    def explain(self, graph: Graph, node: Node) -> dict[str, str | None]:
        """Why each rule does (None) or does not (the reason) fire at `node`."""
        out: dict[str, str | None] = {}
        for r in self.rules:
            res = r.match(graph, node)
            out[r.name] = None if isinstance(res, Match) else res
        return out
