"""The plan of the decode matrix-vector bodies: one `GemvBody` per row shape (K, norm, gate, fused
down, LM-head width) the programs' decode Linear tasks have, with its chunks of K, how many are in
flight, where a fused down's chunks are requested, and the literals every task of the shape shares.
gemv_source.py writes each body's source from its plan; emit.py renders the kernel around them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zlc import bundle as fmt
from zlc.abi import LinearDesc

from . import program as pg
from .program import Program

# Weight bytes one program keeps in flight in a matrix-vector product. Little's law on an H200:
# ~4.3 TB/s x ~0.7 us over 132 SMs is ~22 KB per SM; the A10 (0.6 TB/s, 72 SMs) needs less.
PREFETCH_BYTES = 32 * 1024
# Columns per unrolled chunk (a power of two: tl.arange). Under 256 (the program's threads), the
# row's chunk is cheap for Triton to load again in the weights' layout, where the product's sum over
# the chunk stays inside each warp; at 256 it was loaded once and moved there through shared memory,
# two BAR.SYNC per chunk (the latency model, Llama-1B shape on h200: 753.6 us a token at 256,
# 717.9 at 128). The same 32 KB stay in flight: 4 chunks ahead of one matrix, 2 of a gated pair.
MAX_CHUNK = 128
# A row merged from split-KV partials (norm 3) loads each split's (max, sum, acc) per column. A
# chunk under 256 columns keeps the row in the weights' layout (8 columns a thread at 128: 3
# loads of them per split); from 256 it is merged a column a thread and then moved across the warps
# (two BAR.SYNC per chunk). Priced by the latency model on h200: at 2 splits (the Llama-1B shape)
# 128 columns are 20 us a token faster, at 8 (SmolLM2) 256 are 18 us faster.
MERGED_NARROW_SPLITS = 2
# A fused MLP down (split-K) streams Wd[:, n0:n1] in chunks of at most this many rows ([rows,
# BLOCK_N] tiles: 16 KB of bf16 at BLOCK_N 32), continuing the gate/up weight stream. Each tile's
# partial sums are one atomic add, whose values (replicated across the lanes that summed them)
# Triton first moves through shared memory, two BAR.SYNC: 256 rows halve those of 128 (the
# latency model, Llama-1B shape on h200: 726.8 us a token at 128, 717.9 at 256).
DOWN_MAX_ROWS = 256


@dataclass(frozen=True)
class Chunk:
    """Columns [lo, lo + size) of a row, and the weights that merge its statistics into the running
    ones (Chan et al.: the mean moves by size / n, M2 gains delta^2 * prev * size / n)."""

    i: int
    lo: int
    size: int

    @property
    def mean_w(self) -> float:
        return self.size / (self.lo + self.size)

    @property
    def m2_w(self) -> float:
        return self.lo * self.size / (self.lo + self.size)


@dataclass(frozen=True)
class GemvBody:
    """A matrix-vector body specialized for one row length K, norm kind (0 none, 1 RMS, 2 Layer,
    with or without a LayerNorm bias) and gate (one matrix or two)."""

    k: int
    norm: int
    ln_bias: bool
    gated: bool
    chunks: tuple[Chunk, ...]
    depth: int  # chunks in flight per stream
    block_n: int
    item: int  # bytes per weight
    head_d: int = 0  # norm 3 (merged from split-KV partials): the attention's head size, a literal in the body
    down: int = 0  # a fused MLP down's rows (its output columns; 0: none)
    down_ld: int = 0  # its matrix's row length (the gate/up's N), a literal in the body
    down_chunks: tuple[Chunk, ...] = ()
    # the prologue, then per stream position (the gate/up chunks, then the down chunks): the down
    # chunks requested there, keeping ~prefetch_bytes in flight once the gate/up stream ends
    down_issue: tuple[tuple[int, ...], ...] = ()
    # the BLOCK_N of the tilings whose decode rows ask for this body, where not every tiling's do:
    # a cubin built for the other tilings compiles the body out (the interpreter tiling's bodies
    # were registers, instructions and spills in every GPU kernel that never ran them)
    for_block_n: tuple[int, ...] = ()
    # the activation and LM-head flag (LinearDesc.act, .lm) where every task of the shape has
    # the same (-1: read at run time): literals compile out the branches not taken and free the
    # registers that held them (the Llama-1B shape's sm_90 decode kernel spilled 4 B without)
    act: int = -1
    lm: int = -1
    copy: int = -1  # LinearDesc.copy likewise (1: the output also initializes a fused MLP down's accumulator)
    # the LM head's own block of columns (Tiling.lm_block_n) where wider than BLOCK_N: the body is
    # called with it as its BLOCK_N, so the same code streams block_n (= wide) columns per task
    wide: int = 0

    @property
    def chunk_sizes(self) -> list[int]:
        """The distinct chunk sizes, in order (RMSNorm keeps one vector of squares per size)."""
        return list(dict.fromkeys(c.size for c in self.chunks))

    @property
    def block_n_guard(self) -> str:
        """The dispatch's constexpr term selecting the tilings that use the body ('' : all of them)."""
        return " | ".join(f"(BLOCK_N == {b})" for b in self.for_block_n)

    @property
    def name(self) -> str:
        return (f"_gemv_k{self.k}" + ("", "_rms", "_ln", "_merged")[self.norm] + ("b" if self.ln_bias else "")
                + (f"_d{self.head_d}" if self.norm == 3 else "") + ("_gated" if self.gated else "")
                + (f"_down{self.down}x{self.down_ld}" if self.down else "") + (f"_lm{self.wide}" if self.wide else ""))

    @property
    def down_depth(self) -> int:
        return max((len(x) for x in self.down_issue[:len(self.chunks) + 1]), default=0)

    @property
    def down_distinct_sizes(self) -> list[int]:
        return sorted({c.size for c in self.down_chunks})

    @property
    def distinct_sizes(self) -> list[int]:
        return sorted({c.size for c in self.chunks})

    @property
    def inflight_kb(self) -> float:
        return round(sum(c.size for c in self.chunks[:self.depth]) * self.block_n * self.item
                     * (2 if self.gated else 1) / 1024, 1)


def chunk_plan(k: int, max_chunk: int = MAX_CHUNK) -> tuple[Chunk, ...] | None:
    """K split greedily into power-of-two chunks of at most `max_chunk` columns (576 = 4 x 128 +
    64); None when a piece would be under 32 columns (the masked generic body does those)."""
    out: list[Chunk] = []
    lo = 0
    while lo < k:
        size = min(max_chunk, 1 << ((k - lo).bit_length() - 1))
        if size < 32:
            return None
        out.append(Chunk(len(out), lo, size))
        lo += size
    return tuple(out)


def gemv_bodies(programs: Sequence[Program], weight_dtype: str, block_n: int, max_chunk: int = MAX_CHUNK,
                prefetch_bytes: int = PREFETCH_BYTES, max_down_rows: int = DOWN_MAX_ROWS) -> list[GemvBody]:
    """One body per (K, norm, gate) of the programs' decode Linear tasks whose K splits into chunks (see
    chunk_plan; the rest use the masked generic body). `block_n` is the GPU tiling's block of
    columns; `max_chunk` caps a chunk, `max_down_rows` a fused down's chunk and `prefetch_bytes`
    the weights in flight (tests lower them, so tiny models unroll into many chunks prefetched a
    few ahead)."""
    item = 2 if weight_dtype == "bf16" else 4
    shapes: dict[tuple[int, ...], set[int]] = {}  # shape -> the block_n of the tilings asking for it
    flags: dict[tuple[int, ...], set[tuple[int, int, int]]] = {}  # shape -> its tasks' (activation, LM head, copy)
    for p in programs:
        # decode's rows only: the prefill kernel takes the generic body (SPECIALIZED False), so a
        # body only prefill's descriptors ask for (the MLP down, once fused into gate/up in decode)
        # would be registers and instructions the decode kernel never runs
        for t in p.tables.get("decode", []):
            if t.op == fmt.OP_LINEAR:
                di, L = p.desc_int[t.desc], LinearDesc
                norm = int(di[L.norm])
                down = int(di[L.down_rows]) if int(di[L.route]) == 0 else 0  # a fused down
                lm_wide = int(di[L.lm]) != 0 and t.b - t.a > p.tiling.block_n  # an LM-head task of lm_block_n
                wide = p.tiling.lm_block_n if lm_wide and p.tiling.lm_block_n else 0
                shape = (int(di[L.k]), norm, int(norm == pg.NORM_LAYER and int(di[L.norm_b]) >= 0),
                         int(int(di[L.w2]) >= 0), int(di[L.merge_head_dim]) if norm == pg.NORM_COMBINE else 0,
                         down, int(di[L.n]) if down else 0, wide)
                shapes.setdefault(shape, set()).add(p.tiling.block_n)
                flags.setdefault(shape, set()).add((int(di[L.act]), int(di[L.lm] != 0), int(di[L.copy])))
    every = {p.tiling.block_n for p in programs}
    splits = max(p.tiling.kv_splits for p in programs)
    out = []
    for key, users in sorted(shapes.items()):
        k, norm, lnb, gtd, head_d, down, down_ld, wide = key
        ln_bias, gated = bool(lnb), bool(gtd)
        acts, lms, copies = ({f[i] for f in flags[key]} for i in range(3))
        bn = wide or block_n
        # a wide body's chunks hold as many weights as block_n's (fewer columns of more rows), down
        # to chunk_plan's 32 columns
        cap = 2 * max_chunk if norm == pg.NORM_COMBINE and splits > MERGED_NARROW_SPLITS else max_chunk
        chunks = chunk_plan(k, min(cap, max(32, cap * block_n // bn)))
        if chunks is None or (wide and not _rolls(chunks, norm, gated, down)):
            continue
        depth, got = 0, 0
        while depth < len(chunks) and got < prefetch_bytes:
            got += chunks[depth].size * bn * item * (2 if gated else 1)
            depth += 1
        d_chunks = chunk_plan(down, max_down_rows) if down else ()
        if d_chunks is None:
            continue  # rows that do not split into chunks: the generic body
        issue = _down_issue([c.size * bn * item * (2 if gated else 1) for c in chunks], depth,
                            [c.size * bn * item for c in d_chunks], prefetch_bytes)
        act, lm, copy = (v.pop() if len(v) == 1 else -1 for v in (acts, lms, copies))
        out.append(GemvBody(k, norm, ln_bias, gated, chunks, depth, bn, item, head_d, down, down_ld,
                            d_chunks, issue, () if users == every else tuple(sorted(users)),
                            act=act, lm=lm, copy=copy, wide=wide))
    return out


def _rolls(chunks: tuple[Chunk, ...], norm: int, gated: bool, down: int) -> bool:
    """Whether the LM head's wide body (a rolled loop over equal chunks: unrolled, its many small
    chunks' loads were hoisted by ptxas and spilled on sm_86) covers the shape: one matrix, no fused
    down, a norm (or none) but not a merged split-KV row; the generic body takes the rest."""
    return len({c.size for c in chunks}) == 1 and not gated and not down and norm != pg.NORM_COMBINE


def _down_issue(up: list[int], depth: int, down: list[int], prefetch_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Where a fused down's chunks are requested: entry 0 is the prologue (before the wait), entry
    1 + p stream position p (the gate/up chunks, then the down chunks), before p's arithmetic. The
    down chunks continue the gate/up stream: none before it has requested its last chunk (the
    gate/up chunks keep their fixed depth), then the next ones while less than `prefetch_bytes`
    of requested weights are not yet consumed (in the prologue, too, when the whole gate/up slice
    is requested there: the down matrix never depends on the step either)."""
    if not down:
        return ()
    sizes = up + down
    issued = min(depth, len(up))  # stream items requested so far
    out: list[tuple[int, ...]] = []
    for p in range(-1, len(sizes)):
        if 0 <= p and p + depth < len(up):
            issued = max(issued, p + depth + 1)
        now: list[int] = []
        if issued >= len(up):
            while issued < len(sizes) and (issued <= p or sum(sizes[p + 1:issued]) < prefetch_bytes):
                now.append(issued - len(up))
                issued += 1
        out.append(tuple(now))
    return tuple(out)
