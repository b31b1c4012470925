"""What every part of the task builder shares: how IR values live in memory (the views a producer
leaves for its consumers: a buffer, a norm to fuse, split heads with their RoPE and q/k norm, an
attention output or its split-KV partials), the fused op record, and `TaskBuilderCore`: the
builder's state (graph, tiling, views, `pack.Layout`), its arena and view helpers, and the Linear
op (tiles of columns with a fused norm, bias, activation, residual epilogue, LM-head partials)
that the row ops, the MLPs and the attention's projections all lower to. The op families build on
it (tasks_attention.py, tasks_mlp.py); tasks.TaskBuilder puts them together."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from zlc.abi import Desc, LinearDesc
from zlc.bundle import OP_LINEAR
from zlc.errors import ZlcError
from zlc.ir import Graph, Node, Value

from .pack import Layout
from .program import ACTIVATIONS, NORM_COMBINE, NORM_NONE, Buffer, Region, Task, Tiling


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


@dataclass
class Op:
    """One fused op instance: its tasks per mode (decode and prefill may tile differently)."""

    label: str
    tasks: dict[str, list[Task]] = field(default_factory=dict)


# ---- the builder's core ---------------------------------------------------------------------

class TaskBuilderCore:
    """The state of one walk over the raised decode graph and the helpers every op's lowering uses:
    arenas (buffers, constants, descriptors), the views of values, and the ops it emits (`ops`:
    tasks per mode, events not yet assigned)."""

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

    def w(self, v: Value | None, node: Node, *, packed_ok: bool = False) -> int:
        """W offset of a matrix; a packed one (its Q byte offset) only where the reader streams its
        blocks (`packed_ok`: a Linear's own w/w2)."""
        c = self._const(v, node)
        if c.quant is not None and not packed_ok:
            raise ScheduleError(f"node '{node.name}' ({node.op}) reads the {c.quant.format.name} weight %{c.name} "
                                "where the kernels only read dense weights")
        return self.layout.place(c, "W")

    def p(self, v: Value | None, node: Node) -> int:
        return -1 if v is None else self.layout.place(self._const(v, node), "P")

    def _const(self, v: Value | None, node: Node) -> Value:
        if v is None or v.kind != "const":
            raise ScheduleError(f"node '{node.name}' ({node.op}): expected a constant weight, got "
                                f"{'nothing' if v is None else v.kind + ' %' + v.name}")
        return v

    def desc(self, label: str, schema: type[Desc], **fields: float) -> int:
        """A descriptor row of op `schema` with these fields (descriptors.py), the rest zero."""
        return self.layout.desc(label, *schema.row(**fields))


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
                  softcap: float = 0.0, expert: int | None = None, route: dict[str, int] | None = None) -> Buf:
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
        w_format = 0 if wv.quant is None else wv.quant.format.code
        w2v = None if w2 is None else self._const(w2, node)
        if w2v is not None and (0 if w2v.quant is None else w2v.quant.format.code) != w_format:
            raise ScheduleError(f"node '{node.name}' ({node.op}): the gated pair's matrices %{wv.name} and "
                                f"%{w2v.name} are stored in different formats (one descriptor word holds both)")
        if w_format and expert is not None:
            raise ScheduleError(f"node '{node.name}' ({node.op}): a packed weight in a MoE expert is not streamed "
                                "by the kernels yet")
        if act not in ACTIVATIONS:
            raise ScheduleError(f"node '{node.name}' ({node.op}): activation '{act}' has no kernel")
        if out is None:
            out = self.buffer(label, n)
        t = self.t
        bn = t.lm_block_n if lm and t.lm_block_n else t.block_n
        nblocks = -(-n // bn)
        per = 1 if not t.max_linear_tasks else -(-nblocks // t.max_linear_tasks)
        ranges = [(b * bn, min(n, (b + per) * bn)) for b in range(0, nblocks, per)]
        partials = self.buffer("lm.partials", 2 * len(ranges), rows=1) if lm else None
        common = dict(
            x_stride=src.cols, k=src.cols, n=n, w=self.w(wv, node, packed_ok=True) + at,
            w2=self.w(w2, node, packed_ok=True) + at if w2 is not None else -1, bias=self.p(bias, node),
            res_off=self.buffers[residual.name].offset if residual else -1,
            out_off=self.buffers[out.name].offset, out_stride=out.cols, act=ACTIVATIONS[act], lm=int(lm),
            lm_partials=self.buffers[partials.name].offset if partials else -1, eps=eps, softcap=softcap,
            **({"w_format": w_format} if w_format else {}))
        d = self.desc(label, LinearDesc, x_off=self.buffers[src.name].offset, norm=nk, norm_w=nw, norm_b=nb,
                      **common, **(route or {}))
        routed = [Region(self.route_buf[route["route_logits"]], 0, route["route_experts"])] if route else []
        # Decode after split-KV attention with fuse_combine: the row is merged from the attention
        # partials as it is loaded (NORM_COMBINE: x_off is the partials), so no combine op stands
        # between attention and this projection.
        merged = isinstance(x, AttnOut) and x.partials is not None
        if merged:
            assert isinstance(x, AttnOut) and x.partials is not None
            d_dec = self.desc(label + ".merged", LinearDesc, x_off=self.buffers[x.partials.name].offset,
                              norm=NORM_COMBINE, merge_splits=x.splits, merge_head_dim=x.head_dim, **common)

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

