"""Picking the next token from logits: greedy, or temperature / top-p with a seeded generator.
Every executor (the reference session, the megakernel's host loop) samples through this one
function, so the same seed gives the same tokens on every device."""

from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
        probs /= probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))
