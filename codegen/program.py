"""The megakernel's program: fused ops over arenas, split into tasks with fine-grained events.

A `Program` is everything the generated kernel reads besides weights: a task table per mode
(prefill, decode), op descriptors (offsets and sizes per op instance), the arena layout, and the
events (counters) tasks wait on and signal. It is plain data: the scheduler builds it, the
validator checks it, the emitter renders it, the bundle stores it, and executors load it.

Memory model. The kernel takes eight pointers:
  TASKS i32 (header + rows)  DI i64 / DF f32 (op descriptors)  CTRL i32 (control block)
  CNT i32 (queue, exit count, events)  W (weights, bf16 or f32)  P f32 (norm weights, biases,
  rotary tables)  A f32 (activations, KV cache, logits, partials).
Activation buffers are single-assignment ([chunk, cols] each), so the only hazards are
read-after-write, and those are what events order.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

# the layouts and codes the tables carry are the ABI's (zlc.abi); the codes are re-exported for codegen
from zlc.abi import (  # noqa: F401 (NORM_*, ROPE_*, ACTIVATIONS, PF_*: re-exported)
    ACTIVATIONS,
    CNT_EVENTS,
    CTRL_TOKENS,
    NORM_COMBINE,
    NORM_LAYER,
    NORM_NONE,
    NORM_RMS,
    OP_ATTENTION,
    OP_CACHE_APPEND,
    OP_LINEAR,
    OP_NAMES,
    PF_FIRST,
    PF_FIRST2,
    PF_NONE,
    PF_UNIT,
    PF_UNITS,
    PF_WORDS,
    ROPE_HALF,
    ROPE_INTERLEAVED,
    ROPE_NONE,
    AttentionDesc,
    CacheAppendDesc,
    LinearDesc,
    table_header,
    task_row,
)


@dataclass(frozen=True)
class Region:
    """Columns [lo, hi) of a buffer, over all rows of the step (for a cache: heads [lo, hi) of
    the rows this step appends; for scalar outputs: slots)."""

    buffer: str
    lo: int
    hi: int
    row_lo: int = 0  # rows [row_lo, row_hi) of the step (prefill attention tiles rows too)
    row_hi: int = 1 << 30
    # An accumulating write (float atomics adding a partial sum: the MLP split-K's down partials).
    # Accumulating writes to one region commute with each other, so they need no order among
    # themselves; they come after the region's plain (initializing) write and before its readers.
    accumulate: bool = False

    def overlaps(self, other: Region) -> bool:
        return (self.buffer == other.buffer and self.lo < other.hi and other.lo < self.hi
                and self.row_lo < other.row_hi and other.row_lo < self.row_hi)


@dataclass
class Task:
    op: int
    desc: int
    a: int = 0
    b: int = 0
    c: int = 0
    waits: list[tuple[int, int]] = field(default_factory=list)  # (event, target)
    signal: int = -1
    signal_target: int = 0
    parent: int = -1  # event bumped by the last task of this task's group
    reads: list[Region] = field(default_factory=list)
    writes: list[Region] = field(default_factory=list)
    label: str = ""

    def row(self) -> list[int]:
        return task_row(self.op, self.desc, self.a, self.b, self.c, self.waits, self.signal, self.signal_target,
                        self.parent)


@dataclass
class Buffer:
    name: str
    offset: int  # elements into A
    rows: int
    cols: int

    @property
    def size(self) -> int:
        return self.rows * self.cols


@dataclass
class Tiling:
    """Tile sizes and task granularity for one target (constexprs of the kernel)."""

    block_n: int  # output columns per inner block of a Linear
    block_k: int  # reduction chunk of a Linear's matrix-vector path (one row)
    block_kd: int  # reduction chunk of its tl.dot path (prefill rows): small, the dot holds more per thread
    block_t: int  # rows per block in prefill (and query rows per attention task)
    block_kv: int  # keys per attention block
    block_e: int  # embedding columns per block
    max_linear_tasks: int  # tasks per Linear (0: one per block; the interpreter wants few)
    kv_splits: int  # split-KV attention tasks per head in decode (combined by a second task)
    chunk: int  # most tokens one prefill launch handles (longer prompts run in chunks)
    num_warps: int
    grid: int  # persistent programs (SMs on a GPU)
    dot_precision: str = "ieee"  # prefill tl.dot: exact f32 in the interpreter, "tf32x3" on GPUs
    # Fusions that remove dependency levels (the GPU tiling's; docs/megakernel.md, "Fusion"):
    fuse_kv_append: bool = False  # attention reads the step's k/v from the projections; no append op
    fuse_combine: bool = False  # split-KV partials merged where the output projection loads its row
    # decode: the MLP's down projection runs in its gate/up (or up) tasks, split-K over their
    # columns, adding partials into the MLP output with float atomics; the residual's producer
    # initializes that accumulator (docs/megakernel.md, "MLP split-K")
    fuse_mlp_down: bool = False
    # The LM head's columns per task where they differ from block_n (0: block_n). A decode LM-head
    # task never waits (its input was ready a level earlier), so what it costs besides its stream
    # (the claim, its row, the signal) is paid per task: the GPU tiling's 256 columns are 8x fewer
    # tasks than block_n's (Llama-1B shape: 501, not 4,008) and one argmax round trip
    lm_block_n: int = 0

    def constexprs(self) -> dict[str, int | str]:
        return {"BLOCK_N": self.block_n, "BLOCK_K": self.block_k, "BLOCK_KD": self.block_kd, "BLOCK_T": self.block_t,
                "BLOCK_KV": self.block_kv, "BLOCK_E": self.block_e, "KV_SPLITS": self.kv_splits,
                "DOT_PRECISION": self.dot_precision}


@dataclass
class Program:
    model: str
    tiling: Tiling
    head_dim: int  # largest attention head size (HEAD_P2 is its next power of two)
    vocab: int
    max_seq: int
    buffers: dict[str, Buffer]
    a_size: int
    logits: str  # buffer holding logits [chunk, vocab]
    desc_int: np.ndarray  # [n_desc, DESC_WORDS] int64
    desc_float: np.ndarray  # [n_desc, DESC_FLOATS] float32
    desc_labels: list[str]
    tables: dict[str, list[Task]]  # "prefill", "decode"
    n_events: int
    event_labels: list[str]
    w_size: int
    p_size: int
    weights: list[dict[str, Any]] = field(default_factory=list)  # arena placement of each constant
    q_size: int = 0  # bytes of the Q arena (packed weights, ir/quant.py)

    def q_arena(self) -> dict[str, Any]:
        """The manifest's `weights.Q`: the packed weights' arena (bytes) and the formats in it."""
        return {"dtype": "u8", "bytes": self.q_size,
                "formats": sorted({p["format"] for p in self.weights if p["arena"] == "Q"})}

    def constexprs(self, debug: bool = False) -> dict[str, int | str]:
        """The kernel's constexprs but STEP: the mode of the launch, which picks one of the two
        kernels the source compiles into (STEP = MODE_PREFILL or MODE_DECODE)."""
        c = self.tiling.constexprs()
        c["HEAD_P2"] = max(16, 1 << (self.head_dim - 1).bit_length())
        c["DEBUG"] = int(debug)
        return c

    def task_table(self, order: dict[str, list[Task]] | None = None) -> np.ndarray:
        """Header + prefill rows + decode rows, int32."""
        tabs = order or self.tables
        pre, dec = tabs["prefill"], tabs["decode"]
        header = table_header(len(pre), len(dec), self.n_events)
        rows = [w for t in pre + dec for w in t.row()]
        prefetch = [w for t in pre + dec for w in self.prefetch_record(t)]
        arr = np.array(header + rows + prefetch, dtype=np.int64)
        if arr.max(initial=0) >= 2**31 or arr.min(initial=0) < -(2**31):
            raise OverflowError("task table field beyond int32")
        return arr.astype(np.int32)

    def prefetch_record(self, t: Task) -> list[int]:
        """The PF_WORDS words of task t's L2 prefetch record (see PF_WORDS)."""
        if t.op != OP_LINEAR:
            return list(PF_NONE)
        d = self.desc_int[t.desc]
        if int(d[LinearDesc.route]) == 0 and int(d[LinearDesc.w_format]):  # packed (Q): not prefetched yet
            return list(PF_NONE)
        k, w_off, w2_off = int(d[LinearDesc.k]), int(d[LinearDesc.w]), int(d[LinearDesc.w2])
        lo, hi = w_off + t.a * k, w_off + t.b * k
        rec = [0] * PF_WORDS
        rec[PF_FIRST] = lo // PF_UNIT
        rec[PF_UNITS] = max(0, -(-hi // PF_UNIT) - rec[PF_FIRST])
        rec[PF_FIRST2] = (w2_off + t.a * k) // PF_UNIT if w2_off >= 0 else -1
        return rec

    def kv_page_map(self) -> dict[str, Any]:
        """The paged KV cache's map for batched launches (runtime/paged_kv.py; the native kernel
        builds the same one at session start, map_kv_caches): `tok_floats` F, the floats of one
        token over every cache a cache_append task writes (KV heads x head size each, in order of
        first appearance), and per descriptor `k` / `v`, where the K and V caches of a
        cache_append or attention descriptor start in a page's token (-1 for other descriptors).
        F is -1 when an attention reads a cache no cache_append writes: no batched launch then."""
        tasks = [t for mode in ("prefill", "decode") for t in self.tables.get(mode, [])]
        width: dict[int, int] = {}  # cache offset -> floats per token (insertion order: slice order)
        for t in tasks:
            if t.op == OP_CACHE_APPEND:
                di = self.desc_int[t.desc]
                for f in (CacheAppendDesc.k_cache, CacheAppendDesc.v_cache):
                    o = int(di[f])
                    width[o] = max(width.get(o, 0), (t.a + 1) * int(di[CacheAppendDesc.head_dim]))
        tok: dict[int, int] = {}
        f_total = 0
        for o, w in width.items():
            tok[o], f_total = f_total, f_total + w
        k = [-1] * len(self.desc_int)
        v = [-1] * len(self.desc_int)
        for t in tasks:
            if t.op not in (OP_CACHE_APPEND, OP_ATTENTION):
                continue
            di = self.desc_int[t.desc]
            kf, vf = ((AttentionDesc.k_cache, AttentionDesc.v_cache) if t.op == OP_ATTENTION
                      else (CacheAppendDesc.k_cache, CacheAppendDesc.v_cache))
            k[t.desc], v[t.desc] = tok.get(int(di[kf]), -1), tok.get(int(di[vf]), -1)
            if k[t.desc] < 0 or v[t.desc] < 0:
                f_total = -1
        return {"tok_floats": f_total, "k": k, "v": v}

    def counters_size(self) -> int:
        return CNT_EVENTS + max(self.n_events, 1)

    def ctrl_size(self) -> int:
        return CTRL_TOKENS + self.tiling.chunk

    def summary(self) -> dict[str, Any]:
        """What the manifest and `zlc inspect` show."""
        def hist(tasks: list[Task]) -> dict[str, int]:
            h: dict[str, int] = {}
            for t in tasks:
                h[OP_NAMES[t.op]] = h.get(OP_NAMES[t.op], 0) + 1
            return h

        return {"tiling": asdict(self.tiling), "tasks": {m: len(t) for m, t in self.tables.items()},
                "tasks_by_op": {m: hist(t) for m, t in self.tables.items()},
                "waits_per_task": {m: round(sum(len(x.waits) for x in t) / max(len(t), 1), 2)
                                   for m, t in self.tables.items()},
                "events": self.n_events, "descriptors": len(self.desc_labels),
                "arena_elements": {"W": self.w_size, "P": self.p_size, "A": self.a_size},
                **({"q_bytes": self.q_size} if self.q_size else {})}
