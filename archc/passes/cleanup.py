"""dce and cse: drop what nothing reads, and compute what is computed twice once."""

from __future__ import annotations

from collections.abc import Hashable

from archc.ir.ops import Op
from archc.passes.rewrite import Rewriter, has_side_effect, live_nodes, register_rewrite_pass


@register_rewrite_pass("dce", "drop nodes nothing reads (cache writes and inputs stay)")
def dce(rw: Rewriter) -> None:
    # 1. Mark live: the outputs, the graph's inputs (its interface) and the nodes with side
    #    effects (cache writes), then everything they read, transitively.
    # 2. Drop the rest, readers before what they read.
    live = live_nodes(rw.nodes)
    dead = [i for i in rw.order() if i not in live]
    for i in reversed(dead):
        rw.kill(i)
    for i in dead:
        rw.ctx.applied("dce", i, "read by nothing")


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
