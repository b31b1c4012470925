"""Every feature of the kernel compiled for the GPU, no GPU needed: the kernel rendered with every
`HAS_*` flag on (sliding window, both soft-caps, ALiBi, q/k norms, MoE routing, biases, the
embedding's norm and positions, the fused MLP down, every activation, every packed weight format the
Triton kernel streams) is built by Triton's compiler and ptxas for sm_86 (a10) and sm_90 (h100),
decode and prefill kernels, with the GPU tiling's constants, each cubin assembled again by the
older ptxas the bundle ships for older drivers. The interpreter tests run these bodies, but the
interpreter is dynamically typed: a kernel it runs may be one Triton's compiler rejects (issue 37:
the prefill kernel's sliding window rebinding an int32 to an int64). Registers and spills are
printed (`-s` shows them; docs/megakernel.md quotes them). Slow: ~2-5 min on 2 cores."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from synthetic_programs import every_feature

from zlc.bundle import MODE_DECODE, MODE_PREFILL
from zlc.codegen.aot import AotResult, compile_kernel
from zlc.codegen.emit import ENTRY, Features, render, signature
from zlc.codegen.schedule import tiling_for
from zlc.targets import TARGETS

pytest.importorskip("triton")
pytestmark = pytest.mark.slow

STEPS = {"prefill": MODE_PREFILL, "decode": MODE_DECODE}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[AotResult]]:
    p = every_feature()
    f = Features.of([p])
    assert all(f.flags().values()), f"a feature is off in the every-feature program: {f.flags()}"
    path = tmp_path_factory.mktemp("every") / "kernel.py"
    path.write_text(render([p], weight_dtype="bf16", version="test", gemv_block_n=16))
    tiling = tiling_for(TARGETS["a10"], 64)
    consts: dict[str, Any] = {**tiling.constexprs(), "HEAD_P2": 64, "DEBUG": 0, "TRACE": 0, "PREFETCH": 0}

    def build(step: str) -> list[AotResult]:
        return compile_kernel(path, ENTRY, signature("bf16"), {**consts, "STEP": STEPS[step]},
                              [TARGETS["a10"], TARGETS["h100"]], num_warps=tiling.num_warps)

    with ThreadPoolExecutor(max_workers=2) as pool:  # one compiler process per kernel
        return dict(zip(STEPS, pool.map(build, STEPS), strict=True))


@pytest.mark.parametrize("step", list(STEPS))
def test_every_feature_builds_for_sm86_and_sm90(builds: dict[str, list[AotResult]], step: str) -> None:
    results = builds[step]
    assert [(r.target, r.arch) for r in results] == [("a10", "sm_86"), ("h100", "sm_90")]
    for r in results:
        assert r.cubin[:4] == b"\x7fELF"
        res = r.resources
        print(f"every feature, {step} kernel, {r.arch}: {res.registers} registers, spills {res.spill_stores} B "
              f"stored / {res.spill_loads} B loaded, stack {res.stack} B")
        assert res.registers <= 255
        # every ptxas the bundle ships for this capability built a cubin (or says why it could not)
        assert r.cubins and r.cubins[0].cubin == r.cubin
        if r.arch == "sm_90":
            assert len(r.cubins) == 2 or r.fallback_skipped, "no cubin from the older ptxas, and no reason"
            assert {c.ptxas for c in r.cubins} <= {"ptxas", "ptxas-blackwell"}

