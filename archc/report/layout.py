"""Coordinates for drawing a graph, computed here so the page only draws: nodes layered by
topological depth, ordered within a layer to keep edges short, and grouped into kernels.

1. A node's depth is the longest path to it from the graph's inputs; a parameter sits one row
   above its first user (at depth 0 every parameter of the model would crowd the top row).
2. Within a row, nodes are ordered by the mean position of their neighbours (the barycenter
   heuristic), in sweeps down (by producers) and up (by consumers), to reduce crossings.
3. A kernel's group is a compute node with the parameters and views only it reads: the box a
   fused node is drawn in.
"""

from __future__ import annotations

from dataclasses import dataclass

from archc.ir.graph import Graph
from archc.ir.ops import VIEW, Op

NODE_W, NODE_H = 150, 30     # a node's box, in px
GAP_X, GAP_Y = 24, 40        # between boxes of a row, between rows
SWEEPS = 4                   # barycenter sweeps, down and up: enough for one block's graph


@dataclass(frozen=True)
class Placed:
    """Where a graph's nodes are drawn: node id → (x, y) of its box's top-left corner."""

    xy: dict[int, tuple[int, int]]
    width: int
    height: int


def depths(g: Graph) -> list[int]:
    """Row of each node (step 1)."""
    depth = [0] * len(g.nodes)
    for i, n in enumerate(g.nodes):     # inputs come first: topological order
        if n.op != Op.PARAM and n.inputs:
            depth[i] = 1 + max(depth[j] for j in n.inputs)
    users = g.users()
    for i, n in enumerate(g.nodes):
        if n.op == Op.PARAM and users[i]:
            depth[i] = max(min(depth[u] for u in users[i]) - 1, 0)
    return depth


def _sweep(rows: list[list[int]], neighbours: list[list[int]], order: range) -> None:
    """Reorder each row of `order` by the mean position of each node's `neighbours` in the
    rows already placed; a node without any keeps its place."""
    def centred(row: list[int]) -> dict[int, float]:
        """Positions as drawn: rows are centred, so a slot counts from the row's middle."""
        return {i: k - (len(row) - 1) / 2 for k, i in enumerate(row)}

    pos: dict[int, float] = {}
    for row in rows:
        pos.update(centred(row))
    for r in order:
        keyed = []
        for k, i in enumerate(rows[r]):
            near = [pos[j] for j in neighbours[i] if j not in rows[r]]
            keyed.append((sum(near) / len(near) if near else pos[i], k, i))
        rows[r] = [i for _, _, i in sorted(keyed)]
        pos.update(centred(rows[r]))


def place(g: Graph) -> Placed:
    """Coordinates of every node of `g` (steps 1 and 2)."""
    depth = depths(g)
    rows: list[list[int]] = [[] for _ in range(max(depth, default=0) + 1)]
    for i, d in enumerate(depth):
        rows[d].append(i)
    producers = [list(n.inputs) for n in g.nodes]
    consumers = g.users()
    for _ in range(SWEEPS):
        _sweep(rows, producers, range(len(rows)))
        _sweep(rows, consumers, range(len(rows) - 1, -1, -1))
    widest = max((len(r) for r in rows), default=0)
    width = widest * (NODE_W + GAP_X) - GAP_X if widest else 0
    xy = {}
    for d, row in enumerate(rows):
        left = (width - (len(row) * (NODE_W + GAP_X) - GAP_X)) // 2   # rows centred
        for k, i in enumerate(row):
            xy[i] = (left + k * (NODE_W + GAP_X), d * (NODE_H + GAP_Y))
    return Placed(xy, width, len(rows) * (NODE_H + GAP_Y) - GAP_Y if rows else 0)


def kernel_groups(g: Graph) -> dict[int, int]:
    """Node → the compute node whose group it is drawn in (step 3): each compute node, and the
    parameters and views that it alone reads."""
    users = g.users()
    group = {i: i for i in g.compute_ids()}
    for i in reversed(range(len(g.nodes))):     # a view of a view joins its reader's group
        n = g.nodes[i]
        if (n.op == Op.PARAM or n.op in VIEW) and len(users[i]) == 1 and users[i][0] in group:
            group[i] = group[users[i][0]]
    return group
