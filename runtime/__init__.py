"""zlc runtime: executors for compiled graphs (the reference executor is the oracle)."""

from .reference import ReferenceExecutor, run_graph

__all__ = ["ReferenceExecutor", "run_graph"]
