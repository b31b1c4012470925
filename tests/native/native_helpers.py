"""Shared by the native kernel's tests: the zoo families (tests/megakernel_cases.py's), the comparison with the oracle, and a
writer of bundles whose native tiling is any `Program` (conftest.py holds the fixtures)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from megakernel_cases import ATOL, MODELS, PROMPT, derived_tolerance, greedy_logits

__all__ = ["ATOL", "MODELS", "PROMPT", "Built", "assert_matches", "bundle_reference", "run_both", "tsan_build",
           "write_native_bundle"]


class Built:
    """A compiled bundle and the lowered model it came from (the oracle's input)."""

    def __init__(self, path: Path, lowered: Any):
        import zlc

        self.path, self.lowered = path, lowered
        self.manifest = zlc.load(path).manifest
        self.vocab = int(self.manifest["model"]["vocab"])
        self.max_seq = int(self.manifest["model"]["max_seq"])

    def session(self, **kw: Any) -> Any:
        """A MegakernelSession on the native kernel (NativeBackend keyword arguments)."""
        from zlc.runtime.megakernel import MegakernelSession
        from zlc.runtime.native import NativeBackend

        nb = NativeBackend(self.path, self.manifest, **kw)
        return MegakernelSession(nb, chunk=nb.chunk, max_seq=self.max_seq, vocab=self.vocab)

    def program(self, tiling: Any = None) -> Any:
        """The bundle's native program rescheduled (the same as the bundle's when `tiling` is None)."""
        from zlc.codegen.schedule import schedule, tiling_for

        return schedule(self.lowered.decode, tiling or tiling_for(None, self.max_seq, native=True), self.max_seq)


def bundle_reference(path: Path, *, f64: bool = False) -> Any:
    """The reference executor on bundle `path`'s IR and packed weights (`zlc run --device
    reference`), or the same in f64 (the derived tolerance's exact side)."""
    import zlc
    from zlc.runtime.megakernel import MegakernelSession
    from zlc.runtime.reference_backend import ReferenceBackend

    b = zlc.load(path)
    ref = ReferenceBackend(path, b.manifest, f64=f64)
    return MegakernelSession(ref, chunk=ref.chunk, max_seq=b.max_seq, vocab=b.vocab)


def run_both(s: Any, ref: Any, prompt: list[int], steps: int, exact: Any = None) -> dict[str, Any]:
    """Prefill (all logits) + `steps` decode steps on the session `s` and on `ref` (a
    ReferenceSession or another MegakernelSession), each step fed the reference's greedy token.
    Returns the max abs error per launch and both token streams; with `exact` (the same reference
    in f64), also each launch's distance of `s` from it and the derived tolerance of that
    distance (megakernel_cases.derived_tolerance), which assert_matches then checks."""
    def logits(x: Any) -> np.ndarray:
        return np.asarray(x[1] if isinstance(x, tuple) else x.numpy())

    def run(r: Any, first: bool, feed: int | None = None) -> np.ndarray:
        if first:
            return logits(r.prefill(prompt, all_logits=True, want_logits=True) if hasattr(r, "backend")
                          else r.prefill(prompt))
        return logits(r.step(feed, want_logits=True) if hasattr(r, "backend") else r.step(feed)).reshape(1, -1)

    tok, lg = s.prefill(prompt, all_logits=True, want_logits=True)
    want = run(ref, True)
    assert lg is not None and lg.shape == want.shape
    got_rows, want_rows = [lg], [want]
    got, exp = [tok], [int(want[-1].argmax())]
    for _ in range(steps):
        feed = exp[-1]
        tok, lg = s.step(feed, want_logits=True)
        w = run(ref, False, feed)
        got_rows.append(lg[:1])
        want_rows.append(w)
        got.append(tok)
        exp.append(int(w[-1].argmax()))
    out: dict[str, Any] = {"errors": [float(np.abs(g - w).max()) for g, w in zip(got_rows, want_rows, strict=True)],
                           "tokens": got, "ref_tokens": exp}
    if exact is not None:
        ex = [run(exact, True)] + [run(exact, False, t) for t in exp[:-1]]
        out["exact_errors"] = [float(np.abs(g.astype(np.float64) - e).max()) for g, e in zip(got_rows, ex, strict=True)]
        out["tolerances"] = [derived_tolerance(w, e) for w, e in zip(want_rows, ex, strict=True)]
    return out


def assert_matches(r: dict[str, Any], atol: float = ATOL) -> None:
    """Tokens equal the reference's; logits within the derived tolerance of the f64 reference
    per launch when run_both had it, else within `atol` of the reference."""
    if "tolerances" in r:
        bad = [(i, e, t) for i, (e, t) in enumerate(zip(r["exact_errors"], r["tolerances"], strict=True)) if e > t]
        assert not bad, f"launches (index, distance from f64, derived tolerance) beyond it: {bad}"
    else:
        assert max(r["errors"]) <= atol, f"max abs error per launch {r['errors']}"
    assert r["tokens"] == r["ref_tokens"]


def write_native_bundle(src: Path, dst: Path, program: Any) -> Path:
    """Copies bundle `src` to `dst` with its native tiling replaced by `program` (any tiling of the
    same decode graph): the C kernel re-rendered and rebuilt (its constants follow the tiling),
    the tables, and the layout (a_size, chunk, logits offset, counters depend on the tiling)."""
    import zlc
    from zlc.bundle import read_manifest, write_manifest
    from zlc.codegen.native import build_native
    from zlc.codegen.shuffle import write_tables

    shutil.copytree(src, dst)
    man = read_manifest(dst)
    if program.weights != man["weights"]["placement"]:
        raise ValueError("the program places weights differently from the bundle it is written into")
    shutil.rmtree(dst / "native")
    man["native"] = build_native(program, dst / "native", weight_dtype=man["dtype"]["weights"],
                                 version=zlc.__version__).manifest()
    tl = man["tilings"]["native"]
    write_tables(dst / tl["tables"], program, program.tables)
    lb = program.buffers[program.logits]
    tl["layout"] = dict(tl["layout"], a_size=program.a_size, ctrl_size=program.ctrl_size(),
                        counters_size=program.counters_size(), chunk=program.tiling.chunk,
                        logits={"offset": lb.offset, "rows": lb.rows, "cols": lb.cols})
    (dst / tl["readable"]).write_text(json.dumps({"note": "rewritten by a test"}) + "\n")
    write_manifest(dst, man)
    return dst


def tsan_build(b: Built, lib: Path) -> Path:
    """Builds `b`'s C kernel with ThreadSanitizer into `lib` (gcc; any ISA level: the races are in the
    protocol, not the ISA) and returns gcc's libtsan.so to preload; skips when gcc or libtsan is missing."""
    import platform
    import subprocess

    import pytest

    from zlc.codegen.native import compile_library
    from zlc.targets import isa_levels_for

    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("ThreadSanitizer builds use gcc's libtsan; no gcc here")
    rt = subprocess.run([gcc, "-print-file-name=libtsan.so"], capture_output=True, text=True).stdout.strip()
    if not rt or not Path(rt).is_file():
        pytest.skip("gcc has no libtsan.so (install libtsan)")
    level = isa_levels_for(platform.machine())[-1]
    compile_library(b.path / b.manifest["native"]["source"], lib, level, gcc, extra=("-fsanitize=thread", "-g", "-O1"))
    return Path(rt)


class Alone:
    """The oracle: a request run by itself (prefill, then greedy steps) on one MegakernelSession,
    memoized per (prompt, steps)."""

    def __init__(self, b: Built, **kw: object):
        self.s = b.session(threads=2, **kw)
        self.memo: dict[tuple[tuple[int, ...], int], list[np.ndarray]] = {}

    def logits(self, prompt: list[int], steps: int) -> list[np.ndarray]:
        """[vocab] logits after the prompt, then after each of `steps` greedy tokens."""
        key = (tuple(prompt), steps)
        if key not in self.memo:
            self.memo[key] = greedy_logits(self.s, prompt, steps)
        return self.memo[key]

    def close(self) -> None:
        self.s.close()
