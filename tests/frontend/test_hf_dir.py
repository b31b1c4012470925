"""Hugging Face checkpoint directories as MODEL (zlc.frontend.hf_dir): the zoo's families saved with
`save_pretrained` (f32, bf16, f16; one file or shards), built from config.json and the mapped
safetensors weights without a trace. Oracle: Hugging Face on the same weights (in f32 on the
half-rounded ones for a half checkpoint, which is what zlc computes): logits of a teacher-forced
sequence over the synthesized KV cache, greedy tokens, and the native C kernel's greedy tokens
through `zlc compile DIR`. A family the builder does not know goes through transformers +
torch.export. Bad directories are one error line naming the file, field, tensor or architecture."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import zlc  # noqa: E402
from zlc.driver import CompileOptions  # noqa: E402
from zlc.testing.families import CHAT_VOCAB, hf_greedy, hf_model, save_chat_tokenizer  # noqa: E402

PROMPT = [3, 14, 15, 92, 65, 35]
NEW_TOKENS = 8
SEQ = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]  # prefill of 6, then decode steps past a window of 4
#: zoo family -> what it exercises through the checkpoint route (all built like the GGUF families)
CASES = {
    "llama": "the llama layout, Q/K in Hugging Face's order (never permuted)",
    "mistral": "built as llama (its 4096 window on every layer)",
    "mistral_win": "a window of 4 on every layer",
    "qwen2": "q/k/v biases",
    "qwen2_win": "the window on the layers from max_window_layers on (layer_types)",
    "qwen3": "per-head q/k norms",
    "gemma": "(1 + w) norm gains read from w, embedding scale, GELU-tanh, tied head",
    "gemma2": "sandwich norms, soft-caps, query_pre_attn_scalar, layer 0 windowed",
    "gemma3": "q/k (1 + w) norms, two rope bases (rope_parameters per layer type)",
    "phi3": "fused qkv_proj and gate_up_proj split at import",
}
#: max abs logit error against Hugging Face: f32 is summation order; half checkpoints keep
#: Hugging Face's half rotary tables (and Gemma's (1 + w) gains) rounded, which f32 HF does not
ATOL = {"float32": 2e-4, "bfloat16": 3e-2, "float16": 5e-3}


def _model(family: str, dtype: str = "float32", **overrides: Any) -> Any:
    import torch

    model = hf_model(family, vocab_size=CHAT_VOCAB, **overrides)
    if family.startswith("gemma"):  # as tests/frontend/test_gguf_families.py: a table that does not
        with torch.no_grad():  # drown every layer once scaled by sqrt(hidden)
            model.model.embed_tokens.weight.mul_(0.125)
    return model.to(getattr(torch, dtype))


def _save(family: str, d: Path, dtype: str = "float32", shard: str | None = None, **overrides: Any) -> tuple[Path, Any]:
    """The family saved at `d` (with the byte-level chat tokenizer) and the f32 model on its weights."""
    from zlc.testing.quiet import quiet

    model = _model(family, dtype, **overrides)
    with quiet():
        model.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
    save_chat_tokenizer(d)
    return d, model.float()


def _check_logits(d: Path, model: Any, atol: float) -> Any:
    """zlc's reference session on the lowered directory, teacher-forced over SEQ, against HF's logits;
    returns the session (greedy tokens next)."""
    import torch

    from zlc.reference.executor import HALF, in_f32
    from zlc.reference.session import ReferenceSession

    lowered = zlc.lower(d, options=CompileOptions(max_seq=64))
    assert lowered.prefill is not None and lowered.decode is not None
    if lowered.graph.outputs[0].dtype.value in HALF:  # as the kernel computes: f32 on the half weights
        sess = ReferenceSession(in_f32(lowered.prefill), in_f32(lowered.decode), lowered.max_seq)
    else:
        sess = ReferenceSession.from_lowered(lowered)
    rows = [sess.prefill(SEQ[:6]), *(sess.step(t)[None] for t in SEQ[6:-1])]
    with torch.no_grad():
        want = model(torch.tensor([SEQ])).logits[0, :-1].numpy()
    np.testing.assert_allclose(torch.cat(rows).float().numpy(), want, atol=atol, rtol=0)
    return sess


@pytest.mark.parametrize("family", sorted(CASES))
def test_logits_and_greedy_tokens_equal_hugging_face(family: str, tmp_path: Path) -> None:
    d, model = _save(family, tmp_path / family)
    g = zlc.lower(d, options=CompileOptions(max_seq=64), stop_after="import").graph
    assert g.metadata["frontend"] == "hf" and "Attention" in g.op_histogram()  # built, not traced
    sess = _check_logits(d, model, ATOL["float32"])
    expect = hf_greedy(model, PROMPT, NEW_TOKENS)
    assert len(set(expect)) > 1
    assert sess.generate(PROMPT, NEW_TOKENS) == expect


@pytest.mark.parametrize("family,dtype", [("llama", "bfloat16"), ("phi3", "bfloat16"), ("qwen2", "float16"),
                                          ("gemma3", "bfloat16")])
def test_half_checkpoints_build_half_graphs_on_the_mapped_weights(family: str, dtype: str, tmp_path: Path) -> None:
    import torch

    d, model = _save(family, tmp_path / family, dtype)
    g = zlc.lower(d, options=CompileOptions(max_seq=64), stop_after="import").graph
    want = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    weight = g.consts["blk.0.ffn_down.weight"].data
    assert weight.dtype == want and g.outputs[0].dtype.value == ("bf16" if dtype == "bfloat16" else "f16")
    sess = _check_logits(d, model, ATOL[dtype])
    if family != "gemma3":  # the tiny Gemma 3 echoes one token either way: its logits are the check
        assert sess.generate(PROMPT, NEW_TOKENS) == hf_greedy(model, PROMPT, NEW_TOKENS)


def test_the_weights_are_the_files_memory_map_not_copies(tmp_path: Path) -> None:
    """Each matrix constant's storage lies in the safetensors file's mapping (mmap'd, not read)."""
    import torch

    d, _ = _save("llama", tmp_path / "llama", "bfloat16")
    g = zlc.lower(d, options=CompileOptions(max_seq=64), stop_after="import").graph
    maps = [ln.split() for ln in Path("/proc/self/maps").read_text().splitlines() if ln.endswith("model.safetensors")]
    spans = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps]
    assert spans
    for name in ("token_embd.weight", "blk.1.attn_q.weight", "blk.0.ffn_up.weight", "output.weight"):
        t = g.consts[name].data
        assert isinstance(t, torch.Tensor) and any(a <= t.data_ptr() < b for a, b in spans), name


def test_sharded_checkpoints_equal_one_file(tmp_path: Path) -> None:
    d, model = _save("qwen3", tmp_path / "sharded", shard="40KB")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) > 2
    assert _check_logits(d, model, ATOL["float32"]).generate(PROMPT, NEW_TOKENS) == hf_greedy(model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("rope", [{"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}])
def test_llama_rotary_scaling(rope: dict[str, Any], tmp_path: Path) -> None:
    """Llama 3's per-frequency scaling (as llama.cpp's rope_freqs divisors) and linear scaling."""
    d, model = _save("llama", tmp_path / rope["rope_type"], rope_parameters=rope)
    assert _check_logits(d, model, ATOL["float32"]).generate(PROMPT, NEW_TOKENS) == hf_greedy(model, PROMPT, NEW_TOKENS)


def test_other_architectures_go_through_torch_export(tmp_path: Path) -> None:
    d, model = _save("gpt2", tmp_path / "gpt2")
    lowered = zlc.lower(d, options=CompileOptions(max_seq=64))
    assert lowered.graph.metadata["hf"]["route"] == "torch.export"
    from zlc.reference.session import ReferenceSession

    assert ReferenceSession.from_lowered(lowered).generate(PROMPT, NEW_TOKENS) == hf_greedy(model, PROMPT, NEW_TOKENS)


def test_zlc_compile_dir_runs_hugging_faces_greedy_tokens_on_the_native_kernel(tmp_path: Path) -> None:
    """`zlc compile DIR --target cpu`: verified against its imported graph, the directory's
    tokenizer and chat template bundled, the native C kernel's greedy tokens are Hugging Face's."""
    from click.testing import CliRunner

    from zlc.cli import cli

    d, model = _save("qwen2", tmp_path / "qwen2")
    out = tmp_path / "qwen2.zlc"
    res = CliRunner().invoke(cli, ["compile", str(d), "--target", "cpu", "-o", str(out), "--max-seq", "64", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["verification"]["status"] == "passed" and "checkpoint" in report["verification"]["oracle"]
    with zlc.load(out) as b:
        assert b.tokenizer is not None and b.tokenizer.has_chat_template
        assert b.generate(PROMPT, NEW_TOKENS, device="cpu", eos=[]) == hf_greedy(model, PROMPT, NEW_TOKENS)
    res = CliRunner().invoke(cli, ["run", str(d), "--prompt-ids", ",".join(map(str, PROMPT)),
                                   "--max-new-tokens", str(NEW_TOKENS), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["generated"] == hf_greedy(model, PROMPT, NEW_TOKENS)


def test_verify_and_inspect_take_a_checkpoint_directory(llama_dir: Path) -> None:
    from click.testing import CliRunner

    from zlc.cli import cli

    res = CliRunner().invoke(cli, ["verify", str(llama_dir), "--steps", "4", "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.stdout)
    assert rep["ok"] and rep["oracle"] == "zlc reference in f32 on the imported checkpoint graph (no KV cache)"
    res = CliRunner().invoke(cli, ["inspect", str(llama_dir), "--ir", "--after", "import", "--max-seq", "64"])
    assert res.exit_code == 0, res.output
    assert "Attention" in res.stdout and "blk.1.ffn_down.weight" in res.stdout


@pytest.mark.slow
def test_a_bf16_checkpoint_compiles_to_bf16_weights_on_the_native_kernel(tmp_path: Path) -> None:
    d, model = _save("gemma2", tmp_path / "gemma2", "bfloat16")
    res = zlc.compile(d, targets=("cpu",), out=tmp_path / "g.zlc", max_seq=64)
    assert res.manifest["dtype"]["weights"] == "bf16"  # --dtype auto keeps a bf16 checkpoint's bytes
    assert res.manifest["verification"]["ok"]
    with zlc.load(res.path) as b:
        assert b.generate(PROMPT, NEW_TOKENS, device="cpu", eos=[]) == b.generate(PROMPT, NEW_TOKENS,
                                                                                  device="reference", eos=[])


# ---- bad input: one line naming what is wrong -------------------------------------------------------

def _error(path: Path, *args: str) -> str:
    from click.testing import CliRunner

    from zlc.cli import cli

    res = CliRunner().invoke(cli, ["compile", str(path), "-o", str(path.parent / "out.zlc"), *args])
    assert res.exit_code != 0, res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output
    return lines[0]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _save("llama", tmp_path_factory.mktemp("llama") / "llama")[0]


def _copy(src: Path, dst: Path, config: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Path:
    import shutil

    shutil.copytree(src, dst)
    for name in drop:
        (dst / name).unlink()
    if config is not None:
        c = json.loads((dst / "config.json").read_text())
        c.update(config)
        (dst / "config.json").write_text(json.dumps({k: v for k, v in c.items() if v is not ...}))
    return dst


def test_a_directory_without_config_or_weights(llama_dir: Path, tmp_path: Path) -> None:
    assert "no config.json" in _error(_copy(llama_dir, tmp_path / "noconf", drop=("config.json",)))
    assert "no *.safetensors weights" in _error(_copy(llama_dir, tmp_path / "noweights", drop=("model.safetensors",)))


def test_unknown_architectures_are_named(llama_dir: Path, tmp_path: Path) -> None:
    line = _error(_copy(llama_dir, tmp_path / "foo", {"model_type": "foo_lm"}))
    assert "model_type 'foo_lm' is not a causal LM" in line


def test_unsupported_dtypes_and_settings_are_named(llama_dir: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    d = _copy(llama_dir, tmp_path / "f64")
    w = load_file(str(d / "model.safetensors"))
    save_file({k: v.double() if k.endswith("q_proj.weight") else v for k, v in w.items()}, str(d / "model.safetensors"))
    assert "tensor 'model.layers.0.self_attn.q_proj.weight' has dtype F64; supported: F32, BF16, F16" in _error(d)
    d = _copy(llama_dir, tmp_path / "short")
    save_file({k: v[:8] if k.endswith("k_proj.weight") else v for k, v in w.items()}, str(d / "model.safetensors"))
    assert "tensor 'model.layers.0.self_attn.k_proj.weight' has shape [8, 64] but config.json implies [32, 64]" in _error(d)
    yarn = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}
    assert "rope scaling 'yarn' is not supported" in _error(_copy(llama_dir, tmp_path / "yarn", yarn))
    quant = {"quantization_config": {"quant_method": "awq"}}
    assert "quantized checkpoint (awq)" in _error(_copy(llama_dir, tmp_path / "awq", quant))
    assert torch is not None


def test_a_tensor_the_graph_would_drop_is_named(tmp_path: Path) -> None:
    """Llama with MLP biases: the gated MLP has none, so the checkpoint is refused, not run without them."""
    d, _ = _save("llama", tmp_path / "mlp_bias", mlp_bias=True)
    assert "tensor 'model.layers.0.mlp.down_proj.bias' (6 unused in all) is not part of the llama graph" in _error(d)


def test_inspect_names_a_directory_that_is_neither_bundle_nor_checkpoint(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from zlc.cli import cli

    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(cli, ["inspect", str(tmp_path / "empty")])
    assert res.exit_code != 0
    assert "neither a zlc bundle (no manifest.json) nor a Hugging Face checkpoint directory" in res.stderr
