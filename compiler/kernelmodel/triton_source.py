"""The generated kernel.py read as a program: which function an instruction's source frames belong
to (op body, helper, the task loop), the statements of the task loop, and a small evaluator of the
kernel's scalar expressions over the real task tables.

The evaluator is what turns "a loop at line 227" into "9 iterations for this task": it evaluates
`range(...)` bounds and the `if` tests around a loop with the values the kernel itself would load
(task rows from TASKS, descriptors from DI/DF, the control block of a decode step), binding a
helper's parameters through its call sites. Anything it cannot know (loaded data, tl.arange
vectors, loop-carried values) is UNKNOWN, and callers report it as such instead of guessing. It
relies only on how kernel.py is written in general (`name = tl.load(ptr)`, single assignments,
`if`/`for`/`while`), not on any particular op body.
"""

from __future__ import annotations

import ast
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["UNKNOWN", "Evaluator", "KernelSource", "Ptr"]


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()


@dataclass(frozen=True)
class Ptr:
    """A kernel pointer parameter plus an element offset."""

    param: str
    offset: int


@dataclass
class _Fn:
    node: ast.FunctionDef
    params: list[str]
    assigns: dict[str, list[ast.stmt]]  # name -> statements assigning it, by line
    parents: dict[int, ast.AST]  # id(node) -> parent node


class KernelSource:
    """kernel.py's functions, its entry, the task loop and the op dispatch."""

    def __init__(self, text: str, entry: str):
        self.text = text
        self.tree = ast.parse(text)
        self.cache: dict[tuple[Any, ...], Any] = {}  # structural lookups (task-independent)
        self.fns: dict[str, _Fn] = {}
        self.consts: dict[str, Any] = {}
        for node in self.tree.body:
            if isinstance(node, ast.FunctionDef):
                self.fns[node.name] = self._index(node)
            elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                v = node.value
                if isinstance(v, ast.Call) and v.args:  # NAME = tl.constexpr(3)
                    v = v.args[0]
                if isinstance(v, ast.Constant):
                    self.consts[node.targets[0].id] = v.value
        if entry not in self.fns:
            raise ValueError(f"kernel source has no function '{entry}'")
        self.entry = entry
        e = self.fns[entry]
        self.task_loop = self._task_loop(e.node)
        self.task_index = self._task_index(self.task_loop)
        # op code -> its body functions, from the `if op == N:` arms of the task loop. A function
        # called in an arm is a body unless some other function or arm calls it too: then it is
        # task-loop machinery (v2's `_wait_deps`, called in several arms and by the Linear bodies).
        # An arm may hold two bodies chosen by a constexpr (`if STEP == MODE_DECODE:`): one kernel
        # compiles one of them.
        arms: dict[int, list[str]] = {}
        self.dispatch_calls: dict[str, ast.Call] = {}
        for node in ast.walk(self.task_loop):  # type: ignore[assignment]  # (walk yields ast.AST)
            if isinstance(node, ast.If) and (code := _eq_constant(node.test)) is not None:
                for st in node.body:
                    for c in ast.walk(st):
                        if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in self.fns:
                            arms.setdefault(code, []).append(c.func.id)
                            self.dispatch_calls.setdefault(c.func.id, c)
        if not arms:  # no `if op == N` chain: every function the loop calls is a body
            for c in ast.walk(self.task_loop):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in self.fns:
                    self.dispatch_calls.setdefault(c.func.id, c)
            arms = {-1: list(self.dispatch_calls)}
        callers: dict[str, int] = {}
        for name, f in self.fns.items():
            if name == entry:
                continue
            for c in ast.walk(f.node):
                if isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in self.fns:
                    callers[c.func.id] = callers.get(c.func.id, 0) + 1
        in_arms = Counter(fn for names in arms.values() for fn in set(names))
        self.machinery = {fn for fn in in_arms if in_arms[fn] > 1 or callers.get(fn, 0) > 0}
        self.dispatch: dict[int, tuple[str, ...]] = {
            code: tuple(dict.fromkeys(fn for fn in names if fn not in self.machinery)) for code, names in arms.items()}
        self.bodies = {fn for names in self.dispatch.values() for fn in names}
        self.op_of = {fn: code for code, names in self.dispatch.items() for fn in names}
        for fn in self.machinery:
            self.dispatch_calls.pop(fn, None)
        self.claim = self._claim()

    def _claim(self) -> dict[str, Any]:
        """How the task loop takes its next task from the work queue (`atomic_add(CNT + CNT_QUEUE,
        1)` inside the loop): `overlapped` when the claim is issued before the op dispatch into a
        name other than the task index (v2: `t_next`, consumed by the next iteration, so its round
        trip hides under this task), else serial (v1: claimed after the signal, the next task's row
        waits for it)."""
        first_arm = min((c.lineno for c in self.dispatch_calls.values()), default=None)
        for node in ast.walk(self.task_loop):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and _is_tl(node.value.func, "atomic_add") \
                    and node.value.args and any(isinstance(n, ast.Name) and n.id.endswith("QUEUE")
                                                for n in ast.walk(node.value.args[0])):
                tgt = node.targets[0].id if isinstance(node.targets[0], ast.Name) else None
                before = first_arm is not None and node.lineno < first_arm
                return {"line": node.lineno, "target": tgt,
                        "overlapped": bool(before and tgt is not None and tgt != self.task_index)}
        return {"line": None, "target": None, "overlapped": False}

    @staticmethod
    def _index(node: ast.FunctionDef) -> _Fn:
        params = [a.arg for a in node.args.args]
        assigns: dict[str, list[ast.stmt]] = {}
        parents: dict[int, ast.AST] = {}
        for p in ast.walk(node):
            for ch in ast.iter_child_nodes(p):
                parents[id(ch)] = p
            targets: list[ast.expr] = []
            if isinstance(p, ast.Assign):
                targets = list(p.targets)
            elif isinstance(p, (ast.AugAssign, ast.AnnAssign)):
                targets = [p.target]
            elif isinstance(p, ast.For):
                targets = [p.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        assigns.setdefault(n.id, []).append(p)  # type: ignore[arg-type]
        for v in assigns.values():
            v.sort(key=lambda s: s.lineno)
        return _Fn(node, params, assigns, parents)

    def _task_loop(self, fn: ast.FunctionDef) -> ast.stmt:
        best = None
        for node in ast.walk(fn):
            if isinstance(node, (ast.While, ast.For)):
                calls = [c for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                         and c.func.id in self.fns]
                if calls and (best is None or node.lineno < best.lineno):
                    best = node
        if best is None:
            raise ValueError("the kernel entry has no loop that calls an op body")
        return best

    @staticmethod
    def _task_index(loop: ast.stmt) -> str | None:
        if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name):
            return loop.target.id
        if isinstance(loop, ast.While) and isinstance(loop.test, ast.Compare) and isinstance(loop.test.left, ast.Name):
            return loop.test.left.id
        return None

    # ---- where a source line is ------------------------------------------------------------

    def function_at(self, line: int) -> str | None:
        for name, f in self.fns.items():
            if f.node.lineno <= line <= (f.node.end_lineno or f.node.lineno):
                return name
        return None

    def loop_statement(self, fn: str, line: int) -> Any:
        key = ("loop_statement", fn, line)
        if key not in self.cache:
            self.cache[key] = self._loop_statement(fn, line)
        return self.cache[key]

    def _loop_statement(self, fn: str, line: int) -> ast.stmt | None:
        """The innermost for/while statement of `fn` whose span holds `line`."""
        best = None
        for node in ast.walk(self.fns[fn].node):
            if isinstance(node, (ast.For, ast.While)) and node.lineno <= line <= (node.end_lineno or node.lineno):
                if best is None or node.lineno >= best.lineno:
                    best = node
        return best

    def loop_statement_of(self, chain: Sequence[tuple[str, int]]) -> tuple[int, ast.stmt] | None:
        """The innermost source loop around a frame chain (outermost first): (frame index, loop)."""
        for k in range(len(chain) - 1, -1, -1):
            fn, line = chain[k]
            if fn == self.entry and k == 0 and self.loop_statement(fn, line) is self.task_loop:
                return None
            lp = self.loop_statement(fn, line)
            if lp is not None and lp is not self.task_loop:
                return k, lp
        return None

    def task_loop_statement(self, line: int) -> ast.stmt | None:
        """The top-level statement of the task loop's body holding entry line `line`."""
        for st in self.task_loop.body:  # type: ignore[attr-defined]
            if st.lineno <= line <= (st.end_lineno or st.lineno):
                return st
        return None

    def parent(self, fn: str, node: ast.AST) -> ast.AST | None:
        return self.fns[fn].parents.get(id(node))

    def ancestors(self, fn: str, node: ast.AST) -> list[ast.AST]:
        """`node` and its parents up to the function."""
        key = ("anc", fn, id(node))
        if key not in self.cache:
            out: list[ast.AST] = []
            cur: ast.AST | None = node
            while cur is not None:
                out.append(cur)
                cur = self.parent(fn, cur)
            self.cache[key] = out
        return self.cache[key]  # type: ignore[no-any-return]

    def call_at(self, caller: str, line: int, fn: str) -> ast.Call | None:
        """The call of `fn` in `caller` whose span holds `line`."""
        key = ("call", caller, line, fn)
        if key not in self.cache:
            self.cache[key] = next((n for n in ast.walk(self.fns[caller].node) if isinstance(n, ast.Call)
                                    and isinstance(n.func, ast.Name) and n.func.id == fn
                                    and n.lineno <= line <= (n.end_lineno or n.lineno)), None)
        return self.cache[key]  # type: ignore[no-any-return]

    def stmt_at(self, fn: str, line: int) -> ast.stmt | None:
        """The innermost statement of `fn` (not the def) whose span holds `line`."""
        key = ("stmt", fn, line)
        if key not in self.cache:
            best = None
            for node in ast.walk(self.fns[fn].node):
                if isinstance(node, ast.stmt) and not isinstance(node, ast.FunctionDef) \
                        and node.lineno <= line <= (node.end_lineno or node.lineno):
                    if best is None or node.lineno >= best.lineno:
                        best = node
            self.cache[key] = best
        return self.cache[key]  # type: ignore[no-any-return]

    def loads_at(self, fn: str, line: int) -> Any:
        key = ("loads_at", fn, line)
        if key not in self.cache:
            self.cache[key] = self._loads_at(fn, line)
        return self.cache[key]

    def _loads_at(self, fn: str, line: int) -> list[ast.Call]:
        """`tl.load` calls of `fn` whose span holds `line`."""
        return [n for n in ast.walk(self.fns[fn].node) if isinstance(n, ast.Call) and _is_tl(n.func, "load")
                and n.args and n.lineno <= line <= (n.end_lineno or n.lineno)]

    def if_at(self, fn: str, line: int) -> Any:
        key = ("if_at", fn, line)
        if key not in self.cache:
            self.cache[key] = self._if_at(fn, line)
        return self.cache[key]

    def _if_at(self, fn: str, line: int) -> ast.If | None:
        """The `if` statement of `fn` whose test holds `line`."""
        for n in ast.walk(self.fns[fn].node):
            if isinstance(n, ast.If) and n.test.lineno <= line <= (n.test.end_lineno or n.test.lineno):
                return n
        return None

    def pointer_loads(self, fn: str, param: str) -> list[ast.Call]:
        """`tl.load` calls of `fn` whose address expression names `param`."""
        out = []
        for node in ast.walk(self.fns[fn].node):
            if isinstance(node, ast.Call) and _is_tl(node.func, "load") and node.args:
                if any(isinstance(n, ast.Name) and n.id == param for n in ast.walk(node.args[0])):
                    out.append(node)
        return out


def _eq_constant(test: ast.expr) -> int | None:
    if (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
            and isinstance(test.comparators[0], ast.Constant) and isinstance(test.comparators[0].value, int)):
        return test.comparators[0].value
    return None


def _is_tl(func: ast.expr, name: str) -> bool:
    return isinstance(func, ast.Attribute) and func.attr == name and isinstance(func.value, ast.Name) \
        and func.value.id in ("tl", "triton")


_BIN: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
    ast.FloorDiv: lambda a, b: a // b, ast.Mod: lambda a, b: a % b, ast.Div: lambda a, b: a / b,
    ast.BitAnd: lambda a, b: a & b, ast.BitOr: lambda a, b: a | b, ast.BitXor: lambda a, b: a ^ b,
    ast.LShift: lambda a, b: a << b, ast.RShift: lambda a, b: a >> b,
}
_CMP: dict[type, Callable[[Any, Any], bool]] = {
    ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b, ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b,
}


class Evaluator:
    """Evaluates scalar expressions of kernel.py in a frame chain for one task.

    `memory[param]` is a flat array for the pointer parameters the evaluator may read (TASKS, DI,
    DF, CTRL); loads from any other parameter are UNKNOWN. `constexprs` are the entry's constexpr
    arguments, `grid` the number of programs."""

    def __init__(self, src: KernelSource, memory: Mapping[str, np.ndarray], constexprs: Mapping[str, Any],
                 grid: int):
        self.src = src
        self.memory = memory
        self.constexprs = dict(constexprs)
        self.grid = grid
        self.task = 0
        self._memo: dict[tuple[Any, ...], Any] = {}
        self.scratch: dict[tuple[Any, ...], Any] = {}  # callers' per-task caches (path decisions)

    def set_task(self, index: int) -> None:
        if index != self.task:
            self._memo, self.scratch = {}, {}
        self.task = index

    # chain: ((fn, line), ...) outermost (the entry) first
    def value(self, expr: ast.expr, chain: Sequence[tuple[str, int]]) -> Any:
        try:
            return self._eval(expr, tuple(chain))
        except (ArithmeticError, TypeError, ValueError, IndexError, RecursionError):
            return UNKNOWN

    def executes(self, node: ast.AST, chain: Sequence[tuple[str, int]]) -> bool | None:
        """Whether every `if` around `node` (in each frame of the chain) holds: True, False, or
        None when some test is UNKNOWN."""
        chain = tuple(chain)
        verdict: bool | None = True
        for k in range(len(chain)):
            fn, line = chain[k]
            target: ast.AST | None = node if k == len(chain) - 1 else self._stmt_at(fn, line)
            if target is None:
                continue
            ok = self._conditions(fn, target, chain[:k + 1])
            if ok is False:
                return False
            if ok is None:
                verdict = None
        return verdict

    def trips(self, loop: ast.stmt, chain: Sequence[tuple[str, int]]) -> Any:
        """Iterations of a `for ... in range(...)` (static_range too) for this task, or UNKNOWN."""
        if not isinstance(loop, ast.For) or not isinstance(loop.iter, ast.Call):
            return UNKNOWN
        args = [self.value(a, chain) for a in loop.iter.args]
        if any(a is UNKNOWN or not isinstance(a, (int, np.integer)) for a in args) or not args:
            return UNKNOWN
        lo, hi, step = (0, args[0], 1) if len(args) == 1 else (args[0], args[1], args[2] if len(args) > 2 else 1)
        return max(0, math.ceil((int(hi) - int(lo)) / int(step)))

    def pointer_base(self, expr: ast.expr, chain: Sequence[tuple[str, int]]) -> str | None:
        """The pointer parameter of the entry an address expression is based on (`A + off + ks`
        -> "A"), following assignments and helper parameters; None when it cannot tell."""
        return self._base(expr, tuple(chain), 0)

    def _base(self, e: ast.expr, chain: tuple[tuple[str, int], ...], depth: int) -> str | None:
        if depth > 40:
            return None
        if isinstance(e, ast.BinOp) and isinstance(e.op, (ast.Add, ast.Sub)):
            return self._base(e.left, chain, depth + 1) or (
                self._base(e.right, chain, depth + 1) if isinstance(e.op, ast.Add) else None)
        if isinstance(e, ast.Subscript):
            return self._base(e.value, chain, depth + 1)
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute):
            if e.func.attr == "to":  # a bitcast pointer (the packed weights' f16 scales in Q) keeps its base
                return self._base(e.func.value, chain, depth + 1)
            if e.func.attr == "multiple_of" and e.args:
                return self._base(e.args[0], chain, depth + 1)
        if not isinstance(e, ast.Name):
            return None
        fn, line = chain[-1]
        f = self.src.fns[fn]
        prior = [st for st in f.assigns.get(e.id, []) if st.lineno < line and isinstance(st, ast.Assign)]
        if prior:
            return self._base(prior[-1].value, chain[:-1] + ((fn, prior[-1].lineno),), depth + 1)
        if e.id in f.params:
            if len(chain) == 1:
                return e.id if e.id not in self.constexprs else None
            caller, cline = chain[-2]
            node = self.src.call_at(caller, cline, fn)
            idx = f.params.index(e.id)
            if node is not None and idx < len(node.args):
                return self._base(node.args[idx], chain[:-1], depth + 1)
            return None
        return None

    # ---- internals ---------------------------------------------------------------------------

    def _stmt_at(self, fn: str, line: int) -> ast.AST | None:
        return self.src.stmt_at(fn, line)

    def _conditions(self, fn: str, node: ast.AST, chain: tuple[tuple[str, int], ...],
                    stop: ast.AST | None = None) -> bool | None:
        verdict: bool | None = True
        cur = node
        while True:
            par = self.src.parent(fn, cur)
            if par is None or par is stop:
                return verdict
            if isinstance(par, ast.If) and cur is not par.test:
                t = self._eval(par.test, chain[:-1] + ((fn, par.lineno),))
                if t is UNKNOWN:
                    verdict = None
                elif bool(t) != (cur in par.body):
                    return False
            cur = par

    def _eval(self, e: ast.expr, chain: tuple[tuple[str, int], ...]) -> Any:
        if isinstance(e, ast.Constant):
            return e.value
        if isinstance(e, ast.Name):
            return self._name(e.id, chain)
        if isinstance(e, ast.BinOp):
            a, b = self._eval(e.left, chain), self._eval(e.right, chain)
            if a is UNKNOWN or b is UNKNOWN:
                return UNKNOWN
            if isinstance(a, Ptr) and isinstance(b, (int, np.integer)) and isinstance(e.op, ast.Add):
                return Ptr(a.param, a.offset + int(b))
            if isinstance(b, Ptr) and isinstance(a, (int, np.integer)) and isinstance(e.op, ast.Add):
                return Ptr(b.param, b.offset + int(a))
            if isinstance(a, Ptr) or isinstance(b, Ptr):
                return UNKNOWN
            return _BIN[type(e.op)](a, b) if type(e.op) in _BIN else UNKNOWN
        if isinstance(e, ast.UnaryOp):
            v = self._eval(e.operand, chain)
            if v is UNKNOWN:
                return UNKNOWN
            return {ast.USub: lambda x: -x, ast.Not: lambda x: not x, ast.UAdd: lambda x: x,
                    ast.Invert: lambda x: ~x}[type(e.op)](v)
        if isinstance(e, ast.Compare) and len(e.ops) == 1:
            a, b = self._eval(e.left, chain), self._eval(e.comparators[0], chain)
            if a is UNKNOWN or b is UNKNOWN or isinstance(a, Ptr) or isinstance(b, Ptr):
                return UNKNOWN
            return _CMP[type(e.ops[0])](a, b)
        if isinstance(e, ast.BoolOp):
            vals = [self._eval(v, chain) for v in e.values]
            if isinstance(e.op, ast.And):
                if any(v is not UNKNOWN and not v for v in vals):
                    return False
                return UNKNOWN if any(v is UNKNOWN for v in vals) else True
            if any(v is not UNKNOWN and v for v in vals):
                return True
            return UNKNOWN if any(v is UNKNOWN for v in vals) else False
        if isinstance(e, ast.Call):
            return self._call(e, chain)
        return UNKNOWN

    def _call(self, e: ast.Call, chain: tuple[tuple[str, int], ...]) -> Any:
        f = e.func
        if isinstance(f, ast.Attribute) and f.attr == "to":  # x.to(dtype): the value
            return self._eval(f.value, chain)
        args = [self._eval(a, chain) for a in e.args]
        if _is_tl(f, "load") and args:
            p = args[0]
            if isinstance(p, Ptr) and p.param in self.memory:
                arr = self.memory[p.param]
                if 0 <= p.offset < arr.size:
                    v = arr[p.offset]
                    return float(v) if np.issubdtype(arr.dtype, np.floating) else int(v)
            return UNKNOWN
        if any(a is UNKNOWN for a in args):
            return UNKNOWN
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        if name in ("minimum", "min") and len(args) == 2:
            return min(args)
        if name in ("maximum", "max") and len(args) == 2:
            return max(args)
        if name == "cdiv" and len(args) == 2:
            return -(-args[0] // args[1])
        if name == "num_programs":
            return self.grid
        if name == "constexpr" and len(args) == 1:
            return args[0]
        return UNKNOWN

    def _name(self, name: str, chain: tuple[tuple[str, int], ...]) -> Any:
        key = (name, chain)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = UNKNOWN  # cycles resolve to UNKNOWN
        v = self._resolve(name, chain)
        self._memo[key] = v
        return v

    def _resolve(self, name: str, chain: tuple[tuple[str, int], ...]) -> Any:
        fn, line = chain[-1]
        f = self.src.fns[fn]
        if fn == self.src.entry and name == self.src.task_index:
            return self.task
        for st in reversed(f.assigns.get(name, [])):
            if st.lineno >= line:
                continue
            # a loop variable, or an assignment inside a loop the line is not in: not one value
            if isinstance(st, (ast.For, ast.AugAssign)) or self._in_loop_without(fn, st, line):
                return UNKNOWN
            ok = self._conditions(fn, st, chain, stop=self._common_ancestor(fn, st, line))
            if ok is False:
                continue
            if ok is None:
                return UNKNOWN
            value = st.value if isinstance(st, (ast.Assign, ast.AnnAssign)) else None
            if value is None or (isinstance(st, ast.Assign) and not isinstance(st.targets[0], ast.Name)):
                return UNKNOWN
            return self._eval(value, chain[:-1] + ((fn, st.lineno),))
        if name in f.params:
            if len(chain) == 1:  # the entry: a constexpr argument or a pointer
                if name in self.constexprs:
                    return self.constexprs[name]
                return Ptr(name, 0)
            return self._argument(fn, name, chain)
        if name in self.src.consts:
            return self.src.consts[name]
        return UNKNOWN

    def _argument(self, fn: str, name: str, chain: tuple[tuple[str, int], ...]) -> Any:
        caller, cline = chain[-2]
        call = self.src.call_at(caller, cline, fn)
        if call is None:
            return UNKNOWN
        params = self.src.fns[fn].params
        idx = params.index(name)
        for kw in call.keywords:
            if kw.arg == name:
                return self._eval(kw.value, chain[:-1])
        if idx < len(call.args):
            return self._eval(call.args[idx], chain[:-1])
        defaults = self.src.fns[fn].node.args.defaults
        k = idx - (len(params) - len(defaults))
        return self._eval(defaults[k], chain) if k >= 0 else UNKNOWN

    def _common_ancestor(self, fn: str, st: ast.AST, line: int) -> ast.AST | None:
        key = ("common", fn, id(st), line)
        if key not in self.src.cache:
            here = self._stmt_at(fn, line)
            mine = {id(a) for a in self.src.ancestors(fn, here)} if here is not None else set()
            self.src.cache[key] = next((a for a in self.src.ancestors(fn, st) if id(a) in mine), None)
        return self.src.cache[key]

    def _in_loop_without(self, fn: str, st: ast.AST, line: int) -> bool:
        key = ("loop", fn, id(st), line)
        if key not in self.src.cache:
            self.src.cache[key] = any(isinstance(a, (ast.For, ast.While)) and not (
                a.lineno <= line <= (a.end_lineno or a.lineno)) for a in self.src.ancestors(fn, st)[1:])
        return self.src.cache[key]
