"""`zlc verify` and `zlc.verify(...)`: runs a model in ONNX Runtime and in zlc (prefill of a prompt,
then N decode steps with the synthesized KV cache) and reports max abs/rel logit error per step and
greedy-token agreement. Both sides are driven with ONNX Runtime's greedy tokens (teacher forcing), so every
step compares logits for the same sequence; `tokens_equal` says whether zlc's argmax agreed.

Half-precision models (weights and activations in f16 or bf16) are checked as the megakernel runs
them: zlc's side computes in f32 on the half-rounded weights (`zlc.reference.executor.in_f32`).
The oracle for f16 is ONNX Runtime (it has f16 CPU kernels); for bf16, where ONNX Runtime has none,
and for an f16 model it cannot run, it is the reference executor running the imported op-level
graph (before any raising or KV-cache synthesis) in f32 on the same weights. The report names its
oracle (`VerifyReport.oracle`), and the default tolerance depends on the model's dtype
(`DEFAULT_ATOL`): half-precision logits are only as exact as their last rounding.

Verify also says whether the lowered decode graph fits the megakernel (`megakernel_fit`: the
scheduler's own check, run on the graph without compiling anything), naming each op that does not
and the family feature it most likely comes from: a model can be exact on the reference executor
and still not compile (`VerifyReport.ok` is the numbers, `.compilable` the kernel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .driver import CompileOptions, Lowered, Observer, lower
from .errors import ModelFormatError, ZlcError
from .ir import Graph, Node


class NotCompilableError(ZlcError):
    """The lowered model does not fit the megakernel: names each op that does not, and why."""

    exit_code = 4  # the numbers may well be right (verify's 0) and wrong ones are 3: CI tells all three apart


#: The default max abs logit error per model dtype (the logits' dtype); `--atol` overrides it.
#: f32: the reference executor and ONNX Runtime agree to ~1e-5 on unit-scale logits.
#: f16: ONNX Runtime computes in f16 (each op's output rounded, ulp 2**-10 relative) while zlc computes
#: in f32: the zoo's families differ by up to ~5e-3.
#: bf16: the oracle is f32 on the same weights and rotary tables (~2e-6 apart), but a bf16 graph's
#: scalar constants are bf16 too (gelu_tanh's 0.044715 is 0.04468 there) while raising names the
#: activation and the kernel computes it with exact constants: GPT-2 differs by ~1.2e-3.
DEFAULT_ATOL: dict[str, float] = {"f32": 1e-3, "f16": 2e-2, "bf16": 1e-2}
ORT = "ONNX Runtime"
#: A GGUF file's oracle: its imported graph (no KV cache) on the reference executor, each step rerun
#: over the whole sequence; Hugging Face on the same weights is the tests' oracle (tests/frontend/test_gguf.py).
GGUF_ORACLE = "zlc reference in f32 on the imported GGUF graph (no KV cache)"
#: A checkpoint directory's: the same, on the graph built from its config and weights.
HF_DIR_ORACLE = "zlc reference in f32 on the imported checkpoint graph (no KV cache)"


def default_atol(dtype: str) -> float:
    """The default tolerance for a model whose logits are `dtype` (DEFAULT_ATOL; f32's otherwise)."""
    return DEFAULT_ATOL.get(dtype, DEFAULT_ATOL["f32"])


class F32Reference:
    """The oracle where ONNX Runtime cannot run a half model: the imported op-level graph (no
    raising, no KV cache) on the reference executor in f32, on the same half-rounded weights.
    Stateless graphs only (input_ids -> logits); each feed reruns the whole sequence."""

    def __init__(self, imported: Graph, name: str):
        from zlc.reference.executor import ReferenceExecutor, in_f32

        if imported.state or len(imported.inputs) != 1:
            raise ZlcError(f"verify of {name}: ONNX Runtime cannot run it and the f32 reference "
                           f"oracle takes only stateless input_ids -> logits graphs (this one has inputs "
                           f"{[v.name for v in imported.inputs]})")
        from zlc.passes.probe import is_position_only

        # Casts of position-only tensors to half (rotary cos/sin) keep rounding: raising folds them
        # into half tables, which the kernel reads as weights. Everything else computes in f32.
        tables = [n.name for n in imported.nodes if n.op == "Cast" and n.attrs.get("to") in ("f16", "bf16")
                  and n.inputs[0] is not None and is_position_only(imported, [n.inputs[0]]) is None]
        self.exe = ReferenceExecutor(in_f32(imported, rounding=tables))
        self.ids = imported.inputs[0].name
        self.logits = imported.outputs[0].name
        self.tokens: list[int] = []

    def feed(self, ids: list[int]) -> np.ndarray:
        """Appends tokens; returns logits [len(ids), vocab] for them."""
        self.tokens += ids
        out = self.exe.run({self.ids: np.array([self.tokens], dtype=np.int64)})[self.logits]
        return out[0, -len(ids):].float().numpy()


def _exact_nbits(path: str | os.PathLike[str], so: Any) -> tuple[str | bytes, int]:
    """The model ORT runs as the oracle, and how many MatMulNBits it runs at accuracy_level 0: a
    higher level (4: onnxruntime-genai's CPU int4 default) makes ORT quantize the activations to
    int8, which the model's weights do not define; zlc computes in f32 on the exact weight, as ORT
    does at level 0. Such a model runs from its proto (without loading its external data: ORT
    reads that from the model's folder) with those nodes at level 0."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # ORT's own loading reports it
        return str(path), 0
    n = 0
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            for a in node.attribute:
                if a.name == "accuracy_level" and a.i != 0:
                    a.i, n = 0, n + 1
    if not n:
        return str(path), 0
    try:
        data = model.SerializeToString()
    except ValueError:  # a proto over 2 GB (inline weights): ORT runs the file as it is
        return str(path), 0
    so.add_session_config_entry("session.model_external_initializers_file_folder_path",
                                str(Path(path).resolve().parent))
    return data, n


class OrtReference:
    """ONNX Runtime as the oracle, for stateless and cache-carrying (Optimum/genai) graphs."""

    def __init__(self, path: str | os.PathLike[str], past_dims: dict[str, list[int]] | None = None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        model, self.exact_nbits = _exact_nbits(path, so)
        try:
            self.sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own exception types for bad models
            raise ModelFormatError(f"ONNX Runtime cannot load {path}: {str(e).splitlines()[0]}") from None
        self.inputs = {i.name: i for i in self.sess.get_inputs()}
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.ids = next((n for n in self.inputs if "ids" in n.lower() and "position" not in n.lower()),
                        next(iter(self.inputs)))
        self.past = [n for n in self.inputs if "past" in n.lower() and "tensor(float" in self.inputs[n].type]
        self.stateless = not self.past
        # Exporters may name head dims symbolically (genai's kv_cache_dim): the caller passes the
        # static dims zlc's import resolved, else symbolic dims default to 1.
        self.past_dims: dict[str, list[int]] = dict(past_dims or {})
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.cache: dict[str, np.ndarray] = {}
        for n in self.past:
            shp = self.past_dims.get(n) or [d if isinstance(d, int) else 1 for d in self.inputs[n].shape]
            shp[2] = 0
            dt = np.float16 if "float16" in self.inputs[n].type else np.float32
            self.cache[n] = np.zeros(shp, dtype=dt)

    def feed(self, ids: list[int]) -> np.ndarray:
        """Appends tokens; returns logits [len(ids), vocab] for them."""
        past = len(self.tokens)
        self.tokens += ids
        if self.stateless:
            out = self.sess.run([self.outputs[0]], {self.ids: np.array([self.tokens], dtype=np.int64)})[0]
            return out[0, -len(ids):]
        feeds: dict[str, Any] = {self.ids: np.array([ids], dtype=np.int64)}
        for n, meta in self.inputs.items():
            low = n.lower()
            if "mask" in low:
                feeds[n] = np.ones((1, past + len(ids)), dtype=np.int64 if "int64" in meta.type else np.int32)
            elif "position" in low:
                feeds[n] = np.arange(past, past + len(ids), dtype=np.int64)[None]
        feeds.update(self.cache)
        missing = [n for n in self.inputs if n not in feeds]
        if missing:
            raise ZlcError(f"verify does not know how to feed input(s) {missing} of the reference model")
        res = dict(zip(self.outputs, self.sess.run(self.outputs, feeds), strict=True))
        for n in self.past:
            present = n.replace("past_key_values", "present")
            if present not in res:
                raise ZlcError(f"reference model has no output '{present}' for cache input '{n}'")
            self.cache[n] = res[present]
        return res[self.outputs[0]][0]


@dataclass
class VerifyReport:
    model: str
    prompt: list[int]
    prefill_max_abs: float
    prefill_max_rel: float
    decode_max_abs: list[float] = field(default_factory=list)
    decode_max_rel: list[float] = field(default_factory=list)
    tokens_ref: list[int] = field(default_factory=list)
    tokens_zlc: list[int] = field(default_factory=list)
    atol: float = 1e-3
    dtype: str = "f32"  # the model's (its logits'): f16 and bf16 are checked as the kernel runs them, in f32
    oracle: str = ORT  # what the numbers were compared with
    histogram_before: dict[str, int] = field(default_factory=dict)
    histogram_after: dict[str, int] = field(default_factory=dict)
    megakernel: list[str] = field(default_factory=list)  # what does not fit the megakernel, one line each

    @property
    def compilable(self) -> bool:
        """Whether `zlc compile` can turn the lowered model into a megakernel."""
        return not self.megakernel

    @property
    def max_abs(self) -> float:
        return max([self.prefill_max_abs] + self.decode_max_abs)

    @property
    def tokens_equal(self) -> bool:
        return self.tokens_ref == self.tokens_zlc

    @property
    def ok(self) -> bool:
        """The numbers: logits within atol and the same greedy tokens (compilability aside)."""
        return self.max_abs <= self.atol and self.tokens_equal

    def summary(self) -> str:
        worst = max(self.decode_max_abs) if self.decode_max_abs else 0.0
        agree = sum(a == b for a, b in zip(self.tokens_ref, self.tokens_zlc, strict=True))
        return (f"{self.model}: prefill max abs {self.prefill_max_abs:.3g} (rel {self.prefill_max_rel:.3g}), "
                f"decode max abs {worst:.3g} over {len(self.decode_max_abs)} steps, "
                f"greedy tokens {agree}/{len(self.tokens_ref)} equal -> {'PASS' if self.ok else 'FAIL'} "
                f"(atol {self.atol:g}{'' if self.dtype == 'f32' else ', ' + self.dtype + ' model'}; "
                f"oracle: {self.oracle})")

    def compilable_line(self) -> str:
        """`compilable: yes`, or `compilable: no (...)` naming what does not fit the megakernel."""
        if self.compilable:
            return "compilable: yes"
        return f"compilable: no ({'; '.join(self.megakernel)})"


def check_token_ids(ids: list[int], vocab: int) -> None:
    """Out-of-range ids would fail deep inside an executor; say so up front."""
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ZlcError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")


def _errors(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    d = np.abs(ref.astype(np.float64) - got.astype(np.float64))
    return float(d.max()), float((d / (np.abs(ref) + 1e-6)).max())


def verify(model: str | os.PathLike[str], *, prompt_ids: list[int] | None = None, prompt_len: int = 8,
           steps: int = 32, atol: float | None = None, max_seq: int | None = None, seed: int = 0,
           options: CompileOptions | None = None, observer: Observer | None = None) -> VerifyReport:
    """Compares zlc against ONNX Runtime on `model` (an .onnx path; a GGUF file or a checkpoint
    directory: against its imported graph without a KV cache, GGUF_ORACLE, HF_DIR_ORACLE); for bf16 models (and f16 ones
    ONNX Runtime cannot run), against the imported graph in f32 on the reference executor. `atol`
    defaults by the model's dtype (DEFAULT_ATOL). Raises ZlcError on bad input; the report's `ok`
    says whether it passed. `observer` sees each lowering stage (progress)."""
    from zlc.reference.executor import HALF, in_f32
    from zlc.reference.session import ReferenceSession

    path = Path(model)
    need = (len(prompt_ids) if prompt_ids else prompt_len) + steps
    opts = options or CompileOptions(max_seq=max_seq or max(need, 64))
    if need > opts.max_seq:
        raise ZlcError(f"prompt ({need - steps}) + steps ({steps}) exceed max_seq={opts.max_seq}")
    seen: dict[str, Graph] = {}

    def watch(stage: str, g: Graph) -> None:
        if stage == "import":  # the op-level graph, before any pass: the f32 oracle's input
            seen[stage] = g.clone()
        if observer is not None:
            observer(stage, g)

    lowered = lower(path, options=opts, observer=watch)
    dtype = lowered.graph.outputs[0].dtype.value
    from zlc.passes.probe import PAST_KEY, PAST_VALUE, classify_inputs, past_dims

    roles = classify_inputs(lowered.graph)
    dims = {v.name: past_dims(lowered.graph, v) for v in lowered.graph.inputs
            if roles.get(v.name) in (PAST_KEY, PAST_VALUE)}
    ref: OrtReference | F32Reference
    oracle = ORT
    from zlc.frontend.gguf_file import is_gguf
    from zlc.frontend.hf_dir import is_checkpoint_dir

    if is_gguf(path):  # no ONNX model to run: the imported transformer-level graph, stateless
        oracle = GGUF_ORACLE
        ref = F32Reference(seen["import"], path.name)
    elif is_checkpoint_dir(path):  # the same for a checkpoint directory (Hugging Face is the tests' oracle)
        oracle = HF_DIR_ORACLE
        ref = F32Reference(seen["import"], path.name)
    elif dtype == "bf16":
        oracle = "zlc reference in f32 (ONNX Runtime has no bf16 kernels)"
        ref = F32Reference(seen["import"], path.name)
    else:
        try:
            ref = OrtReference(path, dims)
            if ref.exact_nbits:
                oracle = f"{ORT}, its {ref.exact_nbits} MatMulNBits at accuracy_level 0 (f32, zlc's computation)"
            if dtype == "f16":
                ref.feed([0])  # an f16 graph may load and still lack a kernel at run time
                ref.reset()
        except Exception as e:  # ORT's own exception types (and ModelFormatError for loading)
            if dtype != "f16":
                raise
            why = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
            oracle = f"zlc reference in f32 (ONNX Runtime cannot run this f16 model: {why})"
            ref = F32Reference(seen["import"], path.name)
    sess = ReferenceSession.from_lowered(lowered)
    if dtype in HALF:  # zlc's side as the megakernel computes it: f32 math, half-rounded weights
        assert lowered.prefill is not None and lowered.decode is not None
        sess = ReferenceSession(in_f32(lowered.prefill), in_f32(lowered.decode), lowered.max_seq)
    vocab = lowered.graph.outputs[0].shape[-1]  # type: ignore[index]
    if prompt_ids is None:
        rng = np.random.default_rng(seed)
        hi = vocab if isinstance(vocab, int) else 100
        prompt_ids = [int(x) for x in rng.integers(0, hi, prompt_len)]
    elif isinstance(vocab, int):
        check_token_ids(prompt_ids, vocab)
    r = ref.feed(list(prompt_ids))
    z = sess.prefill(list(prompt_ids)).numpy()
    pa, pr = _errors(r, z)
    rep = VerifyReport(str(path.name), list(prompt_ids), pa, pr, dtype=dtype, oracle=oracle,
                       atol=default_atol(dtype) if atol is None else atol,
                       histogram_before=lowered.histogram_before, histogram_after=lowered.histogram_after,
                       megakernel=megakernel_fit(lowered.decode, lowered.max_seq).lines())
    r_last, z_last = r[-1], z[-1]
    for _ in range(steps):
        t_ref, t_zlc = int(np.argmax(r_last)), int(np.argmax(z_last))
        rep.tokens_ref.append(t_ref)
        rep.tokens_zlc.append(t_zlc)
        if len(rep.tokens_ref) == steps:
            break
        r_last = ref.feed([t_ref])[-1]
        z_last = sess.step(t_ref).numpy()
        a, rr = _errors(r_last, z_last)
        rep.decode_max_abs.append(a)
        rep.decode_max_rel.append(rr)
    return rep


# ---- does it fit the megakernel -----------------------------------------------------------------

# What an op-level region of the decode graph most likely is, by the ops it holds and where it sits
# (first match wins). The scheduler only knows that an op has no lowering; this names the feature.
_ROTARY = ("rotary embedding that raising did not recognise (rotate-half and interleaved pairs, full or "
           "partial, on [B, H, T, D] or [B, T, H, D] raise: Llama, GPT-J, CodeGen, Cohere, GPT-NeoX, Phi-2, StableLM)")
_NORM = ("a normalization that raising did not recognise (q/k norms: Qwen3, OLMo 2; Cohere's bias-free "
         "LayerNorm raises)")
_LOGITS = ("a multiplier on the logits after the LM head with no raised norm before the head to take it "
           "(Cohere's logit_scale and Granite's logits_scaling fold into theirs)")
_FLAT = ("the residual stream reshaped to [T, hidden] around ops that are not all row-wise (raise-rows "
         "unflattens OPT's feed-forward block; `zlc inspect --explain` says why this one stayed): Reshape "
         "and the residual Adds after it")
_PARALLEL = ("a residual Add no projection's epilogue can take (a parallel attention + MLP block's sum "
             "re-associates into (x + attn) + mlp when both terms are projections: GPT-J, CodeGen, "
             "Cohere, GPT-NeoX, Phi-2; this one's are not)")
_AFTER = ("residual Adds after the ops above (one fuses into a projection's epilogue once that "
          "projection lowers; a parallel block's 3-way sum re-associates once both its projections do)")
_LAYOUT = "a reshape between transformer ops the kernel does not fuse"
_QSCALE = ("an attention scale applied to a projection as a Mul that raise-rows could not fold into it "
           "(OPT's q scale folds)")
_SCALAR = ("a multiplier on activations that raise-rows could not fold into a projection (Granite's "
           "residual multipliers fold)")
_OTHER = "op-level computation that raising did not recognise"


def check_lowered(model: Any, example_inputs: Any, lowered: Lowered, atol: float | None,
                     steps: int = 4) -> dict[str, Any]:
    """`zlc compile`'s verify stage: the lowered model against its source: ONNX Runtime for an .onnx file (a 4-step `zlc verify`),
    else the torch module itself, teacher-forced with its own greedy tokens: prefill of the example
    prompt, then `steps` decode steps on the synthesized KV cache, each against the module's logits."""
    # ONNX Runtime; GGUF, checkpoint directory: its imported graph
    if isinstance(model, (str, Path)) and (Path(model).is_file() or Path(model).is_dir()):
        rep = verify(model, steps=steps, prompt_len=8, atol=atol, max_seq=64)
        return {"status": "passed" if rep.ok else "failed", "ok": rep.ok,
                "reference": "onnxruntime" if rep.oracle == "ONNX Runtime" else "zlc reference in f32",
                "oracle": rep.oracle, "atol": rep.atol, "max_abs": rep.max_abs,
                "tokens_equal": rep.tokens_equal, "summary": rep.summary()}
    import torch

    if atol is None:
        atol = default_atol(lowered.graph.outputs[0].dtype.value)

    from zlc.reference.session import ReferenceSession

    if example_inputs is None:
        return {"status": "skipped", "ok": True, "summary": "no reference"}
    prompt = [int(i) for i in example_inputs[0][0]]
    steps = max(0, min(steps, lowered.max_seq - len(prompt)))
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps + 1):  # the module's greedy continuation, one token per call
            ref = _logits(model(torch.tensor([ids])))[0].float()
            ids.append(int(ref[-1].argmax()))
        ids.pop()
        sess = ReferenceSession.from_lowered(lowered)
        got = [sess.prefill(prompt).float()] + [sess.step(t).float()[None] for t in ids[len(prompt):]]
    err = float((ref - torch.cat(got)).abs().max())
    zlc_tokens = [int(r.argmax()) for r in torch.cat(got)[len(prompt) - 1:]]
    tokens_equal = zlc_tokens == [int(r.argmax()) for r in ref[len(prompt) - 1:]]
    ok = err <= atol and tokens_equal
    return {"status": "passed" if ok else "failed", "ok": ok, "reference": "torch module",
            "max_abs": err, "tokens_equal": tokens_equal,
            "summary": f"prefill and {steps} decode steps: max abs {err:.3g} (atol {atol}), greedy tokens "
                       f"{'equal' if tokens_equal else 'differ'}"}


def _logits(out: Any) -> Any:
    """A module's logits, whatever it returns: an HF output, a tuple, or the tensor."""
    return out.logits if hasattr(out, "logits") else (out[0] if isinstance(out, (tuple, list)) else out)


def _feature(ops: set[str], consumers: set[str], to_output: bool) -> str:
    if ops & {"Cos", "Sin", "GatherND", "Gather"} or {"Neg", "Concat"} <= ops:
        return _ROTARY
    if "TopK" in ops:
        return "mixture-of-experts routing (Mixtral, Qwen3-MoE)"
    if "Tanh" in ops:
        return "soft-capping of attention or final logits (Gemma 2)"
    if ops & {"ReduceMean", "Pow", "Sqrt"}:
        return _NORM
    if to_output:
        return _LOGITS
    if {"Reshape", "Add"} <= ops:
        return _FLAT
    if ops <= {"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten"}:
        return _LAYOUT
    if ops <= {"Mul", "Div"}:
        return _QSCALE if "SplitHeads" in consumers else _SCALAR
    return _OTHER


@dataclass
class Misfit:
    """Something in the decode graph the megakernel cannot run: why, and the nodes."""

    why: str
    nodes: list[Node] = field(default_factory=list)

    def line(self) -> str:
        if not self.nodes:
            return self.why
        hist: dict[str, int] = {}
        for n in self.nodes:
            hist[n.op] = hist.get(n.op, 0) + 1
        by_count = sorted(hist.items(), key=lambda kv: -kv[1])
        ops = ", ".join(f"{op} x{k}" if k > 1 else op for op, k in by_count)
        names = ", ".join(f"'{n.name}'" for n in self.nodes[:3]) + (", ..." if len(self.nodes) > 3 else "")
        return f"{self.why}: {ops} (no megakernel lowering; nodes {names})"


@dataclass
class FitReport:
    """`megakernel_fit`'s answer: compilable when nothing misfits."""

    misfits: list[Misfit] = field(default_factory=list)

    @property
    def compilable(self) -> bool:
        return not self.misfits

    def lines(self) -> list[str]:
        return [m.line() for m in self.misfits]

    def check(self, name: str) -> None:
        """Raises NotCompilableError naming every misfit (what `zlc compile` fails with)."""
        if self.misfits:
            raise NotCompilableError(f"{name} does not fit the megakernel: {'; '.join(self.lines())} "
                                     "(`zlc inspect MODEL --explain` shows what raising refused)")


def megakernel_fit(decode: Graph | None, max_seq: int) -> FitReport:
    """Whether the decode graph fits the megakernel, by the scheduler's own check (codegen's
    TaskBuilder per node, then `schedule` for the interpreter's and the GPUs' tilings), without
    compiling anything. Each op-level region that has no lowering becomes one misfit per feature;
    an op whose lowering refuses its inputs is reported with the scheduler's message."""
    from zlc.codegen.schedule import schedule, tiling_for
    from zlc.codegen.tasks import ScheduleError, TaskBuilder

    from .targets import get_target

    if decode is None:
        return FitReport([Misfit("the model was lowered without a KV cache")])
    b = TaskBuilder(decode, tiling_for(get_target("cpu"), max_seq), max_seq)
    unlowered: list[Node] = []
    refused: list[Misfit] = []
    broken: set[int] = set()  # values nothing materializes: their producer has no lowering or failed
    after: set[int] = set()  # ... of those, the ones of ops that lower but were fed a broken value
    by_id = {id(n): n for n in decode.nodes}
    for n in decode.nodes:
        if id(n) in b.skip:
            continue
        fn = getattr(b, "op_" + n.op, None)
        if fn is None:
            unlowered.append(n)
        elif any(v is not None and id(v) in broken for v in n.inputs):
            after.update(id(o) for o in n.outputs)
        else:
            fused = set(b.skip)
            try:
                fn(n)
                continue
            except ScheduleError as e:
                refused.append(Misfit(str(e)))
            for k in b.skip - fused:  # what the failed op had taken into its epilogue is missing too
                broken.update(id(o) for o in by_id[k].outputs)
        broken.update(id(o) for o in n.outputs)
    misfits = _regions(decode, unlowered, after) + refused
    if not any(n.op == "LMHead" for n in decode.nodes):
        misfits.append(Misfit("the graph has no LMHead (the logits are not a raised final projection)"))
    if not misfits:  # the whole schedule, per tiling: events and waits have limits of their own
        for target in ("cpu", "h100"):
            try:
                schedule(decode, tiling_for(get_target(target), max_seq), max_seq)
            except ScheduleError as e:
                misfits.append(Misfit(f"{target} tiling: {e}"))
                break
    return FitReport(misfits)


def _regions(g: Graph, unlowered: list[Node], after: set[int]) -> list[Misfit]:
    """Connected op-level regions, each named by `_feature`; regions of one feature merge. Residual
    Adds (no input computed by an op-level node other than another Add) are named on their own: a
    parallel block's sum, or one downstream of ops that did not lower (which may fuse once they do)."""
    made = {id(o): n for n in unlowered for o in n.outputs}
    residual: list[Node] = []
    for n in unlowered:
        if n.op == "Add" and all(v is None or id(v) not in made or made[id(v)].op == "Add" for v in n.inputs):
            residual.append(n)
            if any(v is not None and id(v) in after for v in n.inputs):
                after.update(id(o) for o in n.outputs)
    skip = {id(n) for n in residual}
    rest = [n for n in unlowered if id(n) not in skip]
    parent = {id(n): id(n) for n in rest}

    def root(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in rest:
        for v in n.inputs:
            if v is not None and v.producer is not None and id(v.producer) in parent:
                parent[root(id(n))] = root(id(v.producer))
    regions: dict[int, list[Node]] = {}
    for n in rest:
        regions.setdefault(root(id(n)), []).append(n)
    users = g.users()
    outputs = {id(v) for v in g.outputs}
    by_feature: dict[str, Misfit] = {}
    for nodes in regions.values():
        inside = {id(n) for n in nodes}
        consumers = {u.op for n in nodes for o in n.outputs for u in users.get(o, []) if id(u) not in inside}
        to_output = any(id(o) in outputs for n in nodes for o in n.outputs)
        why = _feature({n.op for n in nodes}, consumers, to_output)
        by_feature.setdefault(why, Misfit(why)).nodes.extend(nodes)
    for n in residual:
        why = _AFTER if any(id(o) in after for o in n.outputs) else _PARALLEL
        by_feature.setdefault(why, Misfit(why)).nodes.append(n)
    return list(by_feature.values())
