"""One GPU target's megakernel SASS, mapped: every instruction to its op body and kernel.py
source, global loads to the kernel parameter their address derives from (weight loads are the
ones from `W`), registers to the dependent global loads behind them, SASS loops to the source
loops they implement; and path questions for one task (which arm of a branch it takes, what one
loop iteration keeps in flight and waits for) answered through a `triton_source.Evaluator`.

Either kernel of a target: the decode kernel (`kernels/<t>.cubin`, the manifest's target
fields) or the prefill kernel (`targets.<t>.prefill`; a v1 bundle has one kernel for both).
`task_path` walks one task's way through it; `static_facts` turns both into the per-target
facts.

Why one module: `KernelCode`'s maps (instruction -> body and source, weight loads, address depths,
loops, polls, the group arm) are built together from one disassembly, and every path question
(`successors`, `executes`, `loop_path`) reads several of them; the in-order issue model
(`simulate`) is the loop half of `task_path`'s and shares its rules.
"""

from __future__ import annotations

import ast
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zlc.errors import ZlcError

from .sass import Cfg, Instr, Loop, Sass, disassemble, kernel_params, reg_merge, reg_read, reg_write
from .triton_source import UNKNOWN, Evaluator, KernelSource

__all__ = ["KernelCode", "KernelStatsError", "LoopFacts", "SyncCounts", "enclosing", "kernel_info", "path_sync",
           "simulate"]


WEIGHT_PARAMS = frozenset({"W", "Q"})  # the kernel parameters whose loads are weight bytes (Q: packed)


class KernelStatsError(ZlcError):
    """The bundle lacks what the kernel statistics need (a cubin, kernel.py, the tables)."""


@dataclass
class SyncCounts:
    fences: float = 0  # MEMBAR / FENCE
    l1_invalidations: float = 0  # CCTL.IV*
    atomics: float = 0  # ATOMG / RED to global memory
    barriers: float = 0  # BAR.*

    def add(self, ins: Instr, times: float = 1) -> None:
        self.fences += times * ins.is_fence
        self.l1_invalidations += times * ins.is_l1_invalidate
        self.atomics += times * ins.is_global_atomic
        self.barriers += times * ins.is_barrier

    def plus(self, other: SyncCounts, times: float = 1) -> SyncCounts:
        return SyncCounts(self.fences + times * other.fences, self.l1_invalidations + times * other.l1_invalidations,
                          self.atomics + times * other.atomics, self.barriers + times * other.barriers)

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 2) for k, v in vars(self).items()}


@dataclass
class LoopFacts:
    """One SASS loop of an op body (its own instructions; nested loops are separate entries)."""

    loop: Loop
    source_fn: str | None  # the kernel.py for/while it implements
    source_line: int | None
    chain: tuple[tuple[str, int], ...]  # frames to evaluate that loop statement in (outermost first)
    node: Any  # the ast.For / ast.While
    enclosing: list[tuple[tuple[tuple[str, int], ...], Any]]  # source loops around it, innermost first
    mma: bool  # tensor-core instructions in it (or in loops it holds)
    weight_loads: dict[str, int]  # opcode -> count per iteration (all paths)
    other_loads: dict[str, int]
    header_addr: int
    own: list[int]  # instruction indices (nested loops excluded)
    first_load_depth: int | None  # global loads on the address chain of its first global load
    first_weight_depth: int | None  # same, first weight load
    # for the first decode task of the body (None when the loop does not run for it)
    trips: int | None = None
    path: dict[str, int] = field(default_factory=dict)  # in-flight / round-trip facts on its path

    def as_dict(self) -> dict[str, Any]:
        return {"source": f"{self.source_fn}:{self.source_line}", "mma": self.mma, "weight_loads": self.weight_loads,
                "other_loads": self.other_loads, "address_depth_first_load": self.first_load_depth,
                "address_depth_first_weight_load": self.first_weight_depth, "decode_trips": self.trips,
                **self.path}


_SMEM = "smem"  # pseudo-register: the depth of what the last shared-memory store wrote
_DEPTH_CAP = 64


def _is_pred(r: str) -> bool:
    return r.startswith(("P", "UP"))


def simulate(seq: list[Instr], weight: list[bool], passes: int = 2) -> dict[str, Any]:
    """In-order issue over an instruction sequence (a loop iteration path, run twice: the second
    pass is the steady state). A global load is outstanding from issue until an instruction reads
    or overwrites a register it writes (that instruction waits for it). Returns the most weight /
    global bytes outstanding per thread, the weight loads issued before the first wait on one, and
    the dependent round trips per iteration."""
    pending: dict[str, int] = {}
    out: dict[int, tuple[int, bool, int]] = {}  # load id -> (bytes, weight?, depth when it arrives)
    ready: dict[str, int] = {}
    depth, best_w, best_g, before_use = 0, 0, 0, 0
    ends, before_w = [], None
    for p in range(passes):
        first_wait = True
        issued_w = 0
        start = depth
        for n, ins in enumerate(seq):
            hit = {pending[r] for r in (*ins.srcs, *ins.dests) if r in pending}
            if hit and p == passes - 1 and first_wait:
                before_use, first_wait = issued_w, False
            for lid in hit:
                depth = max(depth, out.pop(lid)[2])
            for r in [r for r, lid in pending.items() if lid in hit]:
                pending.pop(r)
            depth = max([depth] + [ready.get(s, 0) for s in ins.srcs])
            if ins.is_global_load:
                if weight[n] and p == passes - 1 and before_w is None:
                    before_w = depth - start
                lid = p * len(seq) + n
                out[lid] = (ins.width(), weight[n], depth + 1)
                issued_w += weight[n]
                for d in ins.dests:
                    pending[d], ready[d] = lid, depth + 1
            else:
                for d in ins.dests:
                    ready[d] = depth
            if p == passes - 1:
                best_w = max(best_w, sum(b for b, w, _ in out.values() if w))
                best_g = max(best_g, sum(b for b, _, _ in out.values()))
        ends.append(depth)
    if before_use == 0:
        before_use = issued_w
    return {"weight_in_flight_per_thread": best_w, "global_in_flight_per_thread": best_g,
            "weight_loads_before_first_use": before_use,
            "round_trips_per_iteration": ends[-1] - ends[-2] if len(ends) > 1 else ends[-1],
            "round_trips_before_weights": before_w or 0,
            "sync": path_sync(seq),
            "weight_loads": sum(weight),
            "weight_opcodes": dict(Counter(i.opcode for i, w in zip(seq, weight, strict=True) if w)),
            "weight_bytes_per_thread": sum(i.width() for i, w in zip(seq, weight, strict=True) if w),
            "global_bytes_per_thread": sum(i.width() for i in seq if i.is_global_load)}


def path_sync(seq: list[Instr]) -> dict[str, float]:
    c = SyncCounts()
    for i in seq:
        c.add(i)
    return vars(c)


class KernelCode:
    """One target's SASS with everything mapped: instruction -> op body / source, weight loads,
    address depths, loops; path questions answered for a task through an `Evaluator`."""

    def __init__(self, bundle: Path, target: str, man: dict[str, Any], src: KernelSource | None = None,
                 kernel: str = "decode"):
        info = kernel_info(man, target, kernel)
        if info is None or "cubin" not in info:
            raise KernelStatsError(f"{bundle}: target '{target}' has no {kernel} cubin")
        kname = man["kernel"]["source"]
        if not (bundle / kname).is_file():
            raise KernelStatsError(f"{bundle}: {kname} is missing (SASS lines cannot be mapped to op bodies)")
        if not (bundle / info["cubin"]).is_file():
            raise KernelStatsError(f"{bundle}: {info['cubin']} is missing")
        self.info, self.kernel, self.target = info, kernel, target
        # one KernelSource for the SASS map and the evaluators: AST nodes are compared by identity
        self.src = src or KernelSource((bundle / kname).read_text(), man["kernel"]["entry"])
        cubin = (bundle / info["cubin"]).read_bytes()
        self.sass: Sass = disassemble(cubin)
        self.params = kernel_params(cubin)
        subs = self.sass.subroutines()
        self.hi = self.sass.index[subs[0]] if subs else len(self.sass.instrs)
        self.cfg = Cfg(self.sass, 0, self.hi)
        base = Path(kname).name
        self.chains = [self._chain(i, base) for i in self.sass.instrs[:self.hi]]
        self.where = [self._body_of(c) for c in self.chains]
        self.callee = self._callee_effects(subs)
        names = [p["name"] for p in info.get("params") or [{"name": n} for n in man["kernel"]["params"]]]
        self.param_of = {o: names[o] for o in self.params.offsets if o < len(names)}
        self.addr_params = self._taint()
        self.weight = {n for n in self.addr_params if self._is_weight_load(n)}
        # the task loop: the smallest loop holding (nearly) all op-body code; ptxas hoists a few
        # loop-invariant instructions with a body's line above the loop: those run once per launch
        body_n = [n for n, w in enumerate(self.where) if w is not None]
        self.task_loop = next((lp for lp in self.cfg.loops if len(body_n) and sum(
            self.cfg.block_of[n] in lp.blocks for n in body_n) >= 0.9 * len(body_n)), None)
        if self.task_loop is None:
            raise KernelStatsError(f"{target}: no SASS loop holds the op bodies (is this a zlc megakernel?)")
        self.in_loop = {n for b in self.task_loop.blocks for n in range(self.cfg.blocks[b].start, self.cfg.blocks[b].end)}
        for n in body_n:
            if n not in self.in_loop:
                self.where[n] = None
        blocks: dict[str, set[int]] = {}
        for n, w in enumerate(self.where):
            if w is not None:
                blocks.setdefault(w, set()).add(self.cfg.block_of[n])
        self.body_blocks = blocks
        self.depth = self._depths()
        self.inner_loops = [lp for lp in self.cfg.loops if lp is not self.task_loop and lp.blocks < self.task_loop.blocks]
        self.outer_of: dict[int, Loop] = {}  # block -> the outermost inner loop holding it
        for lp in sorted(self.inner_loops, key=lambda lp: len(lp.blocks)):
            for b in lp.blocks:
                self.outer_of[b] = lp
        # waits: a poll is a load from CNT spinning in a small loop; wait code is what the source's
        # static_range wait loop holds (one unrolled copy per possible wait)
        self.poll_loops = {lp.header for lp in self.inner_loops if len(lp.instr_indices(self.cfg)) <= 24
                           and any(self._is_cnt_load(n) for n in lp.instr_indices(self.cfg))}
        self.polls = {n for lp in self.inner_loops if lp.header in self.poll_loops for n in lp.instr_indices(self.cfg)
                      if self._is_cnt_load(n)}
        self.in_wait = [self._in_wait(c) for c in self.chains]
        self.ctrl_loads = {n for n, ps in self.addr_params.items()
                           if "CTRL" in ps and self.sass.instrs[n].is_global_load and not self.sass.instrs[n].is_global_atomic}
        claim = self.src.claim.get("line")
        self.claims = {n for n in self.in_loop if self.where[n] is None and self.sass.instrs[n].is_global_atomic
                       and self.chains[n] and self.chains[n][0] == (self.src.entry, claim)}
        self.group_lines = self._atomic_result_ifs()
        self._branch_info: dict[int, Any] = {}
        self._sim_cache: dict[tuple[Any, ...], dict[str, int]] = {}
        self._loop_facts: dict[int, LoopFacts] = {}

    # ---- mapping -------------------------------------------------------------------------------

    def _chain(self, ins: Instr, base: str) -> tuple[tuple[str, int], ...]:
        out = []
        for f in reversed(ins.frames):
            if Path(f.file).name == base:
                fn = self.src.function_at(f.line)
                if fn is not None:
                    out.append((fn, f.line))
        return tuple(out)

    def _body_of(self, chain: tuple[tuple[str, int], ...]) -> str | None:
        if not chain:
            return None
        if len(chain) >= 2 and chain[1][0] in self.src.bodies:
            return chain[1][0]
        line = chain[0][1]
        for name, call in self.src.dispatch_calls.items():  # argument set-up on the call line itself
            if call.lineno <= line <= (call.end_lineno or call.lineno):
                return name
        return None

    def _callee_effects(self, subs: list[int]) -> dict[str, tuple[str, ...]]:
        out = {}
        ends = [*subs[1:], None]
        for lb, addr in self.sass.labels.items():
            if addr in subs:
                lo = self.sass.index[addr]
                end = ends[subs.index(addr)]
                hi = self.sass.index[end] if end is not None else len(self.sass.instrs)
                out[lb] = tuple(sorted({d for i in self.sass.instrs[lo:hi] for d in i.dests}))
        return out

    def _defs(self, ins: Instr) -> tuple[str, ...]:
        return self.callee.get(ins.targets[0], ()) if ins.is_call and ins.targets else ins.dests

    def _taint(self) -> dict[int, frozenset[str]]:
        """For every global memory access: the kernel parameters its address registers derive from."""
        kp, param_of = self.params, self.param_of
        none: frozenset[str] = frozenset()
        union = frozenset.union

        def transfer(ins: Instr, st: dict[Any, Any]) -> None:
            s: frozenset[str] = none.union(*(reg_read(st, r, ins.guard, none) for r in ins.srcs if not _is_pred(r)))
            s |= {param_of[o] for c in ins.consts if (o := kp.slot(c)) is not None and o in param_of}
            val = none if ins.is_global_load or ins.op in ("LDS", "LDSM", "S2R", "S2UR", "CS2R") else s
            for d in self._defs(ins):
                reg_write(st, d, none if _is_pred(d) else val, ins.guard, union, none)

        before = self.cfg.states_before(self.cfg.forward(transfer, reg_merge(union)), transfer)
        return {n: none.union(*(reg_read(before[n], r, ins.guard, none) for r in ins.address_regs))
                for n, ins in enumerate(self.sass.instrs[:self.hi])
                if n in before and (ins.is_global_load or ins.op in ("STG", "ST", "RED", "REDG"))}

    def _is_weight_load(self, n: int) -> bool:
        """Address derives from a weight arena (W, or Q: packed blocks, their quants and scales),
        and the source `tl.load` at its line is based on it (a register reused across paths can
        carry W's taint into another arena's address)."""
        ins = self.sass.instrs[n]
        params = self.addr_params.get(n, frozenset())
        if not ins.is_global_load or not params & WEIGHT_PARAMS:
            return False
        ch = self.chains[n]
        if not ch:
            return params <= WEIGHT_PARAMS
        loads = self.src.loads_at(ch[-1][0], ch[-1][1])
        if not loads:  # the line table put it on a line without a tl.load (its first use): the dataflow decides
            return params <= WEIGHT_PARAMS
        ev = Evaluator(self.src, {}, {}, 1)
        bases = {ev.pointer_base(ld.args[0], ch) for ld in loads}
        if bases <= WEIGHT_PARAMS:
            return True
        return bool(bases & WEIGHT_PARAMS) if None not in bases else params <= WEIGHT_PARAMS

    def _depths(self) -> dict[int, dict[Any, Any]]:
        """Per instruction, per register: global loads on its def-use chain since the top of the task
        loop (values from before the loop, or from the previous task, count 0)."""
        loop = self.task_loop
        assert loop is not None

        def transfer(ins: Instr, st: dict[Any, Any]) -> None:
            # predicates carry no depth: masks and loop bounds, and ptxas keeps spilled predicates
            # as bits of one long-lived register, which would merge every depth ever seen
            d = max([0] + [reg_read(st, r, ins.guard, 0) for r in ins.srcs if not _is_pred(r)])
            if ins.op in ("STS", "STSM"):  # values broadcast through shared memory keep their depth
                st[_SMEM] = d
                return
            if ins.op in ("LDS", "LDSM"):
                d = max(d, st.get(_SMEM, 0))
            # atomics (the task claim) are priced on their own; the depth counts loads
            val = min(_DEPTH_CAP, d + 1) if ins.is_global_load and not ins.is_global_atomic else d
            for r in self._defs(ins):
                reg_write(st, r, 0 if _is_pred(r) else val, ins.guard, max, 0)

        def keep(b: int, k: Any) -> bool:
            # nothing crosses the back edge into the head: a value the previous task loaded has
            # arrived (its task used it), and the claimed index is an atomic's (priced apart).
            # Carrying depths there let a guarded write (`@P0 ATOMG` joins the old value) feed
            # the previous task's deepest value into the next row load, climbing every pass.
            return b != loop.header

        state = self.cfg.forward(transfer, reg_merge(max), start=loop.header, within=loop.blocks, keep=keep)
        return self.cfg.states_before(state, transfer)

    def address_depth(self, n: int) -> int:
        st, ins = self.depth.get(n, {}), self.sass.instrs[n]
        return max([0] + [reg_read(st, r, ins.guard, 0) for r in ins.address_regs])

    def _is_cnt_load(self, n: int) -> bool:
        ins = self.sass.instrs[n]
        return ins.is_global_load and not ins.is_global_atomic and "CNT" in self.addr_params.get(n, ())

    def _in_wait(self, chain: tuple[tuple[str, int], ...]) -> bool:
        """The instruction belongs to the source's wait loop (`for i in tl.static_range(...)` around
        a `tl.atomic_poll`), in any frame of its chain."""
        for fn, line in chain:
            key = ("in_wait", fn, line)
            if key not in self.src.cache:
                st = self.src.stmt_at(fn, line)
                self.src.cache[key] = st is not None and any(
                    _is_wait_for(a) for a in self.src.ancestors(fn, st))
            if self.src.cache[key]:
                return True
        return False

    def _atomic_result_ifs(self) -> list[tuple[int, int]]:
        """Line spans of the task loop's `if` arms whose test reads an atomic's result (the signal's
        `if old == target - 1`: only a group's last task takes it)."""
        names = {t.id for st in ast.walk(self.src.task_loop) if isinstance(st, ast.Assign)
                 and isinstance(st.value, ast.Call) and isinstance(st.value.func, ast.Attribute)
                 and st.value.func.attr.startswith("atomic") for t in st.targets if isinstance(t, ast.Name)}
        claim = self.src.claim.get("target")
        names -= {claim, self.src.task_index}
        out = []
        for node in ast.walk(self.src.task_loop):
            if isinstance(node, ast.If) and any(isinstance(x, ast.Name) and x.id in names for x in ast.walk(node.test)):
                out.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
        return out

    def in_group_arm(self, n: int) -> bool:
        """Task-loop code only a group's last task runs (see `_atomic_result_ifs`)."""
        ch = self.chains[n]
        return bool(ch) and ch[0][0] == self.src.entry and any(a <= ch[0][1] <= b for a, b in self.group_lines)

    # ---- loops ---------------------------------------------------------------------------------

    def loop_facts(self, lp: Loop) -> LoopFacts:
        """One inner loop of the task loop: its own instructions (nested loops excluded), the source
        loop they vote for, the loops around that one, its weight and other loads."""
        if lp.header in self._loop_facts:
            return self._loop_facts[lp.header]
        cfg = self.cfg
        inner = set().union(*(o.blocks for o in self.inner_loops if o is not lp and o.blocks < lp.blocks))
        own = sorted(n for b in lp.blocks - inner for n in range(cfg.blocks[b].start, cfg.blocks[b].end))
        votes: Counter[tuple[Any, ...]] = Counter()
        for n in own:
            hit = self.src.loop_statement_of(self.chains[n]) if self.chains[n] else None
            if hit is not None:
                k, node = hit
                votes[self.chains[n][:k] + ((self.chains[n][k][0], node.lineno),)] += 1
        ch = votes.most_common(1)[0][0] if votes else ()
        stmt = self.src.loop_statement(ch[-1][0], ch[-1][1]) if ch else None
        wl = Counter(self.sass.instrs[n].opcode for n in own if n in self.weight)
        ol = Counter(self.sass.instrs[n].opcode for n in own
                     if self.sass.instrs[n].is_global_load and n not in self.weight)
        wf = next((n for n in own if n in self.weight), None)
        gf = next((n for n in own if self.sass.instrs[n].is_global_load), None)
        lf = LoopFacts(
            lp, ch[-1][0] if ch else None, ch[-1][1] if ch else None, ch, stmt, enclosing(self.src, ch, stmt),
            any(self.sass.instrs[n].is_mma for n in lp.instr_indices(cfg)), dict(wl), dict(ol),
            self.sass.instrs[cfg.blocks[lp.header].start].addr, own,
            None if gf is None else self.address_depth(gf), None if wf is None else self.address_depth(wf))
        self._loop_facts[lp.header] = lf
        return lf

    def body_loops(self, body: str) -> list[LoopFacts]:
        """The loops of an op body (polls excluded), by address."""
        mine = [lp for lp in self.inner_loops if self.where[self.cfg.blocks[lp.header].start] == body
                and lp.header not in self.poll_loops]
        return sorted((self.loop_facts(lp) for lp in mine), key=lambda lf: lf.header_addr)

    def trips(self, lf: LoopFacts, ev: Evaluator) -> int | None:
        """Iterations of the loop in one task (its own trips times the enclosing loops'), 0 when it
        does not run, None when the source cannot tell."""
        if lf.node is None:
            return None
        ok = ev.executes(lf.node, lf.chain)
        if ok is False:
            return 0
        t = ev.trips(lf.node, lf.chain)
        total = None if t is UNKNOWN else int(t)
        for ch, node in lf.enclosing:
            if total == 0:
                break
            o = ev.trips(node, ch)
            total = None if (o is UNKNOWN or total is None) else total * int(o)
        return total if ok is not None else (None if total else total)

    # ---- paths ---------------------------------------------------------------------------------

    def branch(self, b: int) -> Any:
        """The `if` a conditional branch ending block b implements, with the frames to evaluate it
        in and, per successor, whether it starts in the then-arm (True), else/after (False)."""
        if b in self._branch_info:
            return self._branch_info[b]
        blk = self.cfg.blocks[b]
        last = self.sass.instrs[blk.end - 1]
        res = None
        if last.is_branch and len(blk.succs) > 1 and last.op == "BRA" and self.chains[blk.end - 1]:
            ch = self.chains[blk.end - 1]
            node = self.src.if_at(ch[-1][0], ch[-1][1])
            if node is not None:
                side = {}
                for s in blk.succs:
                    v = self._side(s, len(ch) - 1, ch[-1][0], node)
                    if v is not None:
                        side[s] = v
                if len(set(side.values())) == 2:
                    res = (node, ch[:-1] + ((ch[-1][0], node.lineno),), side)
        self._branch_info[b] = res
        return res

    def _side(self, b: int, k: int, fn: str, node: ast.If) -> bool | None:
        """Whether block b runs the then-arm of `node` (True) or code after/else (False): a vote of
        its first instructions' lines at frame k (line info is fuzzy at block boundaries)."""
        blk = self.cfg.blocks[b]
        body = (node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno)
        test = (node.test.lineno, node.test.end_lineno or node.test.lineno)
        inside = outside = 0
        for n in range(blk.start, min(blk.end, blk.start + 24)):
            ch = self.chains[n]
            if len(ch) <= k:
                outside += 1
            elif ch[k][0] == fn and not test[0] <= ch[k][1] <= test[1]:
                if body[0] <= ch[k][1] <= body[1]:
                    inside += 1
                else:
                    outside += 1
        return None if inside == outside else inside > outside

    def successors(self, b: int, ev: Evaluator | None, body: str | None = None) -> list[int]:
        """The successors of block b a task takes. A conditional branch whose `if` evaluates for the
        task takes that arm; one that does not is decided by its arms' code (a successor whose code
        the task provably skips -- a call site or `if` around it is False -- is dropped); in the
        unrolled wait loop the task enters each copy (`task_path` keeps as many as it has waits);
        the signal's `if` on an atomic's result (a group's last task) is not taken (priced apart);
        an arm that may or may not run (its test reads data, or the thread id: one thread polls) is
        entered, so the path is the slowest the task can take. A jump table (the op dispatch, an `if act == ...` chain) goes to the arms that run."""
        succ = self.cfg.blocks[b].succs
        last = self.sass.instrs[self.cfg.blocks[b].end - 1]
        if ev is None or len(succ) <= 1:
            if last.op in ("BRX", "BRXU") and body is not None:
                return [s for s in succ if self.where[self.cfg.blocks[s].start] == body] or succ
            return succ
        memo = ev.scratch
        key = ("succ", b)
        if key in memo:
            return memo[key]  # type: ignore[no-any-return]
        res: list[int] | None = None
        if last.op in ("BRX", "BRXU"):
            cands = [s for s in succ if self.block_executes(s, ev) is not False]
            res = [s for s in cands if self._in_true_arm(s, ev)] or cands or None
        else:
            info = self.branch(b)
            if info is not None:
                node, ch, side = info
                t = ev.value(node.test, ch)
                fn = ch[-1][0]
                if t is not UNKNOWN:
                    res = [s for s in succ if side.get(s) is bool(t)] or None
                elif any(_is_wait_for(x) for x in self.src.ancestors(fn, node)):
                    res = [s for s in succ if side.get(s) is True] or None
                elif fn == self.src.entry and (node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno) \
                        in self.group_lines:
                    res = [s for s in succ if side.get(s) is False] or None
            if res is None:
                res = [s for s in succ if self.block_executes(s, ev) is not False] or None
                join = self.cfg.ipdom()[b]
                if res is not None and len(res) == 2 and join in res:  # an arm that may run: run it
                    res = [s for s in res if s != join]
        out = res or list(succ)
        memo[key] = out
        return out

    def executes(self, n: int, ev: Evaluator) -> bool | None:
        """Whether instruction n runs for the evaluator's task: every call site and `if` around its
        source statement, in every frame (None: some test cannot be evaluated)."""
        ch = self.chains[n]
        if not ch:
            return None
        key = ("ex", ch)
        if key not in ev.scratch:
            st = self.src.stmt_at(ch[-1][0], ch[-1][1])
            ev.scratch[key] = ev.executes(st, ch) if st is not None else None
        return ev.scratch[key]  # type: ignore[no-any-return]

    def block_executes(self, b: int, ev: Evaluator) -> bool | None:
        """A block runs for the task if one of its first instructions provably does; else not if one
        of them provably does not (the others' tests may read data: ptxas schedules an inner
        `if`'s code first on one target and not on another); else unknown."""
        blk = self.cfg.blocks[b]
        verdict: bool | None = None
        for n in range(blk.start, min(blk.end, blk.start + 8)):
            v = self.executes(n, ev)
            if v is True:
                return True
            if v is False:
                verdict = False
        return verdict

    def _in_true_arm(self, b: int, ev: Evaluator) -> bool:
        """The block's first source statement lies inside an `if` arm whose test holds for the task
        (a jump table's taken arm, as opposed to the code after the chain)."""
        blk = self.cfg.blocks[b]
        n = next((n for n in range(blk.start, min(blk.end, blk.start + 8)) if self.chains[n]), None)
        if n is None:
            return False
        ch = self.chains[n]
        for k, (fn, line) in enumerate(ch):
            st = self.src.stmt_at(fn, line)
            if st is None:
                continue
            anc = self.src.ancestors(fn, st)
            for child, par in zip(anc, anc[1:], strict=False):
                if isinstance(par, ast.If) and child in par.body:
                    t = ev.value(par.test, ch[:k] + ((fn, par.lineno),))
                    if t is not UNKNOWN and bool(t):
                        return True
        return False

    def loop_path(self, lf: LoopFacts, ev: Evaluator | None, body: str, limit: int = 32) -> dict[str, Any]:
        """In-flight and round-trip facts of one iteration of the loop on the path(s) the task
        takes (the worst path when several remain)."""
        cfg, lp = self.cfg, lf.loop
        own_blocks = {cfg.block_of[n] for n in lf.own}
        decisions = []
        for b in sorted(own_blocks):
            decisions.append(tuple(self.successors(b, ev, body)))
        key = (lf.header_addr, tuple(decisions))
        if key in self._sim_cache:
            return self._sim_cache[key]
        choose = dict(zip(sorted(own_blocks), decisions, strict=True))
        nested = [o for o in cfg.loops if o.blocks < lp.blocks]
        paths: list[list[int]] = []

        def walk(b: int, path: list[int], seen: set[int]) -> None:
            if len(paths) >= limit:
                return
            if b == lp.header and path:
                paths.append(path)
                return
            if b not in lp.blocks or b in seen:
                if b not in lp.blocks:
                    paths.append(path)
                return
            inner = next((o for o in sorted(nested, key=lambda o: -len(o.blocks)) if b in o.blocks), None)
            if inner is not None:  # skip a nested loop: continue at its exits
                exits = {s for x in inner.blocks for s in cfg.blocks[x].succs if s not in inner.blocks}
                for s in sorted(exits):
                    walk(s, path, seen | inner.blocks)
                return
            for s in choose.get(b, cfg.blocks[b].succs):
                walk(s, [*path, b], seen | {b})

        walk(lp.header, [], set())
        best: dict[str, int] = {}
        for p in paths or [[lp.header]]:
            idx = [n for b in p for n in range(cfg.blocks[b].start, cfg.blocks[b].end)]
            r = simulate([self.sass.instrs[n] for n in idx], [n in self.weight for n in idx])
            if not best or (r["round_trips_per_iteration"], r["global_bytes_per_thread"]) > \
                    (best["round_trips_per_iteration"], best["global_bytes_per_thread"]):
                best = r
        self._sim_cache[key] = best
        return best


def enclosing(src: KernelSource, chain: tuple[tuple[str, int], ...], node: Any
               ) -> list[tuple[tuple[tuple[str, int], ...], Any]]:
    """Source loops around `node` (in its function, then around each call site), innermost first."""
    out: list[tuple[tuple[tuple[str, int], ...], Any]] = []
    for k in range(len(chain) - 1, -1, -1):
        fn, line = chain[k]
        cur = node if k == len(chain) - 1 else src.stmt_at(fn, line)
        par = src.parent(fn, cur) if cur is not None else None
        while par is not None:
            if isinstance(par, (ast.For, ast.While)) and par is not src.task_loop:
                out.append((chain[:k] + ((fn, par.lineno),), par))
            par = src.parent(fn, par)
    return out


def _is_wait_for(node: ast.AST) -> bool:
    """A `for ... in tl.static_range(...)` whose body polls (the task's waits, unrolled)."""
    return (isinstance(node, ast.For) and isinstance(node.iter, ast.Call) and isinstance(node.iter.func, ast.Attribute)
            and node.iter.func.attr == "static_range"
            and any(isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr == "atomic_poll"
                    for st in node.body for c in ast.walk(st)))


def kernel_info(man: dict[str, Any], target: str, kernel: str) -> dict[str, Any] | None:
    """The manifest entry of one kernel of a target: "decode" is the target's own fields; "prefill"
    its `prefill` entry (bundle format 2), or the target's fields where one kernel runs both modes
    (format 1)."""
    info = man["targets"].get(target)
    if info is None or kernel == "decode":
        return info
    return info.get("prefill", info)  # type: ignore[no-any-return]
