"""Packed embedding tables (issue 26): a GGUF's token_embd stays in its blocks from file to kernel.
The native kernel's embedding task gathers a token's row of blocks and dequantizes it; untied, it
reads the file's row-major blocks (copied as they are), tied, the LM head's block panels (one packed
constant serves both: test_native_gguf_packed's tied Q4_1 table). Oracles: gguf's dequantizer (the
gather, bit for bit, every format, both layouts), the reference executor on the bundle's blocks
(logits within 1e-4, equal greedy tokens), decode equals prefill, and the bundle's sizes (no dense
table in weights.safetensors nor in the mapped layout). With a GPU target the table stays dense."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from megakernel_cases import assert_decode_equals_prefill
from native_helpers import Built, assert_matches, run_both

import zlc
from zlc.codegen.native import find_compiler
from zlc.frontend.gguf import import_gguf
from zlc.ir import verify_graph
from zlc.ir.quant import FORMATS
from zlc.passes.embed_tables import dense_tables_for_gpu
from zlc.runtime.native import host_cpu_flags

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")

Q = gguf.GGMLQuantizationType
PROMPT = [3, 14, 15, 92, 65, 35, 89]


def _levels(manifest: dict[str, Any]) -> list[str]:
    flags = host_cpu_flags()
    return [n for n, info in manifest["native"]["levels"].items() if set(info["requires"]) <= flags]


@pytest.fixture(scope="module")
def untied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """A tiny Llama with its own LM head: a Q4_0 token table (a format no Linear streams: the
    kernel's dequantization is there for the table alone), Q8_0 matrices and head."""
    from zlc.testing.families import hf_model
    from zlc.testing.gguf_files import write_gguf

    tmp = tmp_path_factory.mktemp("gguf-embed")
    m = hf_model("llama", tie_word_embeddings=False)
    path = write_gguf(m, tmp / "untied.gguf", qtype=Q.Q8_0, types={"token_embd.weight": Q.Q4_0})
    out = tmp / "untied.zlc"
    return path, out, zlc.compile(path, targets=["cpu"], out=out, max_seq=64, verify=False)


def test_an_untied_packed_table_matches_the_reference(untied: tuple[Path, Path, Any]) -> None:
    _, out, res = untied
    man = res.manifest
    assert man["quantization"]["tensors"]["token_embd.weight"] == "q4_0"
    (table,) = [p for p in man["weights"]["placement"] if p["value"] == "token_embd.weight"]
    assert table["arena"] == "Q" and table["format"] == "q4_0"
    vocab, hidden = table["shape"]
    assert table["bytes"] == vocab * hidden // 32 * 18
    # no dense table anywhere: every matrix is packed (W is empty: one placeholder element), and
    # the host level's mapped layout file is W + Q
    assert man["weights"]["W"]["elements"] == 0
    layouts = [info["weights"] for info in man["native"]["levels"].values() if "weights" in info]
    assert layouts
    for lay in layouts:
        assert int(lay["w"]["bytes"]) <= 4
        assert (out / lay["file"]).stat().st_size <= int(lay["q"]["offset"]) + int(lay["q"]["bytes"]) + 4096
    ref = zlc.load(out).session("reference")
    levels = _levels(man)
    assert levels
    for level in levels:
        for mapped in (None, False):  # the layout file's row-major copy (the host's level), the session's own
            s = Built(out, None).session(threads=2, level=level, mapped=mapped)
            try:
                ref.reset()
                assert_matches(run_both(s, ref, PROMPT, steps=4), atol=1e-4)
                if level == levels[-1] and mapped is None:  # decode equals prefill
                    assert_decode_equals_prefill(s, PROMPT, 3)
            finally:
                s.close()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_the_gather_is_ggufs_dequantization_bit_for_bit(untied: tuple[Path, Path, Any], qtype: Any) -> None:
    """zlc_native_embed_rows (the embedding task's row gather) of random blocks, from the row-major
    blocks and from block panels (a tied head's layout; 37 rows: a narrow last panel at every VL),
    on every ISA level: the f32 bits of gguf.quants.dequantize's rows."""
    from zlc.testing.gguf_files import random_blocks

    out, man = untied[1], untied[2].manifest
    n, k = 37, 512
    blocks = random_blocks(n, k, qtype, seed=qtype.value + 100)
    want = gguf.quants.dequantize(blocks, qtype).reshape(n, k).astype(np.float32)
    toks = np.array([0, 36, 5, 31, 32, 16, 35, 0], dtype=np.int64)
    for level in _levels(man):
        lib = ctypes.CDLL(str(out / man["native"]["levels"][level]["library"]))
        for panels in (0, 1):
            got = np.zeros((len(toks), k), np.float32)
            rc = lib.zlc_native_embed_rows(blocks.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(n),
                                           ctypes.c_int64(k), ctypes.c_int64(FORMATS[qtype.name.lower()].code),
                                           ctypes.c_int(panels), toks.ctypes.data_as(ctypes.c_void_p),
                                           ctypes.c_int64(len(toks)), got.ctypes.data_as(ctypes.c_void_p))
            assert rc == 0
            assert np.array_equal(got.view(np.uint32), want[toks].view(np.uint32)), (level, panels, qtype.name)


def test_a_gpu_target_keeps_the_table_dense(untied: tuple[Path, Path, Any], tmp_path: Path) -> None:
    """The Triton kernel reads no packed embedding table: with a GPU target it is dense (its exact
    dequantization), and the compile report says why."""
    res = zlc.compile(untied[0], targets=["a10", "cpu"], out=tmp_path / "x.zlc", max_seq=64, verify=False,
                      stop_after="quantize")
    q = res.build.quantization
    assert "reads no packed embedding table" in q["dense"]["token_embd.weight"]
    for g in (res.build.lowered.prefill, res.build.lowered.decode):
        assert g.consts["token_embd.weight"].quant is None


def test_a_tied_head_the_triton_kernel_streams_keeps_the_blocks(tmp_path: Path) -> None:
    """A tied table in a format the Triton kernel streams (zlc.targets: q8_0): the embedding reads a
    dense copy (same data), the LM head keeps the packed constant."""
    from zlc.targets import get_target
    from zlc.testing.families import hf_model
    from zlc.testing.gguf_files import write_gguf

    path = write_gguf(hf_model("llama", tie_word_embeddings=True), tmp_path / "tied.gguf",
                      types={"token_embd.weight": Q.Q8_0})
    g = import_gguf(path, 64)
    table = g.consts["token_embd.weight"]
    assert dense_tables_for_gpu([g], []) == {} and table.quant is not None  # no GPU target: as it is
    assert table.quant is not None and get_target("h100").streams(table.quant.format.name)
    why = dense_tables_for_gpu([g], ["h100"])
    emb = next(n for n in g.nodes if n.op == "Embedding")
    head = next(n for n in g.nodes if n.op == "LMHead")
    assert emb.inputs[0].name == "token_embd.weight.dense" and emb.inputs[0].quant is None
    assert emb.inputs[0].data is table.data and head.inputs[1] is table and table.quant is not None
    assert "LM head streams 'token_embd.weight'" in why["token_embd.weight.dense"]
    verify_graph(g)


@pytest.mark.parametrize("word,value", [(None, 0), ("table_format", 9), ("vocab", 1 << 40), ("hidden", 48)])
def test_a_corrupt_packed_table_descriptor_refuses_the_session(untied: tuple[Path, Path, Any], tmp_path: Path,
                                                               word: str | None, value: int) -> None:
    """An embed descriptor naming an unknown format, more rows than Q holds, or a row length that is
    no whole number of blocks: the session does not start (one-line NativeError), nothing is read.
    (None: the tables as compiled, written back the same way, start.)"""
    from safetensors.numpy import load_file, save_file

    from zlc import bundle as fmt
    from zlc.abi import EmbedDesc
    from zlc.runtime.native import NativeBackend, NativeError

    out, man = untied[1], untied[2].manifest
    src = out / man["tilings"][man["native"]["tiling"]]["tables"]
    t = load_file(str(src))
    tasks, di = t["tasks"], t["desc_int"].reshape(-1, fmt.DESC_WORDS).copy()
    embeds = {int(r[1]) for r in tasks[fmt.HEADER_WORDS:].reshape(-1, fmt.TASK_WORDS) if r[0] == fmt.OP_EMBED}
    assert embeds and all(di[d, EmbedDesc.table_format] == 2 for d in embeds)  # q4_0
    for d in embeds if word else ():
        di[d, getattr(EmbedDesc, word)] = value
    save_file({**t, "desc_int": di.reshape(t["desc_int"].shape)}, str(tmp_path / "tables.safetensors"))
    if word is None:
        NativeBackend(out, man, threads=1, tables=tmp_path / "tables.safetensors").close()
        return
    with pytest.raises(NativeError, match="could not start a session"):
        NativeBackend(out, man, threads=1, tables=tmp_path / "tables.safetensors")
