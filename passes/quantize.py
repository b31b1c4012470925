"""Weight-only quantization of a lowered model's Linear weights (`zlc compile --quantize`).

Every Linear matrix (ir/quant.py PACKED_INPUTS: Linear, LMHead, the MLPs) that is an f32 [N, K] constant with K a multiple of 32 gets packed blocks
(ir/quant.py) and, as its data, their exact dequantization: the graphs stay f32 models the
reference executor runs, and they compute what the kernels compute from the blocks. So does the
embedding's token table (ir/quant.py PACKED_TABLES; tied with the LM head: one packed constant serves
both). Left dense, and said so in the summary: MoE expert stacks (3-D), non-f32 weights, K not a
multiple of 32, a learned position table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from zlc.errors import ZlcError
from zlc.ir import DType, Graph, Value
from zlc.ir.quant import PACKED_INPUTS, PACKED_TABLES, get_format, quantize
from zlc.targets import streamed_by

from .embed_tables import dense_tables_for_gpu

# `--quantize` spellings -> the format; int4 alone is q4_0 (scale only; q4_1 adds a min per block)
SCHEMES = {"int8": "q8_0", "int4": "q4_0", "int4:q4_0": "q4_0", "int4:q4_1": "q4_1"}


class QuantizeError(ZlcError):
    """--quantize cannot apply to this model (already packed, an unknown scheme)."""


def scheme_for(scheme: str | None, gpu_targets: Sequence[str]) -> str | None:
    """The format of `--quantize scheme` (None: none asked). With a GPU target the format must be
    one the Triton kernel streams (zlc.targets: Target.weight_formats), else it is a one-line error."""
    if scheme is None:
        return None
    fmt = parse_scheme(scheme)
    if gpu_targets and not streamed_by(get_format(fmt).name, gpu_targets):
        raise QuantizeError(f"--quantize {scheme}: the Triton kernel does not stream {fmt} weights "
                            f"(target {', '.join(gpu_targets)}); compile the quantized bundle for --target cpu")
    return fmt


def parse_scheme(scheme: str) -> str:
    """The weight format of a `--quantize` value ("int8", "int4", "int4:q4_0", "int4:q4_1")."""
    fmt = SCHEMES.get(scheme.strip().lower())
    if fmt is None:
        raise QuantizeError(f"--quantize {scheme!r}: expected one of {', '.join(SCHEMES)}")
    return fmt


@dataclass
class QuantizeSummary:
    format: str
    packed: list[str] = field(default_factory=list)  # constant names
    dense: dict[str, str] = field(default_factory=dict)  # constant name -> why it stays dense
    copies: dict[str, str] = field(default_factory=dict)  # a shared matrix -> its Linears' packed copy
    dense_bytes: int = 0  # f32 bytes of the packed weights before
    packed_bytes: int = 0

    def f32_mb(self) -> str:
        return f"{self.dense_bytes / 1e6:.1f} MB f32 -> {self.packed_bytes / 1e6:.1f} MB {self.format}"

    def manifest(self) -> dict[str, Any]:
        return {"format": self.format, "packed": len(self.packed), "dense": self.dense, "copies": self.copies,
                "f32_bytes": self.dense_bytes, "packed_bytes": self.packed_bytes}


def _key(v: Value) -> Any:
    """Constants sharing one array (a tied LM head, the same weight in prefill and decode)."""
    d = v.data
    ptr = d.__array_interface__["data"][0] if hasattr(d, "__array_interface__") else (
        d.data_ptr() if hasattr(d, "data_ptr") else id(d))
    return (ptr, tuple(getattr(d, "shape", ())), str(getattr(d, "dtype", "")))


def quantize_graphs(graphs: Sequence[Graph], fmt: str) -> QuantizeSummary:
    """Packs the Linear weights of `graphs` (one model's prefill/decode/stateless graphs, which may
    share constants) and their embeddings' token tables in format `fmt`, in place (a tied table:
    one packed constant for both). A matrix that is also read otherwise gets a packed copy of its
    own, `<name>.<fmt>`, for its Linears. Raises QuantizeError on an already packed model."""
    summary = QuantizeSummary(fmt)
    other_use: set[Any] = set()  # storage read as anything but a Linear's weight
    wanted: dict[Any, list[tuple[Graph, Any, int, Value]]] = {}  # storage -> (graph, node, input, weight)
    for g in graphs:
        for v in g.consts.values():
            if v.quant is not None:
                raise QuantizeError(f"--quantize: the model is already quantized ('%{v.name}' is "
                                    f"{v.quant.format.name}); compile it without --quantize")
        for n in g.nodes:
            for i, inp in enumerate(n.inputs):
                if inp is None or inp.kind != "const":
                    continue
                token_table = i in PACKED_TABLES.get(n.op, ()) and len(n.inputs) > 1 and \
                    n.inputs[1] is not None and n.inputs[1].kind == "input"  # not a position table
                if i in PACKED_INPUTS.get(n.op, ()) or token_table:
                    wanted.setdefault(_key(inp), []).append((g, n, i, inp))
                else:
                    other_use.add(_key(inp))
    for key, uses in wanted.items():
        v = uses[0][3]
        shape = v.shape or ()
        why = (f"{v.dtype.name} weights (only f32 weights are packed)" if v.dtype != DType.f32
               else f"not an [N, K] matrix ({v.type})" if len(shape) != 2 or not all(isinstance(d, int) for d in shape)
               else f"K={shape[1]} is not a multiple of 32" if int(shape[1]) % 32  # type: ignore[arg-type]
               else "")
        if why:
            for *_, u in uses:
                summary.dense.setdefault(u.name, why)
            continue
        arr = v.const_array()
        assert arr is not None
        q = quantize(arr, fmt)
        deq = q.dequantize()  # one array for every graph's value: the layout places it once
        summary.dense_bytes += arr.size * 4
        summary.packed_bytes += q.nbytes
        copies: dict[int, Value] = {}  # graph -> its packed copy of a shared matrix
        for g, n, i, u in uses:
            if key in other_use:
                if id(g) not in copies:
                    copies[id(g)] = g.add_const(f"{u.name}.{fmt}", deq)
                    copies[id(g)].quant = q
                w = copies[id(g)]
                n.inputs[i] = w
                summary.copies.setdefault(u.name, w.name)
            else:
                u.data, u.quant, w = deq, q, u
            if w.name not in summary.packed:
                summary.packed.append(w.name)
    return summary


def refuse_packed(graphs: Sequence[Graph]) -> None:
    """QuantizeError when a graph already carries packed weights (a GGUF's blocks)."""
    for g in graphs:
        for v in g.consts.values():
            if v.quant is not None:
                raise QuantizeError(f"--quantize: the model is already quantized ('%{v.name}' is "
                                    f"{v.quant.format.name}); compile it without --quantize")


def _graphs(lowered: Any) -> list[Graph]:
    return [g for g in (lowered.graph, lowered.prefill, lowered.decode) if g is not None]


def packed_as_given(lowered: Any, gpu_targets: Sequence[str]) -> dict[str, Any] | None:
    """The manifest's `quantization` entry of a model whose frontend kept its file's blocks (a GGUF,
    an ONNX model's MatMulNBits int4 weights): which matrices stay packed in which format, which
    are dense and why; None when none is packed (nor an ONNX MatMulNBits weight left dense).
    With a GPU target a matrix whose format the Triton kernel does not stream (zlc.targets:
    Target.weight_formats) drops its blocks (it keeps its exact dequantization as data), per matrix; a gated pair
    (gate and up: one descriptor word holds both formats) always shares its format, so both go.
    Packed embedding tables go dense with a GPU target too (embed_tables.py): Triton reads dense
    tables only."""
    graphs = _graphs(lowered)
    tables = dense_tables_for_gpu(graphs, gpu_targets)  # first: the Triton kernel reads dense tables only
    packed: dict[str, Any] = {}
    # what the bundle streams: the prefill/decode graphs (a fused QKV split there stays whole in the
    # stateless graph, where it would count twice)
    for g in [g for g in (lowered.prefill, lowered.decode) if g is not None] or graphs:
        for v in g.consts.values():
            if v.quant is not None:
                packed.setdefault(v.name, v.quant)
    meta = next((g.metadata.get("gguf") for g in graphs if g.metadata.get("gguf")), None) or {}
    # matrices a frontend or pass left dense and why (an ONNX model's MatMulNBits weights it could
    # not keep packed, a gated pair stored in two formats: raise_layers.one_format)
    left: dict[str, str] = {}
    for g in graphs:
        left.update(g.metadata.get("packed_dense", {}))
    if not packed and not tables and not left:
        return None
    dense = {**meta.get("dense", {}), **tables, **left}
    source = "gguf" if meta else "onnx" if any("onnx_opset" in g.metadata for g in graphs) else "frontend"
    if gpu_targets:
        dropped = {name for name, q in packed.items() if not streamed_by(q.format.name, gpu_targets)}
        for g in graphs:
            for v in g.consts.values():
                if v.name in dropped:
                    v.quant = None
        why = f"dequantized: the Triton kernel ({', '.join(gpu_targets)}) does not stream this format"
        dense.update({name: f"{packed[name].format.name} {why}" for name in dropped})
        packed = {name: q for name, q in packed.items() if name not in dropped}
    formats: dict[str, int] = {}
    for q in packed.values():
        formats[q.format.name] = formats.get(q.format.name, 0) + 1
    return {"source": source, "formats": formats, "packed": len(packed),
            "tensors": {name: q.format.name for name, q in packed.items()}, "dense": dense,
            "f32_bytes": sum(q.n * q.k * 4 for q in packed.values()),
            "packed_bytes": sum(q.nbytes for q in packed.values())}


def describe_packed(q: dict[str, Any]) -> list[str]:
    """The compile report's lines for packed_as_given's entry."""
    by = ", ".join(f"{n} {f}" for f, n in sorted(q["formats"].items()))
    lines = [f"{q['packed']} matrices kept in the file's blocks ({by}): {q['f32_bytes'] / 1e6:.1f} MB as f32 -> "
             f"{q['packed_bytes'] / 1e6:.1f} MB" if q["packed"] else "no matrix kept packed"]
    by_why: dict[str, list[str]] = {}
    for name, why in q["dense"].items():
        by_why.setdefault(why, []).append(name)
    for why, names in by_why.items():
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        lines.append(f"dense: {', '.join(names[:3])}{more} ({why})")
    return lines


def quantize_lowered(lowered: Any, fmt: str, report: Callable[[str], None] | None = None,
                     gpu_targets: Sequence[str] = ()) -> dict[str, Any]:
    """`zlc compile --quantize`: packs a lowered model's Linear matrices and token table in place
    (its stateless, prefill and decode graphs; with GPU targets the table goes dense again,
    embed_tables.py), verifies the graphs, and measures the cost with the reference executor
    (reference/accuracy.py). Returns the manifest's `quantization` entry."""
    from zlc.ir import verify_graph
    from zlc.reference.accuracy import accuracy, probe_logits

    say = report or (lambda _: None)
    refuse_packed(_graphs(lowered))
    say(f"{fmt}: probes on the unquantized model")
    before = probe_logits(lowered)
    graphs = [g for g in (lowered.graph, lowered.prefill, lowered.decode) if g is not None]
    summary = quantize_graphs(graphs, fmt)
    blocks = {v.name: v.quant for g in graphs for v in g.consts.values() if v.quant is not None}
    for name, why in dense_tables_for_gpu(graphs, gpu_targets).items():
        summary.dense[name] = why
        if name in summary.packed:  # the table itself went dense (not a tied head's dense copy)
            summary.packed.remove(name)
            summary.packed_bytes -= blocks[name].nbytes
            summary.dense_bytes -= blocks[name].n * blocks[name].k * 4
    for g in graphs:
        verify_graph(g)
    say(f"{len(summary.packed)} matrices packed ({summary.f32_mb()}), {len(summary.dense)} dense")
    acc = accuracy(before, probe_logits(lowered, forced=before))
    say(acc["summary"])
    return {**summary.manifest(), "accuracy": acc}
