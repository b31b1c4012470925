"""The ONNX loader under hostile input: whatever the bytes or attributes, `import_onnx` (and running
what it imports with the reference executor) raises nothing but `zlc.errors.ZlcError` subclasses,
and problems inside a node are reported with the node's name. Plus explicit cases for the
failures users actually meet: truncated or foreign files, cycles, undefined values, unsupported
ops, missing external weights."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from zlc.errors import ModelFormatError, UnsupportedOpError, ZlcError
from zlc.frontend.onnx import import_onnx
from zlc.ir import DType, Graph
from zlc.reference.executor import ReferenceExecutor

FUZZ = settings(max_examples=int(os.environ.get("ZLC_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
GENERIC = "malformed ONNX model"  # the loader's catch-all message: no node could be blamed


# ---- a small valid model that exercises many converters --------------------------------------------

def base_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = {
        "w": rng.standard_normal((4, 6)).astype(np.float32),
        "ln_w": np.ones(6, np.float32), "ln_b": np.zeros(6, np.float32),
        "shape": np.array([0, 0, 2, 3], np.int64), "axes": np.array([-1], np.int64),
        "starts": np.array([0], np.int64), "ends": np.array([2], np.int64), "two": np.array(2.0, np.float32),
        "emb": rng.standard_normal((10, 4)).astype(np.float32),
    }
    nodes = [
        helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed", axis=0),
        helper.make_node("Add", ["x", "e"], ["h"], name="add"),
        helper.make_node("MatMul", ["h", "w"], ["m"], name="proj"),
        helper.make_node("LayerNormalization", ["m", "ln_w", "ln_b"], ["n"], name="norm", axis=-1, epsilon=1e-5),
        helper.make_node("Reshape", ["n", "shape"], ["r"], name="split_heads"),
        helper.make_node("Transpose", ["r"], ["t"], name="transpose", perm=[0, 2, 1, 3]),
        helper.make_node("Softmax", ["t"], ["s"], name="softmax", axis=-1),
        helper.make_node("ReduceMean", ["s", "axes"], ["rm"], name="reduce", keepdims=1),
        helper.make_node("Slice", ["t", "starts", "ends", "axes"], ["sl"], name="slice"),
        helper.make_node("Concat", ["sl", "rm"], ["c"], name="concat", axis=-1),
        helper.make_node("Mul", ["c", "two"], ["y"], name="scale"),
        helper.make_node("Cast", ["ids"], ["idf"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["idf", "axes"], ["u"], name="unsqueeze"),
        helper.make_node("Where", ["cond", "u", "two"], ["z"], name="where"),
    ]
    graph = helper.make_graph(
        nodes, "fuzz",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [2, 3, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def attention_model() -> onnx.ModelProto:
    """The transformer-level converters: opset-23 Attention/RotaryEmbedding/RMSNormalization and
    com.microsoft GroupQueryAttention/SkipSimplifiedLayerNormalization."""
    rng = np.random.default_rng(1)
    half = 4
    ang = np.arange(16)[:, None] / (10000 ** (np.arange(half) / half))[None]
    inits = {
        "cos": np.cos(ang).astype(np.float32), "sin": np.sin(ang).astype(np.float32),
        "w": np.ones(16, np.float32), "pos": np.arange(3, dtype=np.int64)[None],
        "total": np.array(3, np.int32), "seqlens": np.array([2], np.int32),
        "wq": rng.standard_normal((16, 16)).astype(np.float32),
    }
    nodes = [
        helper.make_node("RMSNormalization", ["x", "w"], ["n"], name="rms", epsilon=1e-5),
        helper.make_node("MatMul", ["n", "wq"], ["q"], name="q_proj"),
        helper.make_node("RotaryEmbedding", ["q", "cos", "sin", "pos"], ["qr"], name="rope", num_heads=2),
        helper.make_node("Attention", ["qr", "n", "n"], ["a"], name="attn", q_num_heads=2, kv_num_heads=2,
                         is_causal=1),
        helper.make_node("GroupQueryAttention", ["a", "n", "n", "", "", "seqlens", "total"], ["g"], name="gqa",
                         domain="com.microsoft", num_heads=2, kv_num_heads=2),
        helper.make_node("SkipSimplifiedLayerNormalization", ["g", "x", "w"], ["y"], name="skip_rms",
                         domain="com.microsoft", epsilon=1e-6),
    ]
    graph = helper.make_graph(
        nodes, "fuzz_attn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)],
                             ir_version=10)


BASE = base_model()
BASE_BYTES = BASE.SerializeToString()
BASES = [BASE, attention_model()]


@pytest.mark.parametrize("index", range(len(BASES)))
def test_base_models_import_and_run(index: int) -> None:
    g = import_onnx(BASES[index])
    out = _run(g)
    assert out is not None and set(out) == {o.name for o in BASES[index].graph.output}


# ---- running what imported -----------------------------------------------------------------------

_MAX_ELEMS = 1 << 16


def _feeds(g: Graph) -> dict[str, torch.Tensor] | None:
    """Random inputs for static, small graph inputs; None when the graph cannot be fed safely."""
    rng = np.random.default_rng(1)
    feeds = {}
    for v in g.inputs:
        n = v.type.numel()
        if n is None or n > _MAX_ELEMS:
            return None
        shape = tuple(int(d) for d in v.shape or ())
        arr: np.ndarray
        if v.dtype == DType.bool:
            arr = rng.random(shape) > 0.5
        elif v.dtype.is_float:
            arr = rng.standard_normal(shape)
        else:
            arr = rng.integers(0, 3, shape)
        feeds[v.name] = torch.from_numpy(np.asarray(arr)).to(v.dtype.torch)
    return feeds


def _bounded(g: Graph) -> bool:
    """No value whose size is unknown or large: a mutated shape must not exhaust the machine."""
    for n in g.nodes:
        for o in n.outputs:
            k = o.type.numel()
            if k is None or k > _MAX_ELEMS:
                return False
    return True


def _run(g: Graph) -> dict[str, torch.Tensor] | None:
    feeds = _feeds(g)
    if feeds is None or not _bounded(g):
        return None
    return ReferenceExecutor(g).run(feeds)


def import_and_run(model: onnx.ModelProto | str | Path) -> ZlcError | None:
    """Imports and (if that worked) runs; returns the ZlcError raised, lets anything else escape."""
    try:
        g = import_onnx(model)
        _run(g)
    except ZlcError as e:
        return e
    return None


# ---- byte-level mutations ------------------------------------------------------------------------

@st.composite
def mutated_bytes(draw: st.DrawFn) -> bytes:
    data = bytearray(BASE_BYTES)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "overwrite"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[pos:pos + draw(st.integers(1, 8))]
        else:
            chunk = draw(st.binary(min_size=1, max_size=4))
            data[pos:pos + len(chunk)] = chunk
    return bytes(data)


@FUZZ
@given(data=mutated_bytes())
def test_fuzz_bytes(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    import_and_run(path)


# ---- structural mutations of the model proto ------------------------------------------------------

_ATTR_NAMES = ["axis", "axes", "perm", "keepdims", "epsilon", "to", "allowzero", "num_outputs", "split",
               "upper", "alpha", "value", "noop_with_empty_axes", "stash_type", "starts", "ends",
               "detect_negative", "fmod", "batch_dims", "exclusive", "num_heads", "kv_num_heads", "q_num_heads",
               "is_causal", "interleaved", "rotary_embedding_dim", "do_rotary", "softcap", "scale",
               "qk_matmul_output_mode", "local_window_size", "bits", "block_size", "K", "N"]
_OPS = ["Add", "Relu", "GroupQueryAttention", "MultiHeadAttention", "MatMulNBits", "SkipLayerNormalization", "Softmax", "Transpose", "Reshape", "Gather", "Split", "Squeeze", "Unsqueeze",
        "Concat", "ReduceSum", "ReduceMax", "Slice", "Cast", "Flatten", "Gemm", "LayerNormalization",
        "RMSNormalization", "Attention", "RotaryEmbedding", "ArgMax", "CumSum", "Trilu", "Where",
        "GatherElements", "ScatterND", "Pow", "Mod", "Clip", "Dropout", "Shape", "Identity", "NoSuchOp"]

_attr_value = st.one_of(
    st.integers(-(2**40), 2**40), st.integers(-6, 6), st.floats(allow_nan=True, allow_infinity=True),
    st.lists(st.integers(-6, 6), min_size=1, max_size=5), st.lists(st.floats(-3, 3), min_size=1, max_size=3),
    st.text(max_size=5), st.binary(max_size=4),
    st.builds(lambda v: numpy_helper.from_array(np.array(v, np.float32)), st.floats(-2, 2)),
    st.builds(lambda v: numpy_helper.from_array(np.array(v, np.int64)), st.lists(st.integers(-3, 3), max_size=3)),
)


def _set_attr(node: onnx.NodeProto, name: str, value: object) -> None:
    for i, a in enumerate(node.attribute):
        if a.name == name:
            del node.attribute[i]
            break
    node.attribute.append(helper.make_attribute(name, value))


_MUTATIONS = ["set_attr", "del_attr", "drop_input", "undefined_input", "empty_input", "op_type",
              "domain", "opset", "elem_type", "dim", "init_dtype", "init_dims", "dup_output", "extra_output"]


@st.composite
def mutated_models(draw: st.DrawFn) -> onnx.ModelProto:
    m = copy.deepcopy(draw(st.sampled_from(BASES)))
    g = m.graph
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(_MUTATIONS))
        node = g.node[draw(st.integers(0, len(g.node) - 1))]
        if kind == "set_attr":
            _set_attr(node, draw(st.sampled_from(_ATTR_NAMES)), draw(_attr_value))
        elif kind == "del_attr" and node.attribute:
            del node.attribute[draw(st.integers(0, len(node.attribute) - 1))]
        elif kind == "drop_input" and node.input:
            del node.input[draw(st.integers(0, len(node.input) - 1))]
        elif kind == "undefined_input" and node.input:
            node.input[draw(st.integers(0, len(node.input) - 1))] = "nowhere"
        elif kind == "empty_input" and node.input:
            node.input[draw(st.integers(0, len(node.input) - 1))] = ""
        elif kind == "op_type":
            node.op_type = draw(st.sampled_from(_OPS))
        elif kind == "domain":
            node.domain = draw(st.sampled_from(["com.microsoft", "ai.onnx", "bogus", ""]))
        elif kind == "opset":
            m.opset_import[0].version = draw(st.sampled_from([-1, 0, 1, 7, 11, 13, 17, 23, 24, 99, 2**31]))
        elif kind == "elem_type":
            v = g.input[draw(st.integers(0, len(g.input) - 1))]
            v.type.tensor_type.elem_type = draw(st.integers(0, 30))
        elif kind == "dim":
            v = g.input[draw(st.integers(0, len(g.input) - 1))]
            dims = v.type.tensor_type.shape.dim
            if dims:
                d = dims[draw(st.integers(0, len(dims) - 1))]
                choice = draw(st.sampled_from(["value", "param", "clear"]))
                if choice == "value":
                    d.dim_value = draw(st.integers(-3, 7))
                elif choice == "param":
                    d.dim_param = draw(st.sampled_from(["batch", "seq", "", "a b"]))
                else:
                    d.Clear()
        elif kind == "init_dtype":
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            t.data_type = draw(st.integers(0, 30))
        elif kind == "init_dims":
            t = g.initializer[draw(st.integers(0, len(g.initializer) - 1))]
            t.dims[:] = draw(st.lists(st.integers(-2, 6), max_size=4))
        elif kind == "dup_output" and node.output:
            node.output[0] = g.node[0].output[0]  # two producers of one name
        elif kind == "extra_output":
            node.output.append(draw(st.sampled_from(["extra", "y", ""])))
    return m


@FUZZ
@given(model=mutated_models())
def test_fuzz_structure(model: onnx.ModelProto) -> None:
    err = import_and_run(model)
    if err is not None:
        # A broken node must be reported at the node, not only by the loader-wide catch-all.
        assert not str(err).startswith(GENERIC), f"unattributed error: {err!r} <- {err.__cause__!r}"


# ---- the failures users meet ---------------------------------------------------------------------

def test_truncated_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.onnx"
    path.write_bytes(BASE_BYTES[: len(BASE_BYTES) // 2])
    with pytest.raises(ModelFormatError, match="cut.onnx"):
        import_onnx(path)


def test_not_an_onnx_file(tmp_path: Path) -> None:
    path = tmp_path / "notes.onnx"
    path.write_text("this is a text file, not a protobuf\n" * 10)
    with pytest.raises(ModelFormatError, match="notes.onnx"):
        import_onnx(path)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="not found"):
        import_onnx(tmp_path / "absent.onnx")
    with pytest.raises(ModelFormatError, match="directory"):
        import_onnx(tmp_path)


def _model(nodes: list[onnx.NodeProto], opset: int = 18, ms: bool = False) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)] if ms else [])
    return helper.make_model(graph, opset_imports=opsets)


def test_cycle_names_a_node() -> None:
    m = _model([helper.make_node("Add", ["x", "b"], ["a"], name="first"),
                helper.make_node("Relu", ["a"], ["b"], name="second"),
                helper.make_node("Identity", ["a"], ["y"], name="out")])
    with pytest.raises(ModelFormatError, match=r"cycle through node '(first|second)'"):
        import_onnx(m)


def test_undefined_input_names_node_and_value() -> None:
    m = _model([helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")])
    with pytest.raises(ModelFormatError, match=r"node 'adder' \(Add\) uses undefined value\(s\) \['ghost'\]"):
        import_onnx(m)


def test_unsupported_op_message() -> None:
    m = _model([helper.make_node("Hardmax", ["x"], ["y"], name="hm")], opset=13)
    with pytest.raises(UnsupportedOpError) as info:
        import_onnx(m)
    msg = str(info.value)
    assert "ai.onnx::Hardmax" in msg and "opset 13" in msg and "node 'hm'" in msg
    assert "supported in ai.onnx:" in msg and "MatMul" in msg and "Softmax" in msg
    assert (info.value.op, info.value.domain, info.value.opset, info.value.node) == ("Hardmax", "", 13, "hm")


def test_unsupported_contrib_op_lists_contrib_ops() -> None:
    m = _model([helper.make_node("Attention", ["x"], ["y"], domain="com.microsoft")], ms=True)
    with pytest.raises(UnsupportedOpError, match=r"com.microsoft::Attention \(opset 1\) at node 'Attention_0'.*"
                                                 r"GroupQueryAttention"):
        import_onnx(m)


def test_op_newer_than_the_model_opset() -> None:
    """RMSNormalization exists from opset 23: at opset 20 it is unsupported, not misread."""
    m = _model([helper.make_node("RMSNormalization", ["x", "x"], ["y"])], opset=20)
    with pytest.raises(UnsupportedOpError, match="opset 20"):
        import_onnx(m)


def test_missing_external_data_file(tmp_path: Path) -> None:
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], initializer=[w])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    path = tmp_path / "ext.onnx"
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.onnx.data", size_threshold=0)
    assert import_onnx(path).consts["w"].const_array().shape == (64, 64)  # intact: it loads
    (tmp_path / "ext.onnx.data").unlink()
    with pytest.raises(ModelFormatError, match=r"weight 'w'.*external data"):
        import_onnx(path)


def test_truncated_external_data_file(tmp_path: Path) -> None:
    w = numpy_helper.from_array(np.ones((64, 64), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 64])], initializer=[w])
    path = tmp_path / "ext.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), str(path),
                    save_as_external_data=True, location="w.bin", size_threshold=0)
    data = tmp_path / "w.bin"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(ModelFormatError, match="weight 'w'"):
        import_onnx(path)


def test_converter_error_names_the_node() -> None:
    m = _model([helper.make_node("Transpose", ["x"], ["y"], name="tr", perm=[3, 1])])
    with pytest.raises(ZlcError, match="node 'tr'"):
        import_onnx(m)


def test_dynamic_axes_input_is_rejected_clearly() -> None:
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["x", "axes"], ["y"], name="rs")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(ModelFormatError, match=r"ReduceSum .*node 'rs'.*axes \(input 1\) must be a constant"):
        import_onnx(m)
