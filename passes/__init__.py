"""zlc passes: pure IR -> IR transformations, one module per pass or rule set.

The pipeline's pass stages are data: `GENERIC_PASSES` before raising, the raising rule sets
(`zlc.passes.raise_all.RAISING`, applied by `raise_graph`), then `CLEANUP_PASSES`, then KV-cache
synthesis (`zlc.passes.kv_cache`). Each pass is a callable Graph -> PassResult that edits the graph
in place; its `.stats` say what it did.
"""

from __future__ import annotations

from collections.abc import Callable

from zlc.ir import Graph

from .base import Pass, PassResult, run_passes
from .canonicalize import Canonicalize, canonicalize_rules
from .cse import CommonSubexpressionElimination
from .dce import DeadCodeElimination
from .fold_constants import FoldConstants
from .rewrite import Match, P, Rule, RuleSet

PassFn = Callable[[Graph], PassResult]

# The generic passes by stage name (zlc.driver.STAGES), in the order the pipeline runs them.
# (Bound `run` methods, not the module-level functions: importing those here would shadow the
# submodules of the same name on the package.)
GENERIC_PASSES: list[tuple[str, PassFn]] = [
    ("fold", FoldConstants().run),
    ("canonicalize", Canonicalize().run),
    ("cse", CommonSubexpressionElimination().run),
    ("dce", DeadCodeElimination().run),
]
# After raising: fold what it exposed (weight views), merge duplicates, drop what it left dead.
CLEANUP_PASSES: list[tuple[str, PassFn]] = [
    ("fold", FoldConstants().run),
    ("cse", CommonSubexpressionElimination().run),
    ("dce", DeadCodeElimination().run),
]

__all__ = [
    "Pass", "PassResult", "PassFn", "run_passes", "Match", "P", "Rule", "RuleSet", "Canonicalize",
    "canonicalize_rules", "CommonSubexpressionElimination", "DeadCodeElimination", "FoldConstants",
    "GENERIC_PASSES", "CLEANUP_PASSES",
]
