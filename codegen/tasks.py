"""Lowering the raised graph to ops and tasks: fusion, tiles, and the regions each task touches.

Fusion happens here, on the transformer-level ops:
- RMSNorm/LayerNorm are not tasks: every Linear tile that consumes a norm recomputes the row's
  statistics (the row is small and already read for the matrix-vector product), which removes a
  whole barrier per norm;
- the residual Add after a projection (attention output, MLP down) is the projection's epilogue;
- SplitHeads/MergeHeads are layouts, RoPE is applied where q is loaded (attention) and where k is
  written to the cache (cache-append), Positions are `past_len + row`;
- GatedMLP is two ops (gate*up with the activation in the epilogue, then down + residual); MoE is
  the router Linear, then those two per expert, routed (op_MoE);
- the LM head writes logits and a per-task (max, argmax) partial; one argmax task reduces them;
- q/k RMSNorms (per head or over the whole projection) apply where q and k are loaded, before RoPE;
  other norms no Linear fuses (post-norms, `x + norm(proj)`) are `row_norm` ops (`_row_norm`).

Each IR value the kernel materializes gets a view (a buffer, a norm to fuse, split heads, ...);
each op kind has an `op_<Kind>` method that emits its tasks with the regions they read and write,
which is all the event derivation (schedule.py) looks at. Buffers, constants and descriptors are
placed through `pack.Layout`.

Why one module (over 600 lines): the lowering is one walk over the graph in which every op's method
reads the views its producers left (a norm to fuse, heads with their RoPE and q/k norm, partials to
merge) and decides what its consumers may fuse; split by op kind, that one table of views and the
fusion decisions that read it would be spread over several modules.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

from zlc.bundle import (
    OP_ARGMAX,
    OP_ATTENTION,
    OP_ATTN_COMBINE,
    OP_CACHE_APPEND,
    OP_EMBED,
    OP_LINEAR,
    OP_ROW_NORM,
)
from zlc.errors import ZlcError
from zlc.ir import Graph, Node, Value

from .pack import Layout
from .program import (
    ACTIVATIONS,
    NORM_COMBINE,
    NORM_LAYER,
    NORM_NONE,
    NORM_RMS,
    ROPE_HALF,
    ROPE_INTERLEAVED,
    ROPE_NONE,
    Buffer,
    Region,
    Task,
    Tiling,
)


class ScheduleError(ZlcError):
    """The raised graph has a shape the megakernel cannot run; names the node."""


# ---- how IR values live in memory -----------------------------------------------------------

@dataclass
class Buf:  # a [rows, cols] activation buffer
    name: str
    cols: int


@dataclass
class Norm:  # a norm's output, fused into the Linear tiles that read it
    src: Buf
    kind: int
    w: int  # P offset
    b: int  # P offset or -1
    eps: float


@dataclass
class Rope:
    kind: int
    cos: int  # P offsets of [positions, half] tables
    sin: int
    half: int
    rot: int
    positions: int  # rows of the tables


@dataclass
class QKNorm:  # an RMSNorm of q or k, applied as the heads are loaded (before their RoPE)
    w: int  # P offset of the gains: [D] shared by the heads, or [H*D] when `whole`
    eps: float
    whole: bool  # statistics over the whole projection row (OLMo 2), else over each head (Qwen3)


@dataclass
class Heads:  # [1, H, T, D] view of a [T, H*D] buffer
    buf: Buf
    heads: int
    dim: int
    rope: Rope | None = None
    norm: QKNorm | None = None


@dataclass
class AttnOut:  # attention output, [T, H*D] once merged
    buf: Buf
    partials: Buf | None = None  # decode with split-KV and fuse_combine: merged where it is read
    splits: int = 1
    head_dim: int = 0


@dataclass
class Positions:
    pass


View = Buf | Norm | Heads | AttnOut | Positions


def _head_cols(x: Heads, h: int) -> Region:
    """What loading head h reads of its projection: its columns, or the row for a whole-row norm."""
    whole = x.norm is not None and x.norm.whole
    return Region(x.buf.name, 0 if whole else h * x.dim, x.buf.cols if whole else (h + 1) * x.dim)


@dataclass
class Op:
    """One fused op instance: its tasks per mode (decode and prefill may tile differently)."""

    label: str
    tasks: dict[str, list[Task]] = field(default_factory=dict)


# ---- the builder -------------------------------------------------------------------------------

class TaskBuilder:
    """Walks the raised decode graph once, lowering each node to fused ops (`run`); the result is
    `ops` (tasks per mode, events not yet assigned), `layout` and the model facts the program
    records (head_dim, vocab, the logits buffer)."""

    def __init__(self, g: Graph, tiling: Tiling, max_seq: int):
        self.g, self.t, self.max_seq = g, tiling, max_seq
        self.users = g.users()
        self.views: dict[int, View] = {}
        self.skip: set[int] = set()
        self.layout = Layout()
        self.ops: list[Op] = []
        self.head_dim = 16
        self.vocab = 0
        self.logits = ""
        self.n_layers = 0
        self.route_buf: dict[int, str] = {}  # a MoE router's logits: A offset -> buffer
        self.linear_ops: dict[str, Op] = {}  # a Linear's output buffer -> its op (fuse_mlp_down)

    # -- arenas
    @property
    def buffers(self) -> dict[str, Buffer]:
        return self.layout.buffers

    def buffer(self, name: str, cols: int, rows: int | None = None) -> Buf:
        b = self.layout.buffer(name, cols, self.t.chunk if rows is None else rows)
        return Buf(b.name, cols)

    def w(self, v: Value | None, node: Node) -> int:
        return self.layout.place(self._const(v, node), "W")

    def p(self, v: Value | None, node: Node) -> int:
        return -1 if v is None else self.layout.place(self._const(v, node), "P")

    def _const(self, v: Value | None, node: Node) -> Value:
        if v is None or v.kind != "const":
            raise ScheduleError(f"node '{node.name}' ({node.op}): expected a constant weight, got "
                                f"{'nothing' if v is None else v.kind + ' %' + v.name}")
        return v

    def desc(self, label: str, ints: dict[int, int], floats: dict[int, float] | None = None) -> int:
        return self.layout.desc(label, ints, floats)


    # -- views
    def view(self, v: Value | None, node: Node) -> View:
        if v is None or id(v) not in self.views:
            what = "nothing" if v is None else f"%{v.name}"
            raise ScheduleError(f"node '{node.name}' ({node.op}) reads {what}, which the megakernel "
                                "does not materialize (unsupported producer pattern)")
        return self.views[id(v)]

    def buf(self, v: Value | None, node: Node) -> Buf:
        x = self.view(v, node)
        if isinstance(x, AttnOut):
            if x.partials is not None:
                raise ScheduleError(f"node '{node.name}' ({node.op}) reads an attention output that only "
                                    "exists as split-KV partials in decode (only a Linear merges them)")
            return x.buf
        if not isinstance(x, Buf):
            raise ScheduleError(f"node '{node.name}' ({node.op}) needs a plain activation input, "
                                f"got a {type(x).__name__.lower()} view of %{v.name if v else '?'}")
        return x

    def sole_user(self, v: Value) -> Node | None:
        us = self.users.get(v, [])
        is_out = any(o is v for o in self.g.outputs)
        return us[0] if len(us) == 1 and not is_out else None

    # -- ops
    def add_op(self, label: str, tasks: list[Task] | dict[str, list[Task]]) -> Op:
        if not isinstance(tasks, dict):  # same tiling in both modes, but each mode has its own events
            tasks = {"prefill": tasks, "decode": [copy.deepcopy(t) for t in tasks]}
        op = Op(label, tasks)
        self.ops.append(op)
        return op

    def linear_op(self, node: Node, label: str, x: View, w: Value | None, n: int, *,
                  w2: Value | None = None, bias: Value | None = None, act: str = "none",
                  residual: Buf | None = None, out: Buf | None = None, lm: bool = False,
                  softcap: float = 0.0, expert: int | None = None, route: dict[int, int] | None = None) -> Buf:
        if isinstance(x, Norm):
            src, nk, nw, nb, eps = x.src, x.kind, x.w, x.b, x.eps
        elif isinstance(x, (Buf, AttnOut)):
            src, nk, nw, nb, eps = (x if isinstance(x, Buf) else x.buf), NORM_NONE, -1, -1, 0.0
        else:
            raise ScheduleError(f"node '{node.name}' ({node.op}): input is a {type(x).__name__} view")
        wv = self._const(w, node)
        # expert e of a MoE: w (and w2) are stacked [E, n, K]; the matrix is w[e], at its offset
        shape = None if wv.shape is None else tuple(wv.shape[1:] if expert is not None else wv.shape)
        if shape is None or len(shape) != 2 or int(shape[0]) != n or int(shape[1]) != src.cols:  # type: ignore[arg-type]
            raise ScheduleError(f"node '{node.name}' ({node.op}): weight {wv.type} does not match "
                                f"[{n}, {src.cols}]")
        at = 0 if expert is None else expert * n * src.cols
        if act not in ACTIVATIONS:
            raise ScheduleError(f"node '{node.name}' ({node.op}): activation '{act}' has no kernel")
        if out is None:
            out = self.buffer(label, n)
        t = self.t
        nblocks = -(-n // t.block_n)
        per = 1 if not t.max_linear_tasks else -(-nblocks // t.max_linear_tasks)
        ranges = [(b * t.block_n, min(n, (b + per) * t.block_n)) for b in range(0, nblocks, per)]
        partials = self.buffer("lm.partials", 2 * len(ranges), rows=1) if lm else None
        d = self.desc(label, {
            0: self.buffers[src.name].offset, 1: src.cols, 2: src.cols, 3: n, 4: self.w(wv, node) + at,
            5: self.w(w2, node) + at if w2 is not None else -1, 6: self.p(bias, node),
            7: self.buffers[residual.name].offset if residual else -1,
            8: self.buffers[out.name].offset, 9: out.cols, 10: nk, 11: nw, 12: nb, 13: ACTIVATIONS[act],
            14: int(lm), 15: self.buffers[partials.name].offset if partials else -1, **(route or {})}, {0: eps, 1: softcap})
        routed = [Region(self.route_buf[route[16]], 0, route[17])] if route else []
        # Decode after split-KV attention with fuse_combine: the row is merged from the attention
        # partials as it is loaded (NORM_COMBINE: x_off is the partials, 11/12 the splits and head
        # size), so no combine op stands between attention and this projection.
        merged = isinstance(x, AttnOut) and x.partials is not None
        if merged:
            assert isinstance(x, AttnOut) and x.partials is not None
            d_dec = self.desc(label + ".merged", {
                0: self.buffers[x.partials.name].offset, 1: src.cols, 2: src.cols, 3: n, 4: self.w(wv, node),
                5: self.w(w2, node) if w2 is not None else -1, 6: self.p(bias, node),
                7: self.buffers[residual.name].offset if residual else -1,
                8: self.buffers[out.name].offset, 9: out.cols, 10: NORM_COMBINE, 11: x.splits, 12: x.head_dim,
                13: ACTIVATIONS[act], 14: int(lm), 15: self.buffers[partials.name].offset if partials else -1},
                {0: eps, 1: softcap})

        def tasks_for(mode: str) -> list[Task]:
            out_tasks = []
            for slot, (lo, hi) in enumerate(ranges):
                if merged and mode == "decode":
                    assert isinstance(x, AttnOut) and x.partials is not None
                    reads = [Region(x.partials.name, 0, x.partials.cols)]
                else:
                    reads = [Region(src.name, 0, src.cols)]
                reads += routed
                if residual is not None:
                    reads.append(Region(residual.name, lo, hi))
                writes = [Region(out.name, lo, hi)]
                if partials is not None:
                    writes.append(Region(partials.name, slot, slot + 1))
                out_tasks.append(Task(OP_LINEAR, d_dec if merged and mode == "decode" else d, lo, hi, slot,
                                      reads=reads, writes=writes, label=f"{label}[{lo}:{hi}]"))
            return out_tasks

        self.linear_ops[out.name] = self.add_op(label, {"prefill": tasks_for("prefill"), "decode": tasks_for("decode")})
        if lm:
            assert partials is not None
            self.lm_partials = partials
            self.lm_slots = len(ranges)
        return out

    def _redesc(self, op: Op, fields: dict[int, int], suffix: str) -> None:
        """Gives op's decode tasks their own descriptors: copies of theirs with `fields` set."""
        lay, made = self.layout, {}
        for t in op.tasks["decode"]:
            if t.desc not in made:
                ints = dict(enumerate(lay.di[t.desc]))
                made[t.desc] = lay.desc(lay.desc_labels[t.desc] + suffix, {**ints, **fields},
                                        dict(enumerate(lay.df[t.desc])))
            t.desc = made[t.desc]

    def fuse_down(self, h: Buf, out: Buf, res: Buf | None, wd: Value, bias: Value | None, node: Node) -> None:
        """MLP split-K (Tiling.fuse_mlp_down, decode only): the tasks computing h's columns [lo, hi)
        also multiply them by the down matrix's columns Wd[:, lo:hi] and add the partial product
        into the MLP output `out` with float atomics (linear descriptor fields 16 Wd's W offset,
        17 out's A offset, 18 the down bias's P offset or -1, added by the task holding column 0,
        22 out's columns: 0 when nothing is fused). The accumulator starts as the residual: the
        Linear that produces the residual also stores its decode output into `out` (fields 19 its
        A offset, 23 = 1), so there is no zeroing pass and no extra level. The down op keeps its
        prefill tasks and loses its decode ones. Left unfused (the down keeps its decode tasks):
        no residual, a residual no Linear produces (an embedding, a post-norm), one whose
        producer already feeds another accumulator."""
        prod, up, down = self.linear_ops.get(res.name) if res else None, self.linear_ops[h.name], self.linear_ops[out.name]
        lay = self.layout
        if (res is None or prod is None or not prod.tasks["decode"] or not up.tasks["decode"]
                or any(lay.di[t.desc][23] or lay.di[t.desc][21] for t in prod.tasks["decode"] + up.tasks["decode"])
                or any(len(t.writes) != 1 for t in prod.tasks["decode"])):
            return
        self._redesc(prod, {19: self.buffers[out.name].offset, 23: 1}, ".init")
        for t in prod.tasks["decode"]:
            t.writes.append(Region(out.name, t.writes[0].lo, t.writes[0].hi))
        self._redesc(up, {16: self.w(wd, node), 17: self.buffers[out.name].offset, 18: self.p(bias, node),
                          22: out.cols}, ".down")
        for t in up.tasks["decode"]:
            t.writes.append(Region(out.name, 0, out.cols, accumulate=True))
        down.tasks["decode"] = []

    def residual_target(self, out: Value) -> tuple[Buf | None, Value]:
        """(residual buffer, value the fused op defines): fuses `Add(x, this)` into the epilogue."""
        add = self.sole_user(out)
        if add is None or add.op != "Add" or len(add.inputs) != 2:
            return None, out
        other = add.inputs[1] if add.inputs[0] is out else add.inputs[0]
        ov = self.views.get(id(other)) if other is not None else None
        if not isinstance(ov, Buf) or other is out or add.output.shape != out.shape:
            return None, out
        self.skip.add(id(add))
        return ov, add.output

    # -- per-op lowering
    def run(self) -> None:
        for n in self.g.nodes:
            if id(n) in self.skip:
                continue
            fn = getattr(self, "op_" + n.op, None)
            if fn is None:
                raise ScheduleError(f"node '{n.name}': op {n.op} has no megakernel lowering "
                                    "(raising left it op-level; see `zlc inspect --explain`)")
            fn(n)
        if not self.logits:
            raise ScheduleError("the graph has no LMHead; the megakernel needs one to produce tokens")

    def op_Positions(self, n: Node) -> None:
        self.views[id(n.output)] = Positions()

    def op_Embedding(self, n: Node) -> None:
        table, idx = n.inputs[0], n.inputs[1]
        tv = self._const(table, n)
        hidden = int(tv.shape[1])  # type: ignore[index, arg-type]
        tables = [(tv, idx)]
        out_v, scale = n.output, 1.0
        user = self.sole_user(out_v)
        if user is not None and user.op == "Mul":  # Gemma: embedding * sqrt(hidden)
            other = user.inputs[1] if user.inputs[0] is out_v else user.inputs[0]
            arr = other.const_array() if other is not None else None
            if arr is not None and arr.size == 1:
                scale = float(arr.reshape(-1)[0])
                self.skip.add(id(user))
                out_v = user.output
                user = self.sole_user(out_v)
        if user is not None and user.op == "Add":  # GPT-2: token + position embeddings
            other = user.inputs[1] if user.inputs[0] is out_v else user.inputs[0]
            pn = other.producer if other is not None else None
            if pn is not None and pn.op == "Embedding" and self.sole_user(other) is user:  # type: ignore[arg-type]
                tables.append((self._const(pn.inputs[0], pn), pn.inputs[1]))
                self.skip.update({id(pn), id(user)})
                out_v = user.output
        srcs = []
        for tab, ix in tables:
            if ix is not None and ix.producer is not None and ix.producer.op == "Positions":
                srcs.append(("pos", tab))
            elif ix is not None and ix.kind == "input":
                srcs.append(("tok", tab))
            else:
                raise ScheduleError(f"node '{n.name}' (Embedding): indices must be the token ids or "
                                    "the positions")
        tok = [t for s, t in srcs if s == "tok"]
        pos = [t for s, t in srcs if s == "pos"]
        if len(tok) != 1 or len(pos) > 1:
            raise ScheduleError(f"node '{n.name}' (Embedding): expected one token table and at most "
                                "one position table")
        if pos and int(pos[0].shape[0]) < self.max_seq:  # type: ignore[index, arg-type]
            raise ScheduleError(f"--max-seq {self.max_seq} exceeds the model's {int(pos[0].shape[0])} "  # type: ignore[index, arg-type]
                                f"learned positions (node '{n.name}'); compile with --max-seq "
                                f"{int(pos[0].shape[0])} or less")  # type: ignore[index, arg-type]
        # A norm right on the embeddings whose output is more than a projection's input (BLOOM's
        # word_embeddings_layernorm is also the first residual): the embed op applies it in place.
        norm = {5: NORM_NONE}
        eps = 0.0
        user = self.sole_user(out_v)
        if user is not None and user.op in ("LayerNorm", "RMSNorm") and any(
                u.op not in ("Linear", "LMHead", "GatedMLP", "MLP") for u in self.users.get(user.output, [])):
            kind = NORM_LAYER if user.op == "LayerNorm" else NORM_RMS
            norm = {5: kind, 6: self.p(user.inputs[1], user), 7: self.p(user.input(2), user)}
            eps = float(user.attrs.get("eps", 1e-5 if kind == NORM_LAYER else 1e-6))
            self.skip.add(id(user))
            out_v = user.output
        out = self.buffer("embed", hidden)
        d = self.desc("embed", {0: self.buffers[out.name].offset, 1: hidden, 2: hidden,
                                3: self.w(tok[0], n), 4: self.w(pos[0], n) if pos else -1, **norm},
                      {0: scale, 1: eps})
        self.add_op("embed", [Task(OP_EMBED, d, writes=[Region(out.name, 0, hidden)], label="embed")])
        self.views[id(out_v)] = out

    def op_RMSNorm(self, n: Node) -> None:
        self._norm(n, NORM_RMS, n.inputs[1], None)

    def op_LayerNorm(self, n: Node) -> None:
        self._norm(n, NORM_LAYER, n.inputs[1], n.input(2))

    def _norm(self, n: Node, kind: int, w: Value | None, b: Value | None) -> None:
        eps = float(n.attrs.get("eps", 1e-5 if kind == NORM_LAYER else 1e-6))
        x = self.view(n.inputs[0], n)
        if isinstance(x, Heads):  # per-head q/k norm (Qwen3, Gemma 3): applied as the heads are loaded
            if kind != NORM_RMS or b is not None or x.rope is not None or x.norm is not None:
                raise ScheduleError(f"node '{n.name}' ({n.op}): a norm of split heads fuses only as an "
                                    "RMSNorm before RoPE")
            self._gains(n, w, x.dim)
            self.views[id(n.output)] = Heads(x.buf, x.heads, x.dim, norm=QKNorm(self.p(w, n), eps, False))
            return
        src = self.buf(n.inputs[0], n)
        users, fused = self.users.get(n.output, []), ("Linear", "LMHead", "GatedMLP", "MLP", "MoE")
        qk = kind == NORM_RMS and b is None and all(u.op == "SplitHeads" for u in users)
        if users and not any(o is n.output for o in self.g.outputs) and (
                qk or all(u.op in fused and u.inputs[0] is n.output for u in users)):
            # fused into the tiles that read it (statistics recomputed per tile), or q/k norms over
            # the whole projection (OLMo 2), which SplitHeads turns into a QKNorm
            if qk:
                self._gains(n, w, src.cols)
            self.views[id(n.output)] = Norm(src, kind, self.p(w, n), self.p(b, n), eps)
            return
        self._row_norm(n, src, kind, w, b, eps)

    def _gains(self, n: Node, w: Value | None, size: int) -> None:
        wv = self._const(w, n)
        if int(wv.type.numel() or 0) != size:
            raise ScheduleError(f"node '{n.name}' ({n.op}): weight {wv.type} is not {size} gains")

    def _row_norm(self, n: Node, src: Buf, kind: int, w: Value | None, b: Value | None, eps: float) -> None:
        """A norm no Linear tile fuses (the post-norms of OLMo 2 and Gemma 2/3, `x + norm(proj)`): its
        statistics need whole rows, which a projection's column tiles lack, and the sum is the
        residual stream later adds read, so it is materialized: one op of whole rows (row blocks in
        prefill), the residual Add its epilogue. A level of its own; fused into its readers instead,
        every reader's tiles would recompute it and the next residual add still has no row to read."""
        self._gains(n, w, src.cols)
        if b is not None:
            self._gains(n, b, src.cols)
        res, defines = self.residual_target(n.output)
        out = self.buffer(n.name, src.cols)
        d = self.desc(n.name, {0: self.buffers[src.name].offset, 1: src.cols, 2: src.cols, 3: kind,
                               4: self.p(w, n), 5: self.p(b, n), 6: self.buffers[res.name].offset if res else -1,
                               7: res.cols if res else 0, 8: self.buffers[out.name].offset, 9: out.cols},
                      {0: eps})
        t = self.t

        def tasks(rows: int, block: int) -> list[Task]:
            return [Task(OP_ROW_NORM, d, lo, min(rows, lo + block),
                         reads=[Region(b.name, 0, b.cols, lo, min(rows, lo + block)) for b in (src, res) if b],
                         writes=[Region(out.name, 0, out.cols, lo, min(rows, lo + block))],
                         label=f"{n.name}[r{lo}:{min(rows, lo + block)}]") for lo in range(0, rows, block)]

        self.add_op(n.name, {"prefill": tasks(t.chunk, t.block_t), "decode": tasks(1, 1)})
        self.views[id(defines)] = out

    def op_Linear(self, n: Node) -> None:
        x = self.view(n.inputs[0], n)
        wv = self._const(n.inputs[1], n)
        res, defines = self.residual_target(n.output)
        out = self.linear_op(n, n.name, x, wv, int(wv.shape[0]), bias=n.input(2), residual=res)  # type: ignore[index, arg-type]
        self.views[id(defines)] = out

    def op_LMHead(self, n: Node) -> None:
        x = self.view(n.inputs[0], n)
        wv = self._const(n.inputs[1], n)
        self.vocab = int(wv.shape[0])  # type: ignore[index, arg-type]
        cap = float(n.attrs.get("softcap", 0.0) or 0.0)
        if cap < 0:
            raise ScheduleError(f"node '{n.name}' (LMHead): negative softcap {cap}")
        # softcap: the logits are cap * tanh(y / cap) (descriptor float 1), before the argmax partial
        out = self.linear_op(n, "lm_head", x, wv, self.vocab, bias=n.input(2), lm=True, softcap=cap)
        self.logits = out.name
        self.views[id(n.output)] = out
        self.add_op("argmax", [Task(OP_ARGMAX, self.desc("argmax", {
            0: self.buffers[self.lm_partials.name].offset, 1: self.lm_slots}),
            reads=[Region(self.lm_partials.name, 0, self.lm_slots)],
            writes=[Region("ctrl.out_token", 0, 1)], label="argmax")])

    def op_GatedMLP(self, n: Node) -> None:
        x = self.view(n.inputs[0], n)
        wg, wu, wd = (self._const(v, n) for v in n.inputs[1:4])
        inter = int(wg.shape[0])  # type: ignore[index, arg-type]
        h = self.linear_op(n, f"{n.name}.gate_up", x, wg, inter, w2=wu,
                           act=str(n.attrs.get("activation", "silu")))
        res, defines = self.residual_target(n.output)
        out = self.linear_op(n, f"{n.name}.down", h, wd, int(wd.shape[0]), residual=res)  # type: ignore[index, arg-type]
        if self.t.fuse_mlp_down:
            self.fuse_down(h, out, res, wd, None, n)
        self.views[id(defines)] = out

    def op_MoE(self, n: Node) -> None:
        """The router as a Linear into logits [T, E], then per expert e a gate/up Linear and a down
        Linear whose descriptors carry the routing (fields 16-21: logits offset, E, top_k, e,
        normalize, mode 1 gate / 2 down). Each task computes softmax and top-k of its row's logits;
        in a one-row step an expert that row does not select returns before it reads a weight (its
        down task passes the residual through), so decode reads the k selected experts' weights
        only. Several rows (prefill) run every expert on every row, and the down projection scales
        each row by its routing weight (0 where not selected). The downs chain through their
        residual inputs: out_e = out_{e-1} + w_e * down_e(h_e), out_{-1} the residual."""
        x = self.view(n.inputs[0], n)
        wr, wg, wu, wd = (self._const(v, n) for v in n.inputs[1:5])
        e_n, f, h = (int(d) for d in wg.shape)  # type: ignore[union-attr]
        if e_n > 256:
            raise ScheduleError(f"node '{n.name}' (MoE): {e_n} experts; the kernel's router takes at most 256")
        if f * h % 64:
            raise ScheduleError(f"node '{n.name}' (MoE): an expert's [{f}, {h}] matrices are not a multiple "
                                "of 64 elements (the kernel's weight alignment)")
        logits = self.linear_op(n, f"{n.name}.router", x, wr, e_n)
        off = self.buffers[logits.name].offset
        self.route_buf[off] = logits.name
        route = {16: off, 17: e_n, 18: int(n.attrs["top_k"]), 20: int(n.attrs.get("normalize", 1))}
        act = str(n.attrs.get("activation", "silu"))
        res, defines = self.residual_target(n.output)
        for e in range(e_n):
            he = self.linear_op(n, f"{n.name}.e{e}.gate_up", x, wg, f, w2=wu, act=act, expert=e,
                                route={**route, 19: e, 21: 1})
            res = self.linear_op(n, f"{n.name}.e{e}.down", he, wd, h, residual=res, expert=e,
                                 route={**route, 19: e, 21: 2})
        assert res is not None
        self.views[id(defines)] = res

    def op_MLP(self, n: Node) -> None:
        x = self.view(n.inputs[0], n)
        wu, wd = self._const(n.inputs[1], n), self._const(n.inputs[3], n)
        h = self.linear_op(n, f"{n.name}.up", x, wu, int(wu.shape[0]), bias=n.input(2),  # type: ignore[index, arg-type]
                           act=str(n.attrs.get("activation", "gelu")))
        res, defines = self.residual_target(n.output)
        out = self.linear_op(n, f"{n.name}.down", h, wd, int(wd.shape[0]),  # type: ignore[index, arg-type]
                             bias=n.input(4), residual=res)
        if self.t.fuse_mlp_down:
            self.fuse_down(h, out, res, wd, n.input(4), n)
        self.views[id(defines)] = out

    def op_SplitHeads(self, n: Node) -> None:
        x = self.view(n.inputs[0], n)
        norm = None
        if isinstance(x, Norm):  # q/k RMSNorm over the whole projection (OLMo 2), applied on load
            src = x.src
            norm = QKNorm(x.w, x.eps, True)
        else:
            src = self.buf(n.inputs[0], n)
        heads = int(n.attrs["heads"])
        if src.cols % heads:
            raise ScheduleError(f"node '{n.name}' (SplitHeads): {src.cols} columns into {heads} heads")
        self.views[id(n.output)] = Heads(src, heads, src.cols // heads, norm=norm)

    def op_RoPE(self, n: Node) -> None:
        x = self.view(n.inputs[0], n)
        if not isinstance(x, Heads) or x.rope is not None:
            raise ScheduleError(f"node '{n.name}' (RoPE): input must be freshly split heads")
        pos = n.input(3)
        if pos is None or not isinstance(self.views.get(id(pos)), Positions):
            raise ScheduleError(f"node '{n.name}' (RoPE): positions must be past_len + row")
        cos, sin = self._const(n.inputs[1], n), self._const(n.inputs[2], n)
        rows, half = (int(d) for d in cos.shape)  # type: ignore[union-attr, arg-type]
        if rows < self.max_seq:
            raise ScheduleError(f"node '{n.name}' (RoPE): the rotary table has {rows} positions, "
                                f"fewer than max_seq={self.max_seq}")
        if 2 * half > x.dim:
            raise ScheduleError(f"node '{n.name}' (RoPE): rotary width {2 * half} > head size {x.dim}")
        kind = ROPE_INTERLEAVED if n.attrs.get("interleaved", 0) else ROPE_HALF
        self.views[id(n.output)] = Heads(x.buf, x.heads, x.dim,
                                         Rope(kind, self.p(cos, n), self.p(sin, n), half, 2 * half, rows), x.norm)

    def op_Attention(self, n: Node) -> None:
        q, k, v = (self.view(x, n) for x in n.inputs[:3])
        if not (isinstance(q, Heads) and isinstance(k, Heads) and isinstance(v, Heads)):
            raise ScheduleError(f"node '{n.name}' (Attention): q, k, v must be split heads of projections")
        if n.input(4) is None or n.input(5) is None:
            raise ScheduleError(f"node '{n.name}' (Attention): no KV cache; compile with the KV-cache stage")
        if not n.attrs.get("causal", 1):
            raise ScheduleError(f"node '{n.name}' (Attention): only causal attention is supported")
        if v.rope is not None or v.norm is not None or q.dim != k.dim or k.dim != v.dim or k.heads != v.heads or q.heads % k.heads:
            raise ScheduleError(f"node '{n.name}' (Attention): unsupported head layout q{q.heads}x{q.dim} "
                                f"k{k.heads}x{k.dim} v{v.heads}x{v.dim}")
        if (q.rope is None) != (k.rope is None):
            raise ScheduleError(f"node '{n.name}' (Attention): RoPE on only one of q and k")
        layer = self.n_layers
        self.n_layers += 1
        D, hq, hkv = q.dim, q.heads, k.heads
        self.head_dim = max(self.head_dim, D)
        rope = q.rope or Rope(ROPE_NONE, -1, -1, 1, 0, 0)
        ck = self.buffer(f"cache.{layer}.key", D, rows=hkv * self.max_seq)
        cv = self.buffer(f"cache.{layer}.value", D, rows=hkv * self.max_seq)
        kr = k.rope or rope
        qn, kn = q.norm, k.norm
        if qn and kn and qn.eps != kn.eps:
            raise ScheduleError(f"node '{n.name}' (Attention): q and k norms with different eps ({qn.eps}, "
                                f"{kn.eps}); the kernel's descriptor holds one")
        qk_eps = qn.eps if qn else kn.eps if kn else 0.0
        t = self.t
        fused = t.fuse_kv_append
        if fused and k.rope is not None and q.rope is not None and k.rope != q.rope:
            raise ScheduleError(f"node '{n.name}' (Attention): q and k rotate differently; the fused "
                                "attention rotates the step's keys with q's tables")
        # Prefill always appends the chunk's k/v first (a level per layer weighs little beside the
        # chunk's matrix products); decode with fuse_kv_append has attention do it (one level less).
        d_app = self.desc(f"{n.name}.cache_append", {
            0: self.buffers[k.buf.name].offset, 1: k.buf.cols, 2: self.buffers[v.buf.name].offset,
            3: v.buf.cols, 4: self.buffers[ck.name].offset, 5: self.buffers[cv.name].offset, 6: D,
            7: kr.kind, 8: kr.cos, 9: kr.sin, 10: kr.half, 11: kr.rot, 12: self.max_seq * D,
            # k's q/k norm (21 gains or -1, 23 bit 0: over the whole projection row; eps in float 3)
            21: kn.w if kn else -1, 23: int(bool(kn and kn.whole))}, {3: kn.eps if kn else 0.0})

        appends_op = [Task(OP_CACHE_APPEND, d_app, h, reads=[_head_cols(k, h), Region(v.buf.name, h * D, (h + 1) * D)],
                           writes=[Region(ck.name, h, h + 1), Region(cv.name, h, h + 1)],
                           label=f"{n.name}.cache_append[h{h}]") for h in range(hkv)]
        self.add_op(f"{n.name}.cache_append",
                    {"prefill": appends_op, "decode": [] if fused else copy.deepcopy(appends_op)})
        out = self.buffer(n.name, hq * D)
        scale = n.attrs.get("scale") or 1.0 / math.sqrt(D)
        window = int(n.attrs.get("window", 0) or 0)
        if window < 0:
            raise ScheduleError(f"node '{n.name}' (Attention): negative window {window}")
        slopes = [float(x) for x in n.attrs.get("alibi") or []]
        if slopes and len(slopes) != hq:
            raise ScheduleError(f"node '{n.name}' (Attention): {len(slopes)} ALiBi slopes for {hq} heads")

        def attn_desc(mode: str, partial: int, split_len: int) -> list[int]:
            """The descriptor of each head: one shared, or one per head with its ALiBi slope."""
            return [one_desc(mode, partial, split_len, sl) for sl in slopes] or \
                [one_desc(mode, partial, split_len, 0.0)] * hq

        def one_desc(mode: str, partial: int, split_len: int, slope: float) -> int:
            floats = {0: float(scale), 1: float(n.attrs.get("softcap", 0.0) or 0.0), 2: slope, 3: qk_eps}
            return self.desc(f"{n.name}.attention.{mode}", {
                0: self.buffers[q.buf.name].offset, 1: q.buf.cols, 2: self.buffers[ck.name].offset,
                3: self.buffers[cv.name].offset, 4: self.buffers[out.name].offset, 5: out.cols, 6: D,
                7: rope.kind, 8: rope.cos, 9: rope.sin, 10: rope.half, 11: rope.rot,
                12: self.max_seq * D, 13: hq // hkv, 14: partial, 15: split_len,
                # fused append: the step's keys and values, read from the projections (k rotated
                # on load); the first q head of each KV group writes them into the cache
                16: self.buffers[k.buf.name].offset if fused and mode == "decode" else -1, 17: k.buf.cols,
                18: self.buffers[v.buf.name].offset if fused and mode == "decode" else -1, 19: v.buf.cols,
                # a causal sliding window (0: none): the query at p attends over keys p-window+1..p
                20: window,
                # q/k norms applied on load (21 q's gains, 22 k's for the fused append, -1 none;
                # 23 bit 0 / bit 1: q / k normed over the whole projection row; their eps in float 3)
                21: qn.w if qn else -1, 22: kn.w if kn else -1,
                23: int(bool(qn and qn.whole)) | 2 * int(bool(kn and kn.whole))}, floats)

        def reads(h: int, mode: str = "decode") -> list[Region]:
            g = h // (hq // hkv)
            if fused and mode == "decode":  # the cache's earlier rows (no writer in this launch), this step's k, v
                return [_head_cols(q, h), Region(ck.name, g, g + 1), Region(cv.name, g, g + 1), _head_cols(k, g),
                        Region(v.buf.name, g * D, (g + 1) * D)]
            return [_head_cols(q, h), Region(ck.name, g, g + 1), Region(cv.name, g, g + 1)]

        def appends(h: int, owner: bool) -> list[Region]:
            """The cache rows of this step, which the group's first head writes (nobody in this
            launch reads them: a separate region, so the earlier rows' readers do not wait)."""
            g = h // (hq // hkv)
            if not (fused and owner and h % (hq // hkv) == 0):
                return []  # (prefill: the cache_append op writes them)
            return [Region(ck.name + ":step", g, g + 1), Region(cv.name + ":step", g, g + 1)]

        d_pre = attn_desc("prefill", -1, self.max_seq)
        nqb = -(-t.chunk // t.block_t)
        prefill = [Task(OP_ATTENTION, d_pre[h], h, qb, 0, reads=reads(h, "prefill"),
                        writes=[Region(out.name, h * D, (h + 1) * D, qb * t.block_t, (qb + 1) * t.block_t)],
                        label=f"{n.name}.attention[h{h},q{qb}]")
                   for h in range(hq) for qb in range(nqb)]
        S = t.kv_splits
        if S <= 1:
            d_dec = attn_desc("decode", -1, self.max_seq)
            decode = [Task(OP_ATTENTION, d_dec[h], h, 0, 0, reads=reads(h),
                           writes=[Region(out.name, h * D, (h + 1) * D), *appends(h, True)],
                           label=f"{n.name}.attention[h{h}]") for h in range(hq)]
            self.add_op(f"{n.name}.attention", {"prefill": prefill, "decode": decode})
        else:
            split_len = -(-self.max_seq // S)
            split_len += (-split_len) % t.block_kv
            part = self.buffer(f"{n.name}.partials", hq * S * (D + 2), rows=1)
            d_dec = attn_desc("decode", self.buffers[part.name].offset, split_len)
            # the split holding this step's key appends it (which split that is depends on past:
            # every split of the group's first head may, so each declares the write; the kernel
            # writes from the one whose range holds `past`)
            decode = [Task(OP_ATTENTION, d_dec[h], h, 0, s, reads=reads(h),
                           writes=[Region(part.name, h * S + s, h * S + s + 1),
                                   *[Region(r.buffer, r.lo, r.hi, s, s + 1) for r in appends(h, True)]],
                           label=f"{n.name}.attention[h{h},s{s}]") for h in range(hq) for s in range(S)]
            self.add_op(f"{n.name}.attention", {"prefill": prefill, "decode": decode})
            if t.fuse_combine:
                self.views[id(n.output)] = AttnOut(out, part, S, D)
                return
            d_comb = self.desc(f"{n.name}.combine", {0: self.buffers[part.name].offset,
                                                     1: self.buffers[out.name].offset, 2: out.cols, 3: D, 4: S})
            self.add_op(f"{n.name}.combine", {"prefill": [], "decode": [
                Task(OP_ATTN_COMBINE, d_comb, h, reads=[Region(part.name, h * S, (h + 1) * S)],
                     writes=[Region(out.name, h * D, (h + 1) * D)], label=f"{n.name}.combine[h{h}]")
                for h in range(hq)]})
        self.views[id(n.output)] = AttnOut(out)

    def op_MergeHeads(self, n: Node) -> None:
        x = self.view(n.inputs[0], n)
        if not isinstance(x, AttnOut):
            raise ScheduleError(f"node '{n.name}' (MergeHeads): input must be an attention output")
        # with merged partials the view stays an AttnOut: only a Linear can merge them on load
        self.views[id(n.output)] = x if x.partials is not None else x.buf
