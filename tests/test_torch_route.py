"""The torch.export route shares the passes: a Hugging Face module lowers, raises and decodes with
the synthesized KV cache, and greedy tokens equal the module's own (PyTorch eager is the oracle)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import zlc  # noqa: E402
from zlc.reference.session import ReferenceSession  # noqa: E402
from zlc.testing import zoo  # noqa: E402


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_module_lowers_raises_and_decodes(family: str) -> None:
    model = zoo.hf_model(family)
    prompt = torch.tensor([[3, 14, 15, 92, 65]])
    lowered = zlc.lower(model, (prompt,), options=zlc.CompileOptions(max_seq=32))
    assert {"Attention", "LMHead", "Embedding"} <= set(lowered.histogram_after)
    assert "Softmax" not in lowered.histogram_after
    sess = ReferenceSession.from_lowered(lowered)
    got = sess.generate(prompt[0].tolist(), max_new_tokens=8)
    ids = prompt
    want = []
    with torch.no_grad():
        for _ in range(8):
            nxt = int(model(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], 1)
    assert got == want
