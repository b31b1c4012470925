"""Packed weights (GGUF Q8_0 / Q4_0 / Q4_1 from `zlc compile --quantize`) through the native C
kernel. Oracle: the reference executor on the bundle's own packed blocks, dequantized by gguf's
dequantizer (max abs 1e-4, equal greedy tokens), prefill (several rows: dequantized panels into
the GEMM tiles) and decode (one row: the in-stream dequantizing matrix-vector bodies), every ISA
level of this host; a ThreadSanitizer build on one format."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from megakernel_cases import assert_decode_equals_prefill
from native_helpers import PROMPT, Built, assert_matches, run_both, tsan_build

import zlc
from zlc.codegen.native import find_compiler
from zlc.runtime.native import host_cpu_flags

pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")

SCHEMES = {"int8": "q8_0", "int4": "q4_0", "int4:q4_1": "q4_1"}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_packed_formats_match_the_reference_on_every_level(built: Callable[..., Built], scheme: str) -> None:
    b = built("llama", quantize=scheme)
    q = b.manifest["weights"]["Q"]
    assert q["formats"] == [SCHEMES[scheme]] and q["bytes"] > 0
    assert b.manifest["quantization"]["dense"] == {}  # every matrix of the tiny Llama is packed
    flags = host_cpu_flags()
    levels = [n for n, info in b.manifest["native"]["levels"].items() if set(info["requires"]) <= flags]
    assert levels
    ref = zlc.load(b.path).session("reference")
    for level in levels:
        with b.session(threads=2, level=level) as s:
            ref.reset()
            assert_matches(run_both(s, ref, PROMPT, steps=4))


def test_prompt_longer_than_a_chunk_and_decode_equals_prefill(built: Callable[..., Built]) -> None:
    b = built("llama", quantize="int4")
    prompt = [(7 * i + 3) % b.vocab for i in range(40)]
    ref = zlc.load(b.path).session("reference")
    with b.session(threads=3) as s:
        assert_matches(run_both(s, ref, prompt, steps=3))
        assert_decode_equals_prefill(s, prompt, 30)


def test_bundle_holds_ggufs_blocks_and_the_roofline_counts_them(built: Callable[..., Built]) -> None:
    """The Q arena is gguf's quantizer's output byte for byte (so a GGUF tensor can be handed
    through), and the manifest prices a step at the packed bytes."""
    from gguf import GGMLQuantizationType, quants
    from safetensors.numpy import load_file

    dense, packed = built("llama"), built("llama", quantize="int8")
    arenas = load_file(str(packed.path / "weights.safetensors"))
    consts = {v.name: v for v in dense.lowered.decode.consts.values()}
    placed = [p for p in packed.manifest["weights"]["placement"] if p["arena"] == "Q"]
    assert placed
    for p in placed:
        want = quants.quantize(consts[p["value"]].const_array(), GGMLQuantizationType.Q8_0).reshape(-1)
        assert np.array_equal(arenas["Q"][p["offset"]:p["offset"] + p["bytes"]], want), p["value"]
    w_dense = dense.manifest["targets"]["cpu"]["roofline"]["weight_bytes"]
    w_packed = packed.manifest["targets"]["cpu"]["roofline"]["weight_bytes"]
    qm = packed.manifest["quantization"]
    # the embedding table is packed too, but a step reads one row of it (a row of q8_0 blocks)
    table = next(n for n in dense.lowered.decode.nodes if n.op == "Embedding").inputs[0]
    assert any(p["value"] == table.name for p in placed)
    n, k = (int(d) for d in table.shape)
    row = k // 32 * 34
    assert w_packed == w_dense - (qm["f32_bytes"] - n * k * 4) + (qm["packed_bytes"] - n * row) - k * 4 + row
    assert 0.0 <= qm["accuracy"]["greedy_agreement"] <= 1.0 and qm["accuracy"]["positions"] > 0


def test_narrow_panels_and_dense_fallback(tmp_path: Path) -> None:
    """A module whose gate/up have N = 80 (the last panel narrower than PANEL on AVX-512), whose
    down has K = 80 (not a multiple of 32: stays dense beside packed matrices), and a tied LM head
    (the torch route gives the head its own array; tests/passes/test_quantize.py covers a head that
    shares the embedding's)."""
    import torch
    from transformers import AutoModelForCausalLM

    from zlc.testing import zoo

    cfg = zoo.hf_config("llama")
    cfg.intermediate_size, cfg.tie_word_embeddings = 80, True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float().eval()
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    out = tmp_path / "narrow.zlc"
    res = zlc.compile(model, example_inputs=(prompt,), targets=["cpu"], out=out, max_seq=32, verify=False,
                      quantize="int4:q4_1")
    q = res.manifest["quantization"]
    assert any("not a multiple of 32" in why for why in q["dense"].values())
    assert q["packed"] > 0
    b = zlc.load(out)
    with b.session("cpu", threads=2) as s, b.session("reference") as ref:
        assert_matches(run_both(s, ref, [3, 14, 15, 92, 65, 35, 89], steps=4))


_CHILD = r"""
import json, sys
import numpy as np
import zlc
from zlc.runtime.megakernel import MegakernelSession
from zlc.runtime.native import NativeBackend
bundle, lib, prompt = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
nb = NativeBackend(bundle, threads=4, library=lib)
man = json.load(open(bundle + "/manifest.json"))
s = MegakernelSession(nb, chunk=nb.chunk, max_seq=man["model"]["max_seq"], vocab=man["model"]["vocab"])
ref = zlc.load(bundle).session("reference")
tok, lg = s.prefill(prompt, all_logits=True, want_logits=True)
err = float(np.abs(lg - ref.prefill(prompt, all_logits=True, want_logits=True)[1]).max())
for _ in range(3):
    t2, l2 = s.step(tok, want_logits=True)
    err = max(err, float(np.abs(l2 - ref.step(tok, want_logits=True)[1]).max()))
    tok = t2
s.close()
import ctypes
print("child done", "tsan" if hasattr(ctypes.CDLL(None), "__tsan_init") else "no tsan", err)
"""


def test_tsan_clean_on_a_packed_model(built: Callable[..., Built], tmp_path: Path) -> None:
    b = built("llama", quantize="int4:q4_1")
    lib = tmp_path / "megakernel-tsan.so"
    rt = str(tsan_build(b, lib))
    env = dict(os.environ, LD_PRELOAD=rt, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
               TSAN_OPTIONS="halt_on_error=0 exitcode=0 report_signal_unsafe=0")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(b.path), str(lib), str(PROMPT)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "child done tsan" in proc.stdout, proc.stdout + proc.stderr[-4000:]
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert float(proc.stdout.split()[-1]) <= 1e-4
