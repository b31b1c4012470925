"""The MLPs' lowering: GatedMLP as gate*up (activation in the epilogue) then down + residual, MLP
as up then down, MoE as the router then those two per expert, routed; and the MLP split-K fusion
(Tiling.fuse_mlp_down, decode only), which folds the down projection into the gate/up tasks."""

from __future__ import annotations

from zlc.abi import LinearDesc
from zlc.ir import Node, Value

from .program import Region
from .tasks_core import Buf, Op, ScheduleError, TaskBuilderCore


class MlpTasks(TaskBuilderCore):
    """op_GatedMLP, op_MoE, op_MLP of the task builder and the split-K fusion they use."""

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
        Linear whose descriptors carry the routing (LinearDesc's route fields: logits offset, E,
        top_k, e, normalize, mode 1 gate / 2 down). Each task computes softmax and top-k of its
        row's logits; in a one-row step an expert that row does not select returns before it reads
        a weight (its down task passes the residual through), so decode reads the k selected
        experts' weights only. Several rows (prefill) run every expert on every row, and the down projection scales
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
        route = dict(route_logits=off, route_experts=e_n, route_top_k=int(n.attrs["top_k"]),
                     route_normalize=int(n.attrs.get("normalize", 1)))
        act = str(n.attrs.get("activation", "silu"))
        res, defines = self.residual_target(n.output)
        for e in range(e_n):
            he = self.linear_op(n, f"{n.name}.e{e}.gate_up", x, wg, f, w2=wu, act=act, expert=e,
                                route={**route, "route_expert": e, "route": 1})
            res = self.linear_op(n, f"{n.name}.e{e}.down", he, wd, h, residual=res, expert=e,
                                 route={**route, "route_expert": e, "route": 2})
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

    def _redesc(self, op: Op, suffix: str, **fields: int) -> None:
        """Gives op's decode tasks their own descriptors: copies of theirs with these LinearDesc
        fields set."""
        lay, made = self.layout, {}
        ints, _ = LinearDesc.row(**fields)
        for t in op.tasks["decode"]:
            if t.desc not in made:
                old = dict(enumerate(lay.di[t.desc]))
                made[t.desc] = lay.desc(lay.desc_labels[t.desc] + suffix, {**old, **ints}, dict(enumerate(lay.df[t.desc])))
            t.desc = made[t.desc]

    def fuse_down(self, h: Buf, out: Buf, res: Buf | None, wd: Value, bias: Value | None, node: Node) -> None:
        """MLP split-K (Tiling.fuse_mlp_down, decode only): the tasks computing h's columns [lo, hi)
        also multiply them by the down matrix's columns Wd[:, lo:hi] and add the partial product
        into the MLP output `out` with float atomics (LinearDesc's down_w, down_out, down_bias
        added by the task holding column 0, and down_rows, out's columns: 0 when nothing is fused).
        The accumulator starts as the residual: the Linear that produces the residual also stores
        its decode output into `out` (copy_off, copy = 1), so there is no zeroing pass and no extra
        level. The down op keeps its prefill tasks and loses its decode ones. Left unfused (the
        down keeps its decode tasks): no residual, a residual no Linear produces (an embedding, a
        post-norm), one whose producer already feeds another accumulator, and packed weights in any of
        the three (the packed body has no split-K down: the down keeps its own tasks)."""
        prod, up, down = self.linear_ops.get(res.name) if res else None, self.linear_ops[h.name], self.linear_ops[out.name]
        lay = self.layout
        if (res is None or prod is None or not prod.tasks["decode"] or not up.tasks["decode"]
                or any(lay.di[t.desc][LinearDesc.copy] or lay.di[t.desc][LinearDesc.route]
                       for t in prod.tasks["decode"] + up.tasks["decode"])
                or any(len(t.writes) != 1 for t in prod.tasks["decode"])
                or any(lay.di[t.desc][LinearDesc.w_format] for t in prod.tasks["decode"] + up.tasks["decode"])
                or wd.quant is not None):
            return
        self._redesc(prod, ".init", copy_off=self.buffers[out.name].offset, copy=1)
        for t in prod.tasks["decode"]:
            t.writes.append(Region(out.name, t.writes[0].lo, t.writes[0].hi))
        self._redesc(up, ".down", down_w=self.w(wd, node), down_out=self.buffers[out.name].offset,
                     down_bias=self.p(bias, node), down_rows=out.cols)
        for t in up.tasks["decode"]:
            t.writes.append(Region(out.name, 0, out.cols, accumulate=True))
        down.tasks["decode"] = []

