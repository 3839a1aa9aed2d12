"""The last steps to kernel-level ops: MoE routing and experts, and whatever is left unfused.

- fuse-moe: router(x·W_rᵀ) → one router kernel over x and W_r; the gate and up stages of a
  gated expert FFN, act(gate)·up, → one expert matmul over [W_gate; W_up] with a glu() epilogue.
- select-kernels: a matmul left alone is a fused_linear with an empty epilogue, an elementwise op
  left alone a pointwise kernel. Any other op without a kernel is refused by name.
"""

from __future__ import annotations

from archc.ir.attrs import Call
from archc.ir.graph import Graph, Node
from archc.ir.ops import ELEMENTWISE, KERNEL_LEVEL, Op, is_compute
from archc.passes.context import PassContext, Refusal
from archc.passes.linear import emit, merged_name, step, view
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.pointwise import to_pointwise
from archc.passes.registry import register_pass
from archc.passes.rewrite import Rewriter

# ---- fuse-moe --------------------------------------------------------------------------------


def _router(rw: Rewriter, m: Bindings) -> int:
    mm = rw.node(m["logits"])
    return rw.emit(Op.ROUTER, list(mm.inputs), like=[m["root"], m["logits"]],
                   **dict(rw.node(m["root"]).attrs))


def _plain_up(n: Node) -> bool:
    return n.attr("stage") == "up" and not n.attr("epilogue")


def _expert_glu(rw: Rewriter, m: Bindings) -> int:
    gate, up = rw.node(m["gate"]), rw.node(m["up"])
    if gate.inputs[:2] != up.inputs[:2] or gate.attr("top_k") != up.attr("top_k"):
        raise Refusal(f"the gate %{m['gate']} and up %{m['up']} stages read different tokens "
                      "or routes")
    wg, wu = gate.inputs[2], up.inputs[2]
    shape = rw.shape(wg)
    if rw.shape(wu) != shape:
        raise Refusal(f"gate weights {list(shape)} and up weights {list(rw.shape(wu))} differ")
    like = [m["gate"], m["act"], m["up"], m["root"]]
    # [W_gate; W_up] per expert: one grouped matmul, act(gate)·up in its epilogue
    weight = rw.add_param(merged_name([rw.node(wg).name, rw.node(wu).name]),
                          Call("cat", (rw.param_expr(wg), rw.param_expr(wu)), (("dim", 1),)),
                          (shape[0], 2 * shape[1], shape[2]), rw.node(wu).dtype, like=like,
                          at=m["gate"])
    glu = step("glu", fn=rw.node(m["act"]).attr("fn"))
    return rw.emit(Op.MOE_LINEAR, [*gate.inputs[:2], weight], like=like, stage="up",
                   top_k=gate.attr("top_k"), epilogue=(glu.call,))


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


# ---- select-kernels --------------------------------------------------------------------------

def _kernel(rw: Rewriter, i: int) -> int:
    op = rw.op(i)
    if op == Op.MATMUL:
        lin = view(rw, i, through_bias=False)
        assert lin is not None
        return emit(rw, lin, like=[i])
    if op in ELEMENTWISE:
        return to_pointwise(rw, i, set())
    raise Refusal(f"{op.value} has no kernel-level form; the pass that fuses it did not "
                  "apply (see the refusals before this one)")


def needs_kernel(n: Node) -> bool:
    """A compute node that is not a kernel yet (a router still reading separate logits
    included)."""
    if not is_compute(n.op):
        return False
    if n.op == Op.ROUTER:
        return len(n.inputs) == 1
    return n.op not in KERNEL_LEVEL


@register_pass("select-kernels", "exact",
               "every compute node left becomes a kernel-level op: lone matmuls and "
               "elementwise ops get kernels of their own")
def select_kernels(g: Graph, ctx: PassContext) -> Graph:
    # 1. Walk the compute nodes that are not kernel-level ops yet.
    # 2. matmul → fused_linear with no prologue or epilogue; an elementwise op → a one-op
    #    pointwise.
    # 3. Anything else (a score chain flash-attention refused, a rope fuse-rope refused, a
    #    router whose matmul fuse-moe could not take) has no kernel: refused, so explain names
    #    it and codegen fails loudly.
    rw = Rewriter(g, ctx)
    for i in rw.order():
        n = rw.node(i)
        if not needs_kernel(n):
            continue
        try:
            new = _kernel(rw, i)
        except Refusal as r:
            ctx.refused("kernel", rw.describe(i), r.why)
            continue
        rw.replace(i, new)
        ctx.applied("kernel", rw.describe(i), f"{n.op.value} → {rw.op(new).value}")
    return rw.finish()
