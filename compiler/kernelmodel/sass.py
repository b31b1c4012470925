"""SASS of a cubin as data: instructions with registers, predicates and source frames, a control
flow graph with natural loops, and the dataflow facts `static_facts` reads (which kernel parameter
an address derives from, how many dependent global round trips feed it, register liveness).

Everything comes from the tools in Triton's wheel (`nvdisasm -gi` for SASS with the full inlining
chain of every instruction, `nvdisasm -lrm count` for live registers, `cuobjdump -elf` for the
parameter constant bank), so it runs on a machine without a GPU or a CUDA toolkit.

The dataflow is deliberately simple and stated: registers only (no memory), join = union/max,
predicated definitions do not kill, calls to internal subroutines (64-bit division) define what
the subroutine writes from what it reads. Widths: `.64`/`.WIDE` pairs, `.128` quads, MMA operands
by fragment size.

Why one module: the instruction model (operands, guards, widths), the CFG built over it and the
dataflow helpers (forward analysis, post-dominators, guarded register state) change together
whenever ptxas emits a new form; split apart, each half would import the other's internals.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zlc.codegen.toolchain import find_tool
from zlc.errors import ZlcError

__all__ = ["Cfg", "Frame", "Instr", "KernelParams", "Loop", "Sass", "SassError", "disassemble", "kernel_params",
           "load_width", "parse_sass", "reg_merge", "reg_read", "reg_write"]


class SassError(ZlcError):
    """A cubin could not be disassembled or its SASS not understood."""


def _run_tool(name: str, args: list[str], cubin: bytes) -> str:
    with tempfile.TemporaryDirectory(prefix="zlc-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([find_tool(name), *args, str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SassError(f"{name} {' '.join(args)} failed: {(proc.stderr or proc.stdout).strip()[:500]}")
    return proc.stdout


def disassemble(cubin: bytes) -> Sass:
    """The cubin's code with inlining chains and live-register counts per instruction."""
    sass = parse_sass(_run_tool("nvdisasm", ["-c", "-gi"], cubin))
    try:  # nvdisasm refuses live ranges where its flow analysis is off (older ELF formats)
        live = _run_tool("nvdisasm", ["-c", "-lrm", "count"], cubin)
    except SassError:
        live = ""
    for m in re.finditer(r"/\*([0-9a-f]+)\*/[^\n]*?//\s*\|\s*(\d*)\s*\|", live):
        ins = sass.at.get(int(m.group(1), 16))
        if ins is not None and m.group(2):
            ins.live_gprs = int(m.group(2))
    return sass


@dataclass(frozen=True)
class KernelParams:
    """Where the kernel's parameters live in constant bank 0 (from the cubin's .nv.info)."""

    base: int  # c[0x0][base] is parameter 0's first byte (0x160 on sm_8x, 0x210 on sm_90)
    offsets: dict[int, int]  # ordinal -> byte offset from base
    threads: int | None  # REQNTID x*y*z: threads per program

    def slot(self, offset: int) -> int | None:
        """Ordinal of the parameter holding constant-bank-0 byte `offset`, if any."""
        rel = offset - self.base
        for ordinal, off in self.offsets.items():
            if off <= rel < off + 8:
                return ordinal
        return None


def kernel_params(cubin: bytes) -> KernelParams:
    text = _run_tool("cuobjdump", ["-elf"], cubin)
    m = re.search(r"EIATTR_PARAM_CBANK\s*\n\s*Format:[^\n]*\n\s*Value:\s*0x[0-9a-f]+\s+0x([0-9a-f]+)", text)
    if m is None:
        raise SassError("the cubin's .nv.info has no EIATTR_PARAM_CBANK (cannot locate the parameters)")
    base = int(m.group(1), 16) & 0xFFFF  # high half: the bank's size
    offsets = {int(o, 16): int(off, 16) for o, off in
               re.findall(r"Ordinal\s*:\s*0x([0-9a-f]+)\s+Offset\s*:\s*0x([0-9a-f]+)", text)}
    t = re.search(r"EIATTR_REQNTID\s*\n\s*Format:[^\n]*\n\s*Value:\s*0x([0-9a-f]+)\s+0x([0-9a-f]+)\s+0x([0-9a-f]+)",
                  text)
    threads = int(t.group(1), 16) * int(t.group(2), 16) * int(t.group(3), 16) if t else None
    return KernelParams(base, offsets, threads)


# ---- instructions ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    file: str
    line: int


@dataclass
class Instr:
    addr: int
    opcode: str  # with modifiers: "LDG.E.U16"
    operands: list[str]
    guard: str | None = None  # "P0", "!P0"; None when always executed
    frames: tuple[Frame, ...] = ()  # innermost first (the last one is in the kernel entry)
    targets: tuple[str, ...] = ()  # branch target labels
    live_gprs: int | None = None
    dests: tuple[str, ...] = ()
    srcs: tuple[str, ...] = ()
    consts: tuple[int, ...] = ()  # c[0x0][off] byte offsets read

    @property
    def op(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def mods(self) -> list[str]:
        return self.opcode.split(".")[1:]

    @property
    def is_global_load(self) -> bool:
        """A load from global memory whose result the program waits for (LD may be global)."""
        return self.op in ("LDG", "LD") or (self.op in ("ATOMG", "ATOM") and any(d.startswith("R") for d in self.dests))

    @property
    def is_global_atomic(self) -> bool:
        return self.op in ("ATOMG", "ATOM", "RED", "REDG")

    @property
    def is_fence(self) -> bool:
        return self.op in ("MEMBAR", "FENCE")

    @property
    def is_l1_invalidate(self) -> bool:
        return self.op in ("CCTL", "CCTLL") and any(m.startswith("IV") for m in self.mods)

    @property
    def is_l2_prefetch(self) -> bool:
        """`prefetch.global.L2` (sm_8x / sm_90: CCTL.E.PF2): a line requested into L2, no result."""
        return self.op in ("CCTL", "CCTLL") and "PF2" in self.mods

    @property
    def is_barrier(self) -> bool:
        return self.op == "BAR"

    @property
    def is_mma(self) -> bool:
        return self.op.endswith("MMA")

    @property
    def is_branch(self) -> bool:
        # sm_8x ptxas also jumps with `CALL.REL.NOINC` to a local label (no return): a branch
        return self.op in ("BRA", "BRX", "BRXU", "JMP", "JMX") or (
            self.op == "CALL" and bool(self.targets) and self.targets[0].startswith(".L"))

    @property
    def is_call(self) -> bool:
        """A call of a subroutine (a symbol, e.g. the 64-bit division), which returns."""
        return self.op == "CALL" and not self.is_branch

    @property
    def ends_block(self) -> bool:
        return self.is_branch or self.op in ("EXIT", "RET", "BREAK", "KILL")

    @property
    def unconditional(self) -> bool:
        if self.guard not in (None, "PT"):
            return False
        return not any(re.fullmatch(r"!?U?P[0-6]", o) for o in self.operands)

    @property
    def address_regs(self) -> list[str]:
        """Registers of the memory address operand (the last bracket of `desc[UR][R2.64+0x40]`)."""
        addr = next((o for o in self.operands if "[" in o and not o.startswith("c[")), None)
        if addr is None:
            return []
        inner = addr[addr.rfind("[") + 1:] if addr.startswith("desc") else addr
        return [r for r in _operand_regs(inner) if r not in ("PT", "UPT")]

    def width(self) -> int:
        """Bytes per thread moved by a load/store/atomic."""
        return load_width(self.opcode)


_WIDTHS = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def load_width(opcode: str) -> int:
    """Bytes per thread of a memory instruction from its modifiers (32 bits when none says)."""
    for m in opcode.split(".")[1:]:
        if m in _WIDTHS:
            return _WIDTHS[m]
    return 4


_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:(@!?U?P(?:[0-7]|T))\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_FRAME = re.compile(r'^\s*//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^([.$\w][\w.$]*):\s*$")
_REG = re.compile(r"(?<![\w.])(U?R(?:\d+|Z)|U?P(?:[0-7]|T))(\.64|\.U32|\.X4|\.H[01]|\.B[0-3]|\.reuse)*")
_CONST = re.compile(r"c\[0x0\]\[(0x[0-9a-f]+)\]")
_NO_DEST = {"ST", "STG", "STS", "STL", "STSM", "RED", "REDG", "BAR", "MEMBAR", "FENCE", "CCTL", "CCTLL", "BRA",
            "BRX", "BRXU", "JMP", "JMX", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "WARPSYNC", "YIELD", "NOP",
            "ERRBAR", "CGAERRBAR", "DEPBAR", "BREAK", "BPT", "KILL", "SYNCS", "UTMASTG", "UBLKCP", "ARRIVES"}
_PRED_DEST_ONLY = {"ISETP", "FSETP", "DSETP", "HSETP2", "PSETP", "UISETP", "PLOP3", "UPLOP3", "R2P", "FCHK"}
_REG_AND_PRED = {"ATOMG", "ATOM", "ATOMS", "SHFL"}  # "PT, R3, ..." : the predicate, then a register


def _regs(op: str, width: int) -> list[str]:
    """`R4` of width 2 -> R4, R5 (RZ/URZ/PT are no storage)."""
    if op in ("RZ", "URZ", "PT", "UPT"):
        return []
    m = re.fullmatch(r"(U?R)(\d+)", op)
    if m is None:
        return [op]
    return [f"{m.group(1)}{int(m.group(2)) + i}" for i in range(width)]


def _operand_regs(text: str, default: int = 1) -> list[str]:
    out: list[str] = []
    for m in _REG.finditer(text):
        w = 2 if ".64" in (m.group(0) or "") else default
        out += _regs(m.group(1), w)
    return out


def _split_operands(text: str) -> list[str]:
    text = re.sub(r"\(\*.*?\*\)", "", text)
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def _dest_width(opcode: str) -> int:
    mods = opcode.split(".")
    if mods[0].endswith("MMA"):
        return 4
    if "WIDE" in mods or mods[0] in ("DADD", "DMUL", "DFMA", "MOV64"):
        return 2
    if mods[0] in ("LDSM",) and mods[-1] in ("2", "4"):
        return int(mods[-1])
    return load_width(opcode) // 4 if load_width(opcode) >= 8 else 1


def _def_use(ins: Instr) -> None:
    ops, op = ins.operands, ins.op
    n_dest = 0
    if op in _NO_DEST:
        n_dest = 0
    elif op in _PRED_DEST_ONLY:
        while n_dest < len(ops) and re.fullmatch(r"U?P(?:[0-7]|T)", ops[n_dest]):
            n_dest += 1
    elif op in _REG_AND_PRED and ops and re.fullmatch(r"U?P(?:[0-7]|T)", ops[0]):
        n_dest = 2
    elif ops:
        n_dest = 1
        while n_dest < len(ops) and re.fullmatch(r"U?P(?:[0-7]|T)", ops[n_dest]):
            n_dest += 1  # carry-out predicates: "LEA R2, P0, ..."
    dw = _dest_width(ins.opcode)
    dests: list[str] = []
    for i, o in enumerate(ops[:n_dest]):
        rm = _REG.match(o)
        dests += _regs(rm.group(1), dw if i == 0 or op in _REG_AND_PRED else 1) if rm else []
    srcs: list[str] = []
    for i, o in enumerate(ops[n_dest:]):
        w = 1
        if (op in ("STG", "ST", "STS", "STL", "RED", "REDG", "ATOMG", "ATOM") and not o.startswith(("[", "desc"))
                and load_width(ins.opcode) >= 8):
            w = load_width(ins.opcode) // 4  # the data operand of a wide store
        elif ins.is_mma:
            w = (4, 2, 4)[i] if i < 3 else 1  # A, B, C fragments
        elif op in ("IMAD", "UIMAD") and "WIDE" in ins.mods and i == 2:
            w = 2  # the 64-bit addend
        srcs += _operand_regs(o, w)
    if ins.guard and ins.guard not in ("PT", "!PT"):
        srcs.append(ins.guard.lstrip("!"))
    ins.dests = tuple(d for d in dests if d not in ("PT", "UPT"))
    ins.srcs = tuple(s for s in srcs if s not in ("PT", "UPT"))
    ins.consts = tuple(int(c, 16) for c in _CONST.findall(" ".join(ops)))


@dataclass
class Sass:
    instrs: list[Instr]
    labels: dict[str, int]  # label -> address
    at: dict[int, Instr] = field(default_factory=dict)
    arch: str | None = None

    def __post_init__(self) -> None:
        self.at = {i.addr: i for i in self.instrs}
        self.index = {i.addr: n for n, i in enumerate(self.instrs)}

    def subroutines(self) -> list[int]:
        """Start addresses of internal subroutines (CALL targets), sorted."""
        return sorted({self.labels[t] for i in self.instrs if i.is_call for t in i.targets if t in self.labels})


def parse_sass(text: str) -> Sass:
    """Parses `nvdisasm -c -gi` output. An instruction inherits the frames printed before it (nvdisasm
    prints a chain only when it changes); a chain is innermost first."""
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    pending_labels: list[str] = []
    frames: list[Frame] = []
    fresh = True  # the next //## line starts a new chain
    arch = None
    for line in text.splitlines():
        if line.lstrip().startswith(".target"):
            arch = line.split()[-1]
            continue
        m = _FRAME.match(line)
        if m:
            if fresh:
                frames, fresh = [], False
            frames.append(Frame(m.group(1), int(m.group(2))))
            continue
        m = _INSTR.match(line)
        if m:
            fresh = True
            addr = int(m.group(1), 16)
            for lb in pending_labels:
                labels[lb] = addr
            pending_labels = []
            rest = m.group(4)
            targets = tuple(re.findall(r"`\(([^)]+)\)", rest))
            bt = re.search(r'BRANCH_TARGETS ([^"]*)"', line)
            if bt:
                targets = tuple(t.strip() for t in bt.group(1).split(","))
            operands = [o for o in _split_operands(re.sub(r"`\([^)]*\)", "", rest)) if o]
            ins = Instr(addr, m.group(3), operands, m.group(2)[1:] if m.group(2) else None, tuple(frames), targets)
            _def_use(ins)
            instrs.append(ins)
            continue
        m = _LABEL.match(line.strip())
        if m and not line.lstrip().startswith("//"):
            pending_labels.append(m.group(1))
    if not instrs:
        raise SassError("no instructions found in the disassembly")
    return Sass(instrs, labels, arch=arch)


# ---- control flow ------------------------------------------------------------------------------

@dataclass
class Block:
    start: int  # index into Sass.instrs
    end: int  # exclusive
    succs: list[int] = field(default_factory=list)
    preds: list[int] = field(default_factory=list)


@dataclass
class Loop:
    header: int  # block id
    blocks: frozenset[int]
    back_edges: list[tuple[int, int]]

    def instr_indices(self, cfg: Cfg) -> list[int]:
        return sorted(i for b in self.blocks for i in range(cfg.blocks[b].start, cfg.blocks[b].end))


class Cfg:
    """Basic blocks of one function (instruction index range [lo, hi)), dominators, natural loops."""

    def __init__(self, sass: Sass, lo: int = 0, hi: int | None = None):
        self.sass = sass
        ins = sass.instrs
        hi = len(ins) if hi is None else hi
        leaders = {lo}
        for n in range(lo, hi):
            i = ins[n]
            for t in i.targets:
                if t in sass.labels and not i.is_call:
                    leaders.add(sass.index[sass.labels[t]])
            if (i.ends_block or i.is_call) and n + 1 < hi:
                leaders.add(n + 1)
        starts = sorted(s for s in leaders if lo <= s < hi)
        self.blocks = [Block(s, e) for s, e in zip(starts, [*starts[1:], hi], strict=True)]
        self.block_of = {}
        for b, blk in enumerate(self.blocks):
            for n in range(blk.start, blk.end):
                self.block_of[n] = b
        first = {blk.start: b for b, blk in enumerate(self.blocks)}
        for blk in self.blocks:
            last = ins[blk.end - 1]
            succ = []
            if last.is_branch or last.op in ("EXIT", "RET"):
                succ += [first[sass.index[sass.labels[t]]] for t in last.targets
                         if t in sass.labels and sass.index[sass.labels[t]] in first]
                if not last.unconditional and blk.end < hi:
                    succ.append(first[blk.end])
            elif blk.end < hi:
                succ.append(first[blk.end])
            blk.succs = list(dict.fromkeys(succ))
        for b, blk in enumerate(self.blocks):
            for s in blk.succs:
                self.blocks[s].preds.append(b)
        self.dom = self._dominators()
        self.loops = self._loops()

    def _dominators(self) -> list[set[int]]:
        n = len(self.blocks)
        order = self._rpo()
        dom: list[set[int]] = [set(range(n)) for _ in range(n)]
        dom[0] = {0}
        changed = True
        while changed:
            changed = False
            for b in order[1:]:
                preds = [p for p in self.blocks[b].preds if p in self._reach]
                new = set.intersection(*(dom[p] for p in preds)) | {b} if preds else {b}
                if new != dom[b]:
                    dom[b], changed = new, True
        return dom

    def _rpo(self) -> list[int]:
        seen: set[int] = set()
        out: list[int] = []
        stack = [(0, iter(self.blocks[0].succs))]
        seen.add(0)
        while stack:
            b, it = stack[-1]
            nxt = next((s for s in it if s not in seen), None)
            if nxt is None:
                out.append(b)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(self.blocks[nxt].succs)))
        self._reach = seen
        return out[::-1]

    def _loops(self) -> list[Loop]:
        by_header: dict[int, list[tuple[int, int]]] = {}
        for b, blk in enumerate(self.blocks):
            for s in blk.succs:
                if b in self._reach and s in self.dom[b]:
                    by_header.setdefault(s, []).append((b, s))
        loops = []
        for h, edges in by_header.items():
            body = {h}
            work = [u for u, _ in edges]
            while work:
                u = work.pop()
                if u not in body:
                    body.add(u)
                    work += self.blocks[u].preds
            loops.append(Loop(h, frozenset(body), edges))
        return sorted(loops, key=lambda lp: len(lp.blocks))

    def ipdom(self) -> list[int | None]:
        """Immediate post-dominator of every block (None: only the exit), by Cooper, Harvey and
        Kennedy's iteration over the reversed graph; blocks without successors lead to the exit."""
        if hasattr(self, "_ipdom"):
            return self._ipdom
        n = len(self.blocks)
        exit_ = n
        succs = [blk.succs or [exit_] for blk in self.blocks]
        preds_rev: list[list[int]] = [[] for _ in range(n + 1)]  # reversed graph: successors become preds
        for b, ss in enumerate(succs):
            for s in ss:
                preds_rev[b].append(s)
        # reverse postorder of the reversed graph from the exit
        rev_succ: list[list[int]] = [[] for _ in range(n + 1)]
        for b, ss in enumerate(succs):
            for s in ss:
                rev_succ[s].append(b)
        order: list[int] = []
        seen = {exit_}
        stack = [(exit_, iter(rev_succ[exit_]))]
        while stack:
            b, it = stack[-1]
            nxt = next((x for x in it if x not in seen), None)
            if nxt is None:
                order.append(b)
                stack.pop()
            else:
                seen.add(nxt)
                stack.append((nxt, iter(rev_succ[nxt])))
        order.reverse()
        num = {b: i for i, b in enumerate(order)}
        idom: dict[int, int] = {exit_: exit_}

        def meet(a: int, b: int) -> int:
            while a != b:
                while num[a] > num[b]:
                    a = idom[a]
                while num[b] > num[a]:
                    b = idom[b]
            return a

        changed = True
        while changed:
            changed = False
            for b in order[1:]:
                done = [p for p in preds_rev[b] if p in idom]
                if not done:
                    continue
                new = done[0]
                for p in done[1:]:
                    new = meet(p, new)
                if idom.get(b) != new:
                    idom[b], changed = new, True
        self._ipdom: list[int | None] = [None if idom.get(b, exit_) == exit_ else idom[b] for b in range(n)]
        return self._ipdom

    def innermost_loop(self, index: int) -> Loop | None:
        b = self.block_of.get(index)
        return next((lp for lp in self.loops if b in lp.blocks), None)

    # ---- dataflow over the blocks ------------------------------------------------------------

    def liveness(self) -> list[set[str]]:
        """Registers live at the entry of each block."""
        ins = self.sass.instrs
        use, defs = [], []
        for blk in self.blocks:
            u: set[str] = set()
            d: set[str] = set()
            for n in range(blk.start, blk.end):
                i = ins[n]
                u |= {s for s in i.srcs if s not in d}
                if i.guard is None:
                    d |= set(i.dests)
            use.append(u)
            defs.append(d)
        live_in: list[set[str]] = [set() for _ in self.blocks]
        changed = True
        while changed:
            changed = False
            for b in reversed(range(len(self.blocks))):
                out: set[str] = set().union(*(live_in[s] for s in self.blocks[b].succs))
                new = use[b] | (out - defs[b])
                if new != live_in[b]:
                    live_in[b], changed = new, True
        return live_in

    def forward(self, transfer: Callable[[Instr, dict[Any, Any]], None],
                merge: Callable[[dict[Any, Any], dict[Any, Any]], dict[Any, Any]], start: int = 0,
                within: Iterable[int] | None = None, keep: Callable[[int, Any], bool] | None = None
                ) -> dict[int, dict[Any, Any]]:
        """Forward dataflow from block `start` (empty state), over the blocks `within` (default
        all): `transfer(instr, state)` updates in place, `merge(old, new)` joins at a block entry,
        `keep(block, key)` filters what flows along an edge into `block`. Returns each reached
        block's entry state."""
        inside = set(within) if within is not None else set(range(len(self.blocks)))
        state_in: dict[int, dict[Any, Any]] = {start: {}}
        work = [start]
        visits = 0
        ins = self.sass.instrs
        while work:
            b = work.pop(0)
            visits += 1
            if visits > 200 * len(self.blocks):
                raise SassError("dataflow did not converge")
            st = dict(state_in[b])
            for n in range(self.blocks[b].start, self.blocks[b].end):
                transfer(ins[n], st)
            for s in self.blocks[b].succs:
                if s not in inside:
                    continue
                new = st if keep is None else {k: v for k, v in st.items() if keep(s, k)}
                old = state_in.get(s)
                merged = dict(new) if old is None else merge(old, new)
                if merged != old:
                    state_in[s] = merged
                    if s not in work:
                        work.append(s)
        return state_in

    def states_before(self, state_in: dict[int, dict[Any, Any]],
                      transfer: Callable[[Instr, dict[Any, Any]], None]) -> dict[int, dict[Any, Any]]:
        """The state before every instruction of the reached blocks (replaying `transfer`)."""
        out: dict[int, dict[Any, Any]] = {}
        for b, st0 in state_in.items():
            st = dict(st0)
            for n in range(self.blocks[b].start, self.blocks[b].end):
                out[n] = dict(st)
                transfer(self.sass.instrs[n], st)
        return out


# ---- register state with predicated definitions ------------------------------------------------
# A predicated definition (`@P1 MOV R24, R33`) may or may not happen, so on its own it cannot kill
# the old value; but an instruction under the same guard (`@P1 LDG [R24]`) sees exactly the new
# one. States keep, per register, the merged value, its version, and the value written under a
# guard with the versions of register and predicate at that time.

def reg_read(st: dict[Any, Any], r: str, guard: str | None, default: Any) -> Any:
    """The value of `r` as an instruction under `guard` sees it."""
    if guard:
        e = st.get(("g", r, guard))
        if e is not None and e[1] == st.get(("v", guard.lstrip("!")), 0) and e[2] == st.get(("v", r), 0):
            return e[0]
    return st.get(r, default)


def reg_write(st: dict[Any, Any], r: str, val: Any, guard: str | None, join: Callable[[Any, Any], Any],
              default: Any) -> None:
    ver = st.get(("v", r), 0) + 1
    st[("v", r)] = ver
    if guard:
        st[r] = join(st.get(r, default), val)
        st[("g", r, guard)] = (val, st.get(("v", guard.lstrip("!")), 0), ver)
    else:
        st[r] = val


def reg_merge(join: Callable[[Any, Any], Any]) -> Callable[[dict[Any, Any], dict[Any, Any]], dict[Any, Any]]:
    """`merge` for `Cfg.forward` over reg_read/reg_write states: values joined, versions that differ
    invalidated (-1), guarded entries kept only where both sides agree."""
    def merge(a: dict[Any, Any], b: dict[Any, Any]) -> dict[Any, Any]:
        out: dict[Any, Any] = {}
        for k in a.keys() | b.keys():
            if isinstance(k, tuple):
                if k[0] == "v":
                    out[k] = a.get(k, 0) if a.get(k, 0) == b.get(k, 0) else -1
                elif a.get(k) == b.get(k):
                    out[k] = a[k]
            elif k in a and k in b:
                out[k] = join(a[k], b[k])
            else:
                out[k] = a[k] if k in a else b[k]
        return out
    return merge
