"""dce and cse: drop what nothing reads, and compute what is computed twice once."""

from __future__ import annotations

from collections.abc import Hashable

from archc.ir.graph import Graph
from archc.ir.ops import Op
from archc.passes.manager import PassContext, register_pass
from archc.passes.rewrite import Rewriter, has_side_effect, live_nodes, register_rewrite_pass


@register_pass("dce", "drop nodes nothing reads (cache writes and inputs stay)")
def dce(g: Graph, ctx: PassContext) -> Graph:
    # 1. Mark live: the outputs, the graph's inputs (its interface) and the nodes with side
    #    effects (cache writes), then everything they read, transitively.
    # 2. Drop the rest, keeping the order of what stays.
    live = live_nodes(dict(enumerate(g.nodes)))
    if len(live) == len(g.nodes):
        return g
    number = {i: k for k, i in enumerate(sorted(live))}
    for i in sorted(set(range(len(g.nodes))) - live):
        ctx.applied("dce", i, "read by nothing")
    ctx.kept = number
    nodes = (g.nodes[i].replace(inputs=tuple(number[j] for j in g.nodes[i].inputs))
             for i in number)
    return Graph(g.name, tuple(nodes))


@register_rewrite_pass("cse", "nodes computing the same value from the same inputs become one")
def cse(rw: Rewriter) -> None:
    # 1. Walk in order; each node's inputs already point at their representatives.
    # 2. Key: op, inputs, attrs, shape, dtype — for a computed parameter its expression. Graph
    #    inputs, outputs, checkpoint parameters (a name, not a value) and cache writes never
    #    merge; a node whose key was seen is replaced by the first node with that key.
    seen: dict[Hashable, int] = {}
    for i in rw.order():
        n = rw.node(i)
        if n.op in (Op.INPUT, Op.OUTPUT) or has_side_effect(n) or (
                n.op == Op.PARAM and n.attr("expr") is None):
            continue
        key = ("param", n.attr("expr"), n.shape, n.dtype) if n.op == Op.PARAM else \
            (n.op, n.inputs, n.attrs, n.shape, n.dtype)
        if key in seen:
            rw.replace(i, seen[key])
            rw.ctx.applied("cse", i, f"same as %{seen[key]}")
        else:
            seen[key] = i
