"""A decoder LM with no transformer layers: input_ids -> Gather(embedding) -> MatMul(LM head).

The smallest graph zlc compiles: no attention, so its KV cache is empty and each position's
logits depend on its own token only. Tests use it (tests/runtime/test_reference_backend.py) to
cover the empty-cache path; as a bench it isolates the per-launch cost of an executor from the
work of the layers.

    python bench/nolayer_model.py nolayer.onnx [--vocab 260] [--hidden 64] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def export_nolayer(out: Path, vocab: int = 260, hidden: int = 64, seed: int = 0) -> Path:
    """Writes the model (opset 20, random f32 weights from `seed`) to `out`; returns `out`."""
    rng = np.random.default_rng(seed)
    embed = rng.normal(0.0, 1.0, (vocab, hidden)).astype(np.float32)
    head = rng.normal(0.0, hidden ** -0.5, (hidden, vocab)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed", "input_ids"], ["hidden"], axis=0, name="embedding"),
         helper.make_node("MatMul", ["hidden", "lm_head"], ["logits"], name="lm_head")],
        "nolayer",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "seq"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "seq", vocab])],
        initializer=[numpy_helper.from_array(embed, "embed"), numpy_helper.from_array(head, "lm_head")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)],
                              producer_name="zlc-bench-nolayer")
    model.ir_version = 10  # what onnxruntime >= 1.20 reads
    onnx.checker.check_model(model, full_check=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vocab", type=int, default=260)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(export_nolayer(a.out, vocab=a.vocab, hidden=a.hidden, seed=a.seed))


if __name__ == "__main__":
    main()
