"""Exports the bundled example model: the model zoo's tiny random-weight Llama (2 layers, hidden 64,
4 heads, 2 KV heads, vocab 256) as a stateless ONNX graph, input_ids [1, seq] -> logits [1, seq, 256],
with `torch.onnx.export(dynamo=True)` at opset 20 -- the exporter and op patterns zlc's frontend is
built against. Needs the `hf` extra (transformers, onnxscript).

    python examples/tiny/make_tiny.py [OUT.onnx]     (default: examples/tiny/out/tiny-llama.onnx)
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "tiny-llama.onnx"


def export_tiny(out: Path = DEFAULT_OUT, *, seed: int = 0, opset: int = 20) -> Path:
    """Writes the tiny model to `out` (parent folders created) and returns its path."""
    from zlc.testing import zoo

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return zoo.export_stateless("llama", out, opset, seed=seed)


def main(argv: list[str]) -> None:
    print(export_tiny(Path(argv[0]) if argv else DEFAULT_OUT))


if __name__ == "__main__":
    main(sys.argv[1:])
