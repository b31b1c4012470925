"""Attention's lowering: SplitHeads and RoPE as views of a projection (RoPE and q/k norms applied
where the heads are loaded), the cache append (prefill; decode too unless attention appends the
step's k/v itself, Tiling.fuse_kv_append), the attention tasks per head and query block (prefill)
or per head and KV split (decode), their descriptors (RoPE tables, sliding window, soft-cap,
ALiBi slopes, q/k norms), the split-KV combine unless the o projection merges the partials as it
loads them (Tiling.fuse_combine), and MergeHeads."""

from __future__ import annotations

import copy
import math

from zlc.abi import AttentionDesc, CacheAppendDesc, CombineDesc
from zlc.bundle import OP_ATTENTION, OP_ATTN_COMBINE, OP_CACHE_APPEND
from zlc.ir import Node

from .program import ROPE_HALF, ROPE_INTERLEAVED, ROPE_NONE, Region, Task
from .tasks_core import AttnOut, Heads, Norm, Positions, QKNorm, Rope, ScheduleError, TaskBuilderCore


def _head_cols(x: Heads, h: int) -> Region:
    """What loading head h reads of its projection: its columns, or the row for a whole-row norm."""
    whole = x.norm is not None and x.norm.whole
    return Region(x.buf.name, 0 if whole else h * x.dim, x.buf.cols if whole else (h + 1) * x.dim)


class AttentionTasks(TaskBuilderCore):
    """op_SplitHeads, op_RoPE, op_Attention, op_MergeHeads of the task builder."""

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
        d_app = self.desc(
            f"{n.name}.cache_append", CacheAppendDesc, k_off=self.buffers[k.buf.name].offset, k_stride=k.buf.cols,
            v_off=self.buffers[v.buf.name].offset, v_stride=v.buf.cols, k_cache=self.buffers[ck.name].offset,
            v_cache=self.buffers[cv.name].offset, head_dim=D, rope=kr.kind, rope_cos=kr.cos, rope_sin=kr.sin,
            rope_half=kr.half, rope_rot=kr.rot, head_stride=self.max_seq * D,
            k_norm_w=kn.w if kn else -1, qk_norm_whole=int(bool(kn and kn.whole)), qk_eps=kn.eps if kn else 0.0)

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
            return self.desc(
                f"{n.name}.attention.{mode}", AttentionDesc, q_off=self.buffers[q.buf.name].offset,
                q_stride=q.buf.cols, k_cache=self.buffers[ck.name].offset, v_cache=self.buffers[cv.name].offset,
                out_off=self.buffers[out.name].offset, out_stride=out.cols, head_dim=D, rope=rope.kind,
                rope_cos=rope.cos, rope_sin=rope.sin, rope_half=rope.half, rope_rot=rope.rot,
                head_stride=self.max_seq * D, group=hq // hkv, partials=partial, split_len=split_len,
                # fused append: the step's keys and values, read from the projections (k rotated
                # on load); the first q head of each KV group writes them into the cache
                k_new=self.buffers[k.buf.name].offset if fused and mode == "decode" else -1,
                k_new_stride=k.buf.cols,
                v_new=self.buffers[v.buf.name].offset if fused and mode == "decode" else -1,
                v_new_stride=v.buf.cols,
                # a causal sliding window (0: none): the query at p attends over keys p-window+1..p
                window=window,
                # q/k norms applied on load (q's gains, k's for the fused append, -1 none; whether
                # each is over the whole projection row)
                q_norm_w=qn.w if qn else -1, k_norm_w=kn.w if kn else -1,
                qk_norm_whole=int(bool(qn and qn.whole)) | 2 * int(bool(kn and kn.whole)),
                scale=float(scale), softcap=float(n.attrs.get("softcap", 0.0) or 0.0), alibi=slope, qk_eps=qk_eps)

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
            d_comb = self.desc(f"{n.name}.combine", CombineDesc, partials=self.buffers[part.name].offset,
                               out_off=self.buffers[out.name].offset, out_stride=out.cols, head_dim=D, splits=S)
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
