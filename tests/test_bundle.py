"""The artifact bundle end to end: `zlc compile` (library and CLI), AOT for every GPU target,
manifest and checksums, `zlc.load` refusing tampered bundles, `zlc run`/`zlc inspect` on a
bundle, and one clear error for each kind of bad input."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import zlc
from zlc.bundle import MANIFEST, BundleError
from zlc.cli import cli
from zlc.codegen.aot import check_ptx_sync
from zlc.errors import VerificationError, ZlcError
from zlc.targets import TARGETS

GPU_TARGETS = [n for n, t in TARGETS.items() if t.is_gpu]
PROMPT = [1, 5, 9, 200, 17, 33, 2]


@pytest.fixture(scope="module")
def bundle(tiny_onnx: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama compiled for the CPU and every GPU target (distinct archs compile once)."""
    out = tmp_path_factory.mktemp("bundle") / "tiny.zlc"
    zlc.compile(tiny_onnx, targets=["cpu", *GPU_TARGETS], out=out, max_seq=64)
    return out


@pytest.fixture(scope="module")
def reference_tokens(tiny_onnx: Path) -> list[int]:
    lowered = zlc.lower(tiny_onnx, options=zlc.CompileOptions(max_seq=64))
    return zlc.ReferenceSession.from_lowered(lowered).generate(PROMPT, 6)


def _copy(bundle: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy.zlc"
    shutil.copytree(bundle, dst)
    return dst


def test_manifest_describes_every_target(bundle: Path) -> None:
    man = json.loads((bundle / MANIFEST).read_text())
    assert man["format"] == "zlc-bundle" and man["zlc_version"] == zlc.__version__
    assert man["dtype"]["weights"] == "bf16" and man["verification"]["status"] == "passed"
    assert set(man["targets"]) == {"cpu", *GPU_TARGETS}
    archs = {n: TARGETS[n].arch for n in GPU_TARGETS}
    for name in GPU_TARGETS:
        info = man["targets"][name]
        assert info["arch"] == archs[name]
        cubin = (bundle / info["cubin"]).read_bytes()
        assert cubin[:4] == b"\x7fELF"
        ptx = (bundle / info["ptx"]).read_text()
        assert f".target {archs[name]}" in ptx  # sm_90 may carry the 'a' suffix
        assert check_ptx_sync(ptx) == []  # the acquire waits and release signals survived lowering
        res = info["resources"]
        assert res["registers"] > 0 and res["spill_stores"] == 0 and res["spill_loads"] == 0
        params = [p["name"] for p in info["params"]]
        kernel = man["kernel"]["params"]
        assert params[:len(kernel)] == kernel  # then Triton's hidden scratch pointers
        rf = info["roofline"]
        assert rf["weight_bytes"] > 0 and rf["floor_us_at_64"] > 0
    assert man["targets"]["cpu"]["roofline"]["floor_us_at_64"] is None
    for key in ("cpu", "gpu"):
        tl = man["tilings"][key]
        assert (bundle / tl["tables"]).is_file() and tl["summary"]["tasks"]["decode"] > 0
    assert set(man["files"]) >= {"kernel.py", "weights.safetensors", "tables/cpu.safetensors",
                                 "ir/decode.zir", "ir/prefill.zir"}


def test_generate_matches_reference(bundle: Path, reference_tokens: list[int]) -> None:
    assert zlc.load(bundle).generate(PROMPT, 6) == reference_tokens


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_generate_keeps_its_session(bundle: Path, reference_tokens: list[int]) -> None:
    """The native session (its worker threads, its laid-out weights) lives from one generate() to
    the next, and gives the same tokens on reuse; close() ends it."""
    before = _threads()
    with zlc.load(bundle) as b:
        assert b.generate(PROMPT, 6, device="cpu", threads=3) == reference_tokens
        started = _threads()
        assert started == before + 2  # the calling thread is worker 0
        assert b.generate(PROMPT[:2], 6, device="cpu", threads=3) == b.generate(PROMPT[:2], 6, device="cpu",
                                                                                  threads=3)
        assert b.generate(PROMPT, 6, device="cpu", threads=3) == reference_tokens
        assert _threads() == started
    assert _threads() == before


def test_sampling_is_seeded(bundle: Path) -> None:
    b = zlc.load(bundle)
    with b.session() as s:
        a = s.generate(PROMPT, 5, temperature=1.0, seed=3)
        again = s.generate(PROMPT, 5, temperature=1.0, seed=3)
        greedy = s.generate(PROMPT, 5)
    assert a == again
    assert len(greedy) == 5


def test_tampered_bundle_is_refused(bundle: Path, tmp_path: Path) -> None:
    b = _copy(bundle, tmp_path)
    w = b / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(BundleError, match="weights.safetensors does not match its sha256"):
        zlc.load(b)


def test_unlisted_file_and_missing_file_are_refused(bundle: Path, tmp_path: Path) -> None:
    b = _copy(bundle, tmp_path)
    (b / "kernels" / "extra.cubin").write_bytes(b"x")
    with pytest.raises(BundleError, match="not listed in the manifest"):
        zlc.load(b)
    (b / "kernels" / "extra.cubin").unlink()
    (b / "tables" / "cpu.safetensors").unlink()
    with pytest.raises(BundleError, match="missing"):
        zlc.load(b)


def test_unknown_format_version_is_refused(bundle: Path, tmp_path: Path) -> None:
    b = _copy(bundle, tmp_path)
    man: dict[str, Any] = json.loads((b / MANIFEST).read_text())
    man["format_version"] = 99
    (b / MANIFEST).write_text(json.dumps(man))
    with pytest.raises(BundleError, match="format version 99"):
        zlc.load(b)


def test_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="no manifest.json"):
        zlc.load(tmp_path)


def test_bad_inputs_give_one_clear_error(tiny_onnx: Path, bundle: Path, tmp_path: Path) -> None:
    with pytest.raises(ZlcError, match="unknown target 'tpu'"):
        zlc.compile(tiny_onnx, targets=["tpu"], out=tmp_path / "x")
    with pytest.raises(ZlcError, match="unknown --dtype"):
        zlc.compile(tiny_onnx, dtype="fp8", out=tmp_path / "x")
    # a model that does not verify (any error at all is beyond atol 0) is not compiled
    with pytest.raises(VerificationError, match="not compiling it"):
        zlc.compile(tiny_onnx, out=tmp_path / "x", max_seq=64, atol=0.0)
    assert not (tmp_path / "x").exists()
    b = zlc.load(bundle)
    with b.session() as s, pytest.raises(ZlcError, match="exceed the bundle's max_seq=64"):
        s.prefill(list(range(1, 66)))
    with pytest.raises(ZlcError, match="outside the vocabulary"):
        b.generate([1, 100000], 2)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "f").write_text("x")
    with pytest.raises(ZlcError, match="not empty and not a zlc bundle"):
        zlc.compile(tiny_onnx, out=tmp_path / "junk")


def test_max_seq_beyond_learned_positions(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from zlc.testing import zoo

    gpt2 = zoo.cached("stateless", "gpt2", 20)
    positions = zoo.hf_config("gpt2").n_positions
    with pytest.raises(ZlcError, match=f"exceeds the model's {positions} learned positions"):
        zlc.compile(gpt2, out=tmp_path / "g", max_seq=positions * 2, verify=False)


# ---- the CLI on bundles ---------------------------------------------------------------------------

def test_cli_compile_run_inspect(tiny_onnx: Path, tmp_path: Path, reference_tokens: list[int]) -> None:
    runner = CliRunner()
    out = tmp_path / "cli.zlc"
    r = runner.invoke(cli, ["compile", str(tiny_onnx), "--target", "cpu", "-o", str(out), "--max-seq", "64"])
    assert r.exit_code == 0, r.output
    assert "tasks per decode step" in r.output
    r = runner.invoke(cli, ["run", str(out), "--prompt-ids", ",".join(map(str, PROMPT)),
                            "--max-new-tokens", "6", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output.strip().splitlines()[-1])["generated"] == reference_tokens
    r = runner.invoke(cli, ["inspect", str(out)])
    assert r.exit_code == 0 and "checksums:" in r.output and "tiling cpu" in r.output
    r = runner.invoke(cli, ["inspect", str(out), "--tasks"])
    assert r.exit_code == 0 and "argmax" in r.output and "cache_append" in r.output
    r = runner.invoke(cli, ["run", str(out), "--prompt", "hello"])
    assert r.exit_code == 1 and "has no tokenizer" in r.output
    r = runner.invoke(cli, ["compile", str(tiny_onnx), "--target", "tpu", "-o", str(tmp_path / "t")])
    assert r.exit_code == 1 and "unknown target 'tpu'" in r.output
    (out / "kernel.py").write_text("# edited\n")
    r = runner.invoke(cli, ["run", str(out), "--prompt-ids", "1,2"])
    assert r.exit_code == 1 and "kernel.py does not match its sha256" in r.output
