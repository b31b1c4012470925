"""zlc passes: pure IR -> IR transformations, one module per pass or rule set."""

from .base import Pass, PassResult, run_passes
from .canonicalize import Canonicalize, canonicalize_rules
from .cse import CommonSubexpressionElimination
from .dce import DeadCodeElimination
from .fold_constants import FoldConstants
from .rewrite import Match, P, Rule, RuleSet

# The generic passes by name (the driver's pipeline lists these names).
GENERIC_PASSES: dict[str, type] = {
    "fold_constants": FoldConstants,
    "canonicalize": Canonicalize,
    "cse": CommonSubexpressionElimination,
    "dce": DeadCodeElimination,
}

__all__ = [
    "Pass", "PassResult", "run_passes", "Match", "P", "Rule", "RuleSet", "Canonicalize",
    "canonicalize_rules", "CommonSubexpressionElimination", "DeadCodeElimination", "FoldConstants",
    "GENERIC_PASSES",
]
