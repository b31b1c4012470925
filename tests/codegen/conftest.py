"""Fixtures for the scheduler and megakernel tests: lowered zoo models (lowered once per session),
zoo models compiled into bundles (once per module; helpers in megakernel_checks.py) and a writer of
bundle-like directories that run an arbitrary `Program` in the interpreter."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from megakernel_checks import Built, source

Lower = Callable[..., Any]


@pytest.fixture(scope="session")
def lower_model() -> Lower:
    """`lower_model(kind, family, opset, max_seq=64)`: `zoo.cached(kind, family, opset)` lowered
    (once per session; read-only)."""
    import zlc
    from zlc.testing import zoo

    cache: dict[tuple[str, str, int | None, int], Any] = {}

    def get(kind: str, family: str, opset: int | None, max_seq: int = 64) -> Any:
        key = (kind, family, opset, max_seq)
        if key not in cache:
            cache[key] = zlc.lower(zoo.cached(kind, family, opset),  # type: ignore[arg-type]
                                   options=zlc.CompileOptions(max_seq=max_seq))
        return cache[key]

    return get


def write_program_bundle(src: Path, dst: Path, program: Any, **render_kw: Any) -> Path:
    """Copies the bundle `src` to `dst` with its `cpu` tiling replaced by `program` (any tiling of
    the same decode graph): kernel.py re-rendered (the dispatch chain must hold every op kind the
    program uses, e.g. the split-KV combine), the task tables, constexprs, grid and arena layout
    (a_size, logits offset, counter sizes all depend on the tiling). Weights stay: their placement
    does not depend on the tiling, which this checks. `render_kw` goes to the emitter (e.g.
    `max_chunk` to unroll tiny matrix-vector products into several chunks)."""
    from zlc.bundle import read_manifest, write_manifest
    from zlc.codegen.emit import render
    from zlc.codegen.shuffle import write_tables

    shutil.copytree(src, dst)
    man = read_manifest(dst)
    if program.weights != man["weights"]["placement"]:
        raise ValueError("the program places weights differently from the bundle it is written into")
    (dst / man["kernel"]["source"]).write_text(
        render(program, weight_dtype=man["dtype"]["weights"], version=man["zlc_version"], **render_kw))
    tl = man["tilings"]["cpu"]
    write_tables(dst / tl["tables"], program, program.tables)
    lb = program.buffers[program.logits]
    tl["constexprs"] = program.constexprs()
    tl["grid"] = program.tiling.grid
    tl["layout"] = dict(tl["layout"], a_size=program.a_size, ctrl_size=program.ctrl_size(),
                        counters_size=program.counters_size(), chunk=program.tiling.chunk,
                        logits={"offset": lb.offset, "rows": lb.rows, "cols": lb.cols})
    (dst / tl["readable"]).unlink(missing_ok=True)  # would describe the old tables
    tl.pop("readable", None)
    tl.pop("summary", None)
    write_manifest(dst, man)
    return dst


@pytest.fixture(scope="session")
def program_bundle() -> Callable[..., Path]:
    return write_program_bundle


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Built]:
    """`built(name, max_seq=64)`: the zoo model `name` (megakernel_checks.source) compiled for the
    cpu target without verification, with its lowering (once per module)."""
    import zlc
    from zlc.testing import zoo

    cache: dict[tuple[str, int], Built] = {}

    def get(name: str, max_seq: int = 64) -> Built:
        if (name, max_seq) not in cache:
            src = zoo.cached(*source(name))  # type: ignore[arg-type]
            out = tmp_path_factory.mktemp("bundles") / f"{name}-{max_seq}.zlc"
            zlc.compile(src, targets=["cpu"], out=out, max_seq=max_seq, verify=False)
            cache[name, max_seq] = Built(out, zlc.lower(src, options=zlc.CompileOptions(max_seq=max_seq)))
        return cache[name, max_seq]

    return get
