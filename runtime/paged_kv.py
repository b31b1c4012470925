"""The paged KV cache of the Triton kernel's batched launches: the page map and the batch block.

A batched launch (docs/megakernel.md, "Batched steps and the paged KV cache") runs the prefill
table over rows of several sequences. What differs per row -- its position, its sequence's page
table, whether its logits are wanted -- is the **batch block**: int32 words in the A arena past
the layout's own buffers, written by the host before each launch (`CTRL_BATCH` holds its offset;
0 means an ordinary launch). After the block comes the **page pool**: `pages` pages of
`page_size` positions of one sequence for every layer's K and V, the native kernel's layout (the
cache at token offset `tok` keeps KV head h, slot j at
`page * page_size * F + page_size * tok + (h * page_size + j) * D`, F the floats of one token over
every cache). The pool lives in the executor's own A (interpreter tensor, device memory), so the
host never copies it; `extra_floats` says how much larger than the layout's `a_size` A must be.

Pure numpy: the interpreter's worker and the CUDA executor both build on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from zlc import abi
from zlc.errors import ZlcError


@dataclass(frozen=True)
class BatchLayout:
    """Where a session's batch block and page pool sit in A, and their sizes."""

    a_size: int        # the layout's own A (activations, the contiguous cache, logits)
    cap: int           # rows one batched launch can carry (the prefill chunk)
    n_desc: int
    page_size: int
    pages: int
    tok_floats: int    # F
    max_seq: int

    @property
    def block(self) -> int:
        """A offset of the batch block (BATCH_KV_ALIGN-aligned past the layout's buffers)."""
        return -(-self.a_size // abi.BATCH_KV_ALIGN) * abi.BATCH_KV_ALIGN

    @property
    def table_words(self) -> int:
        """Page table entries one launch can name: every row's sequence's whole table."""
        return self.cap * -(-self.max_seq // self.page_size)

    @property
    def block_words(self) -> int:
        return abi.batch_sections(self.n_desc, self.cap)["table"] + self.table_words

    @property
    def pool(self) -> int:
        """A offset of page 0."""
        return -(-(self.block + self.block_words) // abi.BATCH_KV_ALIGN) * abi.BATCH_KV_ALIGN

    @property
    def extra_floats(self) -> int:
        """How much larger than a_size A must be."""
        return self.pool + self.pages * self.page_size * self.tok_floats - self.a_size

    def words(self, kv_k: np.ndarray, kv_v: np.ndarray, pos: np.ndarray, pt: np.ndarray, table: np.ndarray,
              lrows: np.ndarray) -> np.ndarray:
        """The batch block of one launch (int32), checked against what the kernel would index."""
        t = len(pos)
        if not 1 <= t <= self.cap or len(pt) != t or len(lrows) > t:
            raise ZlcError(f"a batched launch takes 1..{self.cap} rows, got {t} (pt {len(pt)}, lrows {len(lrows)})")
        if len(table) > self.table_words:
            raise ZlcError(f"a batched launch's page tables hold {len(table)} entries, more than {self.table_words}")
        if t and (pos.min() < 0 or pos.max() >= self.max_seq):
            raise ZlcError(f"a row's position is outside 0..{self.max_seq - 1}")
        if len(table) and (table.min() < 0 or table.max() >= self.pages):
            raise ZlcError(f"a page index is outside 0..{self.pages - 1}")
        if len(lrows) and (lrows.min() < 0 or lrows.max() >= t):
            raise ZlcError("a logits row is outside the launch's rows")
        last = pt.astype(np.int64) + pos // self.page_size
        if t and (pt.min() < 0 or last.max() >= len(table)):
            raise ZlcError("a row's page table runs past the step's tables")
        w = np.zeros(self.block_words, dtype=np.int32)
        w[abi.BATCH_PAGE_SIZE], w[abi.BATCH_N_LROWS], w[abi.BATCH_TOK_FLOATS] = self.page_size, len(lrows), self.tok_floats
        w[abi.BATCH_KV_BASE] = self.pool // abi.BATCH_KV_ALIGN
        w[abi.BATCH_CAP], w[abi.BATCH_N_DESC] = self.cap, self.n_desc
        at = abi.batch_sections(self.n_desc, self.cap)
        for name, values in (("kv_k", kv_k), ("kv_v", kv_v), ("pos", pos), ("pt", pt), ("lrows", lrows),
                             ("table", table)):
            w[at[name]:at[name] + len(values)] = values
        return w


def batch_layout(layout: dict[str, object], max_seq: int, pages: int, page_size: int) \
        -> tuple[BatchLayout, np.ndarray, np.ndarray]:
    """The BatchLayout of a tiling's `layout` (the manifest's) for a pool of `pages` pages of
    `page_size`, and its cache map (kv_k, kv_v). A one-line ZlcError when the bundle has no map
    (compiled before batched launches) or its tables have no batched launch."""
    pk = layout.get("paged_kv")
    if not isinstance(pk, dict):
        raise ZlcError("the bundle's layout has no paged_kv map (compiled by an older zlc): recompile it for "
                       "batched launches")
    f = int(pk["tok_floats"])
    if f <= 0:
        raise ZlcError("an attention of this model reads a KV cache no cache_append writes: it has no batched launch")
    if pages < 1 or page_size < 1:
        raise ZlcError(f"a page pool needs pages >= 1 and page_size >= 1, got {pages} and {page_size}")
    kv_k = np.asarray(pk["k"], dtype=np.int32)
    kv_v = np.asarray(pk["v"], dtype=np.int32)
    lay = BatchLayout(a_size=int(layout["a_size"]), cap=int(layout["chunk"]), n_desc=len(kv_k),  # type: ignore[call-overload]
                      page_size=page_size, pages=pages, tok_floats=f, max_seq=max_seq)
    if lay.pool // abi.BATCH_KV_ALIGN >= 2**31 or lay.block + lay.block_words >= 2**31:
        raise ZlcError(f"the page pool's offset ({lay.pool} floats) is beyond the kernel's int32 words")
    return lay, kv_k, kv_v
