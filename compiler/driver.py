"""The compiler driver: the lowering pipeline from a model to raised prefill/decode graphs, as data.

    import -> fold -> canonicalize -> cse -> dce -> raise -> cleanup -> kv-cache

`STAGES` names that list: the frontend (`import`) makes a graph, each `GraphStage` of
`GRAPH_STAGES` edits it in place, and KV-cache synthesis (`kv-cache`) derives the prefill and
decode graphs from it. The
`raise` stage runs the raising rule sets (`zlc.passes.raise_all.RAISING`), each of which is a
dump point of its own (`RAISE_STAGES`). Every stage, and every rule set, can be dumped
(`zlc inspect MODEL --ir --after raise-attention`) and reports its time and statistics from the same
list (`Lowered.stages`, `zlc inspect --stats`). The options are a frozen dataclass; its `key()`
hashes into cache keys.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from zlc.passes import CLEANUP_PASSES, GENERIC_PASSES
from zlc.passes.kv_cache import synthesize_kv_cache
from zlc.passes.kv_check import check_decode_matches_prefill
from zlc.passes.probe import IDS, classify_inputs
from zlc.passes.raise_all import RAISING, raise_graph

from .errors import NotADecoderError, PassError, ZlcError
from .ir import Graph, verify_graph


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
    parts: list[StageReport] = field(default_factory=list)  # a stage made of parts: one report each


@dataclass
class StageOutcome:
    """What a graph stage did: its statistics, its parts' reports, raising's refusals."""

    stats: dict[str, Any] = field(default_factory=dict)
    parts: list[StageReport] = field(default_factory=list)
    refused: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphStage:
    """A stage that edits the graph in place. `run(graph, stop_after)` says what it did;
    `stop_after` names the part to end on (a stage made of parts: the raising rule sets)."""

    name: str
    run: Callable[[Graph, str | None], StageOutcome]
    parts: tuple[str, ...] = ()
    doc: str = ""


def _passes(passes: list[tuple[str, Callable[[Graph], Any]]]) -> Callable[[Graph, str | None], StageOutcome]:
    """One stage from passes run in order. Statistics keep their names for a single pass and are
    prefixed with the pass name when several share the stage (`cse.merged`, `dce.removed`)."""
    def run(g: Graph, stop_after: str | None) -> StageOutcome:
        out = StageOutcome()
        for name, fn in passes:
            stats = getattr(fn(g), "stats", None) or {}
            out.stats.update(stats if len(passes) == 1 else {f"{name}.{k}": v for k, v in stats.items()})
        return out
    return run


def _raise(g: Graph, stop_after: str | None) -> StageOutcome:
    """The raising rule sets (over up to RAISE_SWEEPS sweeps); one part report per rule set."""
    parts: dict[str, StageReport] = {}
    clock = [time.perf_counter()]

    def seen(name: str, graph: Graph, s: Any) -> None:
        now = time.perf_counter()
        r = parts.setdefault(name, StageReport(name, 0.0, 0))
        r.seconds += now - clock[0]
        r.nodes = len(graph.nodes)
        for k, v in s.applied.items():
            r.stats[k] = r.stats.get(k, 0) + v
        clock[0] = now

    st = raise_graph(g, observer=seen, stop_after=stop_after)
    return StageOutcome(dict(st.applied), list(parts.values()), st.refused)


GRAPH_STAGES: tuple[GraphStage, ...] = (
    *(GraphStage(name, _passes([(name, fn)])) for name, fn in GENERIC_PASSES),
    GraphStage("raise", _raise, parts=tuple(name for name, _ in RAISING),
               doc="the raising rule sets, in order: op-level subgraphs -> transformer-level ops"),
    GraphStage("cleanup", _passes(CLEANUP_PASSES), doc="fold, CSE and DCE over what raising left"),
)
#: Every stage of the lowering pipeline, in order: the frontend, the graph stages, KV-cache synthesis.
STAGES = ("import", *(s.name for s in GRAPH_STAGES), "kv-cache")
#: Dump points inside `raise`: one per raising rule set (`stop_after="raise-attention"`).
RAISE_STAGES = tuple(name for name, _ in RAISING)
DUMP_POINTS = STAGES + RAISE_STAGES


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


def load_model(model: Any, example_inputs: tuple[Any, ...] | None = None, *, max_seq: int = 2048) -> Graph:
    """An ONNX or GGUF path, a Hugging Face checkpoint directory (config.json + safetensors), an
    ONNX ModelProto, or a torch.nn.Module with example inputs (torch.export). `max_seq`: the
    positions a GGUF or checkpoint model's rotary tables hold."""
    if isinstance(model, (str, os.PathLike)):
        p = Path(model)
        if p.is_dir():
            from zlc.frontend.hf_dir import import_hf_dir

            return import_hf_dir(p, max_seq)
        if p.suffix.lower() not in (".onnx", "") and not p.is_file():
            raise ZlcError(f"model file not found: {p}")
        from zlc.frontend.gguf_file import is_gguf

        if is_gguf(p):
            from zlc.frontend.gguf import import_gguf

            return import_gguf(p, max_seq)
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
    """Runs the pipeline. `observer(stage, graph)` sees the graph after each stage of STAGES (for
    dumps and progress); `stop_after` (any of DUMP_POINTS) ends the pipeline after that stage or
    raising rule set."""
    opts = options or CompileOptions()
    if stop_after is not None and stop_after not in DUMP_POINTS:
        if stop_after.startswith("raise"):
            raise ZlcError(f"unknown raising rule set '{stop_after}'; rule sets: {', '.join(RAISE_STAGES)}")
        raise ZlcError(f"unknown stage '{stop_after}'; stages: {', '.join(STAGES)}")
    part = stop_after if stop_after in RAISE_STAGES else None
    stop = "raise" if part is not None else stop_after
    stages: list[StageReport] = []
    refused: dict[str, dict[str, int]] = {}

    t0 = time.perf_counter()
    g = load_model(model, example_inputs, max_seq=opts.max_seq)
    g.metadata["max_seq"] = opts.max_seq
    stages.append(StageReport("import", time.perf_counter() - t0, len(g.nodes)))
    hist_before = g.op_histogram()
    if observer:
        observer("import", g)
    if stop == "import":
        return Lowered(g, None, None, stages, hist_before, g.op_histogram(), refused, opts.max_seq)
    check_decoder(g)
    for st in GRAPH_STAGES:
        if st.name in ("raise", "cleanup") and not opts.raise_ops:
            break
        t = time.perf_counter()
        out = st.run(g, part if st.name == "raise" else None)
        refused.update(out.refused)
        if opts.verify_ir:
            verify_graph(g)
        stages.append(StageReport(st.name, time.perf_counter() - t, len(g.nodes), out.stats, out.parts))
        if observer:
            observer(st.name, g)
        if st.name == stop:
            return Lowered(g, None, None, stages, hist_before, g.op_histogram(), refused, opts.max_seq)
    if not opts.kv_cache:
        return Lowered(g, None, None, stages, hist_before, g.op_histogram(), refused, opts.max_seq)
    if not opts.raise_ops:
        raise PassError("KV-cache synthesis needs raising (raise_ops=True)")
    t = time.perf_counter()
    try:
        cm = synthesize_kv_cache(g, opts.max_seq)
    except PassError as e:
        # a refused attention bias (not ALiBi) is the reason worth naming: say it on the same line
        bias = sorted(r for r in refused.get("attention", {}) if r.startswith("attention bias"))
        if not bias or "no raised Attention" not in str(e):
            raise
        raise PassError(f"{e}; {bias[0]}") from None
    if opts.verify_ir:
        verify_graph(cm.prefill)
        verify_graph(cm.decode)
    stats: dict[str, Any] = {"cache_buffers": len(cm.cache)}
    if cm.rebased:
        stats["positions_rebased"] = len(cm.rebased)
    # The invariant no path skips: decode equals prefill of the same tokens (kv_check.py).
    check = check_decode_matches_prefill(cm)
    if check is not None:
        stats.update(check.stats())
    stages.append(StageReport("kv-cache", time.perf_counter() - t, len(cm.decode.nodes), stats))
    if observer:
        observer("kv-cache", cm.decode)
    # The histogram that matters is the decode graph's: what codegen will tile.
    return Lowered(g, cm.prefill, cm.decode, stages, hist_before, cm.decode.op_histogram(), refused,
                   opts.max_seq)
