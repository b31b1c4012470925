"""zlc's IR: one graph type for op-level and transformer-level nodes."""

from .graph import Graph
from .ops import OPS, TRANSFORMER_OPS, OpDef, infer_types, is_transformer_op
from .text import graphs_equal, parse_graph, print_graph
from .types import Dim, DType, TensorType
from .values import Node, Value
from .verify import verify_graph

__all__ = [
    "Graph", "Node", "Value", "OPS", "TRANSFORMER_OPS", "OpDef", "infer_types", "is_transformer_op",
    "graphs_equal", "parse_graph", "print_graph", "Dim", "DType", "TensorType", "verify_graph",
]
