"""ONNX Runtime and ONNX-file helpers the zoo's tests and examples share: an op histogram, a CPU
session, and an fp32 reference for ``com.microsoft.MatMulNBits`` (the genai_int4 graphs)."""

from __future__ import annotations

import os
from typing import Any


def op_histogram(path: str | os.PathLike[str]) -> dict[str, int]:
    """``{"domain::op" or "op": count}`` over the main graph of an ONNX file (weights not loaded)."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    hist: dict[str, int] = {}
    for n in m.graph.node:
        key = f"{n.domain}::{n.op_type}" if n.domain not in ("", "ai.onnx") else n.op_type
        hist[key] = hist.get(key, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0])))


def dequantize_matmul_nbits(model: Any) -> Any:
    """Copy of an ONNX model with every ``com.microsoft.MatMulNBits`` replaced by an fp32 ``MatMul``.

    The weight is dequantized exactly as the contrib op defines it: ``B`` is ``uint8 [N, n_blocks,
    block_size * bits / 8]`` with the low bits first, ``W[n, k] = (q[n, k] - zp[n, k // block]) *
    scale[n, k // block]`` (``zp`` defaults to ``2**(bits - 1)``; packed uint8 or float zero points),
    then ``Y = A @ W.T (+ bias)``. ``g_idx`` is not supported. A reference for what MatMulNBits
    computes (ONNX Runtime's CPU kernel with ``accuracy_level=4`` also quantizes activations to
    int8, so it is only approximately equal to this).
    """
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    inits = {t.name: t for t in m.graph.initializer}
    new_nodes = []
    used_q: set[str] = set()
    for node in m.graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            new_nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits, block = attrs["K"], attrs["N"], attrs.get("bits", 4), attrs["block_size"]
        ins = list(node.input) + [""] * (6 - len(node.input))
        if ins[4]:
            raise ValueError("dequantize_matmul_nbits: MatMulNBits with g_idx (act-order) is not handled")
        q = numpy_helper.to_array(inits[ins[1]]).astype(np.uint8)
        n_blocks = (k + block - 1) // block
        q = q.reshape(n, -1)
        per_byte = 8 // bits
        vals = np.stack([(q >> (bits * j)) & ((1 << bits) - 1) for j in range(per_byte)], axis=-1)
        vals = vals.reshape(n, -1)[:, : n_blocks * block].astype(np.float32)
        scales = numpy_helper.to_array(inits[ins[2]]).astype(np.float32).reshape(n, n_blocks)
        if ins[3]:
            zp_raw = numpy_helper.to_array(inits[ins[3]])
            if zp_raw.dtype == np.uint8:
                zp_raw = zp_raw.reshape(n, -1)
                zp = np.stack([(zp_raw >> (bits * j)) & ((1 << bits) - 1) for j in range(per_byte)], axis=-1)
                zp = zp.reshape(n, -1)[:, :n_blocks].astype(np.float32)
            else:
                zp = zp_raw.astype(np.float32).reshape(n, n_blocks)
        else:
            zp = np.full((n, n_blocks), float(1 << (bits - 1)), np.float32)
        w = (vals.reshape(n, n_blocks, block) - zp[..., None]) * scales[..., None]
        w_t = np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)  # [K, N]
        wname = f"{ins[1]}_dequantized"
        m.graph.initializer.append(numpy_helper.from_array(w_t, wname))
        used_q.update(i for i in ins[1:4] if i)
        if ins[5]:
            mm_out = f"{node.output[0]}_nobias"
            new_nodes.append(helper.make_node("MatMul", [ins[0], wname], [mm_out], name=f"{node.name}_dq"))
            new_nodes.append(
                helper.make_node("Add", [mm_out, ins[5]], [node.output[0]], name=f"{node.name}_bias")
            )
        else:
            new_nodes.append(
                helper.make_node("MatMul", [ins[0], wname], [node.output[0]], name=f"{node.name}_dq")
            )
    del m.graph.node[:]
    m.graph.node.extend(new_nodes)
    still_used = {i for nd in m.graph.node for i in nd.input}
    keep = [t for t in m.graph.initializer if t.name not in used_q or t.name in still_used]
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    return m


def ort_session(path: str | os.PathLike[str], threads: int = 1) -> Any:
    """A CPU ``onnxruntime.InferenceSession`` (few threads: tests run in parallel on small machines)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

