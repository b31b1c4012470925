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

The builder is split by op family: tasks_core.py holds what every op shares (the views, the
arenas, the Linear op and the residual epilogue), tasks_attention.py the heads and attention,
tasks_mlp.py the MLPs, MoE and the MLP split-K fusion; `TaskBuilder` here joins them with the walk
over the graph (`run`) and the row ops (embedding, norms, Linear, LM head).
"""

from __future__ import annotations

from zlc.abi import ArgmaxDesc, EmbedDesc, RowNormDesc
from zlc.bundle import OP_ARGMAX, OP_EMBED, OP_ROW_NORM
from zlc.ir import Node, Value

from .program import NORM_LAYER, NORM_NONE, NORM_RMS, Region, Task
from .tasks_attention import AttentionTasks
from .tasks_core import Buf, Heads, Norm, Op, Positions, QKNorm, ScheduleError
from .tasks_mlp import MlpTasks

__all__ = ["Op", "ScheduleError", "TaskBuilder"]


class TaskBuilder(AttentionTasks, MlpTasks):
    """Walks the raised decode graph once, lowering each node to fused ops (`run`); the result is
    `ops` (tasks per mode, events not yet assigned), `layout` and the model facts the program
    records (head_dim, vocab, the logits buffer)."""

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
        norm: dict[str, int] = {"norm": NORM_NONE}
        eps = 0.0
        user = self.sole_user(out_v)
        if user is not None and user.op in ("LayerNorm", "RMSNorm") and any(
                u.op not in ("Linear", "LMHead", "GatedMLP", "MLP") for u in self.users.get(user.output, [])):
            kind = NORM_LAYER if user.op == "LayerNorm" else NORM_RMS
            norm = {"norm": kind, "norm_w": self.p(user.inputs[1], user), "norm_b": self.p(user.input(2), user)}
            eps = float(user.attrs.get("eps", 1e-5 if kind == NORM_LAYER else 1e-6))
            self.skip.add(id(user))
            out_v = user.output
        out = self.buffer("embed", hidden)
        fmt = tok[0].quant.format.code if tok[0].quant is not None else 0  # a packed token table (GGUF)
        d = self.desc("embed", EmbedDesc, out_off=self.buffers[out.name].offset, out_stride=hidden, hidden=hidden,
                      table=self.w(tok[0], n, packed_ok=True), pos_table=self.w(pos[0], n) if pos else -1, **norm,
                      scale=scale, eps=eps, table_format=fmt, vocab=int(tok[0].shape[0]))  # type: ignore[index, arg-type]
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
        d = self.desc(n.name, RowNormDesc, x_off=self.buffers[src.name].offset, x_stride=src.cols, k=src.cols,
                      norm=kind, norm_w=self.p(w, n), norm_b=self.p(b, n),
                      res_off=self.buffers[res.name].offset if res else -1, res_stride=res.cols if res else 0,
                      out_off=self.buffers[out.name].offset, out_stride=out.cols, eps=eps)
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
        # softcap: the logits are cap * tanh(y / cap) (LinearDesc.softcap), before the argmax partial
        out = self.linear_op(n, "lm_head", x, wv, self.vocab, bias=n.input(2), lm=True, softcap=cap)
        self.logits = out.name
        self.views[id(n.output)] = out
        self.add_op("argmax", [Task(OP_ARGMAX, self.desc(
            "argmax", ArgmaxDesc, partials=self.buffers[self.lm_partials.name].offset, slots=self.lm_slots),
            reads=[Region(self.lm_partials.name, 0, self.lm_slots)],
            writes=[Region("ctrl.out_token", 0, 1)], label="argmax")])
