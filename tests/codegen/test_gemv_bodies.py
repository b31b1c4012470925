"""The decode matrix-vector bodies' shapes (gemv_plan.gemv_bodies): which chunks and literals each body
gets. Register pressure (spills) is checked on real cubins by tests/test_smollm2_bundle.py and
bench/kernel_stats.py; this pins the plan those cubins come from."""

from types import SimpleNamespace

from zlc import bundle as fmt
from zlc.abi import LinearDesc
from zlc.codegen import program as pg
from zlc.codegen.gemv_plan import MAX_CHUNK, MERGED_NARROW_SPLITS, gemv_bodies


def _program(*shapes: tuple[int, int, bool, int], block_n: int = 32, kv_splits: int = 1) -> SimpleNamespace:
    """One decode Linear task per (K, norm, gated, word 12: the LayerNorm bias or, merged, the
    head size) with a descriptor holding just those."""
    desc, tasks = [], []
    for i, (k, norm, gated, w12) in enumerate(shapes):
        di = [0] * fmt.DESC_WORDS
        merged = norm == pg.NORM_COMBINE
        ints, _ = LinearDesc.row(k=k, w2=4096 if gated else -1, norm=norm,
                                 **{"merge_head_dim" if merged else "norm_b": w12})
        for word, v in ints.items():
            di[word] = v
        desc.append(di)
        tasks.append(SimpleNamespace(op=fmt.OP_LINEAR, desc=i, a=0, b=block_n))
    return SimpleNamespace(tables={"decode": tasks}, desc_int=desc,
                           tiling=SimpleNamespace(block_n=block_n, lm_block_n=0, kv_splits=kv_splits))


def test_rows_unroll_in_chunks_under_the_thread_count_with_32_kb_in_flight() -> None:
    """Chunks of 128 columns (under the 256 threads: Triton loads the row's chunk in the weights'
    layout, no shared-memory move), as deep as 32 KB of weights: 4 chunks of one matrix, 2 of a
    gated pair; a K that is no multiple of 128 ends in a smaller chunk."""
    p = _program((2048, pg.NORM_RMS, True, -1), (576, pg.NORM_RMS, True, -1), (2048, pg.NORM_RMS, False, -1))
    by = {(g.k, g.gated): g for g in gemv_bodies([p], "bf16", 32)}
    long, short, plain = by[2048, True], by[576, True], by[2048, False]
    assert MAX_CHUNK == 128
    assert {c.size for c in long.chunks} == {128} and long.depth == 2
    assert [c.size for c in short.chunks] == [128, 128, 128, 128, 64] and short.depth == 2
    assert {c.size for c in plain.chunks} == {128} and plain.depth == 4
    assert long.inflight_kb == short.inflight_kb == plain.inflight_kb == 32.0  # 32 KB per program each


def test_a_row_merged_from_many_splits_unrolls_in_256_column_chunks() -> None:
    """A merged split-KV row (norm 3) keeps 128-column chunks at up to MERGED_NARROW_SPLITS splits;
    past that its per-split loads in the weights' layout cost more than a move across the warps, so
    its chunks are 256 columns (the other bodies keep 128)."""
    shapes = ((576, pg.NORM_COMBINE, False, 64), (576, pg.NORM_RMS, False, -1))
    for splits, size in ((MERGED_NARROW_SPLITS, 128), (MERGED_NARROW_SPLITS + 1, 256), (8, 256)):
        by = {g.norm: g for g in gemv_bodies([_program(*shapes, kv_splits=splits)], "bf16", 32)}
        assert by[pg.NORM_COMBINE].chunks[0].size == size
        assert by[pg.NORM_RMS].chunks[0].size == 128


def test_the_merged_body_is_one_per_head_size_with_the_size_in_its_name() -> None:
    p = _program((576, pg.NORM_COMBINE, False, 64), (576, pg.NORM_COMBINE, False, 32), (576, pg.NORM_RMS, False, -1))
    merged = sorted((g for g in gemv_bodies([p], "bf16", 32) if g.norm == pg.NORM_COMBINE), key=lambda g: g.head_d)
    assert [(g.head_d, g.name) for g in merged] == [(32, "_gemv_k576_merged_d32"), (64, "_gemv_k576_merged_d64")]
    plain = [g for g in gemv_bodies([p], "bf16", 32) if g.norm != pg.NORM_COMBINE]
    assert [g.head_d for g in plain] == [0]


def test_a_body_only_some_tilings_dispatch_is_guarded_by_their_block_n() -> None:
    """A bundle's kernel.py serves the interpreter's tiling (BLOCK_N 128) and the GPUs' (32): a body
    only one of them asks for carries that BLOCK_N in its dispatch, so the other's cubin compiles
    it out; a body both ask for has no guard."""
    interp = _program((2048, pg.NORM_RMS, False, -1), (2048, pg.NORM_NONE, False, -1), block_n=128)
    gpu = _program((2048, pg.NORM_RMS, False, -1), (2048, pg.NORM_COMBINE, False, 64), block_n=32)
    by = {g.name: g for g in gemv_bodies([interp, gpu], "bf16", 32)}
    assert by["_gemv_k2048_rms"].block_n_guard == ""
    assert by["_gemv_k2048"].block_n_guard == "(BLOCK_N == 128)"
    assert by["_gemv_k2048_merged_d64"].block_n_guard == "(BLOCK_N == 32)"
    assert all(g.block_n_guard == "" for g in gemv_bodies([gpu], "bf16", 32))  # one tiling: nothing to select


def test_a_shape_whose_tasks_share_the_activation_and_lm_flag_gets_them_as_literals() -> None:
    """Descriptor words 13 (activation) and 14 (LM head) become literals in a body when every task
    of its shape has the same, else stay loads: an LM head sharing its shape with q/k/v projections
    keeps lm a load, a gate/up body whose tasks are all silu gets act 1 and lm 0."""
    p = _program((2048, pg.NORM_RMS, False, -1), (2048, pg.NORM_RMS, False, -1), (2048, pg.NORM_RMS, True, -1))
    p.desc_int[1][LinearDesc.lm] = 1  # the second plain task is an LM head
    p.desc_int[2][LinearDesc.act] = pg.ACTIVATIONS["silu"]
    by = {g.gated: g for g in gemv_bodies([p], "bf16", 32)}
    assert (by[False].act, by[False].lm) == (0, -1)
    assert (by[True].act, by[True].lm) == (pg.ACTIVATIONS["silu"], 0)


def test_the_lm_heads_wider_tasks_get_their_own_body_with_the_same_bytes_per_chunk() -> None:
    """Tiling.lm_block_n: LM-head tasks wider than BLOCK_N take a body of their own, called with that
    width as its BLOCK_N (so `_lm256` streams 256 columns per task), its chunks as narrow as
    chunk_plan allows (32 columns of 256 rows, not 128 of 256) and its LM flag a literal; the q/k/v
    projections sharing K and norm keep the narrow body, now without LM-head tasks."""
    p = _program((2048, pg.NORM_RMS, False, -1), (2048, pg.NORM_RMS, False, -1))
    p.desc_int[1][LinearDesc.lm] = 1
    p.tables["decode"][1].b = 256
    p.tiling.lm_block_n = 256
    by = {g.name: g for g in gemv_bodies([p], "bf16", 32)}
    assert set(by) == {"_gemv_k2048_rms", "_gemv_k2048_rms_lm256"}
    narrow, wide = by["_gemv_k2048_rms"], by["_gemv_k2048_rms_lm256"]
    assert (narrow.wide, narrow.block_n, narrow.lm) == (0, 32, 0)
    assert (wide.wide, wide.block_n, wide.lm) == (256, 256, 1)
    assert {c.size for c in narrow.chunks} == {MAX_CHUNK} and {c.size for c in wide.chunks} == {32}
    assert narrow.inflight_kb == wide.inflight_kb == 32.0
