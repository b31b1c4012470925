"""Triton's compiler frontend over a kernel the interpreter is about to run.

Triton's interpreter is dynamically typed: it runs code that Triton's compiler rejects (a variable
that one branch of a constexpr feature flag rebinds to another type, a `break`, a malformed device
assert), so a kernel could pass every interpreter test and still fail `zlc compile --target a10`.
Before the interpret executor runs a kernel it takes it through the compiler's frontend (Python
AST -> Triton IR, where types are checked) for an NVIDIA target, once per launch kind (STEP): a
kernel that no GPU could build is refused in one line before it runs. No GPU, ptxas or LLVM is
needed (~1-2 s per kernel); a kernel checked once is remembered by a marker named by the hash of
its source, constants and Triton's version in the user's cache directory
($XDG_CACHE_HOME/zlc/frontend), so the test suite's many sessions of one bundle pay it once.
ZLC_TRITON_FRONTEND=0 turns the check off.

The frontend runs in a child process of its own: Triton reads TRITON_INTERPRET when `@triton.jit`
decorates a function, its own standard library's included (decorated once, when Triton is first
imported), so a process that imported Triton for the interpreter cannot compile, and a process
that compiled cannot interpret.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zlc.errors import ZlcError

# Any NVIDIA capability does: the frontend's type rules do not depend on it (the backends differ
# only after the IR is built). sm_86 is the a10's, the default GPU target.
FRONTEND_CC = 86


class KernelFrontendError(ZlcError):
    """Triton's compiler rejects a kernel its interpreter would run."""


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "zlc" / "frontend"


def enabled() -> bool:
    return os.environ.get("ZLC_TRITON_FRONTEND", "1").strip() not in ("0", "", "off", "no")


def check_kernel(source: Path, entry: str, signature: Mapping[str, str], constexprs: Mapping[str, Any],
                 steps: list[int], *, num_warps: int = 4) -> None:
    """Builds the Triton IR of `entry` in `source` for each STEP in `steps` with `constexprs`;
    raises KernelFrontendError (file line and Triton's message) on the first it rejects."""
    if not enabled() or importlib.util.find_spec("triton") is None:
        return
    text = source.read_text()
    todo = []
    for step in steps:
        consts = {**constexprs, "STEP": step}
        key = hashlib.sha256(json.dumps([text, entry, dict(signature), sorted(consts.items()), num_warps,
                                         _triton_version()], default=str).encode()).hexdigest()
        if not (cache_dir() / key).exists():
            todo.append((consts, key))
    if not todo:
        return
    req = {"source": str(source), "entry": entry, "signature": dict(signature), "num_warps": num_warps,
           "checks": [[consts, key] for consts, key in todo]}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "from zlc.runtime.triton_frontend import _child; _child()"],
                          input=json.dumps(req, default=str), capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(_RESULT)]
    if proc.returncode != 0 or not lines:
        raise ZlcError(f"the Triton frontend check of {source.name} did not finish (exit {proc.returncode}): "
                       f"{(proc.stderr or proc.stdout).strip()[-400:]}")
    error = json.loads(lines[-1][len(_RESULT):])
    if error:
        raise KernelFrontendError(error)


_RESULT = "@@zlc-frontend "  # stdout marker: Triton's own prints are not the answer


def _child() -> None:
    """The check's own process (TRITON_INTERPRET unset): reads the request on stdin, prints None or
    the first rejection's message, remembers every kernel that passed."""
    req = json.loads(sys.stdin.read())
    source = Path(req["source"])
    error = None
    try:
        fn = _load(source, req["entry"])
        for consts, key in req["checks"]:
            if _frontend(fn, source, req["signature"], consts, int(req["num_warps"])):
                _remember(key)
    except ZlcError as e:
        error = str(e)
    print(_RESULT + json.dumps(error), flush=True)


def _triton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")
    except PackageNotFoundError:
        return "none"


def _load(source: Path, entry: str) -> Any:
    name = "_zlc_frontend_" + hashlib.sha1(str(source).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, source)
    if spec is None or spec.loader is None:
        raise ZlcError(f"cannot import {source}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # Triton reads the kernel's source through `inspect`
    spec.loader.exec_module(mod)
    fn = getattr(mod, entry, None)
    if fn is None or not hasattr(fn, "arg_names"):
        raise ZlcError(f"'{entry}' is not a compiled @triton.jit function in {source} (TRITON_INTERPRET set?)")
    return fn


def _frontend(fn: Any, source: Path, signature: Mapping[str, str], consts: Mapping[str, Any],
              num_warps: int) -> bool:
    """True when checked; False when this Triton has no NVIDIA backend to check with."""
    try:
        from triton.backends.nvidia import compiler as _nvidia  # noqa: F401
    except ImportError:
        return False  # a Triton without the NVIDIA backend (not x86-64/aarch64 Linux) cannot check
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    # a constexpr argument with a default (the kernel's TRACE, PREFETCH) takes it unless given
    defaults = {n: p.default for n, p in inspect.signature(fn.fn).parameters.items()
                if p.default is not inspect.Parameter.empty and n not in signature}
    consts = {**defaults, **consts}
    missing = [a for a in fn.arg_names if a not in signature and a not in consts]
    if missing:
        raise ZlcError(f"{source.name}: no type or value for the kernel's {', '.join(missing)} (the manifest's "
                       "kernel signature and the tiling's constants do not cover its parameters)")
    full = {a: signature.get(a, "constexpr") for a in fn.arg_names}
    target = GPUTarget("cuda", FRONTEND_CC, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": num_warps})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    src = ASTSource(fn, full, constexprs=dict(consts))
    try:
        src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
    except Exception as e:  # CompilationError and the frontend's asserts (types, `break`)
        raise KernelFrontendError(f"Triton's compiler rejects {source.name} (STEP={consts.get('STEP')}), which its "
                                  f"interpreter would run: {_message(e)}") from None
    return True


def _message(e: BaseException) -> str:
    """The innermost cause's message, first line of Triton's error text and its kernel line."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = str(e).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    where = lines[0] if lines and lines[0].startswith("at ") else ""
    return f"{type(e).__name__}: {lines[-1] if lines else ''}" + (f" ({where})" if where else "")


def _remember(key: str) -> None:
    d = cache_dir()
    try:
        d.mkdir(parents=True, exist_ok=True)
        (d / key).touch()
    except OSError:
        pass  # a read-only cache only costs the next session the check again
