"""An `onnx.backend.base.Backend` over zlc: `prepare` imports the model with `import_onnx` and
`run` executes the IR with the reference executor. It lets ONNX's own node tests
(`onnx.backend.test`) check the frontend's converters together with the reference kernels.

zlc compiles static graphs: the inputs that decide shapes (reduce axes, Split sizes, Squeeze
axes, Dropout's training flag) must be constants, and the frontend rejects them as runtime
inputs with a clear error. ONNX's node tests often feed such values as graph inputs, so this
backend *specializes* the model on them, as a user would for deployment: graph inputs that feed
one of `STATIC_INPUTS` become initializers holding the values of the run, and the model is
imported on the first `run` (and again if those values change).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep

from zlc.frontend.onnx import import_onnx, sanitize
from zlc.ir import Graph
from zlc.reference.executor import ReferenceExecutor

_REDUCE = ("ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
           "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp")
# op -> positions of inputs zlc requires to be constants
STATIC_INPUTS: dict[str, tuple[int, ...]] = {
    **{op: (1,) for op in _REDUCE},
    "Split": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "Dropout": (1, 2), "TopK": (1,),
}


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        import ml_dtypes  # onnx's own test data uses ml_dtypes for bfloat16

        return t.detach().contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.detach().contiguous().numpy()


def _to_torch(x: Any) -> torch.Tensor:
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(arr).copy())


def static_input_names(model: onnx.ModelProto) -> set[str]:
    """Graph inputs (not initializers) that feed an input zlc needs as a constant."""
    inits = {t.name for t in model.graph.initializer}
    graph_inputs = {v.name for v in model.graph.input} - inits
    names: set[str] = set()
    for node in model.graph.node:
        for i in STATIC_INPUTS.get(node.op_type, ()):
            if i < len(node.input) and node.input[i] in graph_inputs:
                names.add(node.input[i])
    return names


def specialize(model: onnx.ModelProto, values: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of `model` with the named graph inputs turned into initializers."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = [v for v in m.graph.input if v.name not in values]
    del m.graph.input[:]
    m.graph.input.extend(keep)
    for name, arr in values.items():
        m.graph.initializer.append(numpy_helper.from_array(np.asarray(arr), name))
    return m


class ZlcRep(BackendRep):
    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.input_names = [v.name for v in model.graph.input
                            if v.name not in {t.name for t in model.graph.initializer}]
        self.static = static_input_names(model)
        self._key: tuple[bytes, ...] | None = None
        self.graph: Graph | None = None
        self.executor: ReferenceExecutor | None = None
        if not self.static:  # import eagerly so import errors surface in prepare()
            self._import({})

    def _import(self, bound: dict[str, np.ndarray]) -> None:
        model = specialize(self.model, bound) if bound else self.model
        self.graph = import_onnx(model)
        self.executor = ReferenceExecutor(self.graph)

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        if isinstance(inputs, dict):
            given = dict(inputs)
        else:
            xs: Sequence[Any] = [inputs] if isinstance(inputs, np.ndarray) else list(inputs)
            given = dict(zip(self.input_names, xs, strict=False))  # trailing optional inputs
        bound = {k: np.asarray(v) for k, v in given.items() if k in self.static}
        key = tuple(bound[k].tobytes() + str(bound[k].shape).encode() for k in sorted(bound))
        if self.executor is None or key != self._key:
            self._import(bound)
            self._key = key
        assert self.graph is not None and self.executor is not None
        feeds = {sanitize(k): _to_torch(v) for k, v in given.items() if k not in self.static}
        out = self.executor.run(feeds)
        return tuple(_to_numpy(out[v.name]) for v in self.graph.outputs)


class ZlcBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> ZlcRep:
        return ZlcRep(model)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"


# ---- zlc vs ONNX Runtime, for hand-built graphs ---------------------------------------------------

def make_model(nodes: list[onnx.NodeProto], inputs: dict[str, np.ndarray], outputs: list[str], *,
               initializers: dict[str, np.ndarray] | None = None, opset: int = 23,
               ms_opset: int | None = 1) -> onnx.ModelProto:
    """A model over `nodes` whose graph inputs take the dtypes and shapes of `inputs`."""
    from onnx import helper

    ins = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
           for n, a in inputs.items()]
    outs = [helper.make_empty_tensor_value_info(n) for n in outputs]  # ORT infers the types
    inits = [numpy_helper.from_array(np.asarray(a), n) for n, a in (initializers or {}).items()]
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", ms_opset)] if ms_opset else [])
    graph = helper.make_graph(nodes, "g", ins, outs, initializer=inits)
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # run the ops as given
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return list(sess.run(None, feeds))


def run_zlc(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    graph = import_onnx(model)
    out = ReferenceExecutor(graph).run({sanitize(k): _to_torch(v) for k, v in feeds.items()})
    return [_to_numpy(out[v.name]) for v in graph.outputs]


def assert_matches_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], *, rtol: float = 1e-5,
                       atol: float = 1e-5) -> Graph:
    """Runs the model in ONNX Runtime and through zlc; every output must agree. Returns the IR."""
    want = run_ort(model, feeds)
    got = run_zlc(model, feeds)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape, f"output {i}: shape {g.shape} != ORT's {w.shape}"
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol,
                                   err_msg=f"output {i} ({model.graph.output[i].name})")
    return import_onnx(model)
