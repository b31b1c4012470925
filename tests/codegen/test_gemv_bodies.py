"""The decode matrix-vector bodies' shapes (emit.gemv_bodies): which chunks and literals each body
gets. Register pressure (spills) is checked on real cubins by tests/test_smollm2_bundle.py and
bench/kernel_stats.py; this pins the plan those cubins come from."""

from types import SimpleNamespace

from zlc import bundle as fmt
from zlc.codegen import program as pg
from zlc.codegen.emit import GATED_MAX_CHUNK, GATED_SPLIT_K, MAX_CHUNK, gemv_bodies


def _program(*shapes: tuple[int, int, bool, int]) -> SimpleNamespace:
    """One decode Linear task per (K, norm, gated, field 12) with a descriptor holding just those."""
    desc, tasks = [], []
    for i, (k, norm, gated, f12) in enumerate(shapes):
        di = [0] * 16
        di[2], di[5], di[10], di[12] = k, (4096 if gated else -1), norm, f12
        desc.append(di)
        tasks.append(SimpleNamespace(op=fmt.OP_LINEAR, desc=i))
    return SimpleNamespace(tables={"decode": tasks}, desc_int=desc)


def test_long_gated_rows_unroll_in_smaller_chunks_with_the_same_bytes_in_flight() -> None:
    p = _program((2048, pg.NORM_RMS, True, -1), (576, pg.NORM_RMS, True, -1), (2048, pg.NORM_RMS, False, -1))
    by = {(g.k, g.gated): g for g in gemv_bodies([p], "bf16", 32)}
    long, short, plain = by[2048, True], by[576, True], by[2048, False]
    assert 2048 >= GATED_SPLIT_K > 576
    assert {c.size for c in long.chunks} == {GATED_MAX_CHUNK} and long.depth == 2
    assert [c.size for c in short.chunks] == [256, 256, 64] and short.depth == 1
    assert {c.size for c in plain.chunks} == {MAX_CHUNK} and plain.depth == 2
    assert long.inflight_kb == short.inflight_kb == plain.inflight_kb == 32.0  # 32 KB per program each


def test_the_merged_body_is_one_per_head_size_with_the_size_in_its_name() -> None:
    p = _program((576, pg.NORM_COMBINE, False, 64), (576, pg.NORM_COMBINE, False, 32), (576, pg.NORM_RMS, False, -1))
    merged = sorted((g for g in gemv_bodies([p], "bf16", 32) if g.norm == pg.NORM_COMBINE), key=lambda g: g.head_d)
    assert [(g.head_d, g.name) for g in merged] == [(32, "_gemv_k576_merged_d32"), (64, "_gemv_k576_merged_d64")]
    plain = [g for g in gemv_bodies([p], "bf16", 32) if g.norm != pg.NORM_COMBINE]
    assert [g.head_d for g in plain] == [0]
