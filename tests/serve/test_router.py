"""`zlc serve --devices`, without processes: the SPEC parser (devices.py) and the routing rule
(router.py). Oracle for the router: the rule as docs/serving.md states it, checked by Hypothesis
over random loads and served histories."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zlc.errors import ZlcError
from zlc.runtime.serve.ingress.devices import Device, DeviceSpecError, parse_devices
from zlc.runtime.serve.ingress.router import MAX_SLACK, PAGES_PER_EXTRA_REQUEST, Load, PrefixRouter, page_keys

CORES = range(8)


def test_specs_name_engines_in_order() -> None:
    assert parse_devices("cpu:0-1,cpu:2-3", CORES) == [Device("cpu", frozenset({0, 1})), Device("cpu", frozenset({2, 3}))]
    # numbers without a kind continue the previous core list
    got = parse_devices("cpu:0,2,cpu:1,3-4", CORES)
    assert [d.label for d in got] == ["cpu:0,2", "cpu:1,3-4"]
    gpus = parse_devices("cuda:0, cuda:1", CORES)
    assert [d.label for d in gpus] == ["cuda:0", "cuda:1"] and gpus[1].env() == {"CUDA_VISIBLE_DEVICES": "1"}
    assert parse_devices("cpu", CORES) == [Device("cpu")]  # every core, as --device cpu
    assert [d.label for d in parse_devices("reference:5,cpu:6-7,cuda:0", CORES)] == ["reference:5", "cpu:6-7",
                                                                                         "cuda:0"]


def test_a_gpu_index_counts_the_visible_gpus() -> None:
    d = parse_devices("cuda:1", CORES)[0]
    assert d.env({}) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert d.env({"CUDA_VISIBLE_DEVICES": "4,6"}) == {"CUDA_VISIBLE_DEVICES": "6"}
    with pytest.raises(DeviceSpecError, match=r"'cuda:1': CUDA_VISIBLE_DEVICES=3 leaves 1 GPU\(s\) visible"):
        d.env({"CUDA_VISIBLE_DEVICES": "3"})


def test_threads_default_to_a_devices_cores() -> None:
    d = Device("cpu", frozenset({2, 3}))
    assert d.threads(None) == 2 and d.threads(1) == 1 and Device("cpu").threads(None) == 1
    with pytest.raises(DeviceSpecError, match=r"--threads 3 is more than the 2 core\(s\) of cpu:2-3"):
        d.threads(3)


@pytest.mark.parametrize("spec, message", [
    ("cpu:0,,cpu:1", "an empty part"),
    ("cpu:0,", "an empty part"),
    ("tpu:0", "bad --devices part 'tpu:0': unknown device 'tpu'"),
    ("cpu:", "bad --devices part 'cpu:': nothing after the colon"),
    ("cpu:a-b", "bad --devices part 'cpu:a-b': 'a-b' is not a core number"),
    ("cpu:3-1", "'3-1' is not a core number or range"),
    ("cpu:0-1,cpu:1-2", "core 1 is in both 'cpu:0-1' and 'cpu:1-2'"),
    ("cpu:0,cpu", "core 0 is in both 'cpu:0' and 'cpu'"),
    ("cpu:9", "bad --devices part 'cpu:9': core 9 is not one this process may run on (0-7)"),
    ("cuda:0,1", "bad --devices part 'cuda:0,1': one engine drives one GPU; write cuda:0,cuda:1"),
    ("cuda:0,cuda:0", "GPU 0 is named twice"),
    ("cuda", "bad --devices part 'cuda': name the GPU (cuda:0)"),
    ("1,cpu:0", "bad --devices part '1': a number needs a device kind before it"),
    ("cpu,2", "bad --devices part '2': a number needs a device kind"),
])
def test_bad_specs_are_one_line_naming_the_part(spec: str, message: str) -> None:
    with pytest.raises(ZlcError) as e:
        parse_devices(spec, CORES)
    assert message in str(e.value) and "\n" not in str(e.value)


# -- routing

def keys(*pages: int, size: int = 4) -> list[int]:
    """Page keys of a prompt made of the given page contents (each page: `size` copies of a token)."""
    return page_keys([t for p in pages for t in [p] * size], size)


def test_page_keys_chain_over_full_pages() -> None:
    assert len(page_keys(list(range(39)), 16)) == 2  # the partial third page has no key
    a, b = page_keys([1] * 16 + [2] * 16, 16), page_keys([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # page 2 is the same, what came before is not: another key
    assert page_keys(list(range(40)), 16)[:1] == page_keys(list(range(16)), 16)  # a prefix's keys are a prefix


def test_least_loaded_without_a_held_prefix() -> None:
    r = PrefixRouter(4)
    route = r.choose(keys(1, 2), [Load(3), Load(1), None, Load(1, queued_tokens=9)])
    assert (route.engine, route.how, route.pages) == (1, "least_loaded", 0)
    assert r.choose(keys(1), [Load(2, 50), Load(2, 10)]).engine == 1  # queued prompt tokens break ties


def test_affinity_holds_within_the_slack_and_rebalances_beyond() -> None:
    r = PrefixRouter(4)
    system = [7, 8, 9, 10, 11]  # 5 pages: slack 5 // 4 = 1
    r.served(keys(*system, 1), 0, 0)
    assert r.choose(keys(*system, 2), [Load(1), Load(0)]).how == "affinity"  # 1 more in flight: kept
    route = r.choose(keys(*system, 2), [Load(2), Load(0)])
    assert (route.engine, route.how, route.pages) == (1, "rebalanced", 5)
    # a 1-page match (a chat template's opening) only breaks ties
    r.served(keys(42), 1, 0)
    assert r.choose(keys(42, 3), [Load(0), Load(0)]).engine == 1
    assert r.choose(keys(42, 3), [Load(0), Load(1)]).how == "rebalanced"
    # an engine with a full batch and queue keeps nothing (it would refuse the request)
    assert r.choose(keys(*system, 2), [Load(1, full=True), Load(0)]).how == "rebalanced"
    # a restarted engine (epoch changed) holds nothing any more
    assert r.choose(keys(*system, 2), [Load(1, epoch=1), Load(0)]).how == "least_loaded"


def test_the_longest_held_run_wins() -> None:
    r = PrefixRouter(4)
    r.served(keys(1, 2, 3, 4, 5, 6), 1, 0)
    r.served(keys(1, 9), 0, 0)  # engine 0 served page 1 last, engine 1 holds pages 1-6
    route = r.choose(keys(1, 2, 3, 4, 5, 6, 7), [Load(0), Load(0)])
    assert (route.engine, route.pages) == (1, 6)


@settings(max_examples=300, deadline=None)
@given(history=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=0, max_size=12), st.integers(0, 2)),
                        max_size=20),
       prompt=st.lists(st.integers(0, 3), max_size=12),
       loads=st.lists(st.one_of(st.none(), st.builds(Load, st.integers(0, 20), st.integers(0, 100),
                                                      full=st.booleans())),
                      min_size=3, max_size=3).filter(lambda ls: any(ld is not None for ld in ls)))
def test_routes_follow_the_documented_rule(history: list[tuple[list[int], int]], prompt: list[int],
                                           loads: list[Load | None]) -> None:
    r = PrefixRouter(4)
    for pages, engine in history:
        r.served(keys(*pages), engine, 0)
    up = [i for i, ld in enumerate(loads) if ld is not None]
    least = min(up, key=lambda i: (loads[i].in_flight, loads[i].queued_tokens, i))  # type: ignore[union-attr]
    route = r.choose(keys(*prompt), loads)
    assert route.engine in up
    # the oracle: the longest prefix run whose last server is up
    held, run = None, 0
    for n in range(len(prompt), 0, -1):
        last = [e for pages, e in history if pages[:n] == prompt[:n] and len(pages) >= n]
        if last and loads[last[-1]] is not None:
            held, run = last[-1], n
            break
    if held is None:
        assert (route.engine, route.how) == (least, "least_loaded")
        return
    assert route.pages == run
    slack = min(run // PAGES_PER_EXTRA_REQUEST, MAX_SLACK)
    if not loads[held].full and loads[held].in_flight <= loads[least].in_flight + slack:  # type: ignore[union-attr]
        assert (route.engine, route.how) == (held, "affinity")
    else:
        assert (route.engine, route.how) == (least, "rebalanced")


def test_the_table_is_bounded() -> None:
    r = PrefixRouter(4, capacity=10)
    for i in range(30):
        r.served(keys(i, i + 1), i % 2, 0)
    assert len(r.last) == 10
