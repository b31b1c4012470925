"""The source the emitter writes for the decode matrix-vector bodies (codegen/gemv_source.py), pinned
by golden files: SmolLM2-135M's shapes (K 576, RMSNorm, bf16 weights, BLOCK_N 32) as gemv_plan.gemv_bodies
plans them -- the gate/up pair, the gate/up pair with the MLP down fused, the LM head's rolled wide
body -- and the dispatch chain that picks them.

A change to the emitter (or to the plan) shows here as a diff against tests/codegen/golden/. Once the
new source is what is meant (and, for a change meant to leave the machine code alone, the cubins
compare equal: docs/megakernel.md, "Linear bodies"), rewrite the files with
    ZLC_WRITE_GOLDEN=1 python -m pytest tests/codegen/test_gemv_source.py
and commit them with the change."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from zlc import bundle as fmt
from zlc.abi import LinearDesc
from zlc.codegen import gemv_source
from zlc.codegen import program as pg
from zlc.codegen.gemv_plan import GemvBody, gemv_bodies

GOLDEN = Path(__file__).parent / "golden"
WRITE = os.environ.get("ZLC_WRITE_GOLDEN") == "1"

SILU = pg.ACTIVATIONS["silu"]
# SmolLM2-135M's decode Linear tasks with these shapes (hidden 576, MLP 1536, vocab columns in
# tasks of 256): (descriptor fields, task columns)
TASKS = [
    (dict(k=576, n=1536, w2=4096, norm=pg.NORM_RMS, act=SILU), 32),  # gate/up
    (dict(k=576, n=1536, w2=4096, norm=pg.NORM_RMS, act=SILU, down_w=8192, down_out=512, down_bias=-1,
          down_rows=576), 32),  # gate/up with the down fused
    (dict(k=576, n=49152, w2=-1, norm=pg.NORM_RMS, lm=1), 256),  # the LM head
]


def _bodies() -> dict[str, GemvBody]:
    desc, tasks = [], []
    for i, (fields, cols) in enumerate(TASKS):
        di = [0] * fmt.DESC_WORDS
        for word, v in LinearDesc.row(**fields)[0].items():
            di[word] = v
        desc.append(di)
        tasks.append(SimpleNamespace(op=fmt.OP_LINEAR, desc=i, a=0, b=cols))
    p = SimpleNamespace(tables={"decode": tasks}, desc_int=desc,
                        tiling=SimpleNamespace(block_n=32, lm_block_n=256, kv_splits=8))
    return {g.name: g for g in gemv_bodies([p], "bf16", 32)}


def _golden(name: str, text: str) -> None:
    path = GOLDEN / f"{name}.txt"
    if WRITE:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"no {path}: write it with ZLC_WRITE_GOLDEN=1"
    assert text == path.read_text(), f"{name} differs from {path} (ZLC_WRITE_GOLDEN=1 rewrites it)"


def test_the_plan_is_smollm2s() -> None:
    assert set(_bodies()) == {"_gemv_k576_rms_gated", "_gemv_k576_rms_gated_down576x1536", "_gemv_k576_rms_lm256"}


@pytest.mark.parametrize("name", ["_gemv_k576_rms_gated", "_gemv_k576_rms_gated_down576x1536",
                                  "_gemv_k576_rms_lm256"])
def test_body_source(name: str) -> None:
    src = gemv_source.body(_bodies()[name])
    compile(src, name, "exec")
    _golden(name, src)


def test_dispatch_source() -> None:
    """The packed body first (a constexpr-0 `wf` folds it away without HAS_PACKED), then the
    fused-down bodies; with and without MoE routing (a routed expert takes the generic body)."""
    bodies = list(_bodies().values())
    src = gemv_source.dispatch(bodies, moe_route=False)
    assert src.splitlines()[-1] == "    else:"
    assert gemv_source.dispatch(bodies, moe_route=True) == src.replace("SPECIALIZED &", "SPECIALIZED & (route == 0) &")
    _golden("dispatch", src + "\n")
    assert gemv_source.dispatch([], moe_route=False).splitlines() == [
        "    if wf != 0:",
        "        _linear_q(DI, DF, CNT, CTRL, Q, P, A, row, d, r, n0, n1, slot, BLOCK_N, BLOCK_K, KV_SPLITS, DEBUG, "
        "SPECIALIZED)",
        "    else:"]
