"""`zlc verify` and `zlc.verify(...)`: runs a model in ONNX Runtime and in zlc (prefill of a prompt,
then N decode steps with the synthesized KV cache) and reports max abs/rel logit error per step and
greedy-token agreement. Both sides are driven with ONNX Runtime's greedy tokens (teacher forcing), so every
step compares logits for the same sequence; `tokens_equal` says whether zlc's argmax agreed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .driver import CompileOptions, Observer, lower
from .errors import ModelFormatError, ZlcError


class OrtReference:
    """ONNX Runtime as the oracle, for stateless and cache-carrying (Optimum/genai) graphs."""

    def __init__(self, path: str | os.PathLike[str], past_dims: dict[str, list[int]] | None = None):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 3
        try:
            self.sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
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
    histogram_before: dict[str, int] = field(default_factory=dict)
    histogram_after: dict[str, int] = field(default_factory=dict)

    @property
    def max_abs(self) -> float:
        return max([self.prefill_max_abs] + self.decode_max_abs)

    @property
    def tokens_equal(self) -> bool:
        return self.tokens_ref == self.tokens_zlc

    @property
    def ok(self) -> bool:
        return self.max_abs <= self.atol and self.tokens_equal

    def summary(self) -> str:
        worst = max(self.decode_max_abs) if self.decode_max_abs else 0.0
        agree = sum(a == b for a, b in zip(self.tokens_ref, self.tokens_zlc, strict=True))
        return (f"{self.model}: prefill max abs {self.prefill_max_abs:.3g} (rel {self.prefill_max_rel:.3g}), "
                f"decode max abs {worst:.3g} over {len(self.decode_max_abs)} steps, "
                f"greedy tokens {agree}/{len(self.tokens_ref)} equal -> {'PASS' if self.ok else 'FAIL'} "
                f"(atol {self.atol:g})")


def check_token_ids(ids: list[int], vocab: int) -> None:
    """Out-of-range ids would fail deep inside an executor; say so up front."""
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ZlcError(f"token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")


def _errors(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    d = np.abs(ref.astype(np.float64) - got.astype(np.float64))
    return float(d.max()), float((d / (np.abs(ref) + 1e-6)).max())


def verify(model: str | os.PathLike[str], *, prompt_ids: list[int] | None = None, prompt_len: int = 8,
           steps: int = 32, atol: float = 1e-3, max_seq: int | None = None, seed: int = 0,
           options: CompileOptions | None = None, observer: Observer | None = None) -> VerifyReport:
    """Compares zlc against ONNX Runtime on `model` (an .onnx path). Raises ZlcError on bad input;
    the report's `ok` says whether it passed. `observer` sees each lowering stage (progress)."""
    from zlc.reference.session import ReferenceSession

    path = Path(model)
    need = (len(prompt_ids) if prompt_ids else prompt_len) + steps
    opts = options or CompileOptions(max_seq=max_seq or max(need, 64))
    if need > opts.max_seq:
        raise ZlcError(f"prompt ({need - steps}) + steps ({steps}) exceed max_seq={opts.max_seq}")
    lowered = lower(path, options=opts, observer=observer)
    from zlc.passes.probe import PAST_KEY, PAST_VALUE, classify_inputs, past_dims

    roles = classify_inputs(lowered.graph)
    dims = {v.name: past_dims(lowered.graph, v) for v in lowered.graph.inputs
            if roles.get(v.name) in (PAST_KEY, PAST_VALUE)}
    ref = OrtReference(path, dims)
    sess = ReferenceSession.from_lowered(lowered)
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
    rep = VerifyReport(str(path.name), list(prompt_ids), pa, pr, atol=atol,
                       histogram_before=lowered.histogram_before, histogram_after=lowered.histogram_after)
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
