"""Compile memory proportional to the model (issue 33): the weight files are written matrix by matrix
(codegen/arena_file.py) and a GGUF's packed matrices are dequantized only where read
(ir.quant.Dequantized), so a compile holds the mapped model and one matrix at a time.

Oracles: the bundle's weights.safetensors equals `pack_arenas` + safetensors' `save_file` (the old
way, the arenas built in memory) byte for byte, and native/<level>.weights equals
`native.write_layout` on those arenas; a compile in a subprocess peaks at <= 1.5x the model's
bytes above the interpreter's own baseline (a child that imports what a compile imports, measured
in the same run); a model larger than the memory left is refused in one line before any work.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import zlc
from zlc.codegen.arena_file import write_arenas
from zlc.codegen.native import find_compiler
from zlc.codegen.pack import pack_arenas
from zlc.errors import ZlcError
from zlc.testing.random_models import write_llama_checkpoint, write_qwen_gguf

pytest.importorskip("gguf")
TINY = {"layers": 2, "hidden": 256, "ffn": 512, "heads": 4, "kv_heads": 2, "vocab": 1024}


def _old_weights(b: Any, path: Path) -> bytes:
    from safetensors.torch import save_file

    W, P, Q = pack_arenas(b.decode, b.programs["cpu"], b.wdtype)
    save_file({"W": W, "P": P, **({"Q": Q} if Q.numel() else {})}, str(path))
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["gguf-tied", "gguf-untied", "bf16-dir", "f32-dir"])
def test_streamed_weights_equal_the_arenas_built_in_memory(kind: str, tmp_path: Path) -> None:
    if kind.startswith("gguf"):
        model = write_qwen_gguf(tmp_path / "m.gguf", tied=kind == "gguf-tied", **TINY)
    else:
        model = write_llama_checkpoint(tmp_path / "ck", "bfloat16" if kind == "bf16-dir" else "float32", layers=2,
                                       hidden=256, ffn=512, vocab=1000)
    res = zlc.compile(model, targets=["cpu"], out=tmp_path / "b.zlc", max_seq=64, verify=False, stop_after="weights")
    b = res.build
    assert b is not None and res.path is None
    got = write_arenas(b.decode, b.programs["cpu"], b.wdtype, tmp_path / "new.safetensors")
    assert got.path.read_bytes() == _old_weights(b, tmp_path / "old.safetensors")
    assert res.memory["stages"] and res.memory["peak_rss"] >= max(r for r, _ in res.memory["stages"].values())


def test_a_packed_matrix_is_dequantized_where_read_and_not_kept(tmp_path: Path) -> None:
    from zlc.ir.quant import Dequantized

    model = write_qwen_gguf(tmp_path / "m.gguf", **TINY)
    g = zlc.lower(model, options=zlc.CompileOptions(max_seq=32)).decode
    lazy = [v for v in g.consts.values() if isinstance(v.data, Dequantized)]
    assert lazy and all(v.quant is not None for v in lazy)
    v = lazy[0]
    a, b = np.asarray(v.data), np.asarray(v.data)
    assert a.shape == v.data.shape == tuple(v.shape) and a.dtype == np.float32
    assert a is not b and np.array_equal(a, b) and np.array_equal(a, v.quant.dequantize().reshape(a.shape))


def test_half_matrices_are_widened_where_read_bit_for_bit(tmp_path: Path) -> None:
    """Verification's f32 graphs of a bf16 checkpoint read its mapped half weights, widened where a
    node reads them (reference/evaluate.py `Wide`: an Embedding its gathered rows, an LM head over
    CHUNK_BYTES in row chunks): the logits equal those of the same graphs with every constant
    widened up front, bit for bit, prefill and decode."""
    import torch

    from zlc.reference.evaluate import CHUNK_BYTES
    from zlc.reference.executor import in_f32
    from zlc.reference.session import ReferenceSession

    vocab = 20000  # the LM head: 20000 x 256 in f32 = 20 MiB > CHUNK_BYTES, two chunks
    assert vocab * 256 * 4 > CHUNK_BYTES
    model = write_llama_checkpoint(tmp_path / "ck", "bfloat16", layers=1, hidden=256, ffn=512, vocab=vocab)
    lw = zlc.lower(model, options=zlc.CompileOptions(max_seq=32))
    assert lw.prefill is not None and lw.decode is not None
    runs = []
    for upfront in (False, True):
        pre, dec = in_f32(lw.prefill), in_f32(lw.decode)
        if upfront:
            for g in (pre, dec):
                for v in g.consts.values():
                    if isinstance(v.data, torch.Tensor) and v.data.dtype == torch.bfloat16:
                        v.data = v.data.float()
        s = ReferenceSession(pre, dec, lw.max_seq)
        runs.append([s.prefill([5, 19999, 7, 5]), s.step(123), s.step(0)])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def _mapped_kib(path: Path) -> tuple[int, int]:
    """(Rss, Anonymous) kB of this process's maps of `path` (/proc/self/smaps)."""
    rss = anon = 0
    ours = False
    for ln in Path("/proc/self/smaps").read_text().splitlines():
        head = ln.split(maxsplit=5)
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            ours = len(head) == 6 and head[5] == str(path)
        elif ours and ln.startswith(("Rss:", "Anonymous:")):
            n = int(ln.split()[1])
            rss, anon = (rss + n, anon) if ln.startswith("Rss:") else (rss, anon + n)
    return rss, anon


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="no /proc/self/smaps")
def test_a_checkpoints_maps_leave_the_resident_set_after_the_weights_stage(tmp_path: Path) -> None:
    """release_mapped on a checkpoint directory drops its safetensors maps' pages (read again,
    they fault back in unchanged); a map with a page written in it keeps its pages and the write."""
    import torch
    from safetensors.torch import save_file

    from zlc.frontend.hf_dir import _open
    from zlc.memory import release_mapped

    (tmp_path / "ck").mkdir()
    f = (tmp_path / "ck" / "model.safetensors").resolve()
    w = torch.randn(4096, 2048).bfloat16()  # 16 MiB
    save_file({"w": w}, str(f))
    st = f.stat()
    t = _open(str(f), st.st_mtime_ns, st.st_size).get_tensor("w")
    assert torch.equal(t, w) and _mapped_kib(f)[0] >= 16 << 10
    release_mapped(tmp_path / "ck")
    assert _mapped_kib(f)[0] < 1 << 10
    assert torch.equal(t, w)  # faulted back in from the file
    t[0, 0] = 3.0  # a written page: the map is left alone
    release_mapped(tmp_path / "ck")
    assert _mapped_kib(f)[1] > 0 and _mapped_kib(f)[0] >= 16 << 10 and float(t[0, 0]) == 3.0


def test_a_model_too_large_for_the_memory_left_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from zlc import memory

    model = write_qwen_gguf(tmp_path / "m.gguf", **TINY)
    # 1 KiB left: below even the model's own share, whatever this process holds already (a test run is large)
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 10)
    with pytest.raises(ZlcError) as e:
        zlc.compile(model, targets=["cpu"], out=tmp_path / "b.zlc")
    msg = str(e.value)
    assert "\n" not in msg and "needs about" in msg and "GiB of memory" in msg and "available" in msg
    assert not (tmp_path / "b.zlc").exists() and not (tmp_path / "b.zlc.partial").exists()


# ---- peak RSS of whole compiles, in subprocesses ---------------------------------------------------------

_PROBE = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
          "sys.stderr.write(r.stderr[-3000:]); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)")
_IMPORTS = "import zlc, zlc.build, zlc.reference.executor, torch, transformers, safetensors, gguf, tokenizers"
_COMPILE = (_IMPORTS + "; import json, sys; r = zlc.compile(sys.argv[1], targets=['cpu'], out=sys.argv[2], "
            "max_seq=128); print(json.dumps(r.memory))")


def _peak(code: str, *args: str) -> int:
    """Peak RSS (bytes) of `python -c code args` run as the only child of a fresh helper."""
    r = subprocess.run([sys.executable, "-c", _PROBE, sys.executable, "-c", code, *args], capture_output=True,
                       text=True, timeout=900)
    kb, rc = r.stdout.split()
    assert rc == "0", r.stderr
    return int(kb) * 1024


@pytest.mark.slow
@pytest.mark.skipif(find_compiler()[0] is None, reason="no C compiler on this host")
@pytest.mark.parametrize("kind", ["gguf", "bf16-dir"])
def test_compile_peak_rss_is_within_1_5x_of_the_model(kind: str, tmp_path: Path) -> None:
    """Issue 33's model, the Qwen2.5-0.5B-shaped GGUF (374 MiB, its 151,936-token Q8_0 table):
    peak RSS above the interpreter's baseline (the same imports, nothing compiled) <= 1.5x the
    file. A 4-layer bf16 Llama checkpoint (211 MiB): <= 1.5x too (verification widens its matrices
    where read, in row chunks, and freed blocks leave the resident set: ~1.2x measured,
    docs/performance.md). And the bundle's weight files are the old way's, byte for byte."""
    if kind == "gguf":
        model, bound = write_qwen_gguf(tmp_path / "m.gguf"), 1.5
        nbytes = model.stat().st_size
    else:
        model, bound = write_llama_checkpoint(tmp_path / "ck", "bfloat16", layers=4), 1.5
        nbytes = (model / "model.safetensors").stat().st_size
    base = _peak(_IMPORTS)
    peak = _peak(_COMPILE, str(model), str(tmp_path / "b.zlc"))
    assert peak - base <= bound * nbytes, (f"peak {peak >> 20} MiB, baseline {base >> 20} MiB: "
                                           f"{(peak - base) / nbytes:.2f}x the model's {nbytes >> 20} MiB")
    # the same bundle's weights built the old way (in this process; no verification: the weights are the same)
    res = zlc.compile(model, targets=["cpu"], out=tmp_path / "again.zlc", max_seq=128, verify=False)
    b = res.build
    assert b is not None and res.path is not None
    bundle = tmp_path / "b.zlc"
    assert (bundle / "weights.safetensors").read_bytes() == _old_weights(b, tmp_path / "old.safetensors")
    man = json.loads((bundle / "manifest.json").read_text())
    level, lv = next((k, v) for k, v in man["native"]["levels"].items() if "weights" in v)
    _check_layout(bundle, b, level, lv, tmp_path)


def _check_layout(bundle: Path, b: Any, level: str, lv: dict[str, Any], tmp: Path) -> None:
    import torch

    from zlc.codegen.native import write_layout

    W, _, Q = pack_arenas(b.decode, b.programs["cpu"], b.wdtype)
    w = W.contiguous().view(torch.int16 if W.dtype == torch.bfloat16 else W.dtype).numpy()
    prog = b.programs["native"]
    entry = write_layout(bundle / lv["library"], prog.task_table(), prog.desc_int, w, Q.numpy(), tmp / "n" / "old.weights")
    assert {**entry, "file": lv["weights"]["file"]} == lv["weights"]
    assert (tmp / "n" / "old.weights").read_bytes() == (bundle / lv["weights"]["file"]).read_bytes()
