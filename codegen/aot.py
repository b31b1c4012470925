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
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zlc.errors import ZlcError

if TYPE_CHECKING:
    from zlc.targets import Target

__all__ = ["AotError", "AotResult", "Resources", "check_ptx_sync", "compile_kernel", "resource_usage"]


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
) -> list[AotResult]:
    """Compile `fn_name` (a `@triton.jit` function in `kernel_path`) for each target; one result per
    target, in order. `signature` maps every argument to a Triton type ("*fp32", "i32", ... or
    "constexpr"); arguments named in `constexprs` may be left out of it. Constexpr values must be
    JSON scalars. Targets sharing a compute capability share one compile."""
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
    request = {
        "kernel_path": str(kernel_path), "fn_name": fn_name, "signature": dict(signature),
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
            built[k["cc"]] = {**k, "cubin": cubin, "ptx": ptx, "resources": res}

    out = []
    for t in targets:
        b = built[int(t.compute_capability)]  # type: ignore[arg-type]
        out.append(AotResult(
            target=t.name, arch=t.arch, cubin=b["cubin"], ptx=b["ptx"], metadata=dict(b["metadata"]),
            params=[dict(p) for p in b["params"]], resources=b["resources"], seconds=b["seconds"],
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
    # Triton's wheel ships the tools; locate them without importing triton (slow, and TRITON_INTERPRET
    # may be set in this process).
    env = os.environ.get(f"TRITON_{name.upper()}_PATH")
    if env:
        return env
    spec = importlib.util.find_spec("triton")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        p = Path(loc) / "backends" / "nvidia" / "bin" / name
        if p.is_file():
            return str(p)
    found = shutil.which(name)
    if found is None:
        raise AotError(f"{name} not found (neither in the triton wheel nor on PATH)")
    return found


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


def _child_compile(req: dict[str, Any], work: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    assert "TRITON_INTERPRET" not in os.environ
    path, fn_name = Path(req["kernel_path"]), req["fn_name"]
    fn = _load_kernel(path, fn_name)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError

    arg_names: list[str] = list(fn.arg_names)
    sig: dict[str, str] = req["signature"]
    consts: dict[str, Any] = req["constexprs"]
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
                    options={"num_warps": req["num_warps"], "num_stages": req["num_stages"]},
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
        kernels.append({
            "cc": cc, "arch": arch, "seconds": seconds, "params": params, "ptxas_log": log.getvalue(),
            "metadata": {k: md.get(k) for k in _METADATA_KEYS},
        })
        progress(f"{arch}: compiled {fn_name} in {seconds:.1f} s")
    return {"ok": True, "kernels": kernels}


def _load_kernel(path: Path, fn_name: str) -> Any:
    # Triton reads kernel source with `inspect`, which needs a real module backed by the file.
    sys.path.insert(0, str(path.parent))  # generated kernels may import sibling helper files
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
