"""The last steps to kernel-level ops: biases, activations, scales and residual adds join the
epilogue of the kernel beside them, MoE routing and experts fuse, leftover elementwise chains
become `pointwise` kernels, and whatever is left gets a kernel of its own or a refusal naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import archc.ir.expr as E
from archc.ir.attrs import Call
from archc.ir.graph import Node
from archc.ir.ops import (
    ELEMENTWISE,
    KERNEL_LEVEL,
    ROW_KERNELS,
    Op,
    full_attrs,
    is_compute,
    roles_of,
)
from archc.ir.ops.core import elementwise_expr
from archc.ir.ops.steps import PAIRING
from archc.passes.linear import (
    LINEAR,
    bias_of,
    emit,
    extend,
    merged_name,
    step,
    unary,
    view,
)
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.rewrite import Refusal, Rewriter, register_rewrite_pass


def _step(rw: Rewriter, m: Bindings) -> int:
    """The root as a step appended to the epilogue of the kernel bound as "k"."""
    n = rw.nodes[m["root"]]
    if n.op == Op.ADD:
        new = step("bias", m["b"])
    elif n.op == Op.ACT:
        new = step("act", fn=n.attr("fn"))
    else:
        new = step(n.attr("expr").fn, **dict(n.attr("expr").kwargs))
    return extend(rw, m["k"], new, like=[m["root"]])


def _input_scale(rw: Rewriter, m: Bindings) -> int:
    lin = view(rw, m["root"], through_bias=False)
    assert lin is not None
    if lin.prologue:
        raise Refusal(f"%{m['root']} gathers row statistics of its input, which the scale "
                      "changes")
    if len(lin.operands) != 1:
        raise Refusal(f"%{m['root']} concatenates two operands; the scale is of one")
    s = rw.nodes[m["s"]]
    new = lin.replace(operands=(s.inputs[0],),
                      steps=(step("scale", by=s.attr("expr").kw("by")), *lin.steps))
    return emit(rw, new, like=[*lin.covers, m["s"]])


# a kernel whose epilogue a step can join: a matmul (as a fused_linear), a norm, an expert matmul
KERNEL = Pat(ROW_KERNELS | {Op.MATMUL}, "k", one_use=True)
register_rule_pass("fuse-epilogue", "bias, activation, scale and soft-cap after a matmul, norm or "
                   "expert matmul run in its epilogue", (
    # k + b: the bias joins the accumulator before it is stored
    Rule("bias", Pat({Op.ADD}, "root", (KERNEL, Pat({Op.PARAM}, "b",
                                                    where=lambda n: len(n.shape) == 1))), _step),
    # act(k): the activation runs on the accumulator
    Rule("act", Pat({Op.ACT}, "root", (KERNEL,)), _step),
    # c·k, and cap·tanh(k/cap): Gemma's final-logit soft-cap
    *(Rule(fn, Pat({Op.POINTWISE}, "root", (KERNEL,), where=lambda n, fn=fn: unary(n) == fn),
           _step) for fn in ("scale", "softcap")),
    # (c·x)·Wᵀ = c·(x·Wᵀ): a constant scale of the input moves to the epilogue (T5's head)
    Rule("input-scale", Pat(LINEAR, "root", (Pat({Op.POINTWISE}, "s", one_use=True,
                                                  where=lambda n: unary(n) == "scale"),)),
         _input_scale),
))


def _add_before_norm(rw: Rewriter, m: Bindings) -> int:
    n = rw.nodes[m["root"]]
    if n.attr("add_before"):
        raise Refusal(f"%{m['root']} already adds a residual before normalizing")
    a, b = rw.nodes[m["sum"]].inputs
    if rw.shape(a) != rw.shape(m["sum"]) or rw.shape(a) != rw.shape(b):
        raise Refusal(f"the operands of %{m['sum']} differ in shape (broadcast)")
    if bias_of(rw, m["sum"]) is not None:
        raise Refusal(f"%{m['sum']} adds a bias vector, not a residual")
    return rw.emit(Op.NORM, [a, n.inputs[1], b, *n.inputs[2:]], like=[m["root"], m["sum"]],
                   **n.attrs.replace(add_before=True))


def _operand_epilogue(name: str) -> Callable[[Rewriter, Bindings], int]:
    """A rule's action: the `name` step (residual, gate) reads the root's other operand in the
    epilogue of the kernel that produced k."""
    def fuse(rw: Rewriter, m: Bindings) -> int:
        a, b = rw.nodes[m["root"]].inputs
        other = a if b == m["k"] else b
        if rw.shape(other) != rw.shape(m["root"]) or rw.shape(m["k"]) != rw.shape(m["root"]):
            raise Refusal(f"the operands of %{m['root']} differ in shape (broadcast)")
        return extend(rw, m["k"], step(name, other), like=[m["root"]])
    return fuse


_residual_epilogue = _operand_epilogue("residual")


# The norm rules first: an add next to a norm joins the norm rather than a matmul.
register_rule_pass("fuse-residual", "residual adds join the norm after them, or the matmul, norm "
                   "or expert matmul that produced an operand", (
    # norm(a + b), the sum read by nothing else: the norm kernel adds b as it loads a row
    # (post-norm blocks, BERT's embedding sum)
    Rule("residual-before-norm", Pat({Op.NORM}, "root", (Pat({Op.ADD}, "sum", one_use=True),)),
         _add_before_norm),
    # a + norm(y), the norm read by nothing else: the norm kernel adds a to its output
    # (sandwich blocks: x + post_norm(sublayer(x)))
    Rule("residual-after-norm", Pat({Op.ADD}, "root", (None, Pat({Op.NORM}, "k", one_use=True))),
         _residual_epilogue),
), (
    # r + (x·Wᵀ + …), r + Σ experts: the epilogue reads r and adds it before the store
    Rule("residual-epilogue", Pat({Op.ADD}, "root", (
        None, Pat(LINEAR | {Op.MOE_LINEAR}, "k", one_use=True))), _residual_epilogue),
))




register_rule_pass("fuse-gate", "a product of two tensors runs in the epilogue of the matmul or "
                   "norm that produced one of them", (
    # y ⊙ (x·Wᵀ + …): gated attention's σ(gate) projection multiplies the attention output as
    # it stores (Qwen3-Next) — no kernel of its own for the product
    Rule("gate-epilogue", Pat({Op.MUL}, "root", (
        None, Pat(LINEAR | {Op.NORM}, "k", one_use=True))), _operand_epilogue("gate")),
))


def _router(rw: Rewriter, m: Bindings) -> int:
    root = rw.nodes[m["root"]]
    bias = [rw.nodes[m["bias_add"]].inputs[1]] if "bias_add" in m else []
    # the choice bias, if any, stays the last operand
    return rw.emit(Op.ROUTER, [*rw.nodes[m["logits"]].inputs, *bias, *root.inputs[1:]],
                   like=[m["root"], *([m["bias_add"]] if bias else []), m["logits"]],
                   **root.attrs)


def over_logits(n: Node) -> bool:
    """A router over separate logits (not yet fused with its matmul)."""
    return "weight" not in roles_of(n.op, full_attrs(n.op, n.attrs), len(n.inputs))


def _expert_glu(rw: Rewriter, m: Bindings) -> int:
    gate, up = rw.nodes[m["gate"]], rw.nodes[m["up"]]
    if gate.inputs[:2] != up.inputs[:2] or gate.attrs != up.attrs:
        raise Refusal(f"the gate %{m['gate']} and up %{m['up']} stages read different tokens "
                      "or routes, or differ in their biases or gating")
    wg, wu = gate.inputs[2], up.inputs[2]
    if rw.shape(wu) != rw.shape(wg):
        raise Refusal(f"gate weights {list(rw.shape(wg))} and up weights {list(rw.shape(wu))} "
                      "differ")
    # [W_gate; W_up] per expert, its rows interleaved at load time (gate row n and up row n
    # become rows 2n and 2n + 1: a permutation, exact), so that one column tile holds both
    # partners of each of its outputs: one grouped matmul with one accumulator, act(gate)·up in
    # its epilogue; the experts' biases [E, N] interleave alike
    act = rw.nodes[m["act"]]
    like = [m["gate"], m["act"], m["up"], *([m["up_fn"]] if "up_fn" in m else []), m["root"]]

    def interleaved(g: int, u: int) -> int:
        stacked = E.call("cat", rw.param_expr(g), rw.param_expr(u), dim=1)
        shape = list(rw.shape(g))
        shape[1] *= 2
        return rw.add_param(merged_name([rw.nodes[g].name, rw.nodes[u].name]),
                            E.call("interleave", stacked, dim=1), shape, rw.nodes[g].dtype,
                            like=like, at=m["gate"])
    weights = [interleaved(wg, wu)]
    if gate.attr("bias"):
        weights.append(interleaved(gate.inputs[3], up.inputs[3]))
    if act.op == Op.ACT:
        glu = E.call("glu", fn=act.attr("fn"), interleaved=True)
    else:   # act(g) and up(u) as elementwise expressions: glu(identity) over them
        up_fn = rw.nodes[m["up_fn"]].attr("expr") if "up_fn" in m else None
        glu = E.call("glu", fn="identity", interleaved=True, gate=act.attr("expr"), up=up_fn)
    return rw.emit(Op.MOE_LINEAR, [*gate.inputs[:2], *weights], like=like,
                   **gate.attrs.replace(epilogue=(glu,)))


def _plain_up(n: Node) -> bool:
    return n.attr("stage") == "up" and not n.attr("epilogue")


def _unary(n: Node) -> bool:
    """An elementwise expression of one input (a clamp, a swish gate)."""
    return len(n.inputs) == 1


EXPERT_UP = Pat({Op.MOE_LINEAR}, "up", one_use=True, where=_plain_up)
# the gate stage's activation: act(g), or an elementwise expression of g
EXPERT_GATE = (Pat({Op.MOE_LINEAR}, "gate", one_use=True, where=_plain_up),)
register_rule_pass("fuse-moe", "MoE: router matmul (+ bias) + top-k in one kernel; gate and up "
                   "expert stages in one grouped matmul with act(gate)·up in its epilogue", (
    # top-k(x·W_rᵀ [+ b]): the router logits never leave the kernel
    # (a choice bias, the router's second operand, is carried over)
    Rule("topk-router", Pat({Op.ROUTER}, "root", (Pat({Op.MATMUL}, "logits", one_use=True),),
                            where=over_logits), _router),
    Rule("topk-router-bias", Pat({Op.ROUTER}, "root", (Pat({Op.ADD}, "bias_add", (
        Pat({Op.MATMUL}, "logits", one_use=True),
        Pat({Op.PARAM}, where=lambda n: len(n.shape) == 1)), one_use=True),),
        where=over_logits), _router),
    # act(x·W_gate,eᵀ)·(x·W_up,eᵀ) per routed expert e = glu over x·[W_gate,e; W_up,e]ᵀ, and
    # so with elementwise expressions of the gate and of the up (gpt-oss's clamps)
    *(Rule(name, Pat({Op.MUL}, "root", (
        Pat(ops, "act", EXPERT_GATE, one_use=True, where=where), up)), _expert_glu)
      for name, ops, where, up in (
        ("moe-glu", {Op.ACT}, None, EXPERT_UP),
        ("moe-glu-expr", {Op.POINTWISE}, _unary, EXPERT_UP),
        ("moe-glu-expr-up", {Op.POINTWISE}, _unary,
         Pat({Op.POINTWISE}, "up_fn", (EXPERT_UP,), one_use=True, where=_unary)))),
))


def to_pointwise(rw: Rewriter, root: int, inline: Collection[int]) -> tuple[int, list[int]]:
    """A pointwise node computing `root`, inlining the nodes of `inline` it reaches; and those."""
    leaves: list[int] = []
    inlined: list[int] = []

    def expression(i: int) -> Call:
        n = rw.nodes[i]
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
    #    inputs, inlining what step 1 marked and numbering the rest x(0), x(1)… (x + y, then
    #    ·0.5 → pointwise(x, y) {expr=scale(add(x(0), x(1)), by=0.5)}); a pointwise node that
    #    inlines nothing stays as it is.
    order = rw.order()
    inline = {i for i in order if rw.op(i) in ELEMENTWISE and len(rw.users(i)) == 1
              and rw.op(rw.users(i)[0]) in ELEMENTWISE}
    for i in order:
        if rw.op(i) not in ELEMENTWISE or i in inline or (
                rw.op(i) == Op.POINTWISE and not inline.intersection(rw.nodes[i].inputs)):
            continue
        new, chain = to_pointwise(rw, i, inline)
        rw.replace(i, new)
        rw.ctx.applied("pointwise", i, " → ".join(rw.op(j).value for j in [*chain, i]))


def _pair_rows(rw: Rewriter, i: int) -> int:
    """fused_linear i with its weight rows permuted so that the partners of its glu/rope step are
    neighbours (the new weight computed at load time), marked `paired`."""
    lin = view(rw, i)
    assert lin is not None
    if lin.paired:
        raise Refusal("its weight rows are paired already")
    pairing = [s.call for s in lin.steps if s.fn in PAIRING]
    if len(pairing) != 1:
        raise Refusal("no glu() or rope() step pairs its columns")
    st = pairing[0]
    if st.fn == "rope" and st.kw("rotary_start", 0):
        raise Refusal("its rope() rotates dims from column "
                      f"{st.kw('rotary_start')} of each head (the kernel gathers the partners)")
    if st.fn == "glu":
        expr = E.call("interleave", rw.param_expr(lin.weight))
    else:
        expr = E.call("rope_pairs", rw.param_expr(lin.weight), heads=st.kw("heads"),
                      head_dim=st.kw("head_dim"), rotary_dim=st.kw("rotary_dim"),
                      interleaved=st.kw("interleaved"))
    w = rw.nodes[lin.weight]
    if rw.users(lin.weight) == [i]:   # read by this projection alone: the new one keeps its name
        rw.param_names.discard(w.name)
    weight = rw.add_param(w.name, expr, w.shape, w.dtype, like=[lin.weight], at=i)
    return emit(rw, lin.replace(weight=weight, paired=True), like=[i])


@register_rewrite_pass("pair-rows", "a projection whose epilogue pairs columns (glu, rope) has its "
                       "weight rows permuted at load time so partners are neighbours: one "
                       "accumulator, split in registers")
def pair_rows(rw: Rewriter) -> None:
    # 1. For each fused_linear with a glu() or rope() step, the pairing step's column order
    #    (steps.pair_order) as a load-time permutation of the weight rows (interleave for glu,
    #    rope_pairs for rope); the weight must be a parameter.
    # 2. The node is rebuilt over the new weight, marked paired: its eager value is unchanged
    #    (the accumulator is put back in column order), and the kernel's tile of BLOCK_N
    #    contiguous weight rows holds BLOCK_N // 2 whole pairs.
    for i in rw.order():
        if rw.op(i) != Op.FUSED_LINEAR or not any(
                s.fn in PAIRING for s in rw.nodes[i].attr("epilogue", ())):
            continue
        new = rw.attempt("pair-rows", i, _pair_rows, rw, i)
        if new is not None:
            rw.replace(i, new)
            rw.kill(i)   # a cache write is a root: the old node would stay and write it too
            rw.ctx.applied("pair-rows", i, f"weight %{view(rw, new).weight} "  # type: ignore[union-attr]
                           "in pair order")


def _kernel(rw: Rewriter, m: Bindings) -> int:
    i = m["root"]
    if rw.op(i) == Op.MATMUL:
        return emit(rw, view(rw, i), like=[i])  # type: ignore[arg-type]
    if rw.op(i) in ELEMENTWISE:
        return to_pointwise(rw, i, ())[0]
    raise Refusal(f"{rw.op(i).value} has no kernel-level form; the pass that fuses it did not "
                  "apply (see the refusals before this one)")


def needs_kernel(n: Node) -> bool:
    """A compute node that is not a kernel yet (a router over separate logits included)."""
    return is_compute(n.op) and (over_logits(n) if n.op == Op.ROUTER
                                 else n.op not in KERNEL_LEVEL)


# Any other node without a kernel (a score chain flash-attention refused, a rope fuse-rope
# refused, a router whose matmul fuse-moe could not take) is refused: explain names it and
# codegen fails loudly.
register_rule_pass("select-kernels", "every compute node left becomes a kernel-level op: lone "
                   "matmuls and elementwise ops get kernels of their own",
                   (Rule("kernel", Pat(None, "root", where=needs_kernel), _kernel),))
