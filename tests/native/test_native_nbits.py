"""ONNX Runtime's MatMulNBits int4 weights kept 4-bit from the ONNX file to the native kernel
(ir/quant.py nbits4_b<B>). Models: the zoo's tiny Llama export quantized by onnxruntime's own
MatMulNBitsQuantizer, node by node in blocks of 16 (with zero points), 32 (symmetric) and 128
(too wide for K=64: dense, and the report says why; so is a gated pair in two formats): one
kernel streams all three formats; and onnxruntime-genai's int4 build of the tiny Llama (fused
QKV, block 32). Oracles: the reference executor on the bundle's blocks (max abs 1e-4, equal
greedy tokens, every ISA level of this host), ONNX Runtime on the quantized model itself, and
ORT's own dequantization (its f32 kernel on an identity matrix) bit for bit against zlc's
blocks, numpy's (q - z) * s and the kernel's exported zlc_native_dequantize."""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from native_helpers import Built, assert_matches, run_both

import zlc
from zlc.codegen.native import find_compiler
from zlc.ir.quant import FORMATS, NBITS_BLOCKS, pack_nbits4
from zlc.passes.quantize import describe_packed
from zlc.runtime.native import host_cpu_flags

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

PROMPT = [3, 14, 15, 92, 65, 35, 89]
#: ORT's f32 MatMulNBits (accuracy_level 0) against zlc's f32 Linear on the same exact weight:
#: summation order only (~3e-6 measured on these logits of magnitude ~3.6)
ORT_ATOL = 1e-4


def _levels(man: dict[str, Any]) -> list[str]:
    flags = host_cpu_flags()
    levels = [n for n, info in man["native"]["levels"].items() if set(info["requires"]) <= flags]
    assert levels
    return levels


def _linears(*index: int) -> list[str]:
    """The tiny Llama export's MatMul nodes by index (per layer q, k, v, o, gate, up, down; 14: LM head)."""
    return ["node_linear" if i == 0 else f"node_linear_{i}" for i in index]


#: (block, symmetric, MatMul nodes): layer 0 in blocks of 16 with zero points, layer 1's attention
#: in blocks of 32 without, its gate 16 and up 32 (a gated pair in two formats: both dense), its
#: down projection (K=128) in blocks of 128, the LM head too (K=64: ORT pads it, so it stays dense)
PLAN = [(16, False, _linears(*range(7), 11)), (32, True, _linears(7, 8, 9, 10, 12)), (128, False, _linears(13, 14))]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """(the tiny Llama quantized by ORT's MatMulNBitsQuantizer per PLAN, its bundle, the compile
    result), compiled for the CPU with ORT's verification of the lowered graph (zlc.compile's default)."""
    pytest.importorskip("transformers", reason="the zoo's exports need the 'hf' extra")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from zlc.testing import zoo

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    tmp = tmp_path_factory.mktemp("nbits")
    model = onnx.load(str(zoo.cached("stateless", "llama", 20)))
    for block, symmetric, nodes in PLAN:  # each pass quantizes its nodes, leaving the others as they are
        q = MatMulNBitsQuantizer(model, block_size=block, is_symmetric=symmetric,
                                 nodes_to_exclude=[n for n in _linears(*range(15)) if n not in nodes])
        q.process()
        model = q.model.model
    path = tmp / "llama-int4-mixed.onnx"
    onnx.save(model, str(path))
    res = zlc.compile(path, targets=["cpu"], out=tmp / "llama-int4-mixed.zlc", max_seq=64)
    return path, tmp / "llama-int4-mixed.zlc", res


def test_the_quantizers_blocks_stay_packed_and_the_report_says_which_not(mixed: tuple[Path, Path, Any]) -> None:
    q = mixed[2].manifest["quantization"]
    assert q["source"] == "onnx" and q["formats"] == {"nbits4_b16": 7, "nbits4_b32": 4, "nbits4_b128": 1}, q
    assert sorted(mixed[2].manifest["weights"]["Q"]["formats"]) == ["nbits4_b128", "nbits4_b16", "nbits4_b32"]
    assert q["packed_bytes"] < q["f32_bytes"] / 4
    pair = "a gated pair's gate is nbits4_b16 and its up nbits4_b32 (one format word holds both)"
    assert q["dense"] == {"val_376_Q4.nk": pair, "val_378_Q4.nk": pair, "val_394_Q4":
                          "MatMulNBits K=64 is not a multiple of block_size=128 (ORT pads the last block)"}, q["dense"]
    lines = describe_packed(q)  # the compile report's quantize lines
    assert lines[0].startswith("12 matrices kept") and len(lines) == 3, lines


def test_native_matches_the_reference_and_ort(mixed: tuple[Path, Path, Any]) -> None:
    path, bundle, _ = mixed
    b = Built(bundle, None)
    ref = zlc.load(bundle).session("reference")
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    levels = _levels(b.manifest)
    for level in levels:
        with b.session(threads=2, level=level) as s:
            ref.reset()
            r = run_both(s, ref, PROMPT, steps=4)
            assert_matches(r)
            # ONNX Runtime on the quantized model, the whole sequence at once (a stateless graph)
            seq = PROMPT + r["tokens"][:4]
            want = sess.run(None, {sess.get_inputs()[0].name: np.array([seq], np.int64)})[0][0]
            s.reset()
            _, got = s.prefill(seq, all_logits=True, want_logits=True)
            assert np.abs(got - want).max() <= ORT_ATOL, (level, float(np.abs(got - want).max()))
            assert list(want[len(PROMPT) - 1:-1].argmax(-1)) == r["tokens"][:4]
            if level == levels[-1]:  # decode equals prefill on the in-stream dequantizing bodies
                s.reset()
                s.prefill(seq[:3])
                for i, t in enumerate(seq[3:]):
                    _, lg = s.step(t, want_logits=True)
                    assert np.abs(lg[0] - got[3 + i]).max() <= 1e-4


def _ort_tensors(n: int, k: int, block: int, with_zp: bool, seed: int) -> dict[str, np.ndarray]:
    """Random MatMulNBits int4 tensors as ORT lays them out; scales of mixed magnitude."""
    rng = np.random.default_rng(seed)
    kb = k // block
    q = rng.integers(0, 16, (n, kb, block), dtype=np.uint8)
    zp = rng.integers(0, 16, (n, kb), dtype=np.uint8) if with_zp else np.full((n, kb), 8, np.uint8)
    zpp = np.zeros((n, -(-kb // 2)), np.uint8)
    for j in range(kb):
        zpp[:, j // 2] |= zp[:, j] << (4 * (j % 2))
    scales = (rng.standard_normal((n, kb)) * 10.0 ** rng.integers(-6, 1, (n, kb))).astype(np.float32)
    return {"q": q, "zp": zp, "B": (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8),
            "scales": scales.reshape(-1), "zp_packed": zpp if with_zp else None}


def _ort_weight(t: dict[str, np.ndarray], n: int, k: int, block: int) -> np.ndarray:
    """ORT's own f32 weight [N, K]: its MatMulNBits (accuracy_level 0) applied to the identity."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(t["B"], "B"), numpy_helper.from_array(t["scales"], "S")]
    ins = ["A", "B", "S"]
    if t["zp_packed"] is not None:
        inits.append(numpy_helper.from_array(t["zp_packed"], "Z"))
        ins.append("Z")
    node = helper.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [k, k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [k, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.ascontiguousarray(s.run(None, {"A": np.eye(k, dtype=np.float32)})[0].T)


@pytest.mark.parametrize("block", NBITS_BLOCKS)  # 16 .. 1024
@pytest.mark.parametrize("with_zp", [True, False])
@pytest.mark.parametrize("scale_type", ["f32", "f16"])
def test_dequantization_is_orts_bit_for_bit(mixed: tuple[Path, Path, Any], block: int, with_zp: bool,
                                            scale_type: str) -> None:
    """nbits4 blocks from ORT's tensors: QuantizedWeight.dequantize (the reference executor's
    weights) and the kernel's zlc_native_dequantize (session-start panels, then a prefill task's
    dequantization, full panels VL lanes at a time and a narrow last one, every ISA level) give
    (q - z) * s in f32 bit for bit, which is what ORT's f32 kernel multiplies by (f32 scales; ORT
    reads f16 scales only with f16 activations, so those are checked against numpy's widening)."""
    n, k = 37, 1024  # 37 rows: full panels and a narrow one at every VL
    t = _ort_tensors(n, k, block, with_zp, seed=block + with_zp)
    scales = t["scales"].astype(np.float16) if scale_type == "f16" else t["scales"]
    want = ((t["q"].astype(np.float32) - t["zp"][..., None].astype(np.float32))
            * scales.astype(np.float32).reshape(n, -1, 1)).reshape(n, k)
    if scale_type == "f32":  # ORT sums the +0 terms into its zeros: equal values, not signs of 0
        assert np.array_equal(_ort_weight(t, n, k, block), want)
    packed = pack_nbits4(t["B"], scales, t["zp_packed"], n=n, k=k, block=block)
    assert packed.format is FORMATS[f"nbits4_b{block}"] and packed.nbytes == n * k // block * (5 + block // 2)
    assert np.array_equal(packed.dequantize().view(np.uint32), want.view(np.uint32))
    man = zlc.load(mixed[1]).manifest
    for level in _levels(man):
        lib = ctypes.CDLL(str(mixed[1] / man["native"]["levels"][level]["library"]))
        got = np.zeros((n, k), np.float32)
        rc = lib.zlc_native_dequantize(packed.blocks.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n),
                                       ctypes.c_int64(k), ctypes.c_int64(packed.format.code),
                                       got.ctypes.data_as(ctypes.c_void_p))
        assert rc == 0
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (level, block)


def test_genai_int4_build_stays_packed(tmp_path: Path) -> None:
    """onnxruntime-genai's `-p int4` build of the tiny Llama (MatMulNBits block 32, fused QKV split
    into row ranges of its blocks): every matrix streams packed and matches the reference (Gemma's
    tied GatherBlockQuantized build: tests/frontend/test_onnx_zoo.py against ORT)."""
    from zlc.testing import zoo

    if not zoo.genai_available():
        pytest.skip("pip install onnxruntime-genai")
    path = zoo.cached("genai_int4", "llama")
    # verified against ORT with its MatMulNBits at accuracy_level 0: the build asks for 4 (int8
    # activations), which the graph's weights do not define
    res = zlc.compile(path, targets=["cpu"], out=tmp_path / "genai-int4.zlc", max_seq=64)
    assert "11 MatMulNBits at accuracy_level 0" in res.manifest["verification"]["summary"]
    q = res.manifest["quantization"]
    assert q["source"] == "onnx" and q["formats"] == {"nbits4_b32": 15} and q["dense"] == {}, q  # 7 per layer + head
    assert q["packed_bytes"] == res.manifest["weights"]["Q"]["bytes"]  # the fused QKV counted once, as its splits
    b = Built(tmp_path / "genai-int4.zlc", None)
    ref = zlc.load(b.path).session("reference")
    with b.session(threads=2) as s:
        assert_matches(run_both(s, ref, PROMPT, steps=4))
