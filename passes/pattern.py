"""The pattern language of zlc's rewrite rules (canonicalization and raising alike): patterns over
the IR, the `Match` a rule's check and rewrite read, and the reasons a pattern gives for not matching.

A pattern is a tree of `P.op` / `P.var` / `P.const` / `P.scalar` / `P.any` / `P.or_`. The root is an op
pattern matched against a node (the rule's anchor); operand patterns are matched against the node's
inputs, upward. `then=` goes the other way, downward: it is matched against the *only* user of the
node's output, so a rule can anchor on the op that starts a subgraph (the ReduceMean of a norm, the
Softmax of attention) and read the rest in dataflow order. Matching backtracks (commutative operand
orders, alternatives), so a pattern yields every consistent way to bind it; the rule's check takes
the first it accepts.

Refusals. `why=` on a pattern is the reason a rule gives when that pattern itself rejects what it sees
(another op, no sole user, an attribute, a value bound to something else); its operands' failures are
theirs. Of the reasons a failed match collected, the one that got furthest (most bindings) wins, so a
reason deep in the subgraph beats a shallower alternative that did not apply, and an `or_`'s own
reason is the fallback when none of its alternatives got anywhere. `where=` on an op pattern is a
condition on the match so far, tested once the node and its operands matched (and before `then=`);
its reason counts like a `why`, which keeps a rule's refusals in the order its conditions are stated.
`keep=True` marks an operand subtree as context: matched and read, but not consumed by the rewrite
(`Match.consumed`), so another match in the same sweep may still use it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from zlc.errors import PassError
from zlc.ir import Graph, Node, Value

COMMUTATIVE = frozenset({"Add", "Mul", "Max", "Min", "And", "Or", "Xor", "Equal"})
CONST_VALUE_MAX = 4096  # P.const(value=...) compares data only for constants up to this size


# ---- matching state ----------------------------------------------------------------------------

class Uses:
    """Use counts for matching: users per value (a node using a value twice counts twice) plus graph
    outputs. The in-place editor keeps it current while rules fire; raising reads a snapshot taken
    when the sweep began."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.users: dict[Value, list[Node]] = graph.users()
        self.out_ids = {id(v) for v in graph.outputs}

    def count(self, v: Value) -> int:
        return len(self.users.get(v, ())) + (id(v) in self.out_ids)

    def of(self, v: Value) -> list[Node]:
        return self.users.get(v, [])

    def is_output(self, v: Value) -> bool:
        return id(v) in self.out_ids

    def sole(self, v: Value, op: str | tuple[str, ...] | None = None) -> Node | None:
        """The single user of v (with the given op), if v has exactly one use and is no graph output."""
        us = self.of(v)
        if len(us) != 1 or id(v) in self.out_ids:
            return None
        if op is not None and us[0].op not in ((op,) if isinstance(op, str) else op):
            return None
        return us[0]

    def add(self, v: Value, n: Node) -> None:
        self.users.setdefault(v, []).append(n)

    def remove(self, v: Value, n: Node) -> None:
        us = self.users.get(v)
        if us is not None and n in us:
            us.remove(n)


class MatchState:
    """Bindings under construction for one anchor node; patterns undo their own bindings when they
    backtrack."""

    __slots__ = ("root", "values", "nodes", "matched", "kept", "keeping", "uses", "why", "refusals")

    def __init__(self, root: Node, uses: Uses, why: list[tuple[int, str]] | None):
        self.root = root
        self.values: dict[str, Value] = {}
        self.nodes: dict[str, Node] = {}
        self.matched: list[Node] = []
        self.kept: list[bool] = []  # parallel to `matched`: inside a keep=True subtree
        self.keeping = 0
        self.uses = uses
        # detailed failure messages, collected only when explaining (string formatting is not free)
        self.why = why
        self.refusals: list[tuple[int, str]] = []  # (progress, declared reason)

    def progress(self) -> int:
        return len(self.values) + len(self.matched)

    def fail(self, fmt: str, *args: Any) -> None:
        if self.why is not None:
            self.why.append((self.progress(), fmt.format(*args)))

    def refuse(self, reason: str | None, at: int | None = None) -> None:
        if reason is not None:
            self.refusals.append((self.progress() if at is None else at, reason))

    def refusal(self) -> str | None:
        """The declared reason that got furthest (ties: the first recorded), if any."""
        if not self.refusals:
            return None
        best = max(p for p, _ in self.refusals)
        return next(r for p, r in self.refusals if p == best)

    def snapshot(self) -> Match:
        return Match(self.root, dict(self.values), dict(self.nodes), list(self.matched), list(self.kept),
                     self.uses)


def _desc(v: Value | None) -> str:
    if v is None:
        return "no value"
    if v.kind == "node" and v.producer is not None:
        return f"%{v.name} from {v.producer.op} '{v.producer.name}'"
    return f"{v.kind} %{v.name}"


def _bind(st: MatchState, name: str, v: Value, why: str | None = None) -> Iterator[None]:
    """Binds `name` to v for the rest of the match (a name used twice must see the same value)."""
    bound = st.values.get(name)
    if bound is not None:
        if bound is v:
            yield
        else:
            st.fail("'{}' is bound to %{}, not %{}", name, bound.name, v.name)
            st.refuse(why)
        return
    st.values[name] = v
    yield
    del st.values[name]


def scalar(v: Value | None) -> float | None:
    """The value of a constant with exactly one element (any shape of size 1)."""
    if v is None or v.data is None:
        return None
    a = v.const_array()
    if a is None or a.size != 1:
        return None
    return float(a.reshape(-1)[0])


# ---- patterns -------------------------------------------------------------------------------------

class Pattern:
    """Matches a value; yields once per consistent way to bind it (backtracking via generators)."""

    why: str | None = None

    def match(self, v: Value | None, st: MatchState) -> Iterator[None]:  # overridden by every kind
        raise TypeError(f"{type(self).__name__} is an abstract pattern")

    def match_user(self, v: Value, st: MatchState) -> Iterator[None]:
        """Matches the only user of v (for `then=`); only op patterns and their alternatives can."""
        raise TypeError(f"{type(self).__name__} cannot match a user node (then= takes P.op or P.or_)")


class AnyPattern(Pattern):
    def match(self, v: Value | None, st: MatchState) -> Iterator[None]:
        yield

    def __repr__(self) -> str:
        return "P.any()"


class VarPattern(Pattern):
    """Binds any present value; a name used twice must bind the same value (x * x)."""

    def __init__(self, name: str, why: str | None = None):
        self.name = name
        self.why = why

    def match(self, v: Value | None, st: MatchState) -> Iterator[None]:
        if v is None:
            st.fail("'{}' wants a value, the input is absent", self.name)
            st.refuse(self.why)
            return
        yield from _bind(st, self.name, v, self.why)

    def __repr__(self) -> str:
        return f"P.var({self.name!r})"


class ConstPattern(Pattern):
    """A constant; with `value`, every element must equal it (x * 1, x + 0)."""

    def __init__(self, name: str | None = None, value: float | None = None, why: str | None = None):
        self.name = name
        self.value = value
        self.why = why

    def match(self, v: Value | None, st: MatchState) -> Iterator[None]:
        if v is None or v.kind != "const":
            st.fail("expected a constant, got {}", _desc(v))
            st.refuse(self.why)
            return
        if self.value is not None:
            arr = v.const_array()
            if arr is None or arr.size > CONST_VALUE_MAX or not bool(np.all(arr == self.value)):
                st.fail("constant %{} is not all {}", v.name, self.value)
                st.refuse(self.why)
                return
        if self.name is None:
            yield
            return
        yield from _bind(st, self.name, v, self.why)

    def __repr__(self) -> str:
        return f"P.const({self.name!r}, value={self.value!r})"


class ScalarPattern(Pattern):
    """A constant with exactly one element (any shape of size 1: eps, a scale, an exponent)."""

    def __init__(self, name: str | None = None, value: float | None = None, why: str | None = None):
        self.name = name
        self.value = value
        self.why = why

    def match(self, v: Value | None, st: MatchState) -> Iterator[None]:
        x = scalar(v)
        if x is None or (self.value is not None and x != self.value):
            st.fail("expected a scalar constant{}, got {}",
                    "" if self.value is None else f" {self.value}", _desc(v))
            st.refuse(self.why)
            return
        if self.name is None:
            yield
            return
        assert v is not None
        yield from _bind(st, self.name, v, self.why)

    def __repr__(self) -> str:
        return f"P.scalar({self.name!r}, value={self.value!r})"


AttrSpec = Any  # a value to compare with, or a predicate `fn(attr_value) -> bool`
Where = Callable[["Match"], "str | None"]


def _attr_eq(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_attr_eq(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


class OpPattern(Pattern):
    """A node with one of `ops`, attribute constraints, and operand patterns.

    Trailing absent inputs are ignored; `rest=True` lets the node have more inputs than patterns.
    Two-operand commutative ops try both orders unless `commutative=False`. `single_use` (operand
    patterns only) requires the value to have exactly one use, so a rewrite does not duplicate work
    that others still need. `output` selects which output of a multi-output node is meant. `name`
    binds the node, `out` its output value (for `where=`, `then=` and the rewrite)."""

    def __init__(self, ops: str | Iterable[str], inputs: Sequence[Pattern], *,
                 attrs: Mapping[str, AttrSpec] | None = None, name: str | None = None,
                 commutative: bool | None = None, single_use: bool = False,
                 output: int | None = None, rest: bool = False, out: str | None = None,
                 where: Where | None = None, then: Pattern | None = None, keep: bool = False,
                 why: str | None = None):
        self.ops = frozenset([ops] if isinstance(ops, str) else ops)
        self.inputs = tuple(inputs)
        self.attrs = dict(attrs or {})
        self.name = name
        self.commutative = commutative
        self.single_use = single_use
        self.output = output
        self.rest = rest
        self.out = out
        self.where = where
        self.then = then
        self.keep = keep
        self.why = why

    def match(self, v: Value | None, st: MatchState) -> Iterator[None]:
        if v is None or v.kind != "node" or v.producer is None:
            st.fail("expected {} node, got {}", "|".join(sorted(self.ops)), _desc(v))
            st.refuse(self.why)
            return
        node = v.producer
        if self.output is not None and node.outputs.index(v) != self.output:
            st.fail("%{} is not output {} of '{}'", v.name, self.output, node.name)
            st.refuse(self.why)
            return
        if self.single_use and st.uses.count(v) != 1:
            st.fail("%{} has {} uses, pattern wants one", v.name, st.uses.count(v))
            st.refuse(self.why)
            return
        yield from self.match_node(node, st, v)

    def match_user(self, v: Value, st: MatchState) -> Iterator[None]:
        user = st.uses.sole(v)
        if user is None:
            st.fail("%{} has {} uses, pattern wants one user", v.name, st.uses.count(v))
            st.refuse(self.why)
            return
        yield from self.match_node(user, st)

    def match_node(self, node: Node, st: MatchState, via: Value | None = None) -> Iterator[None]:
        if node.op not in self.ops:
            st.fail("'{}' is {}, not {}", node.name, node.op, "|".join(sorted(self.ops)))
            st.refuse(self.why)
            return
        for k, spec in self.attrs.items():
            got = node.attrs.get(k)
            ok = bool(spec(got)) if callable(spec) else _attr_eq(got, spec)
            if not ok:
                st.fail("'{}' ({}) attribute {}={!r} does not fit", node.name, node.op, k, got)
                st.refuse(self.why)
                return
        ins = list(node.inputs)
        while ins and ins[-1] is None:
            ins.pop()
        n = len(self.inputs)
        if len(ins) < n or (len(ins) > n and not self.rest):
            st.fail("'{}' ({}) has {} inputs, pattern has {}", node.name, node.op, len(ins), n)
            st.refuse(self.why)
            return
        bound_here = False
        if self.name is not None:
            if self.name in st.nodes:
                if st.nodes[self.name] is not node:
                    st.fail("'{}' is bound to another node", self.name)
                    st.refuse(self.why)
                    return
            else:
                st.nodes[self.name] = node
                bound_here = True
        st.matched.append(node)
        st.kept.append(self.keep or st.keeping > 0)
        out = via if via is not None else node.outputs[self.output or 0]
        comm = self.commutative if self.commutative is not None else node.op in COMMUTATIVE
        orders = [self.inputs]
        if comm and n == 2:
            orders.append((self.inputs[1], self.inputs[0]))
        inner = 1 if self.keep else 0  # the operands of a kept node are context too
        for pats in orders:
            st.keeping += inner
            for _ in _match_seq(pats, ins, 0, st):
                st.keeping -= inner
                yield from self._continue(out, st)
                st.keeping += inner
            st.keeping -= inner
        st.matched.pop()
        st.kept.pop()
        if bound_here:
            del st.nodes[self.name]  # type: ignore[arg-type]

    def _continue(self, out: Value, st: MatchState) -> Iterator[None]:
        """After the node and its operands matched: bind `out`, test `where`, follow `then`."""
        binds = _bind(st, self.out, out) if self.out is not None else iter((None,))
        for _ in binds:
            if self.where is not None:
                reason = self.where(st.snapshot())
                if reason is not None:
                    st.fail("{}", reason)
                    st.refuse(reason)
                    continue
            if self.then is None:
                yield
            else:
                yield from self.then.match_user(out, st)

    def __repr__(self) -> str:
        return f"P.op({'|'.join(sorted(self.ops))}, {', '.join(map(repr, self.inputs))})"


def _match_seq(pats: Sequence[Pattern], vals: Sequence[Value | None], i: int,
               st: MatchState) -> Iterator[None]:
    if i == len(pats):
        yield
        return
    for _ in pats[i].match(vals[i], st):
        yield from _match_seq(pats, vals, i + 1, st)


class OrPattern(Pattern):
    """Alternatives, tried in order; its own `why` is recorded when none of them matched at all."""

    def __init__(self, alts: Sequence[Pattern], why: str | None = None):
        self.alts = tuple(alts)
        self.why = why

    def match(self, v: Value | None, st: MatchState) -> Iterator[None]:
        at, found = st.progress(), False
        for p in self.alts:
            for _ in p.match(v, st):
                found = True
                yield
        if not found:
            st.refuse(self.why, at)

    def match_user(self, v: Value, st: MatchState) -> Iterator[None]:
        at, found = st.progress(), False
        for p in self.alts:
            for _ in p.match_user(v, st):
                found = True
                yield
        if not found:
            st.refuse(self.why, at)


class P:
    """Pattern constructors."""

    @staticmethod
    def op(ops: str | Iterable[str], *inputs: Pattern, attrs: Mapping[str, AttrSpec] | None = None,
           name: str | None = None, commutative: bool | None = None, single_use: bool = False,
           output: int | None = None, rest: bool = False, out: str | None = None,
           where: Where | None = None, then: Pattern | None = None, keep: bool = False,
           why: str | None = None) -> OpPattern:
        return OpPattern(ops, inputs, attrs=attrs, name=name, commutative=commutative,
                         single_use=single_use, output=output, rest=rest, out=out, where=where,
                         then=then, keep=keep, why=why)

    @staticmethod
    def var(name: str, why: str | None = None) -> VarPattern:
        return VarPattern(name, why)

    @staticmethod
    def const(name: str | None = None, value: float | None = None, why: str | None = None) -> ConstPattern:
        return ConstPattern(name, value, why)

    @staticmethod
    def scalar(name: str | None = None, value: float | None = None, why: str | None = None) -> ScalarPattern:
        return ScalarPattern(name, value, why)

    @staticmethod
    def any() -> AnyPattern:
        return AnyPattern()

    @staticmethod
    def or_(*alts: Pattern, why: str | None = None) -> OrPattern:
        return OrPattern(alts, why)


# ---- matches ---------------------------------------------------------------------------------------

class Match:
    """What a rule matched: the root node, bound values (`m["x"]`) and named nodes (`m.node("t")`).

    A check may add what it derives: values (`bind`), other facts (`note`, read with `fact`) and nodes
    the rewrite replaces besides those the pattern consumed (`cover`)."""

    def __init__(self, root: Node, values: dict[str, Value], nodes: dict[str, Node],
                 matched: list[Node], kept: list[bool], uses: Uses):
        self.root = root
        self.values = values
        self.nodes = nodes
        self.matched = matched  # every node the pattern covered, root first
        # what the rewrite replaces: matched nodes outside keep=True subtrees, plus covered ones
        self.consumed = [n for n, k in zip(matched, kept, strict=True) if not k]
        self.facts: dict[str, Any] = {}
        self.uses = uses
        self.graph = uses.graph

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

    def scalar(self, name: str) -> float:
        x = scalar(self.values[name])
        if x is None:
            raise PassError(f"'{name}' (%{self.values[name].name}) is not a one-element constant")
        return x

    def n_uses(self, v: Value) -> int:
        """Uses of `v` in the graph (node inputs plus graph outputs)."""
        return self.uses.count(v)

    def users(self, v: Value) -> list[Node]:
        return self.uses.of(v)

    def sole_user(self, v: Value, op: str | tuple[str, ...] | None = None) -> Node | None:
        return self.uses.sole(v, op)

    def is_output(self, v: Value) -> bool:
        return self.uses.is_output(v)

    def bind(self, name: str, v: Value) -> None:
        self.values[name] = v

    def note(self, name: str, x: Any) -> None:
        self.facts[name] = x

    def fact(self, name: str) -> Any:
        return self.facts[name]

    def cover(self, *nodes: Node) -> None:
        self.consumed.extend(nodes)
