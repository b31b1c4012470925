"""The torch.export frontend against its oracle, PyTorch eager.

Each model is imported once (export + core-ATen decomposition is the slow part) and its IR run by
the reference executor at two sequence lengths other than the export's, which proves that the
sequence axis stayed symbolic. Tolerance: max abs 1e-4 in fp32.
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zlc.errors import ModelFormatError, UnsupportedOpError
from zlc.frontend.fx import (
    ATEN_OPS,
    aten_op,
    import_module,
    import_program,
    op_key,
    resolve_overload,
    supported_ops,
)
from zlc.ir import Graph, parse_graph, print_graph, verify_graph
from zlc.reference.executor import run_graph

TOL = 1e-4
EXPORT_T = 8
RUN_T = (5, 13)
pytestmark = pytest.mark.filterwarnings("ignore:.*LeafSpec:FutureWarning")  # torch.export internals

transformers = pytest.importorskip("transformers")

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _COMMON),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _COMMON),
    "mistral": ("MistralConfig", "MistralForCausalLM", _COMMON),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _COMMON),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(_COMMON, head_dim=16)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                                   n_positions=128, bos_token_id=1, eos_token_id=2)),
}


def _hf_model(family: str) -> nn.Module:
    cfg_name, model_name, kw = FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(**kw, attn_implementation="eager", use_cache=False)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(cfg).eval()


@pytest.fixture(scope="module", params=list(FAMILIES))
def hf(request: pytest.FixtureRequest) -> tuple[str, nn.Module, Graph]:
    model = _hf_model(request.param)
    ids = torch.randint(0, 256, (1, EXPORT_T), generator=torch.Generator().manual_seed(1))
    return request.param, model, import_module(model, (ids,))


def _max_err(model: nn.Module, g: Graph, ids: torch.Tensor) -> float:
    with torch.no_grad():
        ref = model(ids)
    ref = ref.logits if hasattr(ref, "logits") else ref
    out = run_graph(g, {g.inputs[0].name: ids})[g.outputs[0].name]
    assert out.shape == ref.shape
    return float((out - ref).abs().max())


# ---- Hugging Face families --------------------------------------------------------------------

def test_hf_logits_match_eager_at_two_lengths(hf: tuple[str, nn.Module, Graph]) -> None:
    family, model, g = hf
    for t in RUN_T:
        ids = torch.randint(0, 256, (1, t), generator=torch.Generator().manual_seed(t))
        err = _max_err(model, g, ids)
        assert err < TOL, f"{family} at seq {t}: max abs error {err}"


def test_hf_types_keep_seq_symbolic(hf: tuple[str, nn.Module, Graph]) -> None:
    _, _, g = hf
    assert [str(v.type) for v in g.inputs] == ["i64[1, seq]"]
    assert [v.name for v in g.outputs] == ["logits"] and str(g.outputs[0].type) == "f32[1, seq, 256]"
    unknown = [v for v in g.values() if v.shape is None or any(str(d).startswith("?") for d in v.shape)]
    assert not unknown, f"values with unknown dims: {unknown[:5]}"
    assert g.metadata["frontend"] == "fx" and g.metadata["seq_range"][0] == 2
    verify_graph(g)


def test_hf_only_op_level_ir(hf: tuple[str, nn.Module, Graph]) -> None:
    _, _, g = hf
    # LayerNorm is allowed: it is the 1:1 image of aten.native_layer_norm (as of ONNX LayerNormalization)
    raised = {"Embedding", "RMSNorm", "Linear", "LMHead", "RoPE", "Attention", "GatedMLP", "MLP"}
    assert not raised & set(g.op_histogram()), "the frontend must not raise (the passes do)"
    assert g.op_histogram().get("MatMul", 0) >= 2 * 4 + 1  # q, k, v, o (+ MLP) per layer, head


def test_hf_weights_are_constants_by_fqn_without_copy(hf: tuple[str, nn.Module, Graph]) -> None:
    family, model, g = hf
    params = dict(model.named_parameters(remove_duplicate=False))
    named = [k for k in g.consts if k in params]
    assert len(named) >= len(dict(model.named_parameters())) - 1  # tied weights appear once
    for k in named:
        assert g.consts[k].data.data_ptr() == params[k].data_ptr(), f"{k} was copied"
    if family == "llama":
        assert "model.layers.0.self_attn.q_proj.weight" in g.consts
        assert "model.rotary_emb.inv_freq" in g.consts  # buffers too


def test_hf_text_form_round_trips(hf: tuple[str, nn.Module, Graph]) -> None:
    _, _, g = hf
    weights = {k: v.data for k, v in g.consts.items()}
    g2 = parse_graph(print_graph(g), weights)
    ids = torch.randint(0, 256, (1, 9))
    assert torch.equal(run_graph(g2, {"input_ids": ids})["logits"], run_graph(g, {"input_ids": ids})["logits"])


# ---- random small modules (Hypothesis) ---------------------------------------------------------------

class RandomMLP(nn.Module):
    def __init__(self, dims: list[int], act: str, bias: bool, norm: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in itertools.pairwise(dims))
        self.norm = nn.LayerNorm(dims[0]) if norm else nn.Identity()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = {"relu": F.relu, "gelu": F.gelu, "tanh_gelu": lambda t: F.gelu(t, approximate="tanh"),
                     "silu": F.silu, "sigmoid": torch.sigmoid}[self.act](x)
        return x


class RandomAttentionLM(nn.Module):
    """Token ids -> logits with one pre-norm block; the attention is spelled several ways."""

    def __init__(self, vocab: int, heads: int, kv_heads: int, head_dim: int, style: str, gated: bool,
                 rms: bool):
        super().__init__()
        h = heads * head_dim
        self.heads, self.kv_heads, self.head_dim, self.style, self.gated = heads, kv_heads, head_dim, style, gated
        self.emb = nn.Embedding(vocab, h)
        self.pos = nn.Embedding(64, h)
        self.norm = nn.RMSNorm(h) if rms else nn.LayerNorm(h)
        self.q = nn.Linear(h, h)
        self.kv = nn.Linear(h, 2 * kv_heads * head_dim, bias=False)
        self.o = nn.Linear(h, h, bias=False)
        self.up = nn.Linear(h, 2 * h, bias=False)
        self.gate = nn.Linear(h, 2 * h, bias=False)
        self.down = nn.Linear(2 * h, h, bias=False)
        self.head = nn.Linear(h, vocab, bias=False)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        t = q.shape[2]
        rep = self.heads // self.kv_heads
        if self.style == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)
        if self.style == "masked_fill":
            s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        else:  # additive mask from arange comparisons
            i = torch.arange(t)
            s = s + torch.where(i[None, :] > i[:, None], torch.finfo(s.dtype).min, 0.0)
        return torch.softmax(s, dim=-1) @ v

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        x = self.emb(ids) + self.pos(torch.arange(t))
        y = self.norm(x)
        q = self.q(y).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(y).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        a = self._attend(q, k, v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(a)
        m = F.silu(self.gate(x)) * self.up(x) if self.gated else F.gelu(self.up(x))
        return self.head(x + self.down(m))


_SETTINGS = settings(max_examples=4, deadline=None, derandomize=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@_SETTINGS
@given(dims=st.lists(st.integers(1, 24), min_size=2, max_size=4), batch=st.integers(1, 3),
       act=st.sampled_from(["relu", "gelu", "tanh_gelu", "silu", "sigmoid"]), bias=st.booleans(),
       norm=st.booleans(), composite=st.booleans(), seed=st.integers(0, 2**16))
def test_random_mlp_matches_eager(dims: list[int], batch: int, act: str, bias: bool, norm: bool,
                                  composite: bool, seed: int) -> None:
    torch.manual_seed(seed)
    m = RandomMLP(dims, act, bias, norm and dims[0] > 1).eval()
    x = torch.randn(batch, dims[0])
    g = import_module(m, (x,), keep_composite=composite)
    assert str(g.inputs[0].type) == f"f32[{batch}, {dims[0]}]"  # float input: no dynamic axis
    with torch.no_grad():
        ref = m(x)
    assert float((run_graph(g, {"x": x})["logits"] - ref).abs().max()) < TOL


@_SETTINGS
@given(kv_heads=st.sampled_from([1, 2]), rep=st.sampled_from([1, 2]), head_dim=st.sampled_from([4, 8]),
       style=st.sampled_from(["sdpa", "masked_fill", "additive"]), gated=st.booleans(), rms=st.booleans(),
       lengths=st.tuples(st.integers(2, 12), st.integers(2, 12), st.integers(2, 12)),
       composite=st.booleans(), seed=st.integers(0, 2**16))
def test_random_attention_matches_eager_at_two_lengths(kv_heads: int, rep: int, head_dim: int, style: str,
                                                        gated: bool, rms: bool, lengths: tuple[int, int, int],
                                                        composite: bool, seed: int) -> None:
    """composite=False is pure core ATen: matmul as expand/view/bmm, linear as view/mm/addmm."""
    torch.manual_seed(seed)
    m = RandomAttentionLM(50, kv_heads * rep, kv_heads, head_dim, style, gated, rms).eval()
    g = import_module(m, (torch.randint(0, 50, (1, lengths[0])),), keep_composite=composite)
    assert str(g.inputs[0].type) == "i64[1, seq]"
    for t in lengths[1:]:
        ids = torch.randint(0, 50, (1, t))
        assert _max_err(m, g, ids) < TOL


class _SizeArith(nn.Module):
    """Shape arithmetic on the sequence length: //, -, *, %, symbolic views, fills and indices."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.emb(ids)
        half = x[:, : t // 2].sum(1)
        pos = torch.arange(t * 2).float().view(1, 2 * t, 1)[:, ::2].mean(1)
        fill = torch.full((1, t, 1), 2.0).sum(1) + torch.ones_like(x).cumsum(1)[:, -1]
        return half + x[:, t - 1] + pos + (x * (t % 3)).sum(1) + fill


def test_symbolic_size_arithmetic() -> None:
    m = _SizeArith().eval()
    g = import_module(m, (torch.randint(0, 16, (1, 7)),))
    assert any(str(v.type) == "f32[1, (seq//2), 4]" for v in g.values())
    g2 = parse_graph(print_graph(g), {k: v.data for k, v in g.consts.items()})
    for t in (2, 3, 8, 13):
        ids = torch.randint(0, 16, (1, t))
        with torch.no_grad():
            ref = m(ids)
        for graph in (g, g2):
            assert float((run_graph(graph, {"ids": ids})["logits"] - ref).abs().max()) < TOL


# ---- errors, registry, options ----------------------------------------------------------------------

class _Flip(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flip(-1) * 2


class _IntBits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids & 7)


def test_unsupported_op_names_aten_op_and_node() -> None:
    with pytest.raises(UnsupportedOpError) as e:
        import_module(_Flip(), (torch.randn(2, 3),))
    msg = str(e.value)
    assert "aten::flip.default" in msg and "FX node 'flip'" in msg
    assert "test_fx.py" in msg  # points at the user's code
    assert "supported: " in msg and "aten::mm.default" in msg
    assert e.value.op == "aten::flip.default" and e.value.domain == "aten"


def test_unsupported_use_of_a_supported_op_says_why() -> None:
    with pytest.raises(UnsupportedOpError, match=r"aten::bitwise_and\.Scalar.*bitwise ops on integers"):
        import_module(_IntBits(), (torch.randint(0, 16, (1, 4)),))


def test_short_example_input_is_a_clear_error() -> None:
    with pytest.raises(ModelFormatError, match="at least 2 positions"):
        import_module(_IntBits(), (torch.randint(0, 16, (1, 1)),))


def test_export_failure_is_a_model_format_error() -> None:
    class Bad(nn.Module):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return ids.view(1, 4, 2)  # specializes seq to 8

    with pytest.raises(ModelFormatError, match="torch.export failed"):
        import_module(Bad(), (torch.randint(0, 16, (1, 8)),))


def test_static_import_and_names() -> None:
    m = nn.Sequential(nn.Embedding(16, 4), nn.Dropout(0.5), nn.Linear(4, 3))
    m.train()
    ids = torch.randint(0, 16, (2, 5))
    g = import_module(m, (ids,), dynamic_seq=False, input_names=["tokens"])
    assert str(g.inputs[0].type) == "i64[2, 5]" and g.inputs[0].name == "tokens"
    assert m.training, "the caller's module mode is restored"
    with torch.no_grad():
        ref = m.eval()(ids)  # exported in eval mode: no dropout
    assert float((run_graph(g, {"tokens": ids})["logits"] - ref).abs().max()) < TOL


def test_import_program_of_a_user_export() -> None:
    m = RandomMLP([6, 5, 3], "silu", True, True).eval()
    ep = torch.export.export(m, (torch.randn(2, 6),)).run_decompositions()
    g = import_program(ep)
    assert "layers.0.weight" in g.consts
    x = torch.randn(2, 6)
    with torch.no_grad():
        ref = m(x)
    assert float((run_graph(g, {"x": x})["logits"] - ref).abs().max()) < TOL


def test_registry_keys_and_duplicates() -> None:
    assert op_key(torch.ops.aten.mm.default) == "aten::mm.default"
    assert op_key(torch.ops.aten.add.Tensor) == "aten::add.Tensor"
    assert op_key(operator.getitem) == "operator.getitem"
    assert supported_ops() == sorted(ATEN_OPS)
    typos = [k for k in ATEN_OPS if k.startswith("aten::") and resolve_overload(k) is None]
    assert not typos, f"registry keys that name no ATen overload: {typos}"
    assert op_key(resolve_overload("aten::native_layer_norm.default")) == "aten::native_layer_norm.default"
    with pytest.raises(ValueError, match="two lowerings"):
        aten_op("aten::mm.default")(lambda cx, a: None)
