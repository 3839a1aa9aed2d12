"""The last steps to kernel-level ops: MoE routing and experts, pointwise chains, and whatever is
left unfused.

- fuse-moe: router(x·W_rᵀ) → one router kernel over x and W_r; the gate and up stages of a
  gated expert FFN, act(gate)·up, → one expert matmul over [W_gate; W_up] with a glu() epilogue.
- fuse-pointwise: chains of elementwise ops left over become single `pointwise` kernels: x + y,
  then ·0.5 → pointwise(x, y) {expr=scale(add(x(0), x(1)), by=0.5)}.
- select-kernels: a matmul left alone is a fused_linear with an empty epilogue, an elementwise op
  left alone a pointwise kernel. Any other op without a kernel is refused by name.
"""

from __future__ import annotations

from collections.abc import Collection

import archc.ir.expr as E
from archc.ir.attrs import Call
from archc.ir.graph import Node
from archc.ir.ops import ELEMENTWISE, KERNEL_LEVEL, Op, is_compute
from archc.ir.ops.core import elementwise_expr
from archc.passes.linear import cat_params, emit, view
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.registry import Refusal
from archc.passes.rewrite import Rewriter, register_rewrite_pass


def _router(rw: Rewriter, m: Bindings) -> int:
    return rw.emit(Op.ROUTER, rw.node(m["logits"]).inputs, like=[m["root"], m["logits"]],
                   **rw.node(m["root"]).attrs)


def _expert_glu(rw: Rewriter, m: Bindings) -> int:
    gate, up = rw.node(m["gate"]), rw.node(m["up"])
    if gate.inputs[:2] != up.inputs[:2] or gate.attr("top_k") != up.attr("top_k"):
        raise Refusal(f"the gate %{m['gate']} and up %{m['up']} stages read different tokens "
                      "or routes")
    wg, wu = gate.inputs[2], up.inputs[2]
    if rw.shape(wu) != rw.shape(wg):
        raise Refusal(f"gate weights {list(rw.shape(wg))} and up weights {list(rw.shape(wu))} "
                      "differ")
    # [W_gate; W_up] per expert: one grouped matmul, act(gate)·up in its epilogue
    like = [m["gate"], m["act"], m["up"], m["root"]]
    weight = cat_params(rw, [wg, wu], 1, like=like, at=m["gate"])
    glu = E.call("glu", fn=rw.node(m["act"]).attr("fn"))
    return rw.emit(Op.MOE_LINEAR, [*gate.inputs[:2], weight], like=like, stage="up",
                   top_k=gate.attr("top_k"), epilogue=(glu,))


def _plain_up(n: Node) -> bool:
    return n.attr("stage") == "up" and not n.attr("epilogue")


MOE_RULES = (
    # softmax-top-k(x·W_rᵀ): the router logits never leave the kernel
    Rule("topk-router", Pat({Op.ROUTER}, "root", (Pat({Op.MATMUL}, "logits", one_use=True),)),
         _router),
    # act(x·W_gate,eᵀ)·(x·W_up,eᵀ) per routed expert e = glu over x·[W_gate,e; W_up,e]ᵀ
    Rule("moe-glu", Pat({Op.MUL}, "root", (
        Pat({Op.ACT}, "act", (Pat({Op.MOE_LINEAR}, "gate", one_use=True, where=_plain_up),),
            one_use=True),
        Pat({Op.MOE_LINEAR}, "up", one_use=True, where=_plain_up))), _expert_glu),
)
register_rule_pass("fuse-moe",
                   "MoE: router matmul + top-k in one kernel; gate and up expert stages in one "
                   "grouped matmul with act(gate)·up in its epilogue", MOE_RULES)


def to_pointwise(rw: Rewriter, root: int, inline: Collection[int]) -> tuple[int, list[int]]:
    """One pointwise node computing `root` over its leaves, inlining the nodes of `inline` it
    reaches through them; and those nodes."""
    leaves: list[int] = []
    inlined: list[int] = []

    def expression(i: int) -> Call:
        n = rw.node(i)
        return E.substitute(elementwise_expr(n.op, n.attrs), [arg(j) for j in n.inputs])

    def arg(j: int) -> Call:
        if j in inline:
            inlined.append(j)
            return expression(j)
        if j not in leaves:
            leaves.append(j)
        return E.x(leaves.index(j))

    expr = expression(root)
    inlined = sorted(set(inlined))
    return rw.emit(Op.POINTWISE, leaves, like=[root, *inlined], at=root, expr=expr), inlined


@register_rewrite_pass("fuse-pointwise", "chains of leftover elementwise ops become one pointwise "
                       "kernel each")
def fuse_pointwise(rw: Rewriter) -> None:
    # 1. An elementwise node read only by an elementwise node is inlined into it.
    # 2. Every other elementwise node roots one pointwise node whose expression walks its
    #    inputs, inlining what step 1 marked and numbering the rest x(0), x(1)…; a pointwise
    #    node that inlines nothing stays as it is.
    order = rw.order()
    inline = {i for i in order if rw.op(i) in ELEMENTWISE and len(rw.users(i)) == 1
              and rw.op(rw.users(i)[0]) in ELEMENTWISE}
    for i in order:
        if rw.op(i) not in ELEMENTWISE or i in inline or (
                rw.op(i) == Op.POINTWISE and not inline.intersection(rw.node(i).inputs)):
            continue
        new, chain = to_pointwise(rw, i, inline)
        rw.replace(i, new)
        rw.ctx.applied("pointwise", i, " → ".join(rw.op(j).value for j in [*chain, i]))


def _kernel(rw: Rewriter, m: Bindings) -> int:
    i = m["root"]
    if rw.op(i) == Op.MATMUL:
        return emit(rw, view(rw, i), like=[i])  # type: ignore[arg-type]
    if rw.op(i) in ELEMENTWISE:
        return to_pointwise(rw, i, ())[0]
    raise Refusal(f"{rw.op(i).value} has no kernel-level form; the pass that fuses it did not "
                  "apply (see the refusals before this one)")


def needs_kernel(n: Node) -> bool:
    """A compute node that is not a kernel yet (a router still reading separate logits
    included)."""
    return is_compute(n.op) and (len(n.inputs) == 1 if n.op == Op.ROUTER
                                 else n.op not in KERNEL_LEVEL)


# Any other node without a kernel (a score chain flash-attention refused, a rope fuse-rope
# refused, a router whose matmul fuse-moe could not take) is refused: explain names it and
# codegen fails loudly.
register_rule_pass("select-kernels",
                   "every compute node left becomes a kernel-level op: lone matmuls and "
                   "elementwise ops get kernels of their own",
                   (Rule("kernel", Pat(None, "root", where=needs_kernel), _kernel),))
