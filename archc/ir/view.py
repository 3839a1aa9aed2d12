"""Graph algorithms on a networkx view of a graph, and DOT export."""

from __future__ import annotations

import json
from collections.abc import Sequence

import networkx as nx

from archc.ir.graph import Graph, Program
from archc.ir.ops import META, VIEW, Op
from archc.ir.ops.base import MATMUL, POINTWISE, REDUCTION
from archc.ir.shapes import format_shape


def to_networkx(g: Graph) -> nx.DiGraph:
    """Nodes are ids with `op` and `node` data; edges run producer → consumer, with the slot."""
    dg = nx.DiGraph(name=g.name)
    for i, n in enumerate(g.nodes):   # inputs are earlier nodes, so added before their edges
        dg.add_node(i, op=n.op.value, node=n)
        for slot, j in enumerate(n.inputs):
            dg.add_edge(j, i, slot=slot)
    return dg


def topological_order(g: Graph) -> list[int]:
    return list(nx.lexicographical_topological_sort(to_networkx(g)))


def live_ranges(g: Graph, root_of: Sequence[int] | None = None) -> dict[int, tuple[int, int]]:
    """For each node: (defined at, last read at) in node order, for buffer planning. With
    `root_of` (node → the node whose buffer it is, for views), a read of a view is a read of its
    root. Graph outputs stay live to the end."""
    end = len(g.nodes)
    root = list(range(end)) if root_of is None else list(root_of)
    last = list(range(end))
    for i, n in enumerate(g.nodes):
        for j in n.inputs:
            last[root[j]] = max(last[root[j]], i)
        if n.op == Op.OUTPUT:
            last[root[i]] = end
    return {i: (i, last[i]) for i in range(end)}


_COLORS = ((META, "#eeeeee"), (MATMUL, "#aec7e8"), (REDUCTION, "#ffbb78"),
           (POINTWISE, "#98df8a"), (VIEW, "#ffffff"))


def to_dot(p: Program, *, params: bool = False) -> str:
    """Graphviz DOT text; params are hidden unless asked (they double the node count)."""
    lines = [f"digraph {json.dumps(p.model)} {{", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="monospace", fontsize=10];']
    for g in p:
        lines += [f"  subgraph {json.dumps('cluster_' + g.name)} {{",
                  f"    label={json.dumps(g.name)};"]
        shown = [i for i, n in enumerate(g.nodes) if params or n.op != Op.PARAM]
        for i in shown:
            n = g.nodes[i]
            label = "\\n".join([f"%{i} {n.op.value}", *([n.name] if n.name else []),
                                 format_shape(n.dtype, n.shape)])
            color = next((c for group, c in _COLORS if n.op in group), "#c5b0d5")
            lines.append(f'    "{g.name}.{i}" [label="{label}", fillcolor="{color}"];')
        lines += [f'    "{g.name}.{j}" -> "{g.name}.{i}";' for i in shown
                  for j in g.nodes[i].inputs if params or g.nodes[j].op != Op.PARAM]
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"
