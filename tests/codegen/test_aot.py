"""AOT compilation of a Triton kernel file to cubin/PTX for named NVIDIA targets, without a GPU:
real compiles in a child process (ptxas ships in the triton wheel)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from zlc.codegen.aot import (
    AotError,
    AotResult,
    assemble,
    check_ptx_sync,
    compile_kernel,
    cubin_elf_abi,
    min_driver_version,
    ptx_isa_version,
    resource_usage,
)
from zlc.errors import ZlcError
from zlc.targets import TARGETS

pytest.importorskip("triton")

# A persistent-loop toy with the megakernel's protocol: tasks claimed with an atomic counter, a
# dependency waited on with a relaxed (strong) poll, data another CTA wrote read with .cg,
# completion signalled with a release add.
PERSISTENT = '''\
import triton
import triton.language as tl


@triton.jit
def body(A, i):
    x = tl.load(A + i, cache_modifier=".cg")
    tl.store(A + i, x * 2.0)


@triton.jit
def mk(TASKS, CNT, A, n_tasks, DEBUG: tl.constexpr):
    t = tl.atomic_add(CNT, 1)
    while t < n_tasks:
        op = tl.load(TASKS + t * 4)
        w = tl.load(TASKS + t * 4 + 1)
        if w >= 0:
            if DEBUG:
                ok = tl.atomic_poll(CNT + 1 + w, 1, sem="relaxed", timeout_ns=1000000)
            else:
                ok = tl.atomic_poll(CNT + 1 + w, 1, sem="relaxed")
        if op == 0:
            body(A, t)
        elif op == 1:
            body(A, t + 100)
        tl.atomic_add(CNT + 1 + t, 1, sem="release")
        t = tl.atomic_add(CNT, 1)
    d = tl.atomic_add(CNT + 64, 1, sem="acq_rel")
    if d == tl.num_programs(0) - 1:
        tl.store(CNT, 0)
        tl.store(CNT + 64, 0)
'''
SIG = {"TASKS": "*i32", "CNT": "*i32", "A": "*fp32", "n_tasks": "i32"}  # DEBUG comes from constexprs


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[AotResult], list[str]]]:
    path = tmp_path_factory.mktemp("aot") / "kernel.py"
    path.write_text(PERSISTENT)
    progress: list[str] = []
    # The parent may run kernels on the interpreter; the compiler process must not inherit that.
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        results = compile_kernel(path, "mk", SIG, {"DEBUG": False},
                                 [TARGETS["a10"], TARGETS["h100"], TARGETS["rtx3090"]],
                                 on_progress=progress.append)
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old
    yield results, progress


def test_one_result_per_target_one_compile_per_capability(built: tuple[list[AotResult], list[str]]) -> None:
    results, progress = built
    assert [(r.target, r.arch) for r in results] == [("a10", "sm_86"), ("h100", "sm_90"), ("rtx3090", "sm_86")]
    assert len(progress) == 2 and progress[0].startswith("sm_86: ") and progress[1].startswith("sm_90: ")
    a10, _, rtx = results
    assert rtx.cubin == a10.cubin and rtx.seconds == a10.seconds


def test_cubin_and_ptx(built: tuple[list[AotResult], list[str]]) -> None:
    for r in built[0]:
        assert r.cubin[:4] == b"\x7fELF"
        assert re.search(rf"^\.target {r.arch}a?$", r.ptx, re.M), r.arch  # Triton targets sm_90a on Hopper
        assert r.seconds > 0


def test_metadata_is_json_and_describes_the_launch(built: tuple[list[AotResult], list[str]]) -> None:
    for r in built[0]:
        md = json.loads(json.dumps(r.metadata))
        assert md["name"] == "mk" and md["num_warps"] == 4 and md["num_ctas"] == 1
        assert md["global_scratch_size"] == 0 and md["profile_scratch_size"] == 0
        assert md["launch_cooperative_grid"] is False and md["triton_version"]
        assert len(md["hash"]) == 64


def test_params_are_user_then_hidden_and_match_the_ptx_entry(built: tuple[list[AotResult], list[str]]) -> None:
    for r in built[0]:
        assert r.params == [
            {"name": "TASKS", "type": "*i32"}, {"name": "CNT", "type": "*i32"},
            {"name": "A", "type": "*fp32"}, {"name": "n_tasks", "type": "i32"},
            {"name": "global_scratch", "type": "*i8", "hidden": True},
            {"name": "profile_scratch", "type": "*i8", "hidden": True},
        ]
        entry = re.search(r"\.entry mk\((.*?)\)", r.ptx, re.S)
        assert entry is not None and entry.group(1).count(".param") == len(r.params)


def test_resources(built: tuple[list[AotResult], list[str]]) -> None:
    for r in built[0]:
        res = r.resources
        assert res.registers > 0 and res.stack == 0 and res.local == 0
        assert res.spill_stores == 0 and res.spill_loads == 0
        assert resource_usage(r.cubin).registers == res.registers  # standalone: no log, spills 0


def test_spills_come_from_the_ptxas_log(built: tuple[list[AotResult], list[str]]) -> None:
    log = ("ptxas info    : Compiling entry function 'mk' for 'sm_86'\n"
           "ptxas info    : Function properties for mk\n"
           "    96 bytes stack frame, 40 bytes spill stores, 56 bytes spill loads\n")
    res = resource_usage(built[0][0].cubin, function="mk", ptxas_log=log)
    assert (res.spill_stores, res.spill_loads) == (40, 56)
    with pytest.raises(AotError, match="no function 'other'"):
        resource_usage(built[0][0].cubin, function="other")


def test_ptx_sync_guard(built: tuple[list[AotResult], list[str]]) -> None:
    for r in built[0]:
        assert check_ptx_sync(r.ptx) == []
        no_release = "\n".join(ln for ln in r.ptx.splitlines() if ".release" not in ln)
        assert [p for p in check_ptx_sync(no_release) if "release" in p]
        weak_poll = re.sub(r"ld\.relaxed\.gpu", "ld", r.ptx)
        assert [p for p in check_ptx_sync(weak_poll) if "strong poll" in p]
        no_cg = re.sub(r"\.cg\b", "", r.ptx)
        assert [p for p in check_ptx_sync(no_cg) if ".cg" in p]
        cta = re.sub(r"\.release\.gpu|\.gpu\.release", ".release.cta", r.ptx)
        assert any("CTA-scoped" in p for p in check_ptx_sync(cta))


def test_compile_error_names_kernel_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text(PERSISTENT.replace("x * 2.0", "tl.reshape(x, (3, 7))"))
    with pytest.raises(AotError) as e:
        compile_kernel(path, "mk", SIG, {"DEBUG": False}, [TARGETS["a10"]])
    msg = str(e.value)
    assert isinstance(e.value, ZlcError) and "'mk'" in msg and "sm_86" in msg
    assert "power of 2" in msg and "bad.py:8" in msg and "called from bad.py:" in msg
    assert "Traceback" not in msg


def test_syntax_error_names_kernel(tmp_path: Path) -> None:
    path = tmp_path / "syn.py"
    path.write_text(PERSISTENT.replace("x * 2.0", "x * = 2.0"))
    with pytest.raises(AotError, match=r"(?s)cannot load kernel 'mk'.*SyntaxError"):
        compile_kernel(path, "mk", SIG, {"DEBUG": False}, [TARGETS["h100"]])


def test_signature_must_match_arguments(tmp_path: Path) -> None:
    path = tmp_path / "kernel.py"
    path.write_text(PERSISTENT)
    with pytest.raises(AotError, match="missing DEBUG"):
        compile_kernel(path, "mk", SIG, {}, [TARGETS["a10"]])


def test_cpu_target_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AotError, match="'cpu' runs on Triton's CPU interpreter"):
        compile_kernel(tmp_path / "kernel.py", "mk", SIG, {"DEBUG": False}, [TARGETS["a10"], TARGETS["cpu"]])


# ---- two toolkits: Triton's ptxas and the wheel's older one ---------------------------------------


def test_each_toolkits_cubin_is_really_built(built: tuple[list[AotResult], list[str]]) -> None:
    a10, h100, rtx = built[0]
    for r in (a10, rtx):  # sm_86: Triton already assembles with the CUDA 12.9 ptxas; nothing to add
        assert [(c.ptxas, c.toolkit, c.ptx_isa, c.min_driver, c.elf_abi) for c in r.cubins] == [
            ("ptxas", "12.9", "8.8", 12000, 7)]
        assert r.cubins[0].cubin == r.cubin and r.fallback_skipped is None
    new, old = h100.cubins
    assert new.cubin == h100.cubin and (new.ptxas, new.toolkit[:3]) == ("ptxas-blackwell", "13.")
    assert new.ptx_isa == ptx_isa_version(h100.ptx) and new.ptx_isa.startswith("9.")
    assert (new.min_driver, new.elf_abi) == (13000, 8)
    assert (old.ptxas, old.toolkit, old.ptx_isa, old.min_driver, old.elf_abi) == ("ptxas", "12.9", "8.8", 12000, 7)
    assert old.cubin != new.cubin and cubin_elf_abi(old.cubin) == 7
    assert b"release 13." in new.cubin  # the CUDA 13 ELF names its toolkit in a note; the CUDA 12 one has none
    for c in (new, old):  # cuobjdump reads both: the same function, registers, no spills
        res = resource_usage(c.cubin, function="mk")
        assert res.registers == c.resources.registers > 0 and c.resources.spill_stores == 0
        assert c.seconds >= 0


DISCARD = """\
.version {version}
.target sm_80
.address_size 64
.visible .entry f(.param .u64 p)
{{
  .reg .b64 %rd<2>;
  ld.param.u64 %rd1, [p];
  discard.global.L2 [%rd1], 128;
  ret;
}}
"""


def test_assemble_lowers_the_isa_version_only_as_far_as_ptxas_needs(
        built: tuple[list[AotResult], list[str]]) -> None:
    from zlc.codegen.aot import _nvidia_tool  # the wheel's tools

    old, new = _nvidia_tool("ptxas"), _nvidia_tool("ptxas-blackwell")
    h100 = built[0][1]
    assert assemble(h100.ptx, new, function="mk").ptx_isa == ptx_isa_version(h100.ptx)  # never lowered needlessly
    c = assemble(DISCARD.format(version="9.4"), old)  # newer than ptxas 12.9 knows: lowered to its 8.8
    assert (c.ptx_isa, c.toolkit, c.elf_abi) == ("8.8", "12.9", 7) and c.cubin[:4] == b"\x7fELF"
    # why lowering is safe: ptxas checks each instruction against the header's version (discard: 7.4+)
    with pytest.raises(AotError, match=r"ptxas 12\.9 cannot assemble the PTX \(ISA 7\.0, sm_80\).*"
                                       r"'discard' requires PTX ISA \.version 7\.4 or later"):
        assemble(DISCARD.format(version="7.0"), old)


def test_min_driver_version() -> None:
    assert min_driver_version("13.4") == 13000 and min_driver_version("13.0") == 13000
    assert min_driver_version("12.9") == 12000 and min_driver_version("11.8") == 11000
    assert min_driver_version("10.2") == 10020  # before minor version compatibility: its own driver


TIMED = '''\
import triton
import triton.language as tl


@triton.jit
def timed(OUT, TRACE: tl.constexpr = 0):
    t = tl.program_id(0).to(tl.int64)
    if TRACE == 1:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    tl.store(OUT + tl.program_id(0), t)
'''


def test_constexpr_defaults_and_inline_timers(tmp_path: Path) -> None:
    path = tmp_path / "timed.py"
    path.write_text(TIMED)
    plain, = compile_kernel(path, "timed", {"OUT": "*i64"}, {}, [TARGETS["h100"]])  # TRACE: its default
    assert "%globaltimer" not in plain.ptx
    traced, = compile_kernel(path, "timed", {"OUT": "*i64"}, {"TRACE": 1}, [TARGETS["h100"]])
    assert "mov.u64 %rd" in traced.ptx and "%globaltimer" in traced.ptx
    assert [c.toolkit for c in traced.cubins][1:] == ["12.9"]  # the older ptxas takes the timer too
