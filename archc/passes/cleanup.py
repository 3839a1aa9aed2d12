"""dce and cse: drop what nothing reads, and compute what is computed twice once."""

from __future__ import annotations

from collections.abc import Hashable

from archc.ir.graph import Graph
from archc.ir.ops import Op
from archc.passes.context import PassContext
from archc.passes.registry import register_pass
from archc.passes.rewrite import Rewriter, has_side_effect, live_nodes


@register_pass("dce", "exact", "drop nodes nothing reads (cache writes and inputs stay)")
def dce(g: Graph, ctx: PassContext) -> Graph:
    # 1. Mark live: the outputs, the graph's inputs (its interface) and the nodes with side
    #    effects (cache writes), then everything they read, transitively.
    # 2. Drop the rest, keeping the order of what stays.
    live = live_nodes(dict(enumerate(g.nodes)))
    if len(live) == len(g.nodes):
        return g
    number: dict[int, int] = {}
    nodes = []
    for i, n in enumerate(g.nodes):
        if i in live:
            number[i] = len(nodes)
            nodes.append(n.replace(inputs=tuple(number[j] for j in n.inputs)))
        else:
            ctx.applied("dce", i, "read by nothing")
    ctx.kept = number
    return Graph(g.name, tuple(nodes))


def _key(rw: Rewriter, i: int) -> Hashable | None:
    n = rw.node(i)
    if n.op in (Op.INPUT, Op.OUTPUT) or has_side_effect(n):
        return None
    if n.op == Op.PARAM:
        expr = n.attr("expr")
        # a checkpoint tensor is its name; a computed one is its expression
        return None if expr is None else ("param", expr, n.shape, n.dtype)
    return (n.op, n.inputs, n.attrs, n.shape, n.dtype)


@register_pass("cse", "exact", "nodes computing the same value from the same inputs become one")
def cse(g: Graph, ctx: PassContext) -> Graph:
    # 1. Walk in order; each node's inputs already point at their representatives.
    # 2. Key: op, inputs, attrs, shape, dtype — for a computed parameter its expression. Graph
    #    inputs, outputs, checkpoint parameters and cache writes are never merged.
    # 3. A node whose key was seen is replaced by the first node with that key.
    rw = Rewriter(g, ctx)
    seen: dict[Hashable, int] = {}
    for i in rw.order():
        key = _key(rw, i)
        if key is None:
            continue
        if key in seen:
            rw.replace(i, seen[key])
            ctx.applied("cse", rw.describe(i), f"same as %{seen[key]}")
        else:
            seen[key] = i
    return rw.finish()
