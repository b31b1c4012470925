"""The target table and the decode roofline, checked against counts derived independently from the
model's own parameters (the Hugging Face config of the zoo's tiny Llama)."""

from __future__ import annotations

import pytest

from zlc.errors import ZlcError
from zlc.ir import DType
from zlc.targets import TARGETS, decode_traffic, get_target


def test_every_design_target_is_known() -> None:
    assert set(TARGETS) == {"a10", "a100", "l4", "rtx3090", "rtx4090", "h100", "h200", "cpu"}
    assert get_target("H200").arch == "sm_90"
    assert get_target("cpu").is_gpu is False


def test_unknown_target_names_the_known_ones() -> None:
    with pytest.raises(ZlcError, match="unknown target 'v100'.*a10.*h200"):
        get_target("v100")


def test_decode_traffic_of_the_tiny_llama(tiny_lowered) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    from zlc.testing import zoo

    cfg = zoo.hf_config("llama")
    h, i, v, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kvh, hd = cfg.num_key_value_heads, h // cfg.num_attention_heads
    per_layer = h * h + 2 * h * kvh * hd + h * h + 3 * h * i + 2 * h  # q, k, v, o, mlp, 2 norms
    tied = getattr(cfg, "tie_word_embeddings", False)
    params = layers * per_layer + h + (0 if tied else v * h)  # final norm, untied head
    embedding_row = h
    rope_rows = 2 * (hd // 2)
    traffic = decode_traffic(tiny_lowered.decode, context=10, weight_dtype=DType.bf16)
    assert traffic.weight_bytes == 2 * (params + embedding_row + rope_rows + (v * h if tied else 0))
    assert traffic.kv_bytes_per_token == 2 * layers * 2 * kvh * hd
    h200 = get_target("h200")
    assert traffic.floor_us(h200) == pytest.approx(traffic.total_bytes / 4.8e12 * 1e6)  # 4.8 TB/s
    assert traffic.floor_us(get_target("cpu")) is None
