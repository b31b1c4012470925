"""Export forms pinned: the graphs that different transformers releases export for the same tiny
model, kept as fixtures (tests/fixtures/export_forms, written by its strip.py), so that a form
raising recognises stays recognised whichever transformers the test machine has.

transformers 5.25 rewrote Falcon's attention: multi-query Falcon's fused query_key_value is now
split by a Split of the heads axis (`fused_qkv.split([heads, 1, 1], dim=-2)`), where 5.24 sliced
it and gathered the KV head (GatherND). Both forms must raise to one Linear per part, verify
against ONNX Runtime, fit the megakernel and give ONNX Runtime's greedy tokens from the bundle.

The fixtures carry the graph without its weight matrices; :func:`load` fills those from a seed
(the zoo's weights are random anyway), and ONNX Runtime on the same filled file is the oracle.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

from onnx import external_data_helper, helper, numpy_helper  # noqa: E402

from zlc.testing.ort import ort_session  # noqa: E402
from zlc.verifier import verify  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures" / "export_forms"
FORMS = sorted(FIXTURES.glob("*.onnx"))
PROMPT = [3, 14, 15, 92, 65]
NEW_TOKENS = 8


def load(fixture: Path, out_dir: Path, seed: int = 0) -> Path:
    """The fixture with its left-out weight matrices drawn from N(0, 1/8), as a complete ONNX file."""
    model = onnx.load(str(fixture), load_external_data=False)
    rng = np.random.default_rng(seed)
    for t in model.graph.initializer:
        if external_data_helper.uses_external_data(t):
            dtype = helper.tensor_dtype_to_np_dtype(t.data_type)
            w = rng.normal(0.0, 0.125, size=tuple(t.dims)).astype(dtype)
            t.CopyFrom(numpy_helper.from_array(w, t.name))
    out = out_dir / fixture.name
    onnx.save(model, str(out))
    return out


def ort_greedy(model: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of a stateless `input_ids -> logits` graph on ONNX Runtime."""
    sess, ids = ort_session(model), list(prompt)
    for _ in range(new_tokens):
        (logits,) = sess.run(["logits"], {"input_ids": np.array([ids], dtype=np.int64)})
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_there_are_forms_of_each_falcon_variant() -> None:
    names = {p.stem for p in FORMS}
    assert {"falcon-tf5.24.0", "falcon-tf5.25.0", "falcon_new-tf5.24.0", "falcon_new-tf5.25.0"} <= names


@pytest.mark.parametrize("fixture", FORMS, ids=lambda p: p.stem)
def test_form_raises_verifies_and_fits_the_megakernel(fixture: Path, tmp_path: Path) -> None:
    rep = verify(load(fixture, tmp_path), steps=4, max_seq=64)
    assert rep.ok and rep.compilable_line() == "compilable: yes", (rep.summary(), rep.megakernel)
    assert rep.histogram_after.get("Attention") == 2
    assert not {"GatherND", "Split", "Transpose"} & set(rep.histogram_after), rep.histogram_after


@pytest.mark.slow
@pytest.mark.parametrize("fixture", FORMS, ids=lambda p: p.stem)
def test_form_bundle_gives_onnx_runtimes_greedy_tokens(fixture: Path, tmp_path: Path) -> None:
    pytest.importorskip("triton")
    from bundle_checks import DEVICES, bundle_greedy, compile_bundle

    model = load(fixture, tmp_path)
    out = tmp_path / f"{fixture.stem}.zlc"
    compile_bundle(model, out, "--max-seq", "64")
    assert bundle_greedy(out, PROMPT, NEW_TOKENS) == dict.fromkeys(DEVICES, ort_greedy(model, PROMPT, NEW_TOKENS))
