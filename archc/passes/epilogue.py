"""Fusing elementwise neighbours into the kernels beside them.

- fuse-epilogue: a bias, activation, scale or soft-cap after a matmul runs in its epilogue; a
  constant scale of its input moves there too.
- fuse-residual: a residual add joins the kernel next to it — the norm after it (post-norm), the
  norm before it (sandwich), or the matmul that produced one of its operands.
"""

from __future__ import annotations

from collections.abc import Callable

from archc.ir.ops import Op
from archc.passes.context import Refusal
from archc.passes.linear import LINEAR, NORMS, emit, step, view
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.rewrite import Rewriter

ANY_NORM = NORMS | {Op.NORM}

# ---- fuse-epilogue ---------------------------------------------------------------------------


def _append(fn: str, *, inputs: tuple[str, ...] = (), attr: tuple[str, str] | None = None,
            ) -> Callable[[Rewriter, Bindings], int]:
    """A rewrite appending epilogue step `fn` to the linear bound as "lin"; its inputs are the
    bound nodes `inputs`, its keyword `attr = (step kw, root attr)` copied from the root."""
    def rewrite(rw: Rewriter, m: Bindings) -> int:
        lin = view(rw, m["lin"], through_bias=False)
        assert lin is not None
        kw = {attr[0]: rw.node(m["root"]).attr(attr[1])} if attr else {}
        new = lin.then(step(fn, *(m[k] for k in inputs), **kw))
        return emit(rw, new, like=[*lin.covers, m["root"]])
    return rewrite


def _input_scale(rw: Rewriter, m: Bindings) -> int:
    lin = view(rw, m["root"], through_bias=False)
    assert lin is not None
    if lin.prologue:
        raise Refusal(f"%{m['root']} gathers row statistics of its input, which the scale "
                      "changes")
    if len(lin.operands) != 1:
        raise Refusal(f"%{m['root']} concatenates two operands; the scale is of one")
    by = rw.node(m["s"]).attr("factor")
    new = lin.replace(operands=(rw.node(m["s"]).inputs[0],),
                      steps=(step("scale", by=by), *lin.steps))
    return emit(rw, new, like=[*lin.covers, m["s"]])


def _one_use_linear() -> Pat:
    return Pat(LINEAR, "lin", one_use=True)


EPILOGUE_RULES = (
    # (x·Wᵀ) + b: the bias joins the accumulator before it is stored
    Rule("bias", Pat({Op.BIAS_ADD}, "root", (_one_use_linear(), Pat({Op.PARAM}, "b"))),
         _append("bias", inputs=("b",))),
    # act(x·Wᵀ): the activation runs on the accumulator
    Rule("act", Pat({Op.ACT}, "root", (_one_use_linear(),)), _append("act", attr=("fn", "fn"))),
    # c·(x·Wᵀ)
    Rule("scale", Pat({Op.SCALE}, "root", (_one_use_linear(),)),
         _append("scale", attr=("by", "factor"))),
    # cap·tanh((x·Wᵀ)/cap): Gemma's final-logit soft-cap
    Rule("softcap", Pat({Op.SOFTCAP}, "root", (_one_use_linear(),)),
         _append("softcap", attr=("cap", "cap"))),
    # (c·x)·Wᵀ = c·(x·Wᵀ): a constant scale of the input moves to the epilogue (T5's head)
    Rule("input-scale", Pat(LINEAR, "root", (Pat({Op.SCALE}, "s", one_use=True),)),
         _input_scale),
)


register_rule_pass("fuse-epilogue",
                   "bias, activation, scale and soft-cap after a matmul run in its epilogue",
                   EPILOGUE_RULES)


# ---- fuse-residual ---------------------------------------------------------------------------

def norm_kernel(rw: Rewriter, i: int, *, x: int | None = None, before: int | None = None,
                after: int | None = None, like: tuple[int, ...] = ()) -> int:
    """The `norm` kernel of norm node i (unfused or already a kernel), reading `x` instead of
    its input if given, with a residual added before or after it."""
    n = rw.node(i)
    if n.op == Op.NORM:
        names = ["x", "weight"] + (["bias"] if n.attr("bias") else []) + \
            (["before"] if n.attr("add_before") else []) + (["after"] if n.attr("add_after")
                                                             else [])
        got = dict(zip(names, n.inputs))
        kind, eps, unit = n.attr("kind"), n.attr("eps"), n.attr("unit_offset")
    else:
        got = {"x": n.inputs[0], "weight": n.inputs[1]}
        if len(n.inputs) > 2:
            got["bias"] = n.inputs[2]
        kind = "rms" if n.op == Op.RMSNORM else "layer"
        eps, unit = n.attr("eps"), n.attr("unit_offset")
    if x is not None:
        got["x"] = x
    if before is not None:
        if "before" in got:
            raise Refusal(f"%{i} already adds a residual before normalizing")
        got["before"] = before
    if after is not None:
        if "after" in got:
            raise Refusal(f"%{i} already adds a residual after normalizing")
        got["after"] = after
    inputs = [got[k] for k in ("x", "weight", "bias", "before", "after") if k in got]
    return rw.emit(Op.NORM, inputs, like=[i, *like], kind=kind, eps=eps, bias="bias" in got,
                   add_before="before" in got, add_after="after" in got,
                   unit_offset=(unit or False) if kind == "rms" else None)


def _add_before_norm(rw: Rewriter, m: Bindings) -> int:
    a, b = rw.node(m["sum"]).inputs
    if rw.shape(a) != rw.shape(m["sum"]):
        a, b = b, a
    if rw.shape(a) != rw.shape(b):
        raise Refusal(f"the operands of %{m['sum']} differ in shape (broadcast)")
    return norm_kernel(rw, m["root"], x=a, before=b, like=(m["sum"],))


def _add_after_norm(rw: Rewriter, m: Bindings) -> int:
    a, b = rw.node(m["root"]).inputs
    other = a if b == m["n"] else b
    if rw.shape(other) != rw.shape(m["root"]) or rw.shape(m["n"]) != rw.shape(m["root"]):
        raise Refusal(f"the operands of %{m['root']} differ in shape (broadcast)")
    return norm_kernel(rw, m["n"], after=other, like=(m["root"],))


def _residual_epilogue(rw: Rewriter, m: Bindings) -> int:
    a, b = rw.node(m["root"]).inputs
    other = a if b == m["lin"] else b
    if rw.shape(other) != rw.shape(m["root"]) or rw.shape(m["lin"]) != rw.shape(m["root"]):
        raise Refusal(f"the operands of %{m['root']} differ in shape (broadcast)")
    lin = view(rw, m["lin"], through_bias=False)
    assert lin is not None
    return emit(rw, lin.then(step("residual", other)), like=[*lin.covers, m["root"]])


NORM_RESIDUAL_RULES = (
    # norm(a + b), the sum read by nothing else: the norm kernel adds b as it loads a row
    # (post-norm blocks, BERT's embedding sum)
    Rule("residual-before-norm", Pat(ANY_NORM, "root", (Pat({Op.ADD}, "sum", one_use=True),)),
         _add_before_norm),
    # a + norm(y), the norm read by nothing else: the norm kernel adds a to its output
    # (sandwich blocks: x + post_norm(sublayer(x)))
    Rule("residual-after-norm", Pat({Op.ADD}, "root", (None, Pat(ANY_NORM, "n", one_use=True))),
         _add_after_norm),
    Rule("residual-after-norm", Pat({Op.ADD}, "root", (Pat(ANY_NORM, "n", one_use=True),)),
         _add_after_norm),
)

LINEAR_RESIDUAL_RULES = (
    # r + (x·Wᵀ + …): the epilogue reads r and adds it before the store
    Rule("residual-epilogue", Pat({Op.ADD}, "root", (None, Pat(LINEAR, "lin", one_use=True))),
         _residual_epilogue),
    Rule("residual-epilogue", Pat({Op.ADD}, "root", (Pat(LINEAR, "lin", one_use=True),)),
         _residual_epilogue),
)


# 1. Adds that feed only a norm, or that add a norm's output, go into that norm kernel.
# 2. Remaining adds with an operand computed by a matmul read only by the add go into that
#    matmul's epilogue as residual(r).
register_rule_pass("fuse-residual",
                   "residual adds join the norm after them, the norm before them, or the matmul "
                   "that produced an operand",
                   NORM_RESIDUAL_RULES, LINEAR_RESIDUAL_RULES)
