"""llama.cpp as an oracle on the same GGUF file: zlc's native kernel and llama.cpp (llama-cpp-python,
built from source outside CI, see docs/performance.md "Same GGUF file: zlc beside llama.cpp")
teacher-forced on one prompt, their logits compared at every position.

Both compute the same model, not the same arithmetic. zlc keeps activations f32 (packed weights are
dequantized exactly); llama.cpp's CPU dot products with Q8_0 / Q4_1 weights first round each
activation row to 8 bits per block of 32 (Q8_0 / Q8_1: d = amax / 127 stored as f16, q = round(x * 127 / amax);
Q8_1 also keeps each block's sum as f16, times the weight block's min). The tolerance comes from that
rounding, computed per case rather than guessed: Hugging Face on the file's weights, once exact and
once with every Linear's input rounded as llama.cpp rounds it for Q8_0 (q8_activations); on the
tiny model's Q8_0 file that emulation equals llama.cpp's logits to f32 rounding (asserted: the
rounding model is llama.cpp's). zlc may then differ from llama.cpp by at most twice the emulation's
own deviation from the exact model (Q4_1: the same rounding plus Q8_1's f16 block sums, not
emulated, inside the factor 2). On SmolLM2 the emulation itself lands 0.10 from llama.cpp: through
30 layers the rounding is chaotic (inputs that differ by f32 summation order round some values a
step d apart, and those steps grow), so there only the factor is asserted. On the f32 files (the
same weights dense) both sides do f32 math and agree to 1e-5 relative. Metric: the rms of the
logit difference over the rms of llama.cpp's logits, at the worst position; and no greedy token
may differ where llama.cpp's top-2 margin exceeds twice the largest difference (at least a quarter
of the positions have such a margin, so that check has teeth). The KV cache is f32 on both sides
(llama.cpp's default f16 would add its own rounding). Measured (2026-12-04), zlc against
llama.cpp / the emulated rounding's deviation: SmolLM2 f32 2.8e-6, Q4_1 0.12, Q8_0 0.14 / 0.11,
llama.cpp's Q4_K_M mix 0.19 / 0.13 (SmolLM2's outlier channels make a block's scale coarse for its
neighbours); the tiny model 1e-6, Q4_1 0.044 / 0.034, Q8_0 0.030 / 0.030.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zlc
from zlc.codegen.native import find_compiler

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed (a source build outside CI: docs/performance.md)")
gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host"),
              pytest.mark.slow]

Q = gguf.GGMLQuantizationType
#: rms(zlc - llama.cpp) / rms(llama.cpp's logits), the worst position, where both do f32 math
F32_RTOL = 1e-5
#: the Q8_0 rounding emulation against llama.cpp itself (its residue: f32 summation order)
EMULATION_RTOL = 1e-5
#: zlc - llama.cpp on block files, in units of the emulated rounding's own deviation
ROUNDING_FACTOR = 2.0
TINY_IDS = [256, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 258, 259, 97, 98]
SMOLLM2_TEXT = "The capital of France is Paris, and the capital of Italy is Rome."


def llama_cpp_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's logits [len(ids), vocab] for `ids` teacher-forced in one batch (f32 KV cache)."""
    f32 = int(llama_cpp.GGML_TYPE_F32)
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(64, len(ids)), n_batch=max(64, len(ids)), n_threads=2,
                          logits_all=True, type_k=f32, type_v=f32, verbose=False)
    try:
        llm.eval(ids)
        return np.array(llm.scores[:len(ids)], dtype=np.float32)
    finally:
        llm.close()


def zlc_logits(path: Path, out: Path, ids: list[int]) -> np.ndarray:
    """zlc's native kernel's logits [len(ids), vocab]: `path` compiled for the CPU, one prefill."""
    zlc.compile(path, targets=["cpu"], out=out, max_seq=64, verify=False)
    s = zlc.load(out).session("cpu", threads=2)
    try:
        _, lg = s.prefill(ids, all_logits=True, want_logits=True)
        return np.asarray(lg, dtype=np.float32).reshape(len(ids), -1)
    finally:
        s.close()


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """`x` as llama.cpp's x86 quantize_row_q8_0 leaves it: per 32 values q = round(x * (127 / amax)),
    dequantized with d = amax / 127 as stored, f16; the reference executor's rounding of `--numerics
    fast` (zlc.reference.numerics.q8_round), lifted from here."""
    from zlc.reference.numerics import q8_round

    return q8_round(x)


def hf_logits(model: torch.nn.Module, ids: list[int], rounded: bool) -> np.ndarray:
    """Hugging Face's logits [len(ids), vocab]; `rounded`: every Linear's input (the projections,
    the MLP, the LM head: llama.cpp's block-weight products) through q8_activations."""
    hooks = [m.register_forward_pre_hook(lambda _, args: (q8_activations(args[0]),))
             for m in model.modules() if rounded and isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().numpy()
    finally:
        for h in hooks:
            h.remove()


def rel_rms(a: np.ndarray, b: np.ndarray) -> float:
    """rms(a - b) / rms(b), the worst row."""
    return float((np.sqrt(((a - b) ** 2).mean(-1)) / np.sqrt((b ** 2).mean(-1))).max())


def unclear_free(ours: np.ndarray, theirs: np.ndarray) -> tuple[list[int], int]:
    """(the positions whose greedy tokens differ although llama.cpp's top-2 margin there exceeds
    twice the largest difference, how many positions have such a margin)."""
    d = np.abs(ours - theirs).max(-1)
    top2 = np.sort(theirs, -1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * d
    return [int(i) for i in np.flatnonzero(clear) if ours[i].argmax() != theirs[i].argmax()], int(clear.sum())


def check(ours: np.ndarray, theirs: np.ndarray, model: torch.nn.Module | None, ids: list[int],
          qtype: Any, shallow: bool) -> dict[str, Any]:
    """The asserts of one case (the module docstring); returns the figures for the message."""
    got: dict[str, Any] = {"zlc_vs_llama_cpp": rel_rms(ours, theirs)}
    got["wrong"], got["clear"] = unclear_free(ours, theirs)
    if qtype is None:
        assert got["zlc_vs_llama_cpp"] <= F32_RTOL, got
    else:
        assert model is not None
        exact, emulated = hf_logits(model, ids, False), hf_logits(model, ids, True)
        got["rounding"] = rel_rms(exact, emulated)
        got["emulation_vs_llama_cpp"] = rel_rms(emulated, theirs)
        if qtype == Q.Q8_0 and shallow:  # deep models: the rounding is chaotic (docstring)
            assert got["emulation_vs_llama_cpp"] <= EMULATION_RTOL, got
        assert got["zlc_vs_llama_cpp"] <= ROUNDING_FACTOR * got["rounding"], got
    assert not got["wrong"] and got["clear"] >= len(ids) // 4, got
    return got


@pytest.mark.parametrize("qtype", [None, Q.Q8_0, Q.Q4_1], ids=["f32", "q8_0", "q4_1"])
def test_tiny_gguf_logits_match_llama_cpp(qtype: Any, tmp_path: Path) -> None:
    """A tiny random Llama written as llama.cpp's converter does (zlc.testing.gguf_files.write_gguf,
    a byte-level vocabulary), f32 or every matrix (the tied embedding too) in Q8_0 / Q4_1; Hugging
    Face on the blocks' round trip (quantize_model). llama.cpp reads a copy with one BPE merge
    added (its loader requires the key; the byte vocabulary needs no merge, gguf's writer drops an
    empty list, and zlc's tokenizer, through transformers, refuses a merge whose result is not in
    the vocabulary): the tensors are the same bytes."""
    from zlc.testing.families import CHAT_VOCAB, hf_model
    from zlc.testing.gguf_files import quantize_model, requantize_gguf, write_gguf

    model = hf_model("llama", vocab_size=CHAT_VOCAB)
    path = write_gguf(model, tmp_path / "tiny.gguf", qtype=qtype, tokenizer=True)
    if qtype is not None:
        quantize_model(model, qtype)
    theirs = requantize_gguf(path, tmp_path / "tiny-merge.gguf",
                             fields={gguf.Keys.Tokenizer.MERGES: (["a b"], gguf.GGUFValueType.ARRAY)})
    check(zlc_logits(path, tmp_path / "tiny.zlc", TINY_IDS), llama_cpp_logits(theirs, TINY_IDS), model, TINY_IDS,
          qtype, shallow=True)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[tuple[torch.nn.Module, list[int]]]:
    """SmolLM2 dequantized from the Q4_1 file (Hugging Face), and SMOLLM2_TEXT's ids."""
    from zlc.runtime.tokenizer import BundleTokenizer, bundle_tokenizer
    from zlc.testing.smollm2 import load_smollm2, smollm2_gguf_path

    model, _ = load_smollm2()
    with tempfile.TemporaryDirectory() as d:
        bundle_tokenizer(smollm2_gguf_path(), Path(d))
        ids = BundleTokenizer(Path(d)).encode(SMOLLM2_TEXT)
    yield model, ids


@pytest.mark.parametrize("fmt", ["f32", "q4_1", "q8_0"])
def test_smollm2_gguf_logits_match_llama_cpp(smollm2: tuple[torch.nn.Module, list[int]], fmt: str,
                                            tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct: the shipped Q4_1 file, the Q8_0 file requantized from it
    (requantize_gguf: what bench/cpu_decode.py's Q8_0 engines read) and its f32 twin (the Q4_1
    file dequantized), a 15-token text. The Q8_0 case rounds a copy of the model's weights to Q8_0
    (quantize_model: blocks lie along rows, so llama.cpp's Q/K row order is no matter)."""
    from zlc.testing.gguf_files import quantize_model, requantize_gguf
    from zlc.testing.smollm2 import smollm2_gguf_path

    model, ids = smollm2
    src = smollm2_gguf_path()
    path = src if fmt == "q4_1" else requantize_gguf(src, tmp_path / f"smollm2.{fmt}.gguf", Q[fmt.upper()])
    qtype = {"f32": None, "q4_1": Q.Q4_1, "q8_0": Q.Q8_0}[fmt]
    if qtype == Q.Q8_0:
        model = copy.deepcopy(model)
        quantize_model(model, Q.Q8_0)
    check(zlc_logits(path, tmp_path / "smollm2.zlc", ids), llama_cpp_logits(path, ids), model, ids, qtype,
          shallow=False)


def test_smollm2_q4_k_m_logits_match_llama_cpp(smollm2: tuple[torch.nn.Module, list[int]], tmp_path: Path) -> None:
    """SmolLM2 as llama.cpp's own quantizer writes it, Q4_K_M from the f32 twin: SmolLM2's 576
    columns are no whole 256-value super-block, so llama.cpp falls back per matrix (Q5_0 mostly,
    Q4_K and Q6_K for ffn_down, Q8_0 for some attn_v): one real mixed file through zlc's block
    kernels. Hugging Face reads the same file (transformers' GGUF loader, gguf's dequantization).
    llama.cpp rounds the K-quants' inputs to Q8_K (256 values, f32 scale), which the 32-value
    emulation only approximates: inside the factor 2."""
    import ctypes

    from transformers import AutoModelForCausalLM

    from zlc.testing.gguf_files import requantize_gguf
    from zlc.testing.quiet import quiet
    from zlc.testing.smollm2 import smollm2_gguf_path

    _, ids = smollm2
    f32 = requantize_gguf(smollm2_gguf_path(), tmp_path / "f32.gguf", Q.F32)
    path = tmp_path / "smollm2.Q4_K_M.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, 2
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(), ctypes.byref(params)) == 0
    f32.unlink()
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert {"Q5_0", "Q4_K", "Q6_K", "Q8_0"} <= types, types
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, attn_implementation="eager",
                                                     dtype=torch.float32).eval()
    check(zlc_logits(path, tmp_path / "smollm2.zlc", ids), llama_cpp_logits(path, ids), model, ids, Q.Q4_K,
          shallow=False)
