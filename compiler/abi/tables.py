"""The task table, the control block, the batch block and the counters: every word's place, by name.

The kernels (kernel.py's Triton source, the native C source) read these as generated constants
(`zlc.abi.constants()`: `TASK_SIGNAL` is `tl.constexpr(12)` / `#define TASK_SIGNAL 12`), codegen
writes the tables with them, and the executors, the trace reader and the kernel model read them
back with them. A word index written as a literal anywhere else is a bug
(tests/test_abi_literals.py looks for them).
"""

from __future__ import annotations

import numpy as np

# ---- op kinds (the dispatch chain's numbering; a task row's TASK_OP) -------------------------------
OP_EMBED, OP_LINEAR, OP_CACHE_APPEND, OP_ATTENTION, OP_ATTN_COMBINE, OP_ARGMAX, OP_ROW_NORM = range(7)
OP_NAMES = ("embed", "linear", "cache_append", "attention", "attn_combine", "argmax", "row_norm")

# ---- descriptor rows (their fields: zlc.abi.descriptors) -------------------------------------------
DESC_WORDS = 24  # int64 fields per descriptor (DI)
DESC_FLOATS = 4  # f32 fields per descriptor (DF)

# ---- the task table (TASKS, int32): a header, then each mode's rows, then the prefetch records ------
HEADER_WORDS = 16
# per mode (MODE_PREFILL, MODE_DECODE) its row count and where its rows start (words past the
# header); mode m's pair is HDR_MODE_WORDS * m words past the prefill one
HDR_N_PREFILL, HDR_BASE_PREFILL, HDR_N_DECODE, HDR_BASE_DECODE = range(4)
HDR_MODE_WORDS = 2
HDR_N_EVENTS = 4  # events (counters past CNT_EVENTS) the tables use
HDR_PREFETCH = 5  # TASKS word where the prefetch records start (one per row, after every row)

# A task row: TASK_WORDS int32 words.
TASK_WORDS = 16
MAX_WAITS = 3
TASK_OP, TASK_DESC, TASK_A, TASK_B, TASK_C, TASK_N_WAITS = range(6)  # a, b, c: the op's own arguments
# wait i: (event, the count it waits for) at TASK_WAIT_EVENT / TASK_WAIT_TARGET + TASK_WAIT_WORDS * i
TASK_WAIT_EVENT, TASK_WAIT_TARGET, TASK_WAIT_WORDS = 6, 7, 2
TASK_SIGNAL = TASK_WAIT_EVENT + TASK_WAIT_WORDS * MAX_WAITS  # the event signalled (-1 none)
TASK_SIGNAL_TARGET = TASK_SIGNAL + 1  # the count that completes it (a group's last task bumps the parent)
TASK_PARENT = TASK_SIGNAL + 2  # the event the group's last task bumps (-1 none); one word of padding after
NO_WAIT = (-1, 0)  # an unused wait slot

# After the rows, one L2 prefetch record per row (same order; the compiled decode kernel's PREFETCH,
# docs/megakernel.md): a Linear's rows [n0, n1) x K of W and of W2 (gated), in units of PF_UNIT
# elements (pack.py's alignment of W offsets), so int32 covers any arena. Other ops, and a Linear
# whose weights are packed blocks in Q (not prefetched yet): PF_NONE.
PF_WORDS = 4
PF_UNIT = 64
PF_FIRST, PF_UNITS, PF_FIRST2 = 0, 1, 2  # W's first unit, units, W2's first unit (-1 none); a pad word
PF_NONE = (0, 0, -1, 0)

# ---- control block (CTRL, int32) -------------------------------------------------------------------
CTRL_MODE, CTRL_T, CTRL_PAST, CTRL_OUT_TOKEN, CTRL_ERROR, CTRL_ALL_LOGITS, CTRL_AUTO_ADVANCE = range(7)
CTRL_TOKENS = 16  # tokens of this step start here
MODE_PREFILL, MODE_DECODE = 0, 1
ERROR_WAIT_TIMEOUT = 1  # debug builds: a wait ran out of time (bad table or lost signal)
# debug builds: the first wait that timed out. CTRL_ERR_EVENT holds its event + 1 (0: none; the
# first timeout claims it with a compare-and-swap), then its target, the count it saw, and the
# low 32 bits of the waiting task's row address (the host knows where it put TASKS)
CTRL_ERR_EVENT, CTRL_ERR_TARGET, CTRL_ERR_SEEN, CTRL_ERR_ROW = 7, 8, 9, 10
# A batched launch of the Triton kernel (prefill table, rows of several sequences over a paged KV
# cache; runtime/paged_kv.py): the A offset of its batch block (int32 words in A, written by the
# host before the launch), 0 for an ordinary launch. Read once per launch, like the words above.
CTRL_BATCH = 11

# ---- the batch block (int32 words in A) ------------------------------------------------------------
# BATCH_HEADER words, then sections whose lengths are the step's descriptors (n_desc) and rows
# (cap): the cache map kv_k[n_desc], kv_v[n_desc] (per descriptor, where its K / V cache starts in a
# page's token, -1 none), pos[cap], pt[cap], lrows[cap] and the step's page tables. Section X
# starts at BATCH_HEADER + BATCH_<X>_D * n_desc + BATCH_<X>_R * cap. BATCH_KV_BASE is the page
# pool's A offset / BATCH_KV_ALIGN.
BATCH_PAGE_SIZE, BATCH_N_LROWS, BATCH_TOK_FLOATS, BATCH_KV_BASE, BATCH_CAP, BATCH_N_DESC = range(6)
BATCH_HEADER = 16
BATCH_KV_ALIGN = 16
BATCH_KV_K_D, BATCH_KV_K_R = 0, 0
BATCH_KV_V_D, BATCH_KV_V_R = 1, 0
BATCH_POS_D, BATCH_POS_R = 2, 0
BATCH_PT_D, BATCH_PT_R = 2, 1
BATCH_LROWS_D, BATCH_LROWS_R = 2, 2
BATCH_TABLE_D, BATCH_TABLE_R = 2, 3  # the page tables run to the block's end
BATCH_SECTIONS = ("kv_k", "kv_v", "pos", "pt", "lrows", "table")

# ---- counters (CNT, int32) -------------------------------------------------------------------------
CNT_QUEUE, CNT_EXIT = 0, 1
CNT_EVENTS = 16  # event e lives at CNT[16 + e]
# trace builds (TRACE=1): int32 records after the counters, from the first multiple of TRACE_WORDS
# past them: a header, one per task of the launch's table, one per program (runtime/trace.py)
TRACE_WORDS = 8
# A record (the header's, a task's, a program's): the SM, the program, the start and end stamps
# (int64 as lo, hi words), the cycles between them, and a count (a task's: 1 when it ran; a
# program's: its tasks)
TR_SM, TR_PROGRAM, TR_START_LO, TR_START_HI, TR_END_LO, TR_END_HI, TR_CYCLES, TR_COUNT = range(TRACE_WORDS)
# then, from the first whole record past the records, STAMP_WORDS int32 per task of the table: times
# after the task's start (-1: not stamped) at which its claim's result arrived, its row's words
# arrived, its waits passed (where the dispatch waits for the body) and its body's loads and stores
# were issued (runtime/trace_terms.py splits a task's time by them)
STAMP_WORDS = 4
ST_CLAIM, ST_DESCRIPTOR, ST_WAITED, ST_BODY_END = range(STAMP_WORDS)

# ---- codes the descriptors carry -------------------------------------------------------------------
NORM_NONE, NORM_RMS, NORM_LAYER = 0, 1, 2
NORM_COMBINE = 3  # not a norm: the input row is merged from split-KV attention partials
ACTIVATIONS = {"none": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}
ROPE_NONE, ROPE_HALF, ROPE_INTERLEAVED = 0, 1, 2


# The Triton kernel reads these without their zero terms (a `+ 0` Triton would have to fold away):
# mode m's count at TASKS + HDR_MODE_WORDS * m, kv_k's section at BATCH_HEADER + d, pos / kv_v /
# pt / lrows / table sections without a `0 * cap`.
assert HDR_N_PREFILL == MODE_PREFILL == 0 and HDR_N_DECODE == HDR_N_PREFILL + HDR_MODE_WORDS * MODE_DECODE
assert HDR_BASE_DECODE == HDR_BASE_PREFILL + HDR_MODE_WORDS * MODE_DECODE
assert BATCH_KV_K_D == BATCH_KV_K_R == BATCH_KV_V_R == BATCH_POS_R == 0


# ---- the table's writer and readers ----------------------------------------------------------------

def table_header(n_prefill: int, n_decode: int, n_events: int) -> list[int]:
    """The HEADER_WORDS words of a table whose prefill rows come first, then the decode rows, then
    their prefetch records."""
    h = [0] * HEADER_WORDS
    h[HDR_N_PREFILL], h[HDR_BASE_PREFILL] = n_prefill, 0
    h[HDR_N_DECODE], h[HDR_BASE_DECODE] = n_decode, n_prefill * TASK_WORDS
    h[HDR_N_EVENTS] = n_events
    h[HDR_PREFETCH] = HEADER_WORDS + (n_prefill + n_decode) * TASK_WORDS
    return h


def task_row(op: int, desc: int, a: int, b: int, c: int, waits: list[tuple[int, int]], signal: int,
             signal_target: int, parent: int) -> list[int]:
    """One task's TASK_WORDS words (at most MAX_WAITS waits; unused slots NO_WAIT)."""
    if len(waits) > MAX_WAITS:
        raise ValueError(f"a task row holds at most {MAX_WAITS} waits, got {len(waits)}")
    r = [0] * TASK_WORDS
    r[TASK_OP], r[TASK_DESC], r[TASK_A], r[TASK_B], r[TASK_C] = op, desc, a, b, c
    r[TASK_N_WAITS] = len(waits)
    for i in range(MAX_WAITS):
        r[TASK_WAIT_EVENT + TASK_WAIT_WORDS * i], r[TASK_WAIT_TARGET + TASK_WAIT_WORDS * i] = \
            waits[i] if i < len(waits) else NO_WAIT
    r[TASK_SIGNAL], r[TASK_SIGNAL_TARGET], r[TASK_PARENT] = signal, signal_target, parent
    return r


def mode_rows(tasks: np.ndarray, mode: int) -> np.ndarray:
    """[n, TASK_WORDS] int64: the rows of `mode`'s table in a raw task table (header + rows)."""
    t = np.asarray(tasks, dtype=np.int64).reshape(-1)
    n = int(t[HDR_N_PREFILL + HDR_MODE_WORDS * mode])
    base = HEADER_WORDS + int(t[HDR_BASE_PREFILL + HDR_MODE_WORDS * mode])
    return t[base:base + n * TASK_WORDS].reshape(n, TASK_WORDS)


def row_waits(row: np.ndarray | list[int]) -> list[tuple[int, int]]:
    """A row's waits, (event, target) each."""
    n = min(int(row[TASK_N_WAITS]), MAX_WAITS)
    return [(int(row[TASK_WAIT_EVENT + TASK_WAIT_WORDS * i]), int(row[TASK_WAIT_TARGET + TASK_WAIT_WORDS * i]))
            for i in range(n)]


def batch_sections(n_desc: int, cap: int) -> dict[str, int]:
    """Where each section of the batch block starts (words from the block), BATCH_SECTIONS order."""
    g = globals()
    return {s: BATCH_HEADER + g[f"BATCH_{s.upper()}_D"] * n_desc + g[f"BATCH_{s.upper()}_R"] * cap
            for s in BATCH_SECTIONS}
