"""Rules as data: a small declarative pattern language over the IR, and one driver that applies
rule sets to a fixpoint.

    mul_one = Rule(
        "mul_one",
        P.op("Mul", P.var("x"), P.const("c", value=1)),         # Add/Mul match both operand orders
        check=lambda m: None if same_shape(m.root.output.type, m["x"].type) else "broadcasts x",
        rewrite=lambda m, g: m["x"],
    )
    stats = RuleSet("canonicalize", [mul_one, ...]).apply(graph)

A pattern is a tree of `P.op` / `P.var` / `P.const` / `P.any` / `P.or_`; the root is an op pattern
matched against a node, every other pattern against a value. `check(match)` returns None to accept
or a *reason* to refuse, so a rule that does not fire can say why (`RuleSet.last_reason`,
`RuleSet.explain`). `rewrite(match, graph)` builds replacement nodes with `graph.make_node` (or
`graph.op`) and returns the values that replace the root's outputs; the driver places the new nodes
before the root, redirects uses, gives the replacement the root's node and value names, and removes
what became dead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np

from zlc.errors import PassError
from zlc.ir import Graph, Node, Value

from .base import (
    PassResult,
    compatible,
    drop_consts,
    has_side_effects,
    precision,
    rename_node,
    rename_value,
)

COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "And", "Or", "Xor", "Equal"})
CONST_VALUE_MAX = 4096  # P.const(value=...) compares data only for constants up to this size


# ---- matching state ----------------------------------------------------------------------------

class _Uses:
    """Use counts for the driver: users per value (a node using a value twice counts twice) plus
    graph outputs. Maintained incrementally while rules fire, rebuilt once per sweep."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.users: dict[Value, list[Node]] = graph.users()
        self.out_ids = {id(v) for v in graph.outputs}

    def count(self, v: Value) -> int:
        return len(self.users.get(v, ())) + (id(v) in self.out_ids)

    def add(self, v: Value, n: Node) -> None:
        self.users.setdefault(v, []).append(n)

    def remove(self, v: Value, n: Node) -> None:
        us = self.users.get(v)
        if us is not None and n in us:
            us.remove(n)


class _State:
    """Bindings under construction; patterns undo their own bindings when they backtrack."""

    __slots__ = ("values", "nodes", "matched", "uses", "why")

    def __init__(self, uses: _Uses, why: list[tuple[int, str]] | None):
        self.values: dict[str, Value] = {}
        self.nodes: dict[str, Node] = {}
        self.matched: list[Node] = []
        self.uses = uses
        # failure reasons, collected only when explaining (string building is not free)
        self.why = why

    def fail(self, fmt: str, *args: Any) -> None:
        if self.why is not None:
            self.why.append((len(self.values) + len(self.matched), fmt.format(*args)))


def _desc(v: Value | None) -> str:
    if v is None:
        return "no value"
    if v.kind == "node" and v.producer is not None:
        return f"%{v.name} from {v.producer.op} '{v.producer.name}'"
    return f"{v.kind} %{v.name}"


def _bind(st: _State, name: str, v: Value) -> Iterator[None]:
    """Binds `name` to v for the rest of the match (a name used twice must see the same value)."""
    bound = st.values.get(name)
    if bound is not None:
        if bound is v:
            yield
        else:
            st.fail("'{}' is bound to %{}, not %{}", name, bound.name, v.name)
        return
    st.values[name] = v
    yield
    del st.values[name]


# ---- patterns -------------------------------------------------------------------------------------

class Pattern:
    """Matches a value; yields once per consistent way to bind it (backtracking via generators)."""

    def match(self, v: Value | None, st: _State) -> Iterator[None]:  # overridden by every pattern kind
        raise TypeError(f"{type(self).__name__} is an abstract pattern")


class AnyPattern(Pattern):
    def match(self, v: Value | None, st: _State) -> Iterator[None]:
        yield

    def __repr__(self) -> str:
        return "P.any()"


class VarPattern(Pattern):
    """Binds any present value; a name used twice must bind the same value (x * x)."""

    def __init__(self, name: str):
        self.name = name

    def match(self, v: Value | None, st: _State) -> Iterator[None]:
        if v is None:
            st.fail("'{}' wants a value, the input is absent", self.name)
            return
        yield from _bind(st, self.name, v)

    def __repr__(self) -> str:
        return f"P.var({self.name!r})"


class ConstPattern(Pattern):
    """A constant; with `value`, every element must equal it (x * 1, x + 0)."""

    def __init__(self, name: str | None = None, value: float | None = None):
        self.name = name
        self.value = value

    def match(self, v: Value | None, st: _State) -> Iterator[None]:
        if v is None or v.kind != "const":
            st.fail("expected a constant, got {}", _desc(v))
            return
        if self.value is not None:
            arr = v.const_array()
            if arr is None or arr.size > CONST_VALUE_MAX or not bool(np.all(arr == self.value)):
                st.fail("constant %{} is not all {}", v.name, self.value)
                return
        if self.name is None:
            yield
            return
        yield from _bind(st, self.name, v)

    def __repr__(self) -> str:
        return f"P.const({self.name!r}, value={self.value!r})"


AttrSpec = Any  # a value to compare with, or a predicate `fn(attr_value) -> bool`


def _attr_eq(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_attr_eq(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class OpPattern(Pattern):
    """A node with one of `ops`, attribute constraints, and operand patterns.

    Trailing absent inputs are ignored; `rest=True` lets the node have more inputs than patterns.
    Two-operand commutative ops try both orders unless `commutative=False`. `single_use` (operand
    patterns only) requires the value to have exactly one use, so a rewrite does not duplicate work
    that others still need. `output` selects which output of a multi-output node is meant."""

    def __init__(self, ops: str | Iterable[str], inputs: Sequence[Pattern], *,
                 attrs: Mapping[str, AttrSpec] | None = None, name: str | None = None,
                 commutative: bool | None = None, single_use: bool = False,
                 output: int | None = None, rest: bool = False):
        self.ops = frozenset([ops] if isinstance(ops, str) else ops)
        self.inputs = tuple(inputs)
        self.attrs = dict(attrs or {})
        self.name = name
        self.commutative = commutative
        self.single_use = single_use
        self.output = output
        self.rest = rest

    def match(self, v: Value | None, st: _State) -> Iterator[None]:
        if v is None or v.kind != "node" or v.producer is None:
            st.fail("expected {} node, got {}", "|".join(sorted(self.ops)), _desc(v))
            return
        node = v.producer
        if self.output is not None and node.outputs.index(v) != self.output:
            st.fail("%{} is not output {} of '{}'", v.name, self.output, node.name)
            return
        if self.single_use and st.uses.count(v) != 1:
            st.fail("%{} has {} uses, pattern wants one", v.name, st.uses.count(v))
            return
        yield from self.match_node(node, st)

    def match_node(self, node: Node, st: _State) -> Iterator[None]:
        if node.op not in self.ops:
            st.fail("'{}' is {}, not {}", node.name, node.op, "|".join(sorted(self.ops)))
            return
        for k, spec in self.attrs.items():
            got = node.attrs.get(k)
            ok = bool(spec(got)) if callable(spec) else _attr_eq(got, spec)
            if not ok:
                st.fail("'{}' ({}) attribute {}={!r} does not fit", node.name, node.op, k, got)
                return
        ins = list(node.inputs)
        while ins and ins[-1] is None:
            ins.pop()
        n = len(self.inputs)
        if len(ins) < n or (len(ins) > n and not self.rest):
            st.fail("'{}' ({}) has {} inputs, pattern has {}", node.name, node.op, len(ins), n)
            return
        if self.name is not None:
            if self.name in st.nodes:
                if st.nodes[self.name] is not node:
                    st.fail("'{}' is bound to another node", self.name)
                    return
                bound_here = False
            else:
                st.nodes[self.name] = node
                bound_here = True
        st.matched.append(node)
        comm = self.commutative if self.commutative is not None else node.op in COMMUTATIVE
        orders = [self.inputs]
        if comm and n == 2:
            orders.append((self.inputs[1], self.inputs[0]))
        for pats in orders:
            yield from _match_seq(pats, ins, 0, st)
        st.matched.pop()
        if self.name is not None and bound_here:
            del st.nodes[self.name]

    def __repr__(self) -> str:
        return f"P.op({'|'.join(sorted(self.ops))}, {', '.join(map(repr, self.inputs))})"


def _match_seq(pats: Sequence[Pattern], vals: Sequence[Value | None], i: int, st: _State) -> Iterator[None]:
    if i == len(pats):
        yield
        return
    for _ in pats[i].match(vals[i], st):
        yield from _match_seq(pats, vals, i + 1, st)


class OrPattern(Pattern):
    def __init__(self, alts: Sequence[Pattern]):
        self.alts = tuple(alts)

    def match(self, v: Value | None, st: _State) -> Iterator[None]:
        for p in self.alts:
            yield from p.match(v, st)


class P:
    """Pattern constructors."""

    @staticmethod
    def op(ops: str | Iterable[str], *inputs: Pattern, attrs: Mapping[str, AttrSpec] | None = None,
           name: str | None = None, commutative: bool | None = None, single_use: bool = False,
           output: int | None = None, rest: bool = False) -> OpPattern:
        return OpPattern(ops, inputs, attrs=attrs, name=name, commutative=commutative,
                         single_use=single_use, output=output, rest=rest)

    @staticmethod
    def var(name: str) -> VarPattern:
        return VarPattern(name)

    @staticmethod
    def const(name: str | None = None, value: float | None = None) -> ConstPattern:
        return ConstPattern(name, value)

    @staticmethod
    def any() -> AnyPattern:
        return AnyPattern()

    @staticmethod
    def or_(*alts: Pattern) -> OrPattern:
        return OrPattern(alts)


# ---- matches and rules ----------------------------------------------------------------------------

class Match:
    """What a rule matched: the root node, bound values (`m["x"]`) and named nodes (`m.node("t")`)."""

    def __init__(self, root: Node, values: dict[str, Value], nodes: dict[str, Node],
                 matched: list[Node], uses: _Uses):
        self.root = root
        self.values = values
        self.nodes = nodes
        self.matched = matched  # every node the pattern covered, root first
        self._uses = uses

    def __getitem__(self, name: str) -> Value:
        return self.values[name]

    def get(self, name: str) -> Value | None:
        return self.values.get(name)

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def const(self, name: str) -> np.ndarray:
        arr = self.values[name].const_array()
        if arr is None:
            raise PassError(f"'{name}' (%{self.values[name].name}) is not a constant")
        return arr

    def n_uses(self, v: Value) -> int:
        """Uses of `v` in the graph (node inputs plus graph outputs)."""
        return self._uses.count(v)


Check = Callable[[Match], "str | None"]
Rewrite = Callable[[Match, Graph], "Value | Sequence[Value] | None"]


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: OpPattern
    check: Check | None
    rewrite: Rewrite

    def _try(self, node: Node, uses: _Uses, why: list[tuple[int, str]] | None) -> Match | str | None:
        """A match whose check passes; else the last check's reason (str); None: no structural match."""
        st = _State(uses, why)
        reason: str | None = None
        for _ in self.pattern.match_node(node, st):
            m = Match(node, dict(st.values), dict(st.nodes), list(st.matched), uses)
            reason = self.check(m) if self.check is not None else None
            if reason is None:
                return m
        return reason

    def match(self, graph: Graph, node: Node) -> Match | str:
        """Matches at `node` (for tests and --explain): the Match, or the reason there is none."""
        why: list[tuple[int, str]] = []
        r = self._try(node, _Uses(graph), why)
        if isinstance(r, Match):
            return r
        if r is not None:
            return f"check refused: {r}"
        if not why:
            return "no match"
        # the failure that got furthest (most bindings) explains best; ties: the order as written
        best = max(p for p, _ in why)
        return next(msg for p, msg in why if p == best)


# ---- the driver ------------------------------------------------------------------------------------

@dataclass
class RewriteStats:
    matches: dict[str, int] = field(default_factory=dict)
    iterations: int = 0
    nodes_added: int = 0
    nodes_removed: int = 0

    @property
    def changed(self) -> bool:
        return any(self.matches.values())


class _Editor:
    """One sweep's edits: new nodes wait in `before`/`after` lists keyed by their root and are
    spliced in at the end, so a sweep costs O(nodes) plus the work of the rules that fire."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.uses = _Uses(graph)
        self.known = {id(n) for n in graph.nodes}
        self.dead: set[int] = set()
        self.before: dict[int, list[Node]] = {}
        self.after: dict[int, list[Node]] = {}
        self.added = 0
        self.removed = 0

    def apply(self, rule: Rule, m: Match) -> str | None:
        """Runs the rule's rewrite and splices the result in; returns a reason if it declined."""
        g, root = self.graph, m.root
        n_nodes, n_consts = len(g.nodes), len(g.consts)
        out = rule.rewrite(m, g)
        del g.nodes[n_nodes:]  # nodes a rewrite appended with graph.op: placed below like the rest
        new_consts = list(islice(g.consts.values(), n_consts, None))
        if out is None:
            return self._decline(new_consts, "rewrite declined")
        news = [out] if isinstance(out, Value) else list(out)
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


class RuleSet:
    """Applies rules to a fixpoint (at most `max_iters` sweeps). Rules are tried in order on each
    node whose op a rule's root accepts; the first that matches, passes its check and rewrites wins.
    A RuleSet is a Pass."""

    def __init__(self, name: str, rules: Sequence[Rule], *, max_iters: int = 16):
        names = [r.name for r in rules]
        if len(set(names)) != len(names):
            raise PassError(f"rule set '{name}' has duplicate rule names")
        self.name = name
        self.rules = list(rules)
        self.max_iters = max_iters
        self._by_op: dict[str, list[Rule]] = {}
        for r in self.rules:
            for op in sorted(r.pattern.ops):
                self._by_op.setdefault(op, []).append(r)
        # rule name -> "node: reason" of the last refusal (check or rewrite), for --explain
        self.last_reason: dict[str, str] = {}

    def apply(self, graph: Graph) -> RewriteStats:
        stats = RewriteStats(matches={r.name: 0 for r in self.rules})
        initial = {id(c) for c in graph.consts.values()}
        used = {id(v) for n in graph.nodes for v in n.inputs if v is not None} | {id(v) for v in graph.outputs}
        used_before = initial & used
        for it in range(self.max_iters):
            stats.iterations = it + 1
            ed = _Editor(graph)
            fired = 0
            for node in list(graph.nodes):
                if id(node) in ed.dead:
                    continue
                for rule in self._by_op.get(node.op, ()):
                    res = rule._try(node, ed.uses, None)
                    if res is None:
                        continue
                    if isinstance(res, str):
                        self.last_reason[rule.name] = f"{node.name}: {res}"
                        continue
                    declined = ed.apply(rule, res)
                    if declined is not None:
                        self.last_reason[rule.name] = f"{node.name}: {declined}"
                        continue
                    stats.matches[rule.name] += 1
                    fired += 1
                    break
            ed.commit()
            stats.nodes_added += ed.added
            stats.nodes_removed += ed.removed
            if not fired:
                break
        # constants this rule set made unused or made and dropped; older unused ones are DCE's business
        drop_consts(graph, [c for c in graph.consts.values() if id(c) in used_before or id(c) not in initial])
        return stats

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
