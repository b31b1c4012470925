"""The torch.export route (`zlc.lower(module)`) for the zoo families no other test takes that way
(and for Llama, GPT-2 and Phi-3, whose test in test_torch_route.py checks tokens, not the fit).

Each family's tiny HF module is exported by zlc itself, lowered, and checked two ways: the
reference executor's greedy tokens (decode through zlc's own KV cache) equal Hugging Face's
`generate`, and the decode graph fits the megakernel. The families' ONNX routes and their bundles
are tested in tests/test_verify_models.py and tests/test_family_*.py; the torch routes of the others
are there too (the position, rotary, norm, window, ALiBi, Falcon and MoE families in their own files).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from zlc.testing import zoo  # noqa: E402

PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8
#: Families whose torch route no other test file checks for fitting the megakernel.
FAMILIES = ["llama", "gpt2", "phi3", "qwen2", "mistral", "gemma", "starcoder2", "olmo", "qwen2_win", "starcoder2_win", "gemma2",
            "gemma3", "falcon_new", "qwen3_moe"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_torch_export_route_gives_hugging_faces_greedy_tokens_and_fits(family: str) -> None:
    import zlc
    from zlc.reference.session import ReferenceSession
    from zlc.verifier import megakernel_fit

    lowered = zlc.lower(zoo.hf_model(family), (torch.tensor([PROMPT]),), options=zlc.CompileOptions(max_seq=32))
    assert ReferenceSession.from_lowered(lowered).generate(PROMPT, NEW_TOKENS) == zoo.hf_greedy(family, PROMPT, NEW_TOKENS)
    fit = megakernel_fit(lowered.decode, lowered.max_seq)
    assert fit.compilable, fit
