"""fold-biases: drop the biases that provably do not change the output, fold the rest forward.

Three rules. Zero biases vanish. A key bias is dropped when softmax cannot see it. A value bias
moves through attention — softmax or linear — into the output projection's bias.
"""

from __future__ import annotations

from archc.ir.attrs import Call
from archc.ir.graph import Graph
from archc.ir.ops import Op
from archc.passes.context import PassContext, Refusal
from archc.passes.linear import (
    Linear,
    Step,
    bias_of,
    merged_name,
    replace_linear,
    view,
    view_with_bias,
)
from archc.passes.patterns import Pat, Rule, apply_rules
from archc.passes.registry import register_pass
from archc.passes.rewrite import Rewriter
from archc.passes.sites import ScoreChain, modifier, score_chain, trace_up

# Score modifiers that keep a per-row constant a per-row constant (scaled, shifted or replaced).
SHIFT_SAFE = frozenset({"scale", "alibi", "rel_bias", "mask"})


def is_zeros(rw: Rewriter, i: int) -> bool:
    n = rw.node(i)
    expr = n.attr("expr") if n.op == Op.PARAM else None
    return isinstance(expr, Call) and expr.fn == "zeros"


def _drop_zero_bias_add(rw: Rewriter, m: dict[str, int]) -> int | None:
    found = bias_of(rw, m["root"])
    return found[0] if found is not None and is_zeros(rw, found[1]) else None


def _drop_zero_bias_step(rw: Rewriter, m: dict[str, int]) -> int | None:
    lin = view(rw, m["root"])
    assert lin is not None
    steps = tuple(s for s in lin.steps if not (s.fn == "bias" and is_zeros(rw, s.inputs[0])))
    if steps == lin.steps:
        return None
    return replace_linear(rw, lin, lin.replace(steps=steps))


ZERO_BIAS_RULES = (
    # x + 0 = x
    Rule("zero-bias", Pat({Op.ADD}, "root"), _drop_zero_bias_add),
    # acc + 0 = acc: a bias step over a zeros() parameter does nothing
    Rule("zero-bias", Pat({Op.FUSED_LINEAR}, "root"), _drop_zero_bias_step),
)


def _projection_bias(rw: Rewriter, start: int) -> tuple[list[int], int | None]:
    """From an attention operand up to its projection: the path, and the bias_add at its end
    (None when the projection has no separate bias)."""
    path, end = trace_up(rw, start)
    found = bias_of(rw, end)
    if found is not None and view(rw, found[0], through_bias=False) is not None:
        return path, end
    return path, None


def _key_bias(rw: Rewriter, chain: ScoreChain, ctx: PassContext) -> None:
    path, bias = _projection_bias(rw, rw.node(chain.scores).inputs[1])
    if bias is None:
        return
    try:
        for i in path:
            op = rw.op(i)
            if op == Op.ROPE:
                raise Refusal(f"rope %{i} rotates k after its bias: q·R_j·b varies with the "
                              "key position j, so it is not constant along the softmax row")
            if op == Op.NORM:
                raise Refusal(f"{op.value} %{i} (qk-norm) normalizes k after its bias, which "
                              "is not linear")
        for i in chain.modifiers:
            if modifier(rw, i) not in SHIFT_SAFE:
                raise Refusal(f"{modifier(rw, i)} %{i} between scores and softmax is not "
                              "linear, so the row constant q·b does not pass through it "
                              "unchanged")
        for i in [bias, *path]:
            if len(rw.users(i)) != 1:
                raise Refusal(f"%{i} ({rw.op(i).value}) is read outside this attention")
    except Refusal as r:
        ctx.refused("key-bias", rw.describe(bias), r.why)
        return
    # softmax_j(q·(k_j + b)) = softmax_j(q·k_j + q·b) = softmax_j(q·k_j): q·b is constant in j
    rw.replace(bias, bias_of(rw, bias)[0])  # type: ignore[index]
    ctx.applied("key-bias", rw.describe(bias),
                "dropped: a key bias is constant along each softmax row")


def _add_output_bias(rw: Rewriter, o: Linear, extra: Call, v_bias: int, like: int) -> None:
    """Add `extra` (an expression of a vector) to the output projection's bias."""
    dtype = rw.node(o.weight).dtype
    old = [s for s in o.steps if s.fn == "bias"]
    # named after both biases: layers.0.attn.o.bias + layers.0.attn.v.bias → layers.0.attn.o+v.bias
    o_bias = rw.node(o.weight).name.removesuffix(".weight") + ".bias"
    base = merged_name([o_bias, rw.node(v_bias).name])
    expr = Call("add", (rw.param_expr(old[0].inputs[0]), extra)) if old else extra
    b = rw.add_param(base, expr, (rw.shape(o.weight)[0],), dtype, like=[like], at=o.root)
    if o.steps == () and rw.op(o.root) == Op.MATMUL:
        new = rw.emit(Op.ADD, [o.root, b], like=[like], at=o.root)
        for u in rw.users(o.root):
            if u != new:
                n = rw.node(u)
                rw.rewire(u, [new if j == o.root else j for j in n.inputs])
        return
    if o.steps and o.steps[-1].fn == "bias" and bias_of(rw, o.root) is not None:
        new = rw.emit(Op.ADD, [bias_of(rw, o.root)[0], b], like=[o.root, like])  # type: ignore
        rw.replace(o.root, new)
        return
    steps = tuple(Step(s.call, (b,)) if s.fn == "bias" else s for s in o.steps)
    if not old:
        steps = steps + (Step(Call("bias"), (b,)),)
    replace_linear(rw, o, o.replace(steps=steps))


def _softmax_value_bias(rw: Rewriter, chain: ScoreChain, ctx: PassContext) -> None:
    assert chain.wsum is not None
    mask = chain.modifier(rw, "mask")
    padded = None
    if mask is not None and rw.node(mask).attr("padding"):
        padded = (f"mask %{mask} takes a padding mask: a fully padded row has no "
                  "probabilities summing to 1 to carry the bias through")
    _value_bias(rw, rw.node(chain.wsum).inputs[1], chain.merge, chain.problem, padded, ctx)


def _linear_value_bias(rw: Rewriter, att: int, ctx: PassContext) -> None:
    # out_i = φq_i·S_i / φq_i·z_i with S_i = Σ_j φk_j v_jᵀ and z_i = Σ_j φk_j: the weights
    # φq_i·φk_j / φq_i·z_i are positive (φ = elu + 1 > 0) and sum to 1 over j ≤ i, so a bias on
    # every v_j comes out whole, as through softmax; the heads come out merged
    _value_bias(rw, rw.node(att).inputs[2], att, "", None, ctx)


def _value_bias(rw: Rewriter, v_in: int, merge: int | None, no_merge: str,
                refusal: str | None, ctx: PassContext) -> None:
    """Move the bias of the value projection feeding `v_in` into the output projection reading
    `merge` (the heads merged), when each output row is a weighted average of the values."""
    path, bias = _projection_bias(rw, v_in)
    if bias is None:
        return
    try:
        if refusal is not None:
            raise Refusal(refusal)
        for i in path:
            if rw.op(i) not in (Op.SPLIT_HEADS, Op.KV_CACHE, Op.REPEAT_KV):
                raise Refusal(f"{rw.op(i).value} %{i} acts on v after its bias")
        for i in [bias, *path]:
            if len(rw.users(i)) != 1:
                raise Refusal(f"%{i} ({rw.op(i).value}) is read outside this attention")
        if merge is None:
            raise Refusal(no_merge)
        users = rw.users(merge)
        o = view_with_bias(rw, users[0]) if len(users) == 1 else None
        if o is None or o.operands != (merge,):
            raise Refusal(f"the attention output %{merge} is not read by one output "
                          "projection")
        if o.prologue or any(s.fn != "bias" for s in o.steps):
            raise Refusal(f"the output projection %{o.root} already has an epilogue")
        if rw.op(o.weight) != Op.PARAM:
            raise Refusal(f"the output projection weight %{o.weight} is not a parameter")
        b_v = bias_of(rw, bias)[1]  # type: ignore[index]
        kv_width = int(rw.shape(b_v)[0])
        heads_width = rw.width(merge)
        split = next(i for i in path if rw.op(i) == Op.SPLIT_HEADS)
        kv_heads = rw.node(split).attr("heads")
        groups = heads_width // kv_width
        expanded = rw.param_expr(b_v) if groups == 1 else Call(
            "repeat_heads", (rw.param_expr(b_v),), (("groups", groups), ("heads", kv_heads)))
    except Refusal as r:
        ctx.refused("value-bias", rw.describe(bias), r.why)
        return
    # Σ_j p_ij (v_j + b_v) W_oᵀ + b_o = (Σ_j p_ij v_j) W_oᵀ + (W_o b_v + b_o),  as Σ_j p_ij = 1;
    # query head h reads KV head h // g, so b_v is repeated g times along the merged heads.
    _add_output_bias(rw, o, Call("mm", (rw.param_expr(o.weight), expanded)), b_v, like=bias)
    rw.replace(bias, bias_of(rw, bias)[0])  # type: ignore[index]
    ctx.applied("value-bias", rw.describe(bias), "folded into the output projection's bias")


@register_pass("fold-biases", "exact",
               "drop zero and key biases; fold value biases through attention (softmax or "
               "linear) into the output-projection bias")
def fold_biases(g: Graph, ctx: PassContext) -> Graph:
    # 1. Zero biases: apply the zero-bias rules to a fixed point.
    # 2. For each decomposed attention, follow scores → modifiers → softmax → weighted_sum.
    # 3. Key bias: trace k up to its projection; drop the bias if only views, the cache and
    #    repeat_kv lie between, and only shift-safe modifiers lie between scores and softmax.
    # 4. Value bias: trace v up to its projection; if no row can be fully masked and the heads
    #    go straight into one output projection, move the bias into that projection's bias.
    # 5. Linear attention: the value bias likewise (its weights are positive and sum to 1).
    rw = Rewriter(g, ctx)
    apply_rules(rw, ZERO_BIAS_RULES)
    for i in rw.order():
        if rw.op(i) == Op.LINEAR_ATTENTION:
            _linear_value_bias(rw, i, ctx)
        if rw.op(i) != Op.SCORES:
            continue
        chain = score_chain(rw, i)
        if chain.softmax is None or chain.wsum is None:
            continue
        _key_bias(rw, chain, ctx)
        _softmax_value_bias(rw, chain, ctx)
    return rw.finish()
