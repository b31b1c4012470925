"""The kernel compiles in only the optional code paths its model uses (emit.Features): which features
the descriptors of a program set, and that the rendered source sets each feature's constexpr flag
(HAS_<FEATURE>, which Triton folds) exactly when it is set and, read as Triton compiles it (the
flags' branches folded), holds each feature's code exactly when it is set. That the kernels WITH the features still compute the
reference's numbers is the family tests' (tests/test_family_windows.py, test_family_norms.py,
test_family_alibi_falcon.py, test_family_moe.py, tests/codegen/test_megakernel_windows.py,
test_megakernel_norms.py) and a plain model's tests/codegen/test_megakernel.py: they run these same
rendered kernels in the interpreter."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

import pytest
from synthetic_programs import ONE, PLAIN, every_feature_packed
from synthetic_programs import program as _program

from zlc.abi import LinearDesc
from zlc.codegen import program as pg
from zlc.codegen.emit import Features, render

# Code that exists only for one feature: a model without it must compile none of it.
MARKERS: dict[str, list[str]] = {
    "window": ["window = tl.load(di + DI_ATTENTION_WINDOW)", "if window > 0"],
    "attn_softcap": ["softcap = tl.load(DF + d * DESC_FLOATS + DF_ATTENTION_SOFTCAP)", "tl.sigmoid(2.0 * s / softcap)"],
    "alibi": ["alibi = tl.load(DF + d * DESC_FLOATS + DF_ATTENTION_ALIBI)", "alibi * js", "alibi * past"],
    "qk_norm": ["_qk_rstd(A, ", "tl.load(DI + d * DESC_WORDS + DI_ATTENTION_Q_NORM_W + which)",
                "rstd[:, None] * tl.load(P + nw + gofs"],
    "qk_norm_whole": ["tl.load(DI + d * DESC_WORDS + DI_ATTENTION_QK_NORM_WHOLE)", "if whole != 0"],
    "moe_route": ["route = tl.load(di + DI_LINEAR_ROUTE)", "_route_weight(A, di"],
    "lm_softcap": [" cap = tl.load(DF + d * DESC_FLOATS + DF_LINEAR_SOFTCAP)", "tl.sigmoid(2.0 * y / cap)"],
    "bias": ["tl.load(P + b_off + cols"],
    "embed_norm": ["norm = tl.load(di + DI_EMBED_NORM)", "if norm != 0"],
    "embed_pos": ["pos_tab = tl.load(di + DI_EMBED_POS_TABLE)", "if pos_tab >= 0"],
    "mlp_split_k": ["_down_add(W, P, A", "if copy != 0", "down = tl.load(di + DI_LINEAR_DOWN_ROWS)"],
}
ACT_MARKERS = {1: "x * tl.sigmoid(x)", 2: "tl.math.erf(", 3: "0.044715", 4: "tl.maximum(x, 0.0)"}
# Packed weights (HAS_PACKED): the prefill tile's dequantization and its scale planes' offset. Without
# them `wf` is the constexpr 0, so the dispatch's `if wf != 0:` (_linear_q, _gemv_q) folds away too.
PACKED_MARKERS = ["n_all = tl.load(di + DI_LINEAR_N)", "w = _w_tile_q(Q, wf, w_off", "w2 = _w_tile_q(Q, wf, w2_off"]
DENSE_ONLY = ["wf: tl.constexpr = 0"]
NAMES = {code: name for name, code in pg.ACTIVATIONS.items()}
FLAGS = [f.name for f in fields(Features) if f.name not in ("activations", "packed")]  # the bool features


IMPLIES = {"qk_norm_whole": {"qk_norm"}}  # a whole-row q/k norm is a q/k norm


def _source(p: Any) -> str:
    return render([p], weight_dtype="fp32", version="test", gemv_block_n=16)


def _compiled(src: str) -> str:
    """`src` as Triton compiles it: each `if HAS_X:` on a constexpr flag (defined at the top of the
    source) replaced by the branch the flag takes; code behind a False flag is not there."""
    flags = dict(re.findall(r"^(HAS_\w+) = tl\.constexpr\((True|False)\)$", src, re.M))
    out: list[str] = []
    open_ifs: list[list[Any]] = []  # per enclosing `if HAS_X:`: [its indent, whether this branch is kept]
    for line in src.splitlines():
        indent = len(line) - len(line.lstrip())
        if not line.strip():
            continue
        while open_ifs and (indent < open_ifs[-1][0] or indent == open_ifs[-1][0] and line.strip() != "else:"):
            open_ifs.pop()  # its block ended
        if open_ifs and indent == open_ifs[-1][0]:  # its else: the other branch
            open_ifs[-1][1] = not open_ifs[-1][1]
        elif m := re.fullmatch(r" *if (HAS_\w+):", line):
            open_ifs.append([indent, flags[m[1]] == "True"])
        elif all(kept for _, kept in open_ifs):
            out.append(line[4 * len(open_ifs):])
    return "\n".join(out)


def _check_source(src: str, f: Features) -> None:
    compile(src, "kernel.py", "exec")  # valid Python whatever the combination
    for flag, on in f.flags().items():
        assert f"{flag} = tl.constexpr({on})" in src.splitlines(), (flag, on)
    # what Triton compiles: the flags' branches folded; helper functions are defined either way, and
    # only their uses count
    lines = [line for line in _compiled(src).splitlines() if not line.startswith("def ")]
    for name, marks in MARKERS.items():
        _check_marks(lines, getattr(f, name), marks, name)
    for code, m in ACT_MARKERS.items():
        _check_marks(lines, code in f.activations, [m], NAMES[code])
    _check_marks(lines, bool(f.packed), PACKED_MARKERS, "packed")
    _check_marks(lines, not f.packed, DENSE_ONLY, "dense weights only")


def _check_marks(lines: list[str], on: bool, marks: list[str], what: str) -> None:
    for m in marks:
        assert any(m in line for line in lines) == on, f"{what} {'on' if on else 'off'}: {m!r} " \
            f"{'missing' if on else 'compiled in'}"


def test_a_plain_model_compiles_none_of_the_features() -> None:
    f = Features.of([_program(*PLAIN)])
    assert f == Features(activations=(1,)) and f.used() == ["silu"]
    _check_source(_source(_program(*PLAIN)), f)


@pytest.mark.parametrize("feature", sorted(ONE))
def test_each_feature_is_compiled_in_where_a_task_uses_it(feature: str) -> None:
    p = _program(*PLAIN, ONE[feature])
    f = Features.of([p])
    assert {n for n in FLAGS if getattr(f, n)} == {feature} | IMPLIES.get(feature, set())
    _check_source(_source(p), f)


def test_features_are_the_union_over_programs_modes_and_activations() -> None:
    a = _program(*PLAIN, ONE["window"])
    b = _program(*PLAIN, (LinearDesc, dict(k=64, act=3)), (LinearDesc, dict(k=64, act=4)))
    b.tables = {"prefill": b.tables["decode"], "decode": []}  # a feature only prefill uses counts too
    f = Features.of([a, b])
    assert f.window and f.activations == (1, 3, 4) and f.used() == ["window", "silu", "gelu_tanh", "relu"]
    _check_source(render([a, b], weight_dtype="fp32", version="test", gemv_block_n=16), f)


def test_every_combination_renders_valid_python() -> None:
    packed = every_feature_packed()
    every = _program(*PLAIN, *ONE.values(), (LinearDesc, dict(k=64, act=2)), *packed)
    f = Features.of([every])
    assert all(getattr(f, n) for n in FLAGS) and f.activations == (1, 2)
    assert f.packed == tuple(sorted(d["w_format"] for _, d in packed)) and f.flags()["HAS_PACKED"]
    _check_source(_source(every), f)


# Real models: the features their scheduled programs (cpu and h200 tilings, as a build renders
# them) set, read off the descriptors -- never off the model's name.
# (mlp_split_k: the h200 tiling fuses the MLP down, except behind a post-norm -- gemma2, olmo2 --
# and for MoE experts -- mixtral)
FAMILY_FEATURES = {
    "llama": {"silu", "mlp_split_k"},
    "mistral_win": {"window", "silu", "mlp_split_k"},
    "gemma2": {"window", "attn_softcap", "lm_softcap", "gelu_tanh"},
    "bloom": {"alibi", "embed_norm", "bias", "gelu_tanh", "mlp_split_k"},
    "qwen3": {"qk_norm", "silu", "mlp_split_k"},
    "olmo2": {"qk_norm", "qk_norm_whole", "silu"},
    "mixtral": {"moe_route", "silu"},
    "gpt2": {"embed_pos", "bias", "gelu_tanh", "mlp_split_k"},
    "mpt": {"alibi", "gelu", "mlp_split_k"},
    "qwen2": {"bias", "silu", "mlp_split_k"},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILY_FEATURES))
def test_family_features_and_source(family: str) -> None:
    pytest.importorskip("transformers", reason="the model zoo needs the 'hf' extra")
    import zlc
    from zlc.codegen.schedule import schedule, tiling_for
    from zlc.targets import get_target
    from zlc.testing import zoo

    low = zlc.lower(zoo.cached("stateless", family, 20), options=zlc.CompileOptions(max_seq=64))
    progs = [schedule(low.decode, tiling_for(get_target(t), 64), 64) for t in ("cpu", "h200")]
    f = Features.of(progs)
    assert set(f.used()) == FAMILY_FEATURES[family]
    _check_source(render(progs, weight_dtype="fp32", version="test"), f)


@pytest.mark.slow
def test_a_plain_bundle_records_its_features_and_has_none_of_their_code(chat_bundle: Any) -> None:
    """A compiled plain Llama (the shared tiny chat bundle): the manifest's `kernel.features` is
    what the kernel.py it ships was rendered with, and that source holds no feature's code."""
    import json

    man = json.loads((chat_bundle / "manifest.json").read_text())
    assert man["kernel"]["features"] == ["silu"]
    _check_source((chat_bundle / man["kernel"]["source"]).read_text(), Features(activations=(1,)))
