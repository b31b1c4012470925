"""The `reference` executor (runtime/reference_backend.py): a bundle's IR on its packed weights,
run by the torch reference executor. Compared with the megakernel (the `cpu` device: the native C
kernel) and with ONNX Runtime: greedy tokens, prefill and decode logits, a bf16 bundle, prompts
spanning several launches, tied weights (every name of a shared constant is placed), a model
without transformer layers (empty cache), and the error for a constant the placement lacks."""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zlc
from zlc.bundle import MANIFEST
from zlc.errors import ZlcError
from zlc.runtime.megakernel import MegakernelSession
from zlc.runtime.reference_backend import ReferenceBackend

PROMPT = [1, 5, 9, 200, 17, 33, 2]
STEPS = 3  # decode steps after the prefill: 4 greedy tokens in all
MAX_SEQ = 64
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Trace:
    """One greedy run: the prefill's logits for every prompt row, then each decode step's."""

    tokens: list[int]
    prefill: np.ndarray  # [len(prompt), vocab]
    steps: list[np.ndarray]  # STEPS x [1, vocab]


def _trace(bundle: Path, device: str, prompt: list[int] = PROMPT, steps: int = STEPS) -> Trace:
    with zlc.load(bundle).session(device) as s:
        tok, lg = s.prefill(prompt, all_logits=True, want_logits=True)
        assert lg is not None
        tokens, step_logits = [tok], []
        for _ in range(steps):
            tok, slg = s.step(tok, want_logits=True)
            assert slg is not None
            tokens.append(tok)
            step_logits.append(slg)
    return Trace(tokens, lg, step_logits)


def _assert_close(a: Trace, b: Trace, atol: float) -> None:
    assert a.prefill.shape == b.prefill.shape
    np.testing.assert_allclose(a.prefill, b.prefill, rtol=0, atol=atol)
    for x, y in zip(a.steps, b.steps, strict=True):
        assert x.shape == y.shape == (1, a.prefill.shape[1])
        np.testing.assert_allclose(x, y, rtol=0, atol=atol)


def _compile(model: Path, out: Path, **kw: Any) -> Path:
    zlc.compile(model, targets=["cpu"], out=out, max_seq=MAX_SEQ, **kw)
    return out


def _ort_greedy(model: Path, prompt: list[int], n: int) -> list[int]:
    from zlc.verifier import OrtReference

    ort = OrtReference(model)
    logits = ort.feed(list(prompt))[-1]
    out: list[int] = []
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == n:
            return out
        logits = ort.feed([out[-1]])[-1]


@pytest.fixture(scope="module")
def llama(tiny_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile(tiny_onnx, tmp_path_factory.mktemp("ref") / "tiny.zlc")


@pytest.fixture(scope="module")
def llama_cpu(llama: Path) -> Trace:
    return _trace(llama, "cpu")


# ---- the tiny Llama ------------------------------------------------------------------------------


def test_greedy_tokens_match_interpreter_and_ort(tiny_onnx: Path, llama: Path, llama_cpu: Trace) -> None:
    got = zlc.load(llama).generate(PROMPT, STEPS + 1, device="reference")
    assert got == llama_cpu.tokens
    assert got == _ort_greedy(tiny_onnx, PROMPT, STEPS + 1)


def test_logits_match_interpreter(llama: Path, llama_cpu: Trace) -> None:
    ref = _trace(llama, "reference")
    assert ref.tokens == llama_cpu.tokens
    _assert_close(ref, llama_cpu, atol=1e-4)
    # The greedy token is the argmax of the last row (ties: the lowest id, as the kernel's).
    assert ref.tokens[0] == int(np.argmax(ref.prefill[-1]))


def test_prompt_longer_than_one_launch(llama: Path, tiny_lowered: Any) -> None:
    """Chunks of 5 continue each other through the cache (past = tokens already in it)."""
    b = zlc.load(llama)
    prompt = [(7 * i + 3) % b.vocab for i in range(23)]
    whole = _trace(llama, "reference", prompt)
    chunked = MegakernelSession(ReferenceBackend(b.path, b.manifest), chunk=5, max_seq=b.max_seq,
                                vocab=b.vocab)
    with chunked as s:
        tok, lg = s.prefill(prompt, all_logits=True, want_logits=True)
        assert s.launches == 5 and s.length == len(prompt)
        assert lg is not None and lg.shape == (len(prompt), b.vocab)
        np.testing.assert_allclose(lg, whole.prefill, rtol=0, atol=1e-4)
        assert tok == whole.tokens[0]
        tok, slg = s.step(tok, want_logits=True)
        assert tok == whole.tokens[1]
        np.testing.assert_allclose(slg, whole.steps[0], rtol=0, atol=1e-4)
    oracle = zlc.ReferenceSession.from_lowered(tiny_lowered).prefill(prompt).numpy()
    np.testing.assert_allclose(whole.prefill, oracle, rtol=0, atol=1e-4)


def test_bf16_bundle_matches_interpreter(tiny_onnx: Path, tmp_path: Path) -> None:
    bundle = _compile(tiny_onnx, tmp_path / "bf16.zlc", dtype="bf16")
    assert zlc.load(bundle).manifest["weights"]["W"]["dtype"] == "bf16"
    ref, cpu = _trace(bundle, "reference"), _trace(bundle, "cpu")
    assert ref.tokens == cpu.tokens and all(0 <= t < 256 for t in ref.tokens)
    _assert_close(ref, cpu, atol=1e-4)  # both widen the same bf16 weights and compute in f32


def test_session_limits_and_reset(llama: Path) -> None:
    b = zlc.load(llama)
    with b.session("reference") as s:
        assert s.chunk == b.max_seq
        with pytest.raises(ZlcError, match="outside the vocabulary"):
            s.prefill([b.vocab])
        with pytest.raises(ZlcError, match="exceed the bundle's max_seq"):
            s.prefill([1] * (b.max_seq + 1))
        first = s.generate(PROMPT, 3)
        assert s.generate(PROMPT, 3) == first  # stream() resets the cache length


# ---- placement -------------------------------------------------------------------------------------


def test_missing_placement_names_the_constant_and_bundle(llama: Path, tmp_path: Path) -> None:
    man = json.loads((llama / MANIFEST).read_text())
    dropped = man["weights"]["placement"].pop(0)["value"]
    with pytest.raises(ZlcError, match=rf"{llama}.*constant '%{dropped}'.*weights.placement"):
        ReferenceBackend(llama, man)
    # Through zlc.load too (the manifest is not covered by its own checksums).
    bad = tmp_path / "bad.zlc"
    shutil.copytree(llama, bad)
    (bad / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(ZlcError, match=f"constant '%{dropped}'"):
        zlc.load(bad).session("reference")


def test_tied_model_matches_interpreter(tmp_path: Path) -> None:
    """gpt2 ties its LM head to the embedding."""
    from zlc.testing import zoo

    bundle = _compile(zoo.cached("stateless", "gpt2", 20), tmp_path / "gpt2.zlc")
    cpu = _trace(bundle, "cpu", steps=2)
    assert zlc.load(bundle).generate(PROMPT, 3, device="reference") == cpu.tokens


def test_tied_constants_share_one_offset_and_all_resolve(tmp_path: Path) -> None:
    """Two constant names over one array (a tied embedding / LM head) are placed once, and both
    names are listed at that offset so the bundle's IR can be rebuilt from the arenas."""
    from safetensors.torch import load_file, save_file

    from zlc.codegen.pack import pack_arenas
    from zlc.codegen.schedule import schedule, tiling_for
    from zlc.ir.text import parse_graph
    from zlc.targets import get_target
    from zlc.testing import zoo

    src = _compile(zoo.cached("stateless", "gpt2", 20), tmp_path / "gpt2.zlc")
    man = json.loads((src / MANIFEST).read_text())
    ref_tokens = zlc.load(src).generate(PROMPT, 4, device="reference")
    # Rebuild the decode graph with the two LM-head names sharing one array.
    arenas = load_file(str(src / "weights.safetensors"))
    place = {p["value"]: p for p in man["weights"]["placement"]}

    def data(name: str) -> np.ndarray:
        p = place[name]
        n = int(np.prod(p["shape"]))
        return arenas[p["arena"]][p["offset"]:p["offset"] + n].reshape(p["shape"]).numpy()

    a, b = "m.lm_head.weight", "m.lm_head.weight.T.T"
    assert np.array_equal(data(a), data(b))  # the export's two copies of one tensor
    weights = {n: data(n) for n in place}
    weights[b] = weights[a]
    decode = parse_graph((src / "ir" / "decode.zir").read_text(), weights)
    prog = schedule(decode, tiling_for(get_target("cpu"), MAX_SEQ), MAX_SEQ)
    tied = [p for p in prog.weights if p["value"] in (a, b)]
    assert len(tied) == 2 and tied[0]["offset"] == tied[1]["offset"] and tied[0]["arena"] == tied[1]["arena"]
    assert prog.w_size < man["weights"]["W"]["elements"]  # one copy fewer
    assert {p["value"] for p in prog.weights} == set(place)  # every constant name is listed
    # A bundle with those arenas runs on the reference executor and gives the same tokens.
    dst = tmp_path / "tied.zlc"
    shutil.copytree(src, dst)
    W, P, _ = pack_arenas(decode, prog, "fp32")  # no packed weights (Q empty)
    save_file({"W": W, "P": P}, str(dst / "weights.safetensors"))
    man2 = copy.deepcopy(man)
    man2["weights"].update(placement=prog.weights, W={"dtype": "fp32", "elements": prog.w_size},
                           P={"dtype": "fp32", "elements": prog.p_size})
    be = ReferenceBackend(dst, man2)
    with MegakernelSession(be, chunk=be.chunk, max_seq=MAX_SEQ, vocab=int(man["model"]["vocab"])) as s:
        assert s.generate(PROMPT, 4) == ref_tokens


# ---- a model without transformer layers ---------------------------------------------------------------


def test_model_without_layers(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("zlc_bench_nolayer", ROOT / "bench" / "nolayer_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    onnx_path = mod.export_nolayer(tmp_path / "nolayer.onnx")
    bundle = zlc.load(_compile(onnx_path, tmp_path / "nolayer.zlc"))
    assert bundle.verified and bundle.manifest["model"]["layers"] == 0 and bundle.vocab == 260
    ref = _trace(bundle.path, "reference")
    cpu = _trace(bundle.path, "cpu")
    assert ref.tokens == cpu.tokens == _ort_greedy(onnx_path, PROMPT, STEPS + 1)
    _assert_close(ref, cpu, atol=1e-4)
    assert bundle.generate(PROMPT, STEPS + 1, device="reference") == ref.tokens
