"""zlc.abi: what a writer puts by name, a reader gets back by name (task rows and the table header,
the batch block, the engine's stats record), the formats' geometry, and the constants the
templates are rendered with."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc import abi
from zlc.runtime.paged_kv import BatchLayout
from zlc.runtime.trace import table_tasks

_i32 = st.integers(-1, 2**20)
_wait = st.tuples(st.integers(0, 500), st.integers(1, 64))
_task = st.tuples(st.integers(0, len(abi.OP_NAMES) - 1), _i32, _i32, _i32, _i32,
                  st.lists(_wait, max_size=abi.MAX_WAITS), _i32, _i32, _i32)


@settings(max_examples=60, deadline=None)
@given(st.lists(_task, max_size=6), st.lists(_task, max_size=6), st.integers(0, 1000))
def test_rows_read_back_by_name(pre: list[tuple], dec: list[tuple], n_events: int) -> None:
    """A table written with table_header + task_row reads back field for field through
    mode_rows / row_waits (the trace reader's TableTask), for both modes."""
    header = abi.table_header(len(pre), len(dec), n_events)
    table = np.array(header + [w for t in pre + dec for w in abi.task_row(*t)], dtype=np.int32)
    assert len(header) == abi.HEADER_WORDS and table[abi.HDR_N_EVENTS] == n_events
    assert table[abi.HDR_PREFETCH] == table.size  # the prefetch records would start right after
    for mode, tasks in ((abi.MODE_PREFILL, pre), (abi.MODE_DECODE, dec)):
        got = table_tasks(table, mode)
        assert len(got) == len(tasks)
        for g, (op, desc, a, b, c, waits, sig, target, parent) in zip(got, tasks, strict=True):
            assert (g.op, g.desc, g.args, list(g.waits)) == (op, desc, (a, b, c), waits)
            assert (g.signal, g.signal_target, g.parent) == (sig, target, parent)
        rows = abi.mode_rows(table, mode)
        assert all(list(r[abi.TASK_WAIT_EVENT + abi.TASK_WAIT_WORDS * len(t[5]):abi.TASK_SIGNAL]) ==
                   list(abi.NO_WAIT) * (abi.MAX_WAITS - len(t[5])) for r, t in zip(rows, tasks, strict=True))


def test_a_row_with_too_many_waits_is_refused() -> None:
    with pytest.raises(ValueError, match="at most 3 waits"):
        abi.task_row(0, 0, 0, 0, 0, [(0, 1)] * (abi.MAX_WAITS + 1), -1, 0, -1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 9), st.integers(1, 16), st.data())
def test_batch_block_sections_read_back(cap: int, n_desc: int, page_size: int, data: st.DataObject) -> None:
    """paged_kv's writer puts each section where batch_sections says the kernel reads it."""
    max_seq, pages = 64, 40
    lay = BatchLayout(a_size=1000, cap=cap, n_desc=n_desc, page_size=page_size, pages=pages, tok_floats=32,
                      max_seq=max_seq)
    t = data.draw(st.integers(1, cap))
    per_seq = -(-max_seq // page_size)
    table = np.array(data.draw(st.lists(st.integers(0, pages - 1), min_size=per_seq, max_size=per_seq)), np.int32)
    pos = np.array(data.draw(st.lists(st.integers(0, max_seq - 1), min_size=t, max_size=t)), np.int32)
    pt = np.zeros(t, np.int32)
    lrows = np.array(sorted(set(data.draw(st.lists(st.integers(0, t - 1), max_size=t)))), np.int32)
    kv_k = np.arange(n_desc, dtype=np.int32) - 1
    kv_v = np.arange(n_desc, dtype=np.int32) * 7
    w = lay.words(kv_k, kv_v, pos, pt, table, lrows)
    at = abi.batch_sections(n_desc, cap)
    assert w[abi.BATCH_PAGE_SIZE] == page_size and w[abi.BATCH_N_LROWS] == len(lrows)
    assert w[abi.BATCH_CAP] == cap and w[abi.BATCH_N_DESC] == n_desc
    assert w[abi.BATCH_KV_BASE] * abi.BATCH_KV_ALIGN == lay.pool
    for name, want in (("kv_k", kv_k), ("kv_v", kv_v), ("pos", pos), ("pt", pt), ("lrows", lrows), ("table", table)):
        assert list(w[at[name]:at[name] + len(want)]) == list(want), name
    assert at["table"] + lay.table_words == w.size


def test_engine_record_by_name() -> None:
    values = {name: float(i) for i, name in enumerate(abi.ENGINE_STATS)}
    rec = abi.engine_record(values)
    assert [rec[abi.ENGINE_SLOT[n]] for n in abi.ENGINE_STATS] == [values[n] for n in abi.ENGINE_STATS]
    with pytest.raises(KeyError, match="missing \\['steps'\\]"):
        abi.engine_record({k: v for k, v in values.items() if k != "steps"})
    with pytest.raises(KeyError, match="unknown \\['stepz'\\]"):
        abi.engine_record(dict(values, stepz=1.0))


def test_engine_stats_file_is_written_by_name() -> None:
    from zlc.runtime.serve.engine_stats import EngineStats

    s = EngineStats()
    try:
        s.put(**{name: float(i) + 0.5 for i, name in enumerate(abi.ENGINE_STATS)})
        assert s.get("pages_cached") == len(abi.ENGINE_STATS) - 0.5 and s.get("steps") == 0.5
    finally:
        s.close()


def test_formats_geometry() -> None:
    """Codes 1..n without gaps; each block's fields fill it; the C kernel's block-size table is the
    GGUF formats' bytes by code; the nbits4 codes run 16 << (code - QF_NBITS)."""
    c = abi.format_constants()
    table = [int(x) for x in str(c["QF_BLOCK_BYTES"]).strip("{}").split(",")]
    assert table == [0] + [abi.BY_CODE[k].block_bytes for k in range(1, int(c["QF_GGUF_MAX"]) + 1)]
    assert table == [0, 34, 18, 20, 22, 24, 144, 176, 210]  # what the C kernel hard-coded before the ABI
    for f in abi.FORMATS.values():
        assert sum(n for _, n in f.fields) == f.block_bytes
        if f.code >= int(c["QF_NBITS"]):
            assert f.block_k == 16 << (f.code - int(c["QF_NBITS"])) and f.block_bytes == c["NB_HD"] + f.block_k // 2
    assert c["QF_MAX"] == max(abi.BY_CODE) and abi.FORMATS["q4_k"].code == c["QF_KQUANT"]


def test_constants_are_unique_and_cover_the_descriptors() -> None:
    c = abi.constants()
    assert c["TASK_SIGNAL"] == abi.TASK_WAIT_EVENT + abi.TASK_WAIT_WORDS * abi.MAX_WAITS
    assert c["TASK_PARENT"] + 1 < abi.TASK_WORDS  # the pad word stays last
    assert all(f.constant in c for f in abi.all_fields())
    assert c["QF_Q4_1"] == abi.FORMATS["q4_1"].code
