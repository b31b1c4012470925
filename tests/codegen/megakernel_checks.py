"""Shared by the megakernel's interpreter tests (test_megakernel*.py): the zoo models they compile
(tests/megakernel_cases.py's, and any family by name), a compiled bundle with the lowered model it
came from, the comparison with the reference executor, and the cpu tiling reshaped like the GPU's
(conftest.py holds the `built` fixture)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from megakernel_cases import ATOL, MODELS, PROMPT

import zlc
from zlc.codegen import program as pg
from zlc.codegen.schedule import schedule, tiling_for
from zlc.reference.session import ReferenceSession
from zlc.runtime.interpret import InterpretBackend
from zlc.runtime.megakernel import MegakernelSession
from zlc.targets import get_target

__all__ = ["ATOL", "MODELS", "PROMPT", "Built", "assert_matches", "gpu_like", "run_both", "source"]


def source(name: str) -> tuple[str, str, int | None]:
    """The zoo export of a model id: MODELS' entry, else the family's stateless opset-20 export
    (mixtral, qwen3, qwen2_win, ...)."""
    return MODELS.get(name, ("stateless", name, 20))


class Built:
    """A compiled bundle and the lowered model it came from (the reference's input)."""

    def __init__(self, path: Path, lowered: Any):
        self.path, self.lowered = path, lowered
        self.manifest = zlc.load(path).manifest
        self.chunk = int(self.manifest["tilings"]["cpu"]["layout"]["chunk"])
        self.vocab = int(self.manifest["model"]["vocab"])
        self.max_seq = int(self.manifest["model"]["max_seq"])

    def program(self, tiling: pg.Tiling | None = None) -> pg.Program:
        """The bundle's program rescheduled (the same as the bundle's when `tiling` is None)."""
        t = tiling or tiling_for(get_target("cpu"), self.max_seq)
        return schedule(self.lowered.decode, t, self.max_seq)

    def session(self, path: Path | None = None, **kw: Any) -> MegakernelSession:
        """The Triton kernel of the bundle at `path` (this one by default: e.g. one that
        write_program_bundle rewrote for another tiling) in the interpreter; `kw` goes to
        InterpretBackend (tables, debug)."""
        return MegakernelSession(InterpretBackend(path or self.path, "cpu", **kw), chunk=self.chunk,
                                 max_seq=self.max_seq, vocab=self.vocab)


def gpu_like(max_seq: int = 64, **kw: Any) -> pg.Tiling:
    """The cpu tiling with the GPU's shape of work: one block of 16 columns per Linear task (the
    LM head's 64), 2 KV splits of 16 keys merged by the o projection, decode attention appending
    the step's k/v itself; `kw` overrides fields (e.g. fuse_mlp_down=True)."""
    fields: dict[str, Any] = {"block_n": 16, "lm_block_n": 64, "max_linear_tasks": 0, "kv_splits": 2,
                              "block_kv": 16, "fuse_kv_append": True, "fuse_combine": True}
    return replace(tiling_for(get_target("cpu"), max_seq), **{**fields, **kw})


def run_both(s: MegakernelSession, lowered: Any, prompt: list[int], steps: int) -> dict[str, Any]:
    """Prefill (all logits) + `steps` decode steps on the megakernel and the reference, each decode
    step fed the reference's greedy token. Returns the max abs errors and both token streams."""
    ref = ReferenceSession.from_lowered(lowered)
    tok, lg = s.prefill(prompt, all_logits=True, want_logits=True)
    want = ref.prefill(prompt).numpy()
    assert lg is not None and lg.shape == want.shape
    errs = [float(np.abs(lg - want).max())]
    got_toks, ref_toks = [tok], [int(want[-1].argmax())]
    for _ in range(steps):
        feed = ref_toks[-1]
        tok, lg = s.step(feed, want_logits=True)
        want = ref.step(feed).numpy()
        assert lg is not None and lg.shape == (1, want.shape[-1])
        errs.append(float(np.abs(lg[0] - want).max()))
        got_toks.append(tok)
        ref_toks.append(int(want.argmax()))
    return {"errors": errs, "tokens": got_toks, "ref_tokens": ref_toks}


def assert_matches(r: dict[str, Any]) -> None:
    """Every launch's logits within ATOL of the reference's, and the same greedy tokens."""
    assert max(r["errors"]) <= ATOL, f"max abs error per launch {r['errors']}"
    assert r["tokens"] == r["ref_tokens"]
