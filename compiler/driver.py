"""The compiler driver: an explicit, named pipeline from a model to raised prefill/decode graphs.

    import -> fold -> canonicalize -> cse -> dce -> raise -> cleanup -> kv-cache

Every stage can be dumped (`zlc inspect MODEL --ir --after raise`) and reports statistics. The
options are a frozen dataclass; its `key()` hashes into cache keys.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .errors import NotADecoderError, PassError, ZlcError
from .ir import Graph, verify_graph

STAGES = ("import", "fold", "canonicalize", "cse", "dce", "raise", "cleanup", "kv-cache")


@dataclass(frozen=True)
class CompileOptions:
    max_seq: int = 2048  # positions the KV cache and rotary tables hold
    raise_ops: bool = True
    kv_cache: bool = True
    verify_ir: bool = True  # run the IR verifier after every stage

    def key(self) -> str:
        return hashlib.sha256(repr(sorted(asdict(self).items())).encode()).hexdigest()[:16]


@dataclass
class StageReport:
    name: str
    seconds: float
    nodes: int
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Lowered:
    """The pipeline's result: the raised stateless graph and, with a KV cache, prefill/decode."""

    graph: Graph
    prefill: Graph | None
    decode: Graph | None
    stages: list[StageReport]
    histogram_before: dict[str, int]
    histogram_after: dict[str, int]
    refused: dict[str, dict[str, int]]
    max_seq: int

    @property
    def cache(self) -> list[tuple[str, Any]]:
        g = self.prefill
        return [] if g is None else [(v.name, v.type) for v in g.state]


Observer = Callable[[str, Graph], None]


def load_model(model: Any, example_inputs: tuple[Any, ...] | None = None) -> Graph:
    """An ONNX path/ModelProto, or a torch.nn.Module with example inputs (torch.export)."""
    if isinstance(model, (str, os.PathLike)):
        p = Path(model)
        if p.suffix.lower() not in (".onnx", "") and not p.is_file():
            raise ZlcError(f"model file not found: {p}")
        from zlc.frontend.onnx import import_onnx

        return import_onnx(p)
    try:
        import torch

        if isinstance(model, torch.nn.Module):
            if example_inputs is None:
                raise ZlcError("a torch.nn.Module needs example_inputs, e.g. (torch.tensor([[1, 2, 3]]),)")
            from zlc.frontend.fx import import_module

            return import_module(model, example_inputs)
    except ImportError:  # pragma: no cover
        pass
    import onnx

    if isinstance(model, onnx.ModelProto):
        from zlc.frontend.onnx import import_onnx

        return import_onnx(model)
    raise ZlcError(f"cannot compile an object of type {type(model).__name__}: "
                   "pass an .onnx path, an onnx.ModelProto or a torch.nn.Module")


def check_decoder(g: Graph) -> None:
    """One clear error when the graph is not token ids -> logits."""
    from zlc.passes.probe import IDS, classify_inputs

    roles = classify_inputs(g)
    ids = [v for v in g.inputs if roles.get(v.name) == IDS]
    if not ids:
        raise NotADecoderError(f"model '{g.name}' has no integer token-id input (inputs: "
                               f"{', '.join(str(v) for v in g.inputs) or 'none'}); not a decoder LM")
    if ids[0].shape is None or len(ids[0].shape) != 2:
        raise NotADecoderError(f"token-id input '{ids[0].name}' must be [batch, seq], got {ids[0].type}")
    logits = g.outputs[0]
    if not logits.dtype.is_float or logits.shape is None or len(logits.shape) != 3:
        raise NotADecoderError(f"first output '{logits.name}' must be float logits [batch, seq, vocab], "
                               f"got {logits.type}; not a decoder LM")


def lower(model: Any, example_inputs: tuple[Any, ...] | None = None, *,
          options: CompileOptions | None = None, observer: Observer | None = None,
          stop_after: str | None = None) -> Lowered:
    """Runs the pipeline. `observer(stage, graph)` sees the graph after each stage (for dumps and
    progress); `stop_after` ends the pipeline early."""
    from zlc.passes.canonicalize import canonicalize
    from zlc.passes.cse import cse
    from zlc.passes.dce import dce
    from zlc.passes.fold_constants import fold_constants
    from zlc.passes.kv_cache import synthesize_kv_cache
    from zlc.passes.raise_all import raise_graph

    opts = options or CompileOptions()
    if stop_after is not None and stop_after not in STAGES:
        raise ZlcError(f"unknown stage '{stop_after}'; stages: {', '.join(STAGES)}")
    stages: list[StageReport] = []

    t0 = time.perf_counter()
    g = load_model(model, example_inputs)
    g.metadata["max_seq"] = opts.max_seq
    stages.append(StageReport("import", time.perf_counter() - t0, len(g.nodes)))
    hist_before = g.op_histogram()
    refused: dict[str, dict[str, int]] = {}

    def stage(name: str, fn: Callable[[Graph], Any]) -> bool:
        t = time.perf_counter()
        res = fn(g)
        stats = getattr(res, "stats", None) or getattr(res, "applied", None) or {}
        if opts.verify_ir:
            verify_graph(g)
        stages.append(StageReport(name, time.perf_counter() - t, len(g.nodes), dict(stats)))
        if observer:
            observer(name, g)
        return stop_after == name

    if observer:
        observer("import", g)
    if stop_after == "import":
        return Lowered(g, None, None, stages, hist_before, g.op_histogram(), refused, opts.max_seq)
    check_decoder(g)
    done = False
    for name, fn in (("fold", fold_constants), ("canonicalize", canonicalize), ("cse", cse), ("dce", dce)):
        if stage(name, fn):
            done = True
            break
    if not done and opts.raise_ops:
        def _raise(gr: Graph) -> Any:
            st = raise_graph(gr)
            refused.update(st.refused)
            return st

        done = stage("raise", _raise)
        if not done:
            done = stage("cleanup", lambda gr: (fold_constants(gr), cse(gr), dce(gr))[-1])
    prefill = decode = None
    if not done and opts.kv_cache and opts.raise_ops:
        t = time.perf_counter()
        cm = synthesize_kv_cache(g, opts.max_seq)
        prefill, decode = cm.prefill, cm.decode
        if opts.verify_ir:
            verify_graph(prefill)
            verify_graph(decode)
        stages.append(StageReport("kv-cache", time.perf_counter() - t, len(decode.nodes),
                                  {"cache_buffers": len(cm.cache)}))
        if observer:
            observer("kv-cache", decode)
    elif not done and opts.kv_cache and not opts.raise_ops:
        raise PassError("KV-cache synthesis needs raising (raise_ops=True)")
    # The histogram that matters is the decode graph's: what codegen will tile.
    hist_after = decode.op_histogram() if decode is not None else g.op_histogram()
    return Lowered(g, prefill, decode, stages, hist_before, hist_after, refused, opts.max_seq)
