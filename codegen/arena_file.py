"""The bundle's weight files written matrix by matrix, so a compile holds no copy of the model.

`write_arenas` writes `weights.safetensors` (W, P and Q) as `pack.pack_arenas` + safetensors'
`save_file` would, byte for byte, without building the arenas: the header first (the order and
padding safetensors gives the same names and dtypes, taken from safetensors itself), the file
extended with zeros (the gaps between constants), then each constant written at its offset, in
row chunks (a dense matrix widened or narrowed to the arena's dtype one chunk at a time).

`write_layout` writes `native/<level>.weights` (W and Q as the native kernel reads them: every
Linear matrix in panels) as `native.write_layout` would, by running the library's own
`zlc_native_layout` on one matrix at a time (a one-task table, the descriptor's offsets rebased
to that matrix), read from and written back to the files with pread / pwrite. Which matrices, and
what else the layout copies, follows the kernel's `place_weights` (megakernel.c.jinja): W as it
is with each Linear matrix in panels; Q zero but for the Linear matrices' block panels and the
packed token tables no Linear reads (copied as they are).

Peak memory of either: the largest chunk, not the model (tests/test_compile_memory.py).
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from zlc.abi.descriptors import EmbedDesc, LinearDesc
from zlc.abi.formats import BY_CODE
from zlc.abi.tables import HEADER_WORDS, OP_EMBED, OP_LINEAR, TASK_DESC, TASK_OP, TASK_WORDS, mode_rows
from zlc.ir import Graph

from .native import LAYOUT_ALIGN
from .pack import placed_constants
from .program import Program

__all__ = ["ArenaFile", "write_arenas", "write_layout"]

CHUNK = 8 << 20  # elements per write of a dense constant (32 MiB of f32)
_ST_DTYPE = {"fp32": "F32", "bf16": "BF16"}


class ArenaFile:
    """Where each arena's bytes start in a written weights.safetensors, and its element size."""

    def __init__(self, path: Path, at: dict[str, int], nbytes: dict[str, int], w_esize: int) -> None:
        self.path, self.at, self.nbytes, self.w_esize = path, at, nbytes, w_esize


def _header(entries: list[tuple[str, str, int]]) -> tuple[bytes, dict[str, int]]:
    """safetensors' header for 1-D tensors (name, dtype, bytes) and each one's data offset. The
    order is safetensors' own (by dtype, then name), read from its output for 1-element tensors."""
    import torch
    from safetensors.torch import save

    tdt = {"F32": torch.float32, "BF16": torch.bfloat16, "U8": torch.uint8}
    probe = save({name: torch.zeros(1, dtype=tdt[dt]) for name, dt, _ in entries})
    n = struct.unpack("<Q", probe[:8])[0]
    order = [k for k in json.loads(probe[8:8 + n]) if k != "__metadata__"]
    size = {name: (dt, nb) for name, dt, nb in entries}
    esize = {"F32": 4, "BF16": 2, "U8": 1}
    head: dict[str, Any] = {}
    at: dict[str, int] = {}
    pos = 0
    for name in order:
        dt, nb = size[name]
        head[name] = {"dtype": dt, "shape": [nb // esize[dt]], "data_offsets": [pos, pos + nb]}
        at[name] = pos
        pos += nb
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {k: v + start for k, v in at.items()}


def write_arenas(decode: Graph, program: Program, weight_dtype: str, path: Path,
                 on_packed: Callable[[int, int], None] | None = None) -> ArenaFile:
    """weights.safetensors at `path`, equal to save_file({"W", "P", "Q"} of pack_arenas)."""
    import torch

    from zlc.reference.kernels import const_tensor

    wdt = {"fp32": torch.float32, "bf16": torch.bfloat16}[weight_dtype]
    w_esize = 4 if wdt == torch.float32 else 2
    nbytes = {"W": max(program.w_size, 1) * w_esize, "P": max(program.p_size, 1) * 4, "Q": program.q_size}
    entries = [("W", _ST_DTYPE[weight_dtype], nbytes["W"]), ("P", "F32", nbytes["P"])]
    if nbytes["Q"]:
        entries.append(("Q", "U8", nbytes["Q"]))
    head, at = _header(entries)
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(len(head) + sum(nb for _, _, nb in entries))  # zeros: the gaps between constants
        fd = f.fileno()
        for pl, v in placed_constants(program, decode, on_packed):
            if pl["arena"] == "Q":
                blocks = np.ascontiguousarray(v.quant.blocks).reshape(-1)
                _pwrite(fd, blocks.view(np.uint8), at["Q"] + pl["offset"])
                continue
            t = const_tensor(v).reshape(-1)
            dt, es = (wdt, w_esize) if pl["arena"] == "W" else (torch.float32, 4)
            base = at[pl["arena"]] + pl["offset"] * es
            for s in range(0, t.numel(), CHUNK):
                c = t[s:s + CHUNK].to(dt).contiguous()
                _pwrite(fd, c.view(torch.int16 if dt == torch.bfloat16 else dt).numpy(), base + s * es)
    return ArenaFile(path, at, nbytes, w_esize)


def _pwrite(fd: int, a: np.ndarray, pos: int) -> None:
    view = memoryview(np.ascontiguousarray(a).view(np.uint8).reshape(-1).data)  # type: ignore[arg-type]
    while view.nbytes:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n


def _pread(fd: int, nbytes: int, pos: int) -> np.ndarray:
    buf = np.empty(nbytes, dtype=np.uint8)
    view, got = memoryview(buf.data), 0  # type: ignore[arg-type]
    while got < nbytes:
        n = os.preadv(fd, [view[got:]], pos + got)
        if n <= 0:
            raise OSError(f"short read at {pos + got}")
        got += n
    return buf


def _round_up(n: int, to: int = LAYOUT_ALIGN) -> int:
    return n + (-n) % to


def _pieces(tasks: np.ndarray, desc_int: np.ndarray) -> tuple[list[tuple[int, int, int, int]], list[tuple[int, int]]]:
    """What the layout moves, as place_weights walks the tables: the Linear matrices (format code or
    0 for dense, offset, N, K), each once, and the packed token tables no Linear reads (Q offset,
    bytes)."""
    L, E = LinearDesc, EmbedDesc
    mats: list[tuple[int, int, int, int]] = []
    seen_w: set[int] = set()
    seen_q: set[int] = set()
    embeds: list[int] = []
    linear_desc: set[int] = set()
    for mode in (0, 1):
        for row in mode_rows(tasks, mode):
            d = int(row[TASK_DESC])
            if row[TASK_OP] == OP_EMBED:
                embeds.append(d)
            if row[TASK_OP] != OP_LINEAR or d in linear_desc:
                continue
            linear_desc.add(d)
            r = desc_int[d]
            fmt = 0 if r[L.route.word] else int(r[L.w_format.word])
            for word in (L.w.word, L.w2.word):
                off = int(r[word])
                if off < 0 or off in (seen_q if fmt else seen_w):
                    continue
                (seen_q if fmt else seen_w).add(off)
                mats.append((fmt, off, int(r[L.n.word]), int(r[L.k.word])))
    tables: list[tuple[int, int]] = []
    for d in dict.fromkeys(embeds):
        r = desc_int[d]
        f, off = int(r[E.table_format.word]), int(r[E.table.word])
        if f and off not in seen_q:
            fm = BY_CODE[f]
            tables.append((off, int(r[E.vocab.word]) * int(r[E.hidden.word]) // fm.block_k * fm.block_bytes))
    return mats, tables


def write_layout(library: Path, tasks: np.ndarray, desc_int: np.ndarray, arenas: ArenaFile,
                 out: Path) -> dict[str, Any]:
    """native/<level>.weights from the written arenas; the manifest entry native.write_layout
    returns, and the same bytes."""
    lib = ctypes.CDLL(str(library))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.zlc_native_layout.restype = ctypes.c_int
    lib.zlc_native_layout.argtypes = [p, p, i64, p, i64, p, i64, p, p]
    desc_int = np.ascontiguousarray(desc_int, dtype=np.int64)
    tasks = np.ascontiguousarray(tasks, dtype=np.int32)
    es, wbytes, qbytes = arenas.w_esize, arenas.nbytes["W"], arenas.nbytes["Q"]
    q_at = _round_up(wbytes)
    total = q_at + _round_up(qbytes) if qbytes else max(wbytes, 1)
    mats, tables = _pieces(tasks, desc_int)
    # one Linear task in the prefill table, none in decode: the header of native's own tables
    one = np.zeros(HEADER_WORDS + TASK_WORDS, dtype=np.int32)
    one[0], one[HEADER_WORDS + TASK_OP], one[HEADER_WORDS + TASK_DESC] = 1, OP_LINEAR, 0
    dummy = np.zeros(64, dtype=np.uint8)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(arenas.path, "rb") as src, open(out, "wb") as dst:
        sfd, dfd = src.fileno(), dst.fileno()
        dst.truncate(total)
        for s in range(0, wbytes, CHUNK * 4):  # W as it is; its Linear matrices are then put in panels
            n = min(CHUNK * 4, wbytes - s)
            _pwrite(dfd, _pread(sfd, n, arenas.at["W"] + s), s)
        for off, n in tables:
            _pwrite(dfd, _pread(sfd, n, arenas.at["Q"] + off), q_at + off)
        for fmt, off, N, K in mats:
            row_bytes = K // BY_CODE[fmt].block_k * BY_CODE[fmt].block_bytes if fmt else K * es
            at = arenas.at["Q"] + off if fmt else arenas.at["W"] + off * es
            dst_at = q_at + off if fmt else off * es
            limit = qbytes if fmt else wbytes
            if (off if fmt else off * es) + N * row_bytes > limit:
                raise ValueError(f"a Linear matrix at {'Q' if fmt else 'W'}+{off} ({N} rows of {row_bytes} bytes) "
                                 f"is outside the arena ({limit} bytes)")
            # panels of PANEL (<= 64) rows each sit in their own rows' bytes: a chunk of whole panels
            # (a multiple of 256 rows) lays out as that slice of the matrix does
            step = max(256, CHUNK * 4 // row_bytes // 256 * 256)
            for r0 in range(0, N, step):
                rows = min(step, N - r0)
                n = rows * row_bytes
                src_b = _pread(sfd, n, at + r0 * row_bytes)
                desc_row = np.zeros(desc_int.shape[1], dtype=np.int64)  # one Linear descriptor: this chunk
                L = LinearDesc
                desc_row[L.n.word], desc_row[L.k.word], desc_row[L.w.word], desc_row[L.w2.word] = rows, K, 0, -1
                desc_row[L.w_format.word] = fmt
                res = np.zeros(n, dtype=np.uint8)
                if fmt:
                    err = lib.zlc_native_layout(one.ctypes.data, desc_row.ctypes.data, 1, dummy.ctypes.data, 0,
                                                src_b.ctypes.data, n, dummy.ctypes.data, res.ctypes.data)
                else:
                    err = lib.zlc_native_layout(one.ctypes.data, desc_row.ctypes.data, 1, src_b.ctypes.data, rows * K,
                                                None, 0, res.ctypes.data, None)
                if err:
                    raise OSError(err, f"{library.name}: the weight layout failed ({os.strerror(err)})")
                _pwrite(dfd, res, dst_at + r0 * row_bytes)
    return {"file": f"{out.parent.name}/{out.name}", "bytes": int(total), "w": {"offset": 0, "bytes": int(wbytes)},
            "q": {"offset": int(q_at) if qbytes else 0, "bytes": int(qbytes)}}
