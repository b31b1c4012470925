"""The `zlc` command line, run for real (click's CliRunner, in-process) on the bundled tiny model.

Error contract: bad input is ONE line on stderr (no traceback) and a non-zero exit code."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from click.testing import CliRunner, Result
from onnx import TensorProto, helper

import zlc
from zlc import cli
from zlc.cli import EXIT_INTERNAL, EXIT_USAGE
from zlc.errors import VerificationError
from zlc.ir import graphs_equal, parse_graph

WIDE = {"COLUMNS": "240"}  # rich wraps tables at the terminal width; keep cells on one line


def zlc_cli(*args: Any) -> Result:
    return CliRunner().invoke(cli.cli, [str(a) for a in args], env=WIDE)


def assert_one_error_line(res: Result, code: int | None = None) -> str:
    assert res.exit_code != 0, res.output
    if code is not None:
        assert res.exit_code == code, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{res.stderr}"
    assert lines[0].startswith("error: "), lines[0]
    assert "Traceback" not in res.output
    return lines[0]


# ---- basics ---------------------------------------------------------------------------------------

def test_version() -> None:
    res = zlc_cli("--version")
    assert res.exit_code == 0
    assert res.stdout.strip() == f"zlc {zlc.__version__}"


def test_help_lists_commands_and_stages() -> None:
    res = zlc_cli("--help")
    assert res.exit_code == 0
    for cmd in ("verify", "inspect", "run"):
        assert cmd in res.stdout
    res = zlc_cli("inspect", "--help")
    assert all(s in res.stdout for s in zlc.STAGES)
    assert "reference executor" in zlc_cli("run", "--help").stdout


def test_cli_stage_names_mirror_the_driver() -> None:
    assert cli.STAGE_NAMES == zlc.STAGES


def test_cli_mirrors_of_raising_and_compile_stage_names() -> None:
    from zlc.build import COMPILE_STAGE_NAMES
    from zlc.cli import common
    from zlc.driver import RAISE_STAGES

    assert common.RAISE_STAGE_NAMES == RAISE_STAGES
    assert common.COMPILE_STAGE_NAMES == COMPILE_STAGE_NAMES


def test_inspect_after_a_raising_rule_set(tiny_onnx: Path) -> None:
    res = zlc_cli("inspect", tiny_onnx, "--after", "raise-norms")
    assert res.exit_code == 0, res.stderr
    assert "RMSNorm(" in res.stdout and "Attention(" not in res.stdout


def test_inspect_after_compile_stages(tiny_onnx: Path) -> None:
    res = zlc_cli("inspect", tiny_onnx, "--after", "schedule", "--max-seq", 32)
    assert res.exit_code == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["cpu"]["tasks"]["decode"] > 0 and "tasks_by_op" in summary["cpu"]
    res = zlc_cli("inspect", tiny_onnx, "--after", "emit", "--max-seq", 32)
    assert res.exit_code == 0, res.stderr
    assert "@triton.jit" in res.stdout and "def zlc_megakernel(" in res.stdout
    assert not list(Path.cwd().glob("*.partial")), "a stopped compile must leave no bundle behind"


def test_import_and_help_do_not_load_torch() -> None:
    code = "import sys, zlc, zlc.cli; assert 'torch' not in sys.modules and 'onnx' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_console_script_entry_point(tiny_onnx: Path) -> None:
    """The installed `zlc` script: real process, real exit codes, errors on stderr."""
    res = subprocess.run([sys.executable, "-m", "zlc.cli", "inspect", str(tiny_onnx), "--after", "nope"],
                         capture_output=True, text=True)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == [
        "error: unknown stage 'nope'; stages: " + ", ".join(zlc.STAGES)]


# ---- verify ---------------------------------------------------------------------------------------

def test_verify_passes(tiny_onnx: Path) -> None:
    res = zlc_cli("verify", tiny_onnx, "--steps", 8)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "PASS" in out and "greedy tokens equal" in out and "8/8" in out
    assert "prefill logits" in out and "decode logits" in out
    assert "Attention" in out and "Softmax" in out  # histogram after and before raising


def test_verify_json(tiny_onnx: Path) -> None:
    res = zlc_cli("verify", tiny_onnx, "--steps", 4, "--prompt-ids", "5,6,7", "--json")
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["ok"] is True and rep["tokens_equal"] is True
    assert rep["prompt"] == [5, 6, 7]
    assert len(rep["tokens_ref"]) == 4 and len(rep["decode_max_abs"]) == 3
    assert rep["max_abs"] <= 1e-3
    assert rep["histogram_after"]["Attention"] == 2


def test_verify_beyond_tolerance_exits_nonzero(tiny_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("zlc.verifier._errors", lambda ref, got: (0.5, 0.5))
    res = zlc_cli("verify", tiny_onnx, "--steps", 2)
    line = assert_one_error_line(res, VerificationError.exit_code)
    assert "verification failed" in line and "FAIL" in line
    assert "FAIL" in res.stdout


# ---- inspect --------------------------------------------------------------------------------------

def test_inspect_ir_after_raise_parses_back(tiny_onnx: Path) -> None:
    res = zlc_cli("inspect", tiny_onnx, "--ir", "--after", "raise")
    assert res.exit_code == 0, res.stderr
    want = zlc.lower(tiny_onnx, stop_after="raise").graph
    weights = {name: v.const_array() for name, v in want.consts.items()}
    got = parse_graph(res.stdout, weights)
    assert graphs_equal(got, want)
    ops = {n.op for n in got.nodes}
    assert {"Attention", "RMSNorm", "GatedMLP"} <= ops and "Softmax" not in ops


def test_inspect_ir_defaults_to_the_decode_graph(tiny_onnx: Path) -> None:
    res = zlc_cli("inspect", tiny_onnx, "--ir", "--max-seq", 32)
    assert res.exit_code == 0, res.stderr
    g = parse_graph(res.stdout, _weights_of(res.stdout))
    assert g.name == "decode"
    assert g.inputs[0].shape == (1, 1)  # one token per step
    assert len(g.state) == 4 and all(v.shape is not None and 32 in v.shape for v in g.state)
    pre = zlc_cli("inspect", tiny_onnx, "--ir", "--after", "kv-cache", "--prefill", "--max-seq", 32)
    assert parse_graph(pre.stdout, _weights_of(pre.stdout)).name == "prefill"


def _weights_of(text: str) -> dict[str, np.ndarray]:
    """Zero-filled data for the large constants of a dump (shapes are what these tests check)."""
    out: dict[str, np.ndarray] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("const %") and "=" not in line:
            name, ty = line[len("const %"):].split(": ", 1)
            dims = [int(d) for d in ty[ty.index("[") + 1:-1].split(",")]
            out[name] = np.zeros(dims, dtype=np.float32 if ty.startswith("f32") else np.int64)
    return out


def test_inspect_stats(tiny_onnx: Path) -> None:
    res = zlc_cli("inspect", tiny_onnx, "--stats")
    assert res.exit_code == 0, res.stderr
    for stage in zlc.STAGES:
        assert stage in res.stdout
    assert "time (ms)" in res.stdout and "op histogram" in res.stdout and "KV cache (4 buffers" in res.stdout


def test_inspect_explain_lists_reasons(tiny_onnx: Path, tiny_lowered: Any) -> None:
    res = zlc_cli("inspect", tiny_onnx, "--explain")
    assert res.exit_code == 0, res.stderr
    assert "raised:" in res.stdout and "attention=2" in res.stdout
    assert tiny_lowered.refused, "the tiny model should exercise at least one refusal"
    for rule, reasons in tiny_lowered.refused.items():
        for reason, count in reasons.items():
            assert any(rule in ln and reason in ln and str(count) in ln for ln in res.stdout.splitlines()), \
                f"{rule}: {reason} missing from\n{res.stdout}"


def test_inspect_explain_before_raise(tiny_onnx: Path) -> None:
    res = zlc_cli("inspect", tiny_onnx, "--explain", "--after", "cse")
    assert res.exit_code == 0
    assert "raising did not run" in res.stdout


# ---- run ------------------------------------------------------------------------------------------

def test_run_greedy_matches_onnx_runtime(tiny_onnx: Path) -> None:
    res = zlc_cli("run", tiny_onnx, "--prompt-ids", "1,2,3", "--max-new-tokens", 6)
    assert res.exit_code == 0, res.stderr
    ids = [int(x) for x in res.stdout.strip().split(",")]
    ref = zlc.verify(tiny_onnx, prompt_ids=[1, 2, 3], steps=6)  # ORT's greedy tokens
    assert ids == ref.tokens_ref


def test_run_sampling_is_seeded(tiny_onnx: Path, tiny_lowered: Any) -> None:
    vocab = tiny_lowered.graph.outputs[0].shape[-1]
    args = ("run", tiny_onnx, "--prompt-ids", "4,5", "--max-new-tokens", 8, "--temperature", 1.5,
            "--top-p", 0.9, "--json")
    a, b = zlc_cli(*args, "--seed", 1), zlc_cli(*args, "--seed", 1)
    assert a.exit_code == 0, a.stderr
    ja = json.loads(a.stdout)
    assert ja == json.loads(b.stdout)
    assert ja["prompt"] == [4, 5] and len(ja["generated"]) == 8
    assert all(0 <= t < vocab for t in ja["generated"])


def test_run_stops_at_eos(tiny_onnx: Path) -> None:
    first = zlc_cli("run", tiny_onnx, "--prompt-ids", "1,2,3", "--max-new-tokens", 1).stdout.strip()
    res = zlc_cli("run", tiny_onnx, "--prompt-ids", "1,2,3", "--max-new-tokens", 10, "--eos", first)
    assert res.stdout.strip() == first


# ---- bad input: one line, non-zero exit -----------------------------------------------------------

@pytest.fixture(scope="module")
def bad_models(tmp_path_factory: pytest.TempPathFactory, tiny_onnx: Path) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("bad")
    data = tiny_onnx.read_bytes()
    (d / "truncated.onnx").write_bytes(data[: len(data) // 2])
    (d / "text.onnx").write_text("this is not a protobuf\n")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), d / "relu.onnx")
    return {"missing": d / "missing.onnx", "truncated": d / "truncated.onnx", "text": d / "text.onnx",
            "relu": d / "relu.onnx"}


@pytest.mark.parametrize("command", ["verify", "inspect", "run"])
@pytest.mark.parametrize("model, needle", [
    ("missing", "not found"),
    ("truncated", "truncated"),
    ("text", "onnx"),
    ("relu", "not a decoder"),
])
def test_bad_model_is_one_line(bad_models: dict[str, Path], command: str, model: str, needle: str) -> None:
    extra = ["--prompt-ids", "1,2"] if command == "run" else []
    res = zlc_cli(command, bad_models[model], *extra)
    line = assert_one_error_line(res, 1)
    assert needle in line.lower()


def test_unknown_stage_is_one_line(tiny_onnx: Path) -> None:
    line = assert_one_error_line(zlc_cli("inspect", tiny_onnx, "--ir", "--after", "rasie"), 1)
    assert "unknown stage 'rasie'" in line and "kv-cache" in line


@pytest.mark.parametrize("args", [
    ("verify", "--steps", 32, "--prompt-len", 8, "--max-seq", 16),
    ("run", "--prompt-ids", "1,2,3", "--max-new-tokens", 20, "--max-seq", 16),
])
def test_max_seq_too_small_is_one_line(tiny_onnx: Path, args: tuple[Any, ...]) -> None:
    line = assert_one_error_line(zlc_cli(args[0], tiny_onnx, *args[1:]), 1)
    assert "max" in line and "16" in line


@pytest.mark.parametrize("args, needle", [
    (("run", "--prompt-ids", "1,x"), "comma-separated integers"),
    (("run",), "exactly one of --prompt and --prompt-ids"),
    (("verify", "--steps", 0), "--steps"),
    (("frobnicate",), "No such command"),
])
def test_usage_errors_are_one_line(tiny_onnx: Path, args: tuple[Any, ...], needle: str) -> None:
    argv = [args[0], tiny_onnx, *args[1:]] if args[0] != "frobnicate" else list(args)
    line = assert_one_error_line(zlc_cli(*argv), EXIT_USAGE)
    assert needle in line


def test_token_out_of_vocabulary_is_one_line(tiny_onnx: Path) -> None:
    line = assert_one_error_line(zlc_cli("run", tiny_onnx, "--prompt-ids", "1,5000", "--max-new-tokens", 2), 1)
    assert "[5000]" in line and "vocabulary" in line


def test_internal_error_hints_at_debug(tiny_onnx: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a: Any, **k: Any) -> None:
        raise RuntimeError("kaboom\nsecond line")

    monkeypatch.setattr("zlc.driver.lower", boom)
    line = assert_one_error_line(zlc_cli("inspect", tiny_onnx), EXIT_INTERNAL)
    assert "internal error" in line and "kaboom second line" in line and "--debug" in line


def test_debug_shows_the_traceback(bad_models: dict[str, Path]) -> None:
    res = zlc_cli("--debug", "inspect", bad_models["truncated"])
    assert res.exit_code == 1
    assert "Traceback" in res.stderr and res.stderr.strip().splitlines()[-1].startswith("error: ")


# ---- no wrong tokens with exit 0; verify means compilable ----------------------------------------

def _zoo(family: str) -> Path:
    pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")
    from zlc.testing import zoo

    return zoo.cached("stateless", family, 20)


def test_run_refuses_a_decode_graph_that_disagrees_with_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-J (rotary left op-level) with the rebasing of its Range(0, T) disabled: the invariant stops `zlc run` (exit 3)
    before it prints a token, naming the step and the node."""
    from zlc.passes import positions

    monkeypatch.setattr(positions, "rebase_positions", lambda g, ids, past_len, pos: ([], pos))
    _refuse_rotary(monkeypatch)  # raised, its rotary reads Positions and needs no rebasing
    res = zlc_cli("run", _zoo("gptj"), "--prompt-ids", "3,14,15", "--max-new-tokens", 4)
    line = assert_one_error_line(res, VerificationError.exit_code)
    assert "decode step at position 3" in line and "Range '" in line and not res.stdout.strip()


def _refuse_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every zoo family compiles; GPT-J with its interleaved rotary refused by raising stands for a
    model whose rotary raising does not recognise (it stays op-level, exact on the reference)."""
    from zlc.passes import raise_rope_forms

    monkeypatch.setattr(raise_rope_forms, "rotary_tables", lambda *a, **k: "refused for the test")


def test_verify_reports_that_a_model_does_not_fit_the_megakernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from zlc.verifier import NotCompilableError

    _refuse_rotary(monkeypatch)
    gptj = _zoo("gptj")
    res = zlc_cli("verify", gptj, "--steps", 4)
    line = assert_one_error_line(res, NotCompilableError.exit_code)
    assert NotCompilableError.exit_code not in (0, 1, EXIT_USAGE, VerificationError.exit_code)
    assert "verified, but compilable: no" in line and "rotary embedding" in line and "GatherND" in line
    assert "PASS" in res.stdout and "compilable: no" in res.stdout and "fits the megakernel" in res.stdout
    ok = zlc_cli("verify", gptj, "--steps", 4, "--numerics-only")
    assert ok.exit_code == 0, ok.output
    assert "compilable: no" in ok.stdout and "rotary embedding" in ok.stdout
    rep = json.loads(zlc_cli("verify", gptj, "--steps", 4, "--json", "--numerics-only").stdout)
    assert rep["ok"] is True and rep["compilable"] is False and rep["megakernel"]


def test_verify_of_a_compilable_model_says_so(tiny_onnx: Path) -> None:
    res = zlc_cli("verify", tiny_onnx, "--steps", 2)
    assert res.exit_code == 0, res.output
    assert "compilable: yes" in res.stdout
    assert json.loads(zlc_cli("verify", tiny_onnx, "--steps", 2, "--json").stdout)["compilable"] is True


@pytest.mark.parametrize("family", ["gptj", "cohere"])
def test_compile_names_every_misfit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """GPT-J with its rotary refused: the rotary and the parallel block's sums after it. Cohere
    compiles because its logit scale folds into the final norm (raise-rows); without that fold,
    the Mul after the head is named."""
    from zlc.verifier import NotCompilableError

    if family == "cohere":
        monkeypatch.setattr("zlc.passes.raise_rows._head_norm", lambda m: None)
    else:
        _refuse_rotary(monkeypatch)
    res = zlc_cli("compile", _zoo(family), "-o", tmp_path / "c.zlc", "--max-seq", 64, "--skip-verify")
    line = assert_one_error_line(res, NotCompilableError.exit_code)
    for needle in ("does not fit the megakernel", "inspect MODEL --explain"):
        assert needle in line, needle
    for needle in ("rotary embedding", "residual Adds"):
        assert (needle in line) == (family == "gptj"), needle
    for needle in ("logits after the LM head", "no LMHead"):
        assert (needle in line) == (family == "cohere"), needle
    assert not (tmp_path / "c.zlc").exists() and not (tmp_path / "c.zlc.partial").exists()


def test_inspect_explain_works_without_after(monkeypatch: pytest.MonkeyPatch) -> None:
    _refuse_rotary(monkeypatch)
    res = zlc_cli("inspect", _zoo("gptj"), "--explain", "--max-seq", 64)
    assert res.exit_code == 0, res.output
    assert "raised:" in res.stdout and "megakernel: the decode graph does not fit" in res.stdout
    assert "rotary embedding" in res.stdout and "residual Adds" in res.stdout


def test_inspect_explain_says_when_the_model_fits(tiny_onnx: Path) -> None:
    res = zlc_cli("inspect", tiny_onnx, "--explain", "--max-seq", 64)
    assert res.exit_code == 0, res.output
    assert "megakernel: the decode graph fits" in res.stdout


def test_inspect_explain_survives_a_failure_after_raising(tiny_onnx: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(g: Any, max_seq: int) -> Any:
        raise zlc.PassError("KV-cache synthesis found no raised Attention (planted)")

    monkeypatch.setattr("zlc.driver.synthesize_kv_cache", fail)
    assert_one_error_line(zlc_cli("inspect", tiny_onnx, "--stats"), 1)  # only --explain carries on
    res = zlc_cli("inspect", tiny_onnx, "--explain")
    assert res.exit_code == 0, res.output
    assert "raised:" in res.stdout and "attention=2" in res.stdout
    assert "lowering stopped after raising" in res.stdout and "(planted)" in res.stdout
