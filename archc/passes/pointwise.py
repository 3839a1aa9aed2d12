"""fuse-pointwise: chains of elementwise ops left over become single `pointwise` kernels.

    pointwise(add(x, y)) {expr=scale(x(0), by=0.5)}
      →  pointwise(x, y) {expr=scale(add(x(0), x(1)), by=0.5)}
"""

from __future__ import annotations

import archc.ir.expr as E
from archc.ir.attrs import Call
from archc.ir.graph import Graph
from archc.ir.ops import ELEMENTWISE, Op
from archc.ir.ops.core import elementwise_expr
from archc.passes.context import PassContext
from archc.passes.registry import register_pass
from archc.passes.rewrite import Rewriter


def expression(rw: Rewriter, i: int, inline: set[int], leaves: list[int]) -> Call:
    """The expression computing node i over `leaves` (appended to as new inputs are met),
    inlining the nodes in `inline`."""
    n = rw.node(i)

    def arg(j: int) -> Call:
        if j in inline:
            return expression(rw, j, inline, leaves)
        if j not in leaves:
            leaves.append(j)
        return E.x(leaves.index(j))

    return E.substitute(elementwise_expr(n.op, n.attrs), [arg(j) for j in n.inputs])


def to_pointwise(rw: Rewriter, root: int, inline: set[int]) -> int:
    leaves: list[int] = []
    expr = expression(rw, root, inline, leaves)
    covered = [root, *sorted(inline & _reachable(rw, root, inline))]
    return rw.emit(Op.POINTWISE, leaves, like=covered, at=root, expr=expr)


def _reachable(rw: Rewriter, root: int, inline: set[int]) -> set[int]:
    out: set[int] = set()
    stack = [j for j in rw.node(root).inputs if j in inline]
    while stack:
        j = stack.pop()
        if j not in out:
            out.add(j)
            stack += [k for k in rw.node(j).inputs if k in inline]
    return out


@register_pass("fuse-pointwise", "exact",
               "chains of leftover elementwise ops become one pointwise kernel each")
def fuse_pointwise(g: Graph, ctx: PassContext) -> Graph:
    # 1. An elementwise node is inlined into its reader when that reader is elementwise and
    #    is the only node reading it: its value is needed nowhere else.
    # 2. Every elementwise node not inlined roots one pointwise node, whose expression walks
    #    its inputs, inlining what step 1 marked and numbering the rest x(0), x(1)…
    # 3. A pointwise node that inlines nothing is left as it is.
    rw = Rewriter(g, ctx)
    order = rw.order()
    inline = {i for i in order if rw.op(i) in ELEMENTWISE and len(rw.users(i)) == 1
              and rw.op(rw.users(i)[0]) in ELEMENTWISE}
    for i in order:
        if rw.op(i) not in ELEMENTWISE or i in inline:
            continue
        chain = _reachable(rw, i, inline)
        if rw.op(i) == Op.POINTWISE and not chain:
            continue
        new = to_pointwise(rw, i, inline)
        rw.replace(i, new)
        ops = [rw.op(j).value for j in [*sorted(chain), i]]
        ctx.applied("pointwise", rw.describe(i), " → ".join(ops))
    return rw.finish()
