"""Sliding-window attention: Mistral, Qwen2 (windowed only from `max_window_layers` on) and
Starcoder2 with a window of 4 keys, shorter than the prompt plus the new tokens; Gemma 2 and 3
(local and global layers alternating, Gemma 2's attention-logit and final-logit soft-capping).

Raising reads the window off the exported mask by probing it (passes/probe.py `mask_window`) and
writes it on the Attention node (`window`); the KV cache stays full-length and each query attends
over the last `window` positions of it (reference, Triton and C kernels alike). The oracle is
Hugging Face's own greedy generation (its sliding-window cache and masks)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")

from zlc.testing import zoo  # noqa: E402

PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8
# the window of each layer's Attention (0: none); Qwen2 windows layers i >= max_window_layers (1)
WINDOWS = {"mistral_win": [4, 4], "qwen2_win": [0, 4], "starcoder2_win": [4, 4]}


def _hf_greedy(family: str, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    return zoo.hf_greedy(family, prompt, new_tokens)


def _windows(graph: object) -> list[int]:
    return [int(n.attrs.get("window", 0)) for n in graph.nodes if n.op == "Attention"]  # type: ignore[attr-defined]


def _compile_and_run(family: str, out: Path, prompt: list[int], max_seq: int, new_tokens: int,
                     devices: tuple[str, ...] = ("interpret", "cpu")) -> dict[str, list[int]]:
    from bundle_checks import bundle_greedy, compile_bundle

    compile_bundle(zoo.cached("stateless", family, 20), out, "--max-seq", str(max_seq))
    return bundle_greedy(out, prompt, new_tokens, devices)


@pytest.mark.parametrize("family", list(WINDOWS))
def test_verifies_with_the_window_on_each_layer(family: str) -> None:
    import zlc
    from zlc.verifier import verify

    path = zoo.cached("stateless", family, 20)
    rep = verify(path, steps=8, max_seq=64)
    assert rep.ok and rep.compilable, (rep.summary(), rep.megakernel)
    lowered = zlc.lower(path, options=zlc.CompileOptions(max_seq=64))
    assert _windows(lowered.decode) == _windows(lowered.prefill) == WINDOWS[family]


@pytest.mark.parametrize(("family", "softcap"), [("gemma2", 50.0), ("gemma3", None)])
def test_gemma_raises_local_and_global_attention(family: str, softcap: float | None) -> None:
    """Gemma 2's and 3's local layer (0, window 4) and global layer (1), scaled by
    query_pre_attn_scalar^-0.5 = 1/4; Gemma 2's soft-capped at 50 (raising folds
    c * tanh(q k^T / 4 / c) into Attention) and its logits at 30 (LMHead's softcap). The reference
    agrees with ONNX Runtime."""
    import zlc
    from zlc.verifier import verify

    path = zoo.cached("stateless", family, 20)
    rep = verify(path, steps=8, max_seq=64)
    assert rep.ok, rep.summary()
    decode = zlc.lower(path, options=zlc.CompileOptions(max_seq=64)).decode
    attn = [n for n in decode.nodes if n.op == "Attention"]
    assert [(n.attrs.get("window", 0), n.attrs.get("softcap"), n.attrs["scale"]) for n in attn] == \
        [(4, softcap, pytest.approx(0.25)), (0, softcap, pytest.approx(0.25))]
    head = [n for n in decode.nodes if n.op == "LMHead"]
    assert [n.attrs.get("softcap") for n in head] == [30.0 if family == "gemma2" else None]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(WINDOWS))
def test_bundle_gives_hugging_faces_greedy_tokens(family: str, tmp_path: Path) -> None:
    """`zlc compile`, then the Triton kernel in the interpreter and the native C kernel: 5 prompt
    tokens and 8 new ones, so every decode step's window has dropped the earliest keys."""
    pytest.importorskip("triton")
    want = _hf_greedy(family, PROMPT)
    got = _compile_and_run(family, tmp_path / f"{family}.zlc", PROMPT, 64, NEW_TOKENS)
    assert got == {"interpret": want, "cpu": want}


@pytest.mark.slow
def test_a_prompt_across_prefill_chunks(tmp_path: Path) -> None:
    """134 prompt tokens: the interpreter's tiling prefills them in chunks of 64, the native one in
    chunks of 128, so the first queries of each later chunk attend over keys of the one before."""
    pytest.importorskip("triton")
    prompt = [(7 * i + 3) % 256 for i in range(134)]
    want = _hf_greedy("qwen2_win", prompt, 3)
    got = _compile_and_run("qwen2_win", tmp_path / "qwen2_win.zlc", prompt, 160, 3)
    assert got == {"interpret": want, "cpu": want}


def test_the_torch_export_route_gives_hugging_faces_greedy_tokens() -> None:
    import torch

    import zlc
    from zlc.reference.session import ReferenceSession
    from zlc.verifier import megakernel_fit

    lowered = zlc.lower(zoo.hf_model("mistral_win"), (torch.tensor([PROMPT]),),
                        options=zlc.CompileOptions(max_seq=32))
    assert _windows(lowered.decode) == WINDOWS["mistral_win"]
    assert ReferenceSession.from_lowered(lowered).generate(PROMPT, NEW_TOKENS) == _hf_greedy("mistral_win", PROMPT)
    assert megakernel_fit(lowered.decode, lowered.max_seq).compilable


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_bundle_gives_hugging_faces_greedy_tokens_and_the_references_logits(family: str,
                                                                                 tmp_path: Path) -> None:
    """Gemma 2 and 3 end to end: local/global layers, sandwich norms, Gemma 2's soft-caps, Gemma
    3's q/k norms. The tiny tied Gemmas mostly repeat the last prompt token, so besides HF's greedy
    tokens, every launch's logits (a 9-token prompt, past the window, then 4 steps) are compared
    with the reference executor's on both kernels."""
    pytest.importorskip("triton")
    import numpy as np

    import zlc
    from zlc.reference.session import ReferenceSession

    out = tmp_path / f"{family}.zlc"
    want = _hf_greedy(family, PROMPT)
    assert _compile_and_run(family, out, PROMPT, 64, NEW_TOKENS) == {"interpret": want, "cpu": want}
    lowered = zlc.lower(zoo.cached("stateless", family, 20), options=zlc.CompileOptions(max_seq=64))
    prompt = [(11 * i + 5) % 256 for i in range(9)]
    for device in ("interpret", "cpu"):
        ref = ReferenceSession.from_lowered(lowered)
        with zlc.load(out).session(device) as s:
            tok, lg = s.prefill(prompt, all_logits=True, want_logits=True)
            exp = ref.prefill(prompt).numpy()
            assert lg is not None and float(np.abs(lg - exp).max()) <= 1e-4, device
            assert tok == int(exp[-1].argmax())
            for _ in range(4):
                tok, lg = s.step(tok, want_logits=True)
                exp = ref.step(int(exp.reshape(-1, exp.shape[-1])[-1].argmax())).numpy().reshape(-1)
                assert lg is not None and float(np.abs(lg[0] - exp).max()) <= 1e-4, device
                assert tok == int(exp.argmax()), device


# ---- the semantics ----------------------------------------------------------------------------

@pytest.mark.parametrize(("past", "seq"), [(0, 4), (0, 5), (3, 1), (4, 1), (9, 1), (2, 6)])
def test_the_reference_attends_over_exactly_the_window(past: int, seq: int) -> None:
    """Values one-hot by key position: each output row is that query's attention weights, which
    are non-zero exactly on keys p-3..p (W = 4) for the query at position p, and the window of a
    query with fewer than 4 predecessors is all of them."""
    import torch

    from zlc.ir import DType, Graph, TensorType
    from zlc.reference.kernels import KERNELS

    W, total = 4, past + seq
    g = Graph("window")
    ins = [g.add_input(n, TensorType(DType.f32, s)) for n, s in
           (("q", (1, 1, seq, 8)), ("k", (1, 1, total, 8)), ("v", (1, 1, total, total)))]
    node = g.add_node("Attention", ins, {"causal": 1, "window": W}, name="attn")
    q, k = torch.randn(1, 1, seq, 8), torch.randn(1, 1, total, 8)
    v = torch.eye(total).reshape(1, 1, total, total)
    (p,) = KERNELS["Attention"](node, [q, k, v])
    for i in range(seq):
        pos = past + i
        kept = [j for j in range(total) if float(p[0, 0, i, j]) > 0.0]
        assert kept == list(range(max(0, pos - W + 1), pos + 1)), (pos, kept)
    assert torch.allclose(p.sum(-1), torch.ones(1, 1, seq))
