"""The `reference` executor: a bundle's raised IR run by the torch reference executor on the CPU.

Why it exists. The `cpu` executor runs the bundle's megakernel under Triton's interpreter, which
is exact but costs tens of ms per task; this backend serves the same bundle on a CPU at PyTorch
speed (`zlc.load(b).session(device="reference")`, `zlc run --device reference`, `zlc serve`). It
reads nothing but the bundle: the prefill and decode graphs from `ir/*.zir`, their weights from
the `W`/`P` arenas at the offsets of `manifest.weights.placement`, i.e. the very bytes the kernel
reads (bf16 arenas are widened to the IR's dtype). So it is also a cross-check of a bundle: its
IR, run on its packed weights, must agree with its kernel (tests/runtime/test_reference_backend.py).

It implements the `Backend` protocol of `runtime/megakernel.py`; one KV cache (the executors'
shared state) serves both graphs, at the positions the host passes as `past`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zlc.errors import ZlcError
from zlc.ir import DType
from zlc.ir.quant import QuantizedWeight, get_format
from zlc.ir.text import parse_graph
from zlc.reference.executor import ReferenceExecutor, in_f64

# A constant without inline data (`const %name: f32[256, 64]`): its data comes from the arenas.
# A packed one (`const %name: f32[N, K] q4_0`) is a QuantizedWeight cut out of the Q arena.
_WEIGHT_LINE = re.compile(r"^\s*const\s+%(\S+?):\s*(\w+)\[([^\]]*)\](?:\s+(q\d_[0-9k]|nbits4_b\d+))?\s*$", re.M)


def arena_weights(bundle: Path, manifest: dict[str, Any], texts: list[str]) -> dict[str, Any]:
    """name -> tensor for every constant of `texts` that has no inline data, cut out of the
    bundle's W/P arenas (views of the arenas when no dtype conversion is needed)."""
    from safetensors.torch import load_file

    arenas = load_file(str(bundle / manifest["weights"]["file"]))
    place = {p["value"]: p for p in manifest["weights"]["placement"]}
    out: dict[str, Any] = {}
    for text in texts:
        for name, dt, dims, packed in _WEIGHT_LINE.findall(text):
            if name in out:
                continue
            pl = place.get(name)
            if pl is None:
                raise ZlcError(f"bundle {bundle}: constant '%{name}' of its IR has no entry in "
                               "manifest weights.placement, so its data is not in the weight arenas "
                               "(a bundle from an older zlc or a tampered manifest: recompile it)")
            shape = [int(d) for d in dims.split(",") if d.strip()]
            if list(pl["shape"]) != shape:
                raise ZlcError(f"bundle {bundle}: constant '%{name}' is {dt}{shape} in the IR but "
                               f"{pl['shape']} in weights.placement")
            if packed:
                out[name] = _packed(bundle, arenas, pl, name, packed, shape)
                continue
            n = int(np.prod(shape, dtype=np.int64))
            arena = arenas[pl["arena"]]
            off = int(pl["offset"])
            if off < 0 or off + n > arena.numel():
                raise ZlcError(f"bundle {bundle}: constant '%{name}' ({n} elements at {off}) lies outside "
                               f"arena {pl['arena']} ({arena.numel()} elements)")
            out[name] = arena[off:off + n].to(DType(dt).torch).reshape(shape)
    return out


def _packed(bundle: Path, arenas: dict[str, torch.Tensor], pl: dict[str, Any], name: str, fmt: str,
            shape: list[int]) -> QuantizedWeight:
    """The blocks of a packed constant, as the bundle stores them in Q (the parser dequantizes
    them with QuantizedWeight.dequantize, gguf's dequantizer or nbits4's (q - z) * s: the
    reference computes on exactly the kernel's weights)."""
    f = get_format(fmt)
    n, k = shape
    nbytes = n * (k // f.block_k) * f.block_bytes
    q = arenas.get("Q")
    off = int(pl["offset"])
    if pl["arena"] != "Q" or pl.get("format") != fmt or q is None or off < 0 or off + nbytes > q.numel():
        raise ZlcError(f"bundle {bundle}: constant '%{name}' is {fmt} in the IR but its placement "
                       f"{pl['arena']}@{off} ({pl.get('format', 'dense')}) is not {nbytes} bytes of {fmt} in Q")
    blocks = q[off:off + nbytes].numpy().reshape(n, -1)
    w = QuantizedWeight(f, blocks, n, k)
    w.check(f"bundle {bundle}: '%{name}'")
    return w


class ReferenceBackend:
    """`Backend` over a bundle's IR: mode 0 runs the prefill graph, mode 1 the decode graph."""

    def __init__(self, bundle: str | Path, manifest: dict[str, Any], *, f64: bool = False):
        """`f64`: the bundle's IR on its weights computed in f64 (executor.in_f64: the oracle of
        how far any f32 computation of the bundle must land from exact arithmetic); logits f64."""
        path = Path(bundle)
        texts = [(path / "ir" / f"{m}.zir").read_text() for m in ("prefill", "decode")]
        weights = arena_weights(path, manifest, texts)
        prefill, decode = (in_f64(g) if f64 else g for g in (parse_graph(t, weights) for t in texts))
        # a fast bundle's oracle computes its roundings (the manifest says which numerics)
        num = str(manifest.get("numerics", "exact"))
        self._prefill = ReferenceExecutor(prefill, numerics=num)
        self._decode = ReferenceExecutor(decode, state=self._prefill.state, numerics=num)  # one KV cache
        self._ids = prefill.inputs[0].name
        self._logits = prefill.outputs[0].name
        # No fixed activation buffers: a prefill of up to max_seq tokens is one graph run.
        self.chunk = int(manifest["model"]["max_seq"])

    def launch(self, mode: int, ids: list[int], past: int, all_logits: bool,
               want_logits: bool) -> tuple[int, np.ndarray | None]:
        ex = self._prefill if mode == 0 else self._decode
        if mode == 1 and len(ids) != 1:
            raise ZlcError(f"a decode launch takes one token, got {len(ids)}")
        with torch.no_grad():
            out = ex.run({self._ids: torch.tensor([ids], dtype=torch.int64),
                          "past_len": torch.tensor(past, dtype=torch.int64)})
        rows = out[self._logits][0]  # [T, vocab]
        rows = rows if rows.dtype == torch.float64 else rows.float()
        tok = int(torch.argmax(rows[-1]))  # ties: the lowest id, as the kernel's OUT_TOKEN
        if not want_logits:
            return tok, None
        return tok, (rows if all_logits else rows[-1:]).numpy().copy()

    def close(self) -> None:
        self._prefill.state.clear()
