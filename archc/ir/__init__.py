"""The operator IR: plain-data nodes, graphs, text form, verifier, lowering."""

from archc.ir.graph import Graph, GraphBuilder, Node, Program
from archc.ir.lower import lower
from archc.ir.ops import OP_TABLE, Op
from archc.ir.text import format_graph, format_node, format_program, parse_program
from archc.ir.verify import verify, verify_graph

__all__ = [
    "OP_TABLE", "Graph", "GraphBuilder", "Node", "Op", "Program", "format_graph", "format_node",
    "format_program", "lower", "parse_program", "verify", "verify_graph",
]
