"""The last step to kernel-level ops: MoE routing and experts, and whatever is left unfused.

- fuse-moe: router(x·W_rᵀ) → topk_router; moe_experts → moe_linear up (gate and up rows of
  each expert in one grouped matmul, act(gate)·up in its epilogue) and moe_linear down.
- select-kernels: a matmul left alone is a fused_linear with an empty epilogue, a norm left
  alone a norm kernel, an elementwise op left alone a pointwise kernel. Any other unfused op
  has no kernel: it is refused by name.
"""

from __future__ import annotations

from archc.ir.attrs import Call
from archc.ir.graph import Graph
from archc.ir.ops import KERNEL_LEVEL, Op, is_compute
from archc.passes.context import PassContext, Refusal
from archc.passes.epilogue import norm_kernel
from archc.passes.linear import NORMS, emit, merged_name, view
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.pointwise import ELEMENTWISE, to_pointwise
from archc.passes.registry import register_pass
from archc.passes.rewrite import Rewriter

# ---- fuse-moe --------------------------------------------------------------------------------


def _router(rw: Rewriter, m: Bindings) -> int:
    mm = rw.node(m["logits"])
    router = rw.node(m["root"])
    return rw.emit(Op.TOPK_ROUTER, list(mm.inputs), like=[m["root"], m["logits"]],
                   top_k=router.attr("top_k"), normalize=router.attr("normalize"))


def _experts(rw: Rewriter, m: Bindings) -> int:
    n = rw.node(m["root"])
    x, gates, up, down = n.inputs[:4]
    weight = up
    if n.attr("gated"):
        gate = n.inputs[4]
        shape = rw.shape(up)
        weight = rw.add_param(
            merged_name([rw.node(gate).name, rw.node(up).name]),
            Call("cat", (rw.param_expr(gate), rw.param_expr(up)), (("dim", 1),)),
            (shape[0], 2 * shape[1], shape[2]), rw.node(up).dtype, like=[m["root"]],
            at=m["root"])
    h = rw.emit(Op.MOE_LINEAR, [x, gates, weight], like=[m["root"]], stage="up",
                top_k=n.attr("top_k"), act=n.attr("act"), gated=n.attr("gated"))
    return rw.emit(Op.MOE_LINEAR, [h, gates, down], like=[m["root"]], stage="down",
                   top_k=n.attr("top_k"))


MOE_RULES = (
    # softmax-top-k(x·W_rᵀ): the router logits never leave the kernel
    Rule("topk-router", Pat({Op.ROUTER}, "root", (Pat({Op.MATMUL}, "logits", one_use=True),)),
         _router),
    # Σ_e g_e·W_down,e·act(W_gate,e·x)·(W_up,e·x) over routed experts: grouped up, grouped down;
    # [W_gate; W_up] per expert makes the up stage one matmul with act(gate)·up in its epilogue
    Rule("moe-linear", Pat({Op.MOE_EXPERTS}, "root"), _experts),
)


register_rule_pass("fuse-moe",
                   "MoE: router matmul + top-k in one kernel; experts as grouped up/down matmuls",
                   MOE_RULES)


# ---- select-kernels --------------------------------------------------------------------------

def _kernel(rw: Rewriter, i: int) -> int | None:
    op = rw.op(i)
    if op == Op.MATMUL:
        lin = view(rw, i, through_bias=False)
        assert lin is not None
        return emit(rw, lin, like=[i])
    if op in NORMS:
        return norm_kernel(rw, i)
    if op in ELEMENTWISE:
        return to_pointwise(rw, i, set())
    raise Refusal(f"{op.value} has no kernel-level form; the pass that fuses it did not "
                  "apply (see the refusals before this one)")


@register_pass("select-kernels", "exact",
               "every compute node left becomes a kernel-level op: lone matmuls, norms and "
               "elementwise ops get kernels of their own")
def select_kernels(g: Graph, ctx: PassContext) -> Graph:
    # 1. Walk the compute nodes that are not kernel-level ops yet (embedding is its own kernel).
    # 2. matmul → fused_linear with no prologue or epilogue; rmsnorm / layernorm → norm;
    #    an elementwise op → a one-op pointwise.
    # 3. Anything else (a score chain flash-attention refused, a rope fuse-rope refused) has
    #    no kernel: refused, so explain names it and the contract check fails loudly.
    rw = Rewriter(g, ctx)
    for i in rw.order():
        op = rw.op(i)
        if not is_compute(op) or op in KERNEL_LEVEL or op == Op.EMBEDDING:
            continue
        try:
            new = _kernel(rw, i)
        except Refusal as r:
            ctx.refused("kernel", rw.describe(i), r.why)
            continue
        assert new is not None
        rw.replace(i, new)
        ctx.applied("kernel", rw.describe(i), f"{op.value} → {rw.op(new).value}")
    return rw.finish()
