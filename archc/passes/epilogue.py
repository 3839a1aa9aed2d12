"""Fusing elementwise neighbours into the kernels beside them.

- fuse-epilogue: a bias, activation, scale or soft-cap after a kernel that writes rows (a
  matmul, a norm, an expert matmul) runs in its epilogue; a constant scale of a matmul's input
  moves there too.
- fuse-residual: a residual add joins the kernel next to it — the norm after it (post-norm), or
  the kernel that produced one of its operands (a matmul, a norm, the experts' down matmul).
"""

from __future__ import annotations

from archc.ir.ops import Op
from archc.passes.linear import EPILOGUE_HOSTS, LINEAR, bias_of, emit, extend, step, unary, view
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.registry import Refusal
from archc.passes.rewrite import Rewriter


def _step(rw: Rewriter, m: Bindings) -> int:
    """The root as a step appended to the kernel bound as "k": bias(b) of the vector bound as
    "b", act(fn), or the scale or soft-cap of a pointwise fn(x(0), …)."""
    n = rw.node(m["root"])
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
    s = rw.node(m["s"])
    new = lin.replace(operands=(s.inputs[0],),
                      steps=(step("scale", by=s.attr("expr").kw("by")), *lin.steps))
    return emit(rw, new, like=[*lin.covers, m["s"]])


KERNEL = Pat(EPILOGUE_HOSTS, "k", one_use=True)
EPILOGUE_RULES = (
    # k + b: the bias joins the accumulator before it is stored
    Rule("bias", Pat({Op.ADD}, "root", (KERNEL, Pat({Op.PARAM}, "b",
                                                    where=lambda n: len(n.shape) == 1))), _step),
    # act(k): the activation runs on the accumulator
    Rule("act", Pat({Op.ACT}, "root", (KERNEL,)), _step),
    # c·k
    Rule("scale", Pat({Op.POINTWISE}, "root", (KERNEL,), where=lambda n: unary(n) == "scale"),
         _step),
    # cap·tanh(k/cap): Gemma's final-logit soft-cap
    Rule("softcap", Pat({Op.POINTWISE}, "root", (KERNEL,),
                        where=lambda n: unary(n) == "softcap"), _step),
    # (c·x)·Wᵀ = c·(x·Wᵀ): a constant scale of the input moves to the epilogue (T5's head)
    Rule("input-scale", Pat(LINEAR, "root", (Pat({Op.POINTWISE}, "s", one_use=True,
                                                  where=lambda n: unary(n) == "scale"),)),
         _input_scale),
)
register_rule_pass("fuse-epilogue",
                   "bias, activation, scale and soft-cap after a matmul, norm or expert matmul "
                   "run in its epilogue", EPILOGUE_RULES)


def _add_before_norm(rw: Rewriter, m: Bindings) -> int:
    n = rw.node(m["root"])
    if n.attr("add_before"):
        raise Refusal(f"%{m['root']} already adds a residual before normalizing")
    a, b = rw.node(m["sum"]).inputs
    if rw.shape(a) != rw.shape(m["sum"]) or rw.shape(a) != rw.shape(b):
        raise Refusal(f"the operands of %{m['sum']} differ in shape (broadcast)")
    if bias_of(rw, m["sum"]) is not None:
        raise Refusal(f"%{m['sum']} adds a bias vector, not a residual")
    return rw.emit(Op.NORM, [a, n.inputs[1], b, *n.inputs[2:]], like=[m["root"], m["sum"]],
                   **n.attrs.replace(add_before=True))


def _residual_epilogue(rw: Rewriter, m: Bindings) -> int:
    a, b = rw.node(m["root"]).inputs
    other = a if b == m["k"] else b
    if rw.shape(other) != rw.shape(m["root"]) or rw.shape(m["k"]) != rw.shape(m["root"]):
        raise Refusal(f"the operands of %{m['root']} differ in shape (broadcast)")
    return extend(rw, m["k"], step("residual", other), like=[m["root"]])


def _residual_rule(name: str, hosts: frozenset[Op]) -> Rule:
    return Rule(name, Pat({Op.ADD}, "root", (None, Pat(hosts, "k", one_use=True))),
                _residual_epilogue)


NORM_RESIDUAL_RULES = (
    # norm(a + b), the sum read by nothing else: the norm kernel adds b as it loads a row
    # (post-norm blocks, BERT's embedding sum)
    Rule("residual-before-norm", Pat({Op.NORM}, "root", (Pat({Op.ADD}, "sum", one_use=True),)),
         _add_before_norm),
    # a + norm(y), the norm read by nothing else: the norm kernel adds a to its output
    # (sandwich blocks: x + post_norm(sublayer(x)))
    _residual_rule("residual-after-norm", frozenset({Op.NORM})),
)
# r + (x·Wᵀ + …), r + Σ experts: the epilogue reads r and adds it before the store
KERNEL_RESIDUAL_RULES = (_residual_rule("residual-epilogue", LINEAR | {Op.MOE_LINEAR}),)

# The norm rules first: an add next to a norm joins the norm rather than a matmul.
register_rule_pass("fuse-residual",
                   "residual adds join the norm after them, or the matmul, norm or expert "
                   "matmul that produced an operand", NORM_RESIDUAL_RULES, KERNEL_RESIDUAL_RULES)
