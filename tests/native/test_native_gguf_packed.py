"""GGUF files whose blocks stay packed from file to kernel: every block format the native kernel
streams (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) in one tiny Llama (hidden 256 for the
K-quants' 256-value super-blocks; K-quant tensors are random blocks, gguf having no quantizer for
them), a tied Q4_1 embedding table that the LM head and the embedding read as one packed constant
(the embedding gathers from the head's block panels). Oracle: the
reference executor on the bundle's blocks dequantized by gguf (max abs 1e-4, equal greedy tokens)
on every ISA level of this host, and decode equals prefill. The frontend hands the file's bytes
through unchanged and its f32 data is gguf's dequantization bit for bit; so is the kernel's own
dequantization (its exported zlc_native_dequantize) of every format."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from megakernel_cases import assert_decode_equals_prefill
from native_helpers import Built, assert_matches, run_both

import zlc
from zlc.codegen.native import find_compiler
from zlc.frontend.gguf import import_gguf, unpermute_qk
from zlc.ir.quant import FORMATS
from zlc.runtime.native import host_cpu_flags

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")

Q = gguf.GGMLQuantizationType
#: per layer, per matrix: every format twice over the two layers (the gated pair shares one format)
TYPES = {
    "blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q5_K, "blk.0.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q5_0, "blk.0.ffn_gate.weight": Q.Q5_1, "blk.0.ffn_up.weight": Q.Q5_1,
    "blk.0.ffn_down.weight": Q.Q4_K,
    "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.Q5_0,
    "blk.1.attn_output.weight": Q.Q6_K, "blk.1.ffn_gate.weight": Q.Q5_K, "blk.1.ffn_up.weight": Q.Q5_K,
    "blk.1.ffn_down.weight": Q.Q6_K, "token_embd.weight": Q.Q4_1,
}
PROMPT = [3, 14, 15, 92, 65, 35, 89]
FORMATS_CODE = {name: f.code for name, f in FORMATS.items()}


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    from zlc.testing.families import hf_model
    from zlc.testing.gguf_files import write_gguf

    tmp = tmp_path_factory.mktemp("gguf-packed")
    m = hf_model("llama", hidden_size=256, intermediate_size=512, head_dim=64, tie_word_embeddings=True)
    path = write_gguf(m, tmp / "mixed.gguf", types=TYPES)
    out = tmp / "mixed.zlc"
    res = zlc.compile(path, targets=["cpu"], out=out, max_seq=64)
    return path, out, res


def test_every_format_streams_and_matches_the_reference(mixed: tuple[Path, Path, Any]) -> None:
    _, out, res = mixed
    q = res.manifest["quantization"]
    assert q["source"] == "gguf" and sorted(q["formats"]) == sorted(
        {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"})
    assert q["tensors"]["token_embd.weight"] == "q4_1"  # one packed table: the embedding's and the tied head's
    assert not any(name.startswith("token_embd") for name in q["dense"]) and q["packed_bytes"] < q["f32_bytes"] / 4
    places = [p for p in res.manifest["weights"]["placement"] if p["value"].startswith("token_embd")]
    assert [(p["value"], p["arena"]) for p in places] == [("token_embd.weight", "Q")]  # no dense copy in W
    assert sorted(res.manifest["weights"]["Q"]["formats"]) == sorted(q["formats"])
    b = zlc.load(out)
    flags = host_cpu_flags()
    levels = [n for n, info in res.manifest["native"]["levels"].items() if set(info["requires"]) <= flags]
    assert levels
    ref = b.session("reference")
    for level in levels:
        s = Built(out, None).session(threads=2, level=level)
        try:
            ref.reset()
            assert_matches(run_both(s, ref, PROMPT, steps=4))
            if level == levels[-1]:  # decode equals prefill on the in-stream dequantizing bodies
                assert_decode_equals_prefill(s, PROMPT, 3)
        finally:
            s.close()


def test_the_frontend_hands_the_files_blocks_through(mixed: tuple[Path, Path, Any]) -> None:
    path = mixed[0]
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    g = import_gguf(path, 64)
    for name, t in TYPES.items():
        v = g.consts[name]
        assert v.quant is not None and v.quant.format.name == t.name.lower(), name
        raw = np.asarray(tensors[name].data).reshape(v.quant.n, -1)
        deq = gguf.quants.dequantize(tensors[name].data, t).reshape(v.quant.n, v.quant.k)
        if name.split(".")[-2] in ("attn_q", "attn_k"):  # llama.cpp's permuted rows, permuted back
            idx = unpermute_qk(np.arange(v.quant.n), 4 if name.endswith("attn_q.weight") else 2)
            raw, deq = raw[idx], deq[idx]
        assert np.array_equal(v.quant.blocks, raw), name
        assert np.array_equal(np.asarray(v.data).view(np.uint32), deq.astype(np.float32).view(np.uint32)), name
    head = next(n for n in g.nodes if n.op == "LMHead")
    emb = next(n for n in g.nodes if n.op == "Embedding")
    assert head.inputs[1] is emb.inputs[0] is g.consts["token_embd.weight"] and "token_embd.weight.head" not in g.consts


def test_quantize_on_a_quantized_gguf_is_one_error_line(mixed: tuple[Path, Path, Any], tmp_path: Path) -> None:
    from zlc.cli import cli as root

    res = CliRunner().invoke(root, ["compile", str(mixed[0]), "--target", "cpu", "--quantize", "int8",
                                    "-o", str(tmp_path / "x.zlc")])
    assert res.exit_code == 1 and "already quantized" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_the_kernels_dequantization_is_ggufs_bit_for_bit(mixed: tuple[Path, Path, Any], qtype: Any) -> None:
    """zlc_native_dequantize (the session-start transposition, then a prefill task's panel
    dequantization: VL lanes at a time, a narrow last panel column by column) of random blocks,
    some f16 scales subnormal, on every ISA level: the same f32 bits as gguf.quants.dequantize."""
    import ctypes

    from zlc.testing.gguf_files import random_blocks

    man = zlc.load(mixed[1]).manifest
    flags = host_cpu_flags()
    n, k = 37, 512  # 37 rows: full panels and a narrow one at every VL
    blocks = random_blocks(n, k, qtype, seed=qtype.value)
    want = gguf.quants.dequantize(blocks, qtype).reshape(n, k).astype(np.float32)
    for name, info in man["native"]["levels"].items():
        if not set(info["requires"]) <= flags:
            continue
        lib = ctypes.CDLL(str(mixed[1] / info["library"]))
        got = np.zeros((n, k), np.float32)
        rc = lib.zlc_native_dequantize(blocks.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n), ctypes.c_int64(k),
                                       ctypes.c_int64(FORMATS_CODE[qtype.name.lower()]),
                                       got.ctypes.data_as(ctypes.c_void_p))
        assert rc == 0
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (name, qtype.name)
