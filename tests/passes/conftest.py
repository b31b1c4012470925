"""Shared fixtures for pass tests: golden before/expected IR comparisons (TVM style)."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from zlc.ir import Graph, graphs_equal, parse_graph, print_graph, verify_graph
from zlc.passes import PassResult

PassFn = Callable[[Graph], PassResult]
Golden = Callable[..., PassResult]


def run_golden(pass_fn: PassFn, before: str, expected: str, weights: Mapping[str, Any] | None = None,
               expected_weights: Mapping[str, Any] | None = None) -> PassResult:
    """Parses `before`, runs the pass, verifies, and compares with `expected` (parsed; its large
    constants come from `expected_weights`, by default `weights`)."""
    g = parse_graph(before, dict(weights or {}))
    verify_graph(g)
    result = pass_fn(g)
    verify_graph(g)
    want = parse_graph(expected, dict(expected_weights if expected_weights is not None else weights or {}))
    if not graphs_equal(g, want):
        got_s, want_s = print_graph(g), print_graph(want)
        diff = "\n".join(difflib.unified_diff(want_s.splitlines(), got_s.splitlines(), "expected", "got",
                                              lineterm=""))
        raise AssertionError(f"pass output differs from the golden IR:\n{diff or '(constant data differs)'}")
    return result


@pytest.fixture
def golden() -> Golden:
    return run_golden
