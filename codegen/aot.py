"""Ahead-of-time compilation of a generated Triton kernel file to PTX and cubin per named target,
on a machine without a GPU.

`triton.compile` with an explicit `GPUTarget` needs no driver: Triton lowers to PTX and runs the
ptxas it ships (sm_90+ through its bundled ptxas-blackwell). Compilation always happens in a fresh
child process because Triton reads TRITON_INTERPRET once, at import, and a parent that runs
kernels on the CPU interpreter has it set; the child imports Triton once and compiles every
distinct compute capability in turn.

Transport: the parent writes `request.json` into a temp dir, the child answers with
`result.json` (plus one `<arch>.cubin` / `<arch>.ptx` per capability) and streams progress on
stdout as marker-prefixed lines; anything else on stdout or stderr is only shown on a crash.

Two toolkits. Triton assembles sm_90+ with `ptxas-blackwell` (CUDA 13.x), whose cubins need a
CUDA 13 driver (>= 580), and sm_80/86/89 with the older `ptxas` (CUDA 12.9) its wheel also ships.
So every sm_90+ kernel is assembled a second time, from the same PTX, by that older ptxas
(`assemble`; the PTX header's ISA version lowered to what it accepts): a driver of the CUDA 12
family then still has a cubin it loads. Each `CubinBuild` records its toolkit, PTX ISA and the
oldest driver that loads it (`min_driver_version`), and the executor picks by driver version.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zlc.errors import ZlcError

from .toolchain import ToolNotFoundError, find_tool

if TYPE_CHECKING:
    from zlc.targets import Target

__all__ = ["AotError", "AotResult", "CubinBuild", "Resources", "assemble", "check_ptx_sync", "compile_kernel",
           "cubin_elf_abi", "min_driver_version", "ptx_isa_version", "resource_usage"]


class AotError(ZlcError):
    """Ahead-of-time compilation failed: bad target, unloadable kernel file, Triton or ptxas error."""


@dataclass(frozen=True)
class Resources:
    """Per-thread / per-CTA resources of the kernel function, from `cuobjdump -res-usage`.

    cuobjdump does not report spills, so `spill_stores` / `spill_loads` (bytes) come from the
    ptxas `-v` log; they are 0 when no log was available."""

    registers: int
    stack: int  # bytes of stack frame per thread (spills live here)
    shared: int  # static shared memory incl. what the arch reserves (1 KiB on sm_90), not Triton's dynamic smem
    local: int
    spill_stores: int
    spill_loads: int


@dataclass(frozen=True)
class CubinBuild:
    """One cubin of a kernel: the ptxas (and so the CUDA toolkit) that assembled it, from which PTX
    ISA version, and the oldest driver that loads it."""

    cubin: bytes
    ptxas: str  # the tool's file name: "ptxas-blackwell" (Triton's for sm_90+) or "ptxas"
    toolkit: str  # its CUDA release, "13.4"
    ptx_isa: str  # the PTX `.version` it assembled, "9.4" (lowered for an older ptxas)
    min_driver: int  # cuDriverGetVersion encoding (1000 * major + 10 * minor): min_driver_version(toolkit)
    elf_abi: int  # the cubin's ELF EI_ABIVERSION (7 from CUDA 12 tools, 8 from CUDA 13)
    resources: Resources
    seconds: float  # the ptxas run (for Triton's own cubin: the whole triton.compile)

    def entry(self, path: str) -> dict[str, Any]:
        """The manifest's record of this cubin stored at `path` in the bundle."""
        return {"cubin": path, "ptxas": self.ptxas, "toolkit": self.toolkit, "ptx_isa": self.ptx_isa,
                "min_driver": self.min_driver, "elf_abi": self.elf_abi, "resources": asdict(self.resources)}


@dataclass
class AotResult:
    target: str  # e.g. "h100"
    arch: str  # e.g. "sm_90" (Target.arch; Triton's PTX says sm_90a for capability 90)
    cubin: bytes
    ptx: str
    metadata: dict[str, Any]  # JSON-serialisable subset of Triton's KernelMetadata (_METADATA_KEYS)
    params: list[dict[str, Any]]  # full launch parameter list, in order, hidden ones flagged
    resources: Resources
    seconds: float  # wall time of the triton.compile call (shared by targets of one capability)
    # every cubin of the kernel, preferred first: [0] is `cubin` (Triton's own ptxas), then the one
    # the older ptxas assembled from the same PTX (sm_90+)
    cubins: list[CubinBuild] = field(default_factory=list)
    fallback_skipped: str | None = None  # why the older ptxas built no cubin, when it did not


_METADATA_KEYS = (
    "name", "num_warps", "num_ctas", "shared", "global_scratch_size", "global_scratch_align",
    "profile_scratch_size", "profile_scratch_align", "launch_cooperative_grid", "launch_pdl",
    "triton_version", "hash",
)

# Triton 3.9's CUDA launcher (backends/nvidia/driver.c) always appends these two pointers after the
# user arguments -- NULL when the size in the metadata is 0, but the kernel still declares them.
# compile_kernel checks the count against the PTX entry so an ABI change fails loudly.
_HIDDEN_PARAMS: tuple[dict[str, Any], ...] = (
    {"name": "global_scratch", "type": "*i8", "hidden": True},
    {"name": "profile_scratch", "type": "*i8", "hidden": True},
)

_PROGRESS = "@@zlc-aot-progress "  # stdout marker, so stray prints from Triton/MLIR are ignored
_ERROR_LINES = 14  # how much of a Triton/ptxas message to keep


def compile_kernel(
    kernel_path: Path,
    fn_name: str,
    signature: dict[str, str],
    constexprs: Mapping[str, object],
    targets: Sequence[Target],
    *,
    num_warps: int = 4,
    num_stages: int = 1,
    on_progress: Callable[[str], None] | None = None,
    legacy_ptxas: bool = True,
) -> list[AotResult]:
    """Compile `fn_name` (a `@triton.jit` function in `kernel_path`) for each target; one result per
    target, in order. `signature` maps every argument to a Triton type ("*fp32", "i32", ... or
    "constexpr"); arguments named in `constexprs` may be left out of it, and constexpr arguments
    with a default may be left out of both. Constexpr values must be JSON scalars. Targets sharing
    a compute capability share one compile. `legacy_ptxas`: also assemble the PTX with the wheel's
    older `ptxas` where Triton used a newer one (sm_90+), into `AotResult.cubins`."""
    for t in targets:
        if t.compute_capability is None:
            raise AotError(
                f"target '{t.name}' runs on Triton's CPU interpreter ({t.arch}); there is nothing to "
                "compile ahead of time -- pick a GPU target"
            )
    if not targets:
        return []
    kernel_path = Path(kernel_path).resolve()
    if not kernel_path.is_file():
        raise AotError(f"kernel file not found: {kernel_path}")
    ccs = list(dict.fromkeys(int(t.compute_capability) for t in targets))  # type: ignore[arg-type]
    # The child compiles a copy of the file in its working directory and names it by its file
    # name alone in the line info (`.file` in the PTX, the cubin's line table): the same source
    # gives the same PTX and cubin wherever it is compiled (the compile cache relies on it).
    request = {
        "kernel_path": kernel_path.name, "kernel_dir": str(kernel_path.parent), "source": kernel_path.read_text(),
        "fn_name": fn_name, "signature": dict(signature),
        "constexprs": dict(constexprs), "ccs": ccs, "num_warps": num_warps, "num_stages": num_stages,
    }
    try:
        request_text = json.dumps(request)
    except TypeError as e:
        raise AotError(f"constexpr values for '{fn_name}' must be JSON scalars: {e}") from None

    with tempfile.TemporaryDirectory(prefix="zlc-aot-") as tmp:
        work = Path(tmp)
        (work / "request.json").write_text(request_text)
        result = _run_child(work, fn_name, on_progress)
        built: dict[int, dict[str, Any]] = {}
        for k in result["kernels"]:
            cubin = (work / f"{k['arch']}.cubin").read_bytes()
            ptx = (work / f"{k['arch']}.ptx").read_text()
            n_ptx = _ptx_entry_param_count(ptx, k["metadata"]["name"])
            if n_ptx is not None and n_ptx != len(k["params"]):
                raise AotError(
                    f"'{fn_name}' for {k['arch']}: the PTX entry has {n_ptx} parameters but zlc expects "
                    f"{len(k['params'])} ({len(_HIDDEN_PARAMS)} hidden); Triton's launch ABI changed"
                )
            res = resource_usage(cubin, function=k["metadata"]["name"], ptxas_log=k["ptxas_log"])
            tool, toolkit = Path(k["ptxas"]["path"]).name, str(k["ptxas"]["version"])
            cubins = [CubinBuild(cubin=cubin, ptxas=tool, toolkit=toolkit, ptx_isa=ptx_isa_version(ptx),
                                 min_driver=min_driver_version(toolkit), elf_abi=cubin_elf_abi(cubin),
                                 resources=res, seconds=k["seconds"])]
            skipped = None
            if legacy_ptxas and tool != "ptxas":
                old_tool = _nvidia_tool("ptxas")
                if ptxas_release(old_tool) != toolkit:
                    try:
                        cubins.append(assemble(ptx, old_tool, function=k["metadata"]["name"]))
                    except AotError as e:  # the bundle still has Triton's cubin; the manifest says why
                        skipped = str(e)
            built[k["cc"]] = {**k, "cubin": cubin, "ptx": ptx, "resources": res, "cubins": cubins,
                              "skipped": skipped}

    out = []
    for t in targets:
        b = built[int(t.compute_capability)]  # type: ignore[arg-type]
        out.append(AotResult(
            target=t.name, arch=t.arch, cubin=b["cubin"], ptx=b["ptx"], metadata=dict(b["metadata"]),
            params=[dict(p) for p in b["params"]], resources=b["resources"], seconds=b["seconds"],
            cubins=list(b["cubins"]), fallback_skipped=b["skipped"],
        ))
    return out


def _run_child(work: Path, fn_name: str, on_progress: Callable[[str], None] | None) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # read once at `import triton`: must never reach the compiler
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, stated so it does not warn
    env["TRITON_ALWAYS_COMPILE"] = "1"  # a cache hit skips ptxas, and with it the log we read spills from
    env["TRITON_DUMP_PTXAS_LOG"] = "1"  # make_cubin prints the `ptxas -v` log; the child captures it
    cmd = [sys.executable, "-c", "import sys; from zlc.codegen.aot import _child_main; _child_main(sys.argv[1])",
           str(work)]
    stray: list[str] = []
    with open(work / "stderr.txt", "w") as err:
        # cwd=work so the child's sys.path[0] holds nothing that could shadow a package
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith(_PROGRESS):
                    if on_progress is not None:
                        on_progress(line[len(_PROGRESS):].rstrip("\n"))
                else:
                    stray.append(line)
            rc = proc.wait()
        finally:
            if proc.poll() is None:  # interrupted: do not leave a ptxas run behind
                proc.kill()
                proc.wait()
    result_file = work / "result.json"
    if not result_file.exists():
        tail = ((work / "stderr.txt").read_text(errors="replace") + "".join(stray)).strip().splitlines()
        raise AotError(f"the Triton compiler process for '{fn_name}' died (exit code {rc}):\n"
                       + "\n".join(tail[-_ERROR_LINES:]))
    result: dict[str, Any] = json.loads(result_file.read_text())
    if not result["ok"]:
        raise AotError(result["error"])
    return result


def resource_usage(cubin: bytes, *, function: str | None = None, ptxas_log: str | None = None) -> Resources:
    """Resources of `function` in `cubin` (the only function when None) from `cuobjdump -res-usage`;
    spill bytes from `ptxas_log` (ptxas -v output) when given, else 0."""
    tool = _nvidia_tool("cuobjdump")
    with tempfile.TemporaryDirectory(prefix="zlc-res-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([tool, "-res-usage", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise AotError(f"cuobjdump -res-usage failed: {(proc.stderr or proc.stdout).strip()[:500]}")
    # " Function mk:\n  REG:12 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:400 TEXTURE:0 ..."
    funcs = dict(re.findall(r"^\s*Function (\S+):\s*\n\s*(.*)$", proc.stdout, re.M))
    if function is None:
        if len(funcs) != 1:
            raise AotError(f"cubin has {len(funcs)} functions ({', '.join(funcs)}); name one")
        function = next(iter(funcs))
    if function not in funcs:
        raise AotError(f"cuobjdump lists no function '{function}' (found: {', '.join(funcs) or 'none'})")
    fields = {k: int(v) for k, v in re.findall(r"([A-Z]+):(\d+)", funcs[function])}
    stores = loads = 0
    if ptxas_log:
        # "ptxas info : Function properties for mk\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
        m = re.search(rf"Function properties for {re.escape(function)}\s*\n.*?(\d+) bytes spill stores, "
                      r"(\d+) bytes spill loads", ptxas_log)
        if m:
            stores, loads = int(m.group(1)), int(m.group(2))
    return Resources(
        registers=fields.get("REG", 0), stack=fields.get("STACK", 0), shared=fields.get("SHARED", 0),
        local=fields.get("LOCAL", 0), spill_stores=stores, spill_loads=loads,
    )


def min_driver_version(toolkit: str) -> int:
    """The oldest driver, as cuDriverGetVersion reports it (1000 * major + 10 * minor), that loads a
    cubin the ptxas of CUDA `toolkit` ("13.4") assembled.

    The rule is NVIDIA's "CUDA Compatibility" guide, section "Minor Version Compatibility"
    (https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html): from
    CUDA 11 on, device code built with any toolkit of a major release runs on every driver of that
    major release from its minimum on (CUDA 12.x: >= 525, which reports 12.0; CUDA 13.x: >= 580,
    13.0), and on every newer driver (binary backward compatibility). That holds for SASS (cubins)
    only: PTX is JIT-compiled by the driver, which refuses an ISA version newer than its own
    (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), so zlc ships no PTX for the driver. Before CUDA 11 a
    toolkit needed the driver of its own release."""
    major, minor = (int(x) for x in toolkit.split(".")[:2])
    return 1000 * major + (0 if major >= 11 else 10 * minor)


def ptx_isa_version(ptx: str) -> str:
    """The PTX ISA version its header declares (`.version 9.4` -> "9.4")."""
    m = re.search(r"^\s*\.version\s+(\d+\.\d+)", ptx, re.M)
    if m is None:
        raise AotError("the PTX has no .version directive")
    return m.group(1)


def cubin_elf_abi(cubin: bytes) -> int:
    """EI_ABIVERSION of a cubin's ELF header (7 from CUDA 12 tools, 8 from CUDA 13)."""
    if cubin[:4] != b"\x7fELF" or len(cubin) < 16:
        raise AotError("not a cubin (no ELF header)")
    return cubin[8]


_RELEASES: dict[str, str] = {}


def ptxas_release(tool: str) -> str:
    """The CUDA release of a ptxas binary ("12.9"), from its --version."""
    if tool not in _RELEASES:
        out = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
        m = re.search(r"release (\d+\.\d+)", out)
        if m is None:
            raise AotError(f"{tool} --version names no release: {out.strip()[:200]}")
        _RELEASES[tool] = m.group(1)
    return _RELEASES[tool]


# Triton 3.9's ptxas flags (backends/nvidia/compiler.py, make_cubin) minus the temp paths: line
# info for the SASS tools, -v for the spill log, and its register-allocation workaround.
_PTXAS_FLAGS = ("-lineinfo", "-v", "--regAllocOptLevel=2")
_UNSUPPORTED_ISA = re.compile(r"Unsupported \.version (\d+\.\d+); current version is '(\d+\.\d+)'")


def assemble(ptx: str, tool: str, *, function: str | None = None) -> CubinBuild:
    """`ptx` assembled by the ptxas at `tool` for the PTX's own `.target`, with Triton's flags.

    Triton writes the ISA version of the ptxas it compiles with into the header (9.4 for CUDA
    13.4), while the LLVM that produced the PTX targets at most ISA 9.0 features. When `tool` is
    older than the header, ptxas refuses it naming the newest version it knows ("Unsupported
    .version 9.4; current version is '8.8'"); the header is then lowered to that version and
    assembled again. Sound because ptxas checks every instruction and directive against the
    header's version ("Feature 'discard' requires PTX ISA .version 7.4 or later" is an error, not a
    warning): a cubin comes back only when the PTX uses nothing the lower ISA lacks. The version
    is never raised."""
    target = re.search(r"^\s*\.target\s+(sm_\w+)", ptx, re.M)
    if target is None:
        raise AotError("the PTX has no .target directive")
    arch = target.group(1)
    isa = ptx_isa_version(ptx)
    with tempfile.TemporaryDirectory(prefix="zlc-ptxas-") as tmp:
        src, out = Path(tmp) / "kernel.ptx", Path(tmp) / "kernel.cubin"
        t0 = time.perf_counter()
        for _ in range(2):
            src.write_text(ptx)
            proc = subprocess.run([tool, *_PTXAS_FLAGS, f"--gpu-name={arch}", str(src), "-o", str(out)],
                                  capture_output=True, text=True)
            m = _UNSUPPORTED_ISA.search(proc.stderr)
            if proc.returncode == 0 or m is None or _isa_key(m.group(2)) >= _isa_key(isa):
                break
            isa = m.group(2)
            ptx = re.sub(r"^(\s*\.version\s+)\d+\.\d+", rf"\g<1>{isa}", ptx, count=1, flags=re.M)
        if proc.returncode != 0:
            raise AotError(f"{Path(tool).name} {ptxas_release(tool)} cannot assemble the PTX (ISA {isa}, "
                           f"{arch}): {_head(proc.stderr or proc.stdout)}")
        seconds = time.perf_counter() - t0
        cubin = out.read_bytes()
    toolkit = ptxas_release(tool)
    return CubinBuild(cubin=cubin, ptxas=Path(tool).name, toolkit=toolkit, ptx_isa=isa,
                      min_driver=min_driver_version(toolkit), elf_abi=cubin_elf_abi(cubin),
                      resources=resource_usage(cubin, function=function, ptxas_log=proc.stderr),
                      seconds=seconds)


def _isa_key(v: str) -> tuple[int, int]:
    major, minor = v.split(".")
    return int(major), int(minor)


def check_ptx_sync(ptx: str) -> list[str]:
    """Problems with the megakernel's cross-CTA memory ordering in `ptx`; [] means ok.

    The protocol (docs/megakernel.md, "Why it is correct"): a task signals with a release atomic
    (`red`/`atom`/`st` .release, or a gpu/sys fence before a relaxed one) wider than a CTA; a waiting
    task polls with a strong load at gpu/sys scope (`ld.relaxed.gpu`, `ld.acquire`, `atom`) and
    reads what other CTAs wrote with `.cg` loads (L2, never a stale L1 line). acq_rel atomics
    (Triton's default for atomic_add) are not counted as the release: they would hide a release
    lowered to relaxed, the Triton-upgrade regression this guard exists for."""
    release = strong_poll = cg_load = False
    cta_scoped: list[str] = []
    for raw in ptx.splitlines():
        line = raw.strip()
        if line.startswith("@"):  # predicate guard: "@%p10 red.global..."
            line = line.split(None, 1)[1] if " " in line else ""
        if not line or line.startswith("//"):
            continue
        op = line.split(None, 1)[0].rstrip(";")
        parts = op.split(".")
        is_rel = parts[0] in ("red", "atom", "st") and "release" in parts
        is_poll = parts[0] == "ld" and any(p in parts for p in ("relaxed", "acquire", "volatile")) and (
            "cta" not in parts)
        if (is_rel or (parts[0] in ("ld", "atom", "fence") and "acquire" in parts)) and "cta" in parts:
            cta_scoped.append(op)
            continue
        release |= is_rel
        strong_poll |= is_poll
        cg_load |= parts[0] == "ld" and "global" in parts and "cg" in parts
    problems = []
    if not release:
        problems.append("no release atomic at gpu/sys scope (red/atom/st .release): "
                        "a signal may become visible before the data it publishes")
    if not strong_poll:
        problems.append("no strong poll at gpu/sys scope (ld.relaxed.gpu / ld.acquire): a waiting CTA "
                        "may spin on a stale copy of an event")
    if not cg_load:
        problems.append("no .cg loads: activations written by other CTAs could be read through a stale L1")
    if cta_scoped:
        problems.append(f"CTA-scoped ordering does not synchronise across CTAs: {', '.join(sorted(set(cta_scoped)))}")
    return problems


def _ptx_entry_param_count(ptx: str, name: str) -> int | None:
    m = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    return None if m is None else len(re.findall(r"\.param\b", m.group(1)))


def _nvidia_tool(name: str) -> str:
    try:
        return find_tool(name)
    except ToolNotFoundError as e:
        raise AotError(str(e)) from None


# ---- child process -------------------------------------------------------------------------------


def _child_main(workdir: str) -> None:
    """Entry point of the compiler process: reads request.json, writes result.json and the binaries."""
    work = Path(workdir)
    out = sys.stdout  # captured Triton prints must not be mistaken for progress lines
    try:
        result = _child_compile(json.loads((work / "request.json").read_text()), work,
                                lambda msg: print(_PROGRESS + msg, file=out, flush=True))
    except AotError as e:
        result = {"ok": False, "error": str(e)}
    (work / "result.json").write_text(json.dumps(result))


# `.maxnreg 255` in the PTX: one program per SM may take every register it needs. Without it ptxas
# may aim at two programs per SM (128 registers at 256 threads) when a kernel needs a little more,
# and spill to get there: the tiny Llama's sm_86 decode kernel, once the features it does not use
# were compiled out (emit.Features), took 128 registers and 68 bytes of spill stores; with the
# directive, 168 and none. A persistent kernel launches one program per SM: the second would idle.
MAX_REGISTERS = 255


def _child_compile(req: dict[str, Any], work: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    assert "TRITON_INTERPRET" not in os.environ
    path, fn_name = Path(req["kernel_path"]), req["fn_name"]
    (work / path).write_text(req["source"])
    os.utime(work / path, (0, 0))  # ptxas records the file's mtime in the cubin's line table
    sys.path.insert(0, req["kernel_dir"])  # generated kernels may import sibling helper files
    fn = _load_kernel(path, fn_name)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError

    arg_names: list[str] = list(fn.arg_names)
    sig: dict[str, str] = req["signature"]
    # a constexpr argument with a default (the kernel's TRACE) compiles at its default unless given
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty and n not in sig}
    consts: dict[str, Any] = {**defaults, **req["constexprs"]}
    full = {a: sig.get(a, "constexpr" if a in consts else None) for a in arg_names}
    missing = [a for a, t in full.items() if t is None]
    extra = [a for a in [*sig, *consts] if a not in full]
    if missing or extra:
        raise AotError(f"signature of '{fn_name}' does not match its arguments ({', '.join(arg_names)}): "
                       + "; ".join(s for s in (missing and f"missing {', '.join(missing)}",
                                               extra and f"unknown {', '.join(extra)}") if s))
    params = [{"name": a, "type": t} for a, t in full.items() if t != "constexpr"] + list(_HIDDEN_PARAMS)
    # Every pointer parameter is 16-byte aligned (the executors allocate each arena on its own, and
    # the driver aligns allocations to 256 bytes): saying so lets Triton emit 128-bit loads, which
    # Triton's own launcher would have found by checking the pointers at run time.
    aligned = {(arg_names.index(a),): [["tt.divisibility", 16]] for a, t in full.items()
               if t is not None and t.startswith("*")}

    kernels = []
    for cc in req["ccs"]:
        arch = f"sm_{cc}"
        log = io.StringIO()
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(log):  # ptxas -v log (TRITON_DUMP_PTXAS_LOG) and failure dumps
                ck = triton.compile(
                    ASTSource(fn, full, constexprs=consts, attrs=aligned), target=GPUTarget("cuda", cc, 32),
                    options={"num_warps": req["num_warps"], "num_stages": req["num_stages"], "maxnreg": MAX_REGISTERS},
                )
        except CompilationError as e:
            raise AotError(f"Triton could not compile '{fn_name}' ({path.name}) for {arch}: "
                           f"{_compilation_message(e, path)}") from None
        except Exception as e:  # ptxas (PTXASError), MLIR pass failures, asserts in the lowering
            raise AotError(f"Triton could not compile '{fn_name}' ({path.name}) for {arch}: "
                           f"{type(e).__name__}: {_head(str(e))}") from None
        seconds = time.perf_counter() - t0
        (work / f"{arch}.cubin").write_bytes(ck.asm["cubin"])
        (work / f"{arch}.ptx").write_text(ck.asm["ptx"])
        md = ck.metadata._asdict() if hasattr(ck.metadata, "_asdict") else dict(ck.metadata)
        tool = get_ptxas(cc)  # the ptxas Triton ran for this capability (ptxas-blackwell from sm_90)
        kernels.append({
            "cc": cc, "arch": arch, "seconds": seconds, "params": params, "ptxas_log": log.getvalue(),
            "metadata": {k: md.get(k) for k in _METADATA_KEYS},
            "ptxas": {"path": str(tool.path), "version": str(tool.version)},
        })
        progress(f"{arch}: compiled {fn_name} in {seconds:.1f} s")
    return {"ok": True, "kernels": kernels}


def _load_kernel(path: Path, fn_name: str) -> Any:
    # Triton reads kernel source with `inspect`, which needs a real module backed by the file.
    mod_name = "_zlc_aot_" + re.sub(r"\W", "_", path.stem)
    try:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module
        spec.loader.exec_module(module)
    except Exception as e:
        detail = "".join(traceback.format_exception_only(type(e), e)).rstrip()
        raise AotError(f"cannot load kernel '{fn_name}' from {path}:\n{_head(detail)}") from None
    fn = getattr(module, fn_name, None)
    if fn is None or not hasattr(fn, "arg_names"):
        what = "is not defined" if fn is None else "is not a @triton.jit function"
        raise AotError(f"'{fn_name}' {what} in {path}")
    for f in vars(module).values():  # the line info names the file alone: no directory in the PTX
        if hasattr(f, "arg_names") and hasattr(f, "file_name"):
            f.file_name = path.name
    return fn


def _compilation_message(e: Any, path: Path) -> str:
    # Triton's message is "at L:C:\n<function source up to the error>\n   ^\n<message>" with L
    # counted from the function's `def`; an error inside a called @jit helper comes as a chain of
    # these (call site -> __cause__ -> ...). Lead with the innermost message and its file line,
    # then name the call sites.
    from triton.compiler.errors import CompilationError  # child only: triton is imported already

    chain = [e]
    while isinstance(chain[-1].__cause__, CompilationError):
        chain.append(chain[-1].__cause__)
    inner = chain[-1]
    if getattr(inner.node, "lineno", None) is None or inner.src is None:
        return _head(str(e))
    lines = [f"{inner.error_message or 'error'} ({_where(inner, path)})",
             *inner.src.split("\n")[:inner.node.lineno][-3:],
             " " * getattr(inner.node, "col_offset", 0) + "^"]
    lines += [f"  called from {_where(c, path)}" for c in reversed(chain[:-1])]
    return "\n".join(lines)


def _where(e: Any, path: Path) -> str:
    lineno = getattr(e.node, "lineno", None)
    start = _def_line(e.src, path) if e.src is not None else None
    if lineno is None:
        return path.name
    if start is None:
        return f"{path.name}, line {lineno} of the function"
    return f"{path.name}:{start + lineno - 1}"


def _def_line(src: str, path: Path) -> int | None:
    """1-based line of the file where the function whose source is `src` starts its `def`."""
    first = next((ln for ln in src.split("\n") if ln.strip().startswith("def ")), None)
    if first is None:
        return None
    try:
        lines = path.read_text().split("\n")
    except OSError:
        return None
    hits = [i + 1 for i, ln in enumerate(lines) if ln.strip() == first.strip()]
    return hits[0] if len(hits) == 1 else None


def _head(text: str) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:_ERROR_LINES] + (["..."] if len(lines) > _ERROR_LINES else []))
