"""fold-biases: drop the biases that provably do not change the output, fold the rest forward."""

from __future__ import annotations

from collections.abc import Callable

import archc.ir.expr as E
from archc.ir.attrs import Call
from archc.ir.ops import Op
from archc.passes.attention import ScoreChain, modifier, score_chain, trace_up
from archc.passes.linear import Linear, bias_of, emit, merged_name, step, view, view_with_bias
from archc.passes.patterns import Bindings, Pat, Rule, apply_rules
from archc.passes.rewrite import Refusal, Rewriter, register_rewrite_pass

# Score modifiers that keep a per-row constant a per-row constant (scaled, shifted or replaced).
SHIFT_SAFE = frozenset({"scale", "alibi", "rel_bias", "mask"})


def is_zeros(rw: Rewriter, i: int) -> bool:
    return rw.op(i) == Op.PARAM and rw.param_expr(i).fn == "zeros"


def _drop_zero_bias(rw: Rewriter, m: Bindings) -> int | None:
    if rw.op(m["root"]) == Op.ADD:      # x + 0 = x
        found = bias_of(rw, m["root"])
        return found[0] if found is not None and is_zeros(rw, found[1]) else None
    # acc + 0 = acc: a bias step over a zeros() parameter does nothing
    lin = view(rw, m["root"])
    assert lin is not None
    steps = tuple(s for s in lin.steps if not (s.fn == "bias" and is_zeros(rw, s.inputs[0])))
    return None if steps == lin.steps else emit(rw, lin.replace(steps=steps), like=lin.covers)


ZERO_BIAS_RULES = (Rule("zero-bias", Pat({Op.ADD, Op.FUSED_LINEAR}, "root"), _drop_zero_bias),)


def _read_here(rw: Rewriter, nodes: list[int]) -> None:
    for i in nodes:
        if len(rw.users(i)) != 1:
            raise Refusal(f"%{i} ({rw.op(i).value}) is read outside this attention")


def _fold_bias(rw: Rewriter, rule: str, start: int, done: str,
               fold: Callable[..., int], *args: object) -> None:
    """Drop the bias add of the projection above attention operand `start` (up `path`) when
    `fold(rw, path, bias, *args)` may: it returns what the add reads besides the bias."""
    path, bias = trace_up(rw, start)
    found = bias_of(rw, bias)
    if found is None or view(rw, found[0], through_bias=False) is None:
        return
    x = rw.attempt(rule, bias, fold, rw, path, bias, *args)
    if x is not None:
        rw.replace(bias, x)
        rw.ctx.applied(rule, bias, done)


def _plain_softmax(rw: Rewriter, chain: ScoreChain) -> str | None:
    """Why the chain's normalizer is not a plain softmax, whose rows are invariant to a shift
    and sum to 1 (None when it is one)."""
    assert chain.softmax is not None
    n = rw.nodes[chain.softmax]
    if n.op == Op.SOFTMAX:
        return None
    nz = n.attr("normalizer")
    if nz.fn == "softmax" and nz.kw("sinks") is None:
        return None
    shown = ", ".join(f"{k}={v!r}" for k, v in nz.kwargs)
    return (f"normalize %{chain.softmax} is {nz.fn}({shown}): its weights neither ignore a "
            "shift of the scores nor sum to 1")


def _key_bias(rw: Rewriter, path: list[int], bias: int, chain: ScoreChain) -> int:
    # softmax_j(q·(k_j + b)) = softmax_j(q·k_j + q·b) = softmax_j(q·k_j): q·b is constant in j
    # (not with sinks: e^(s + c) / (e^sink + Σ e^(s + c)) depends on c; nor under a sigmoid)
    if (why := _plain_softmax(rw, chain)) is not None:
        raise Refusal(why)
    for i in path:
        if rw.op(i) == Op.ROPE:
            raise Refusal(f"rope %{i} rotates k after its bias: q·R_j·b varies with the "
                          "key position j, so it is not constant along the softmax row")
        if rw.op(i) == Op.NORM:
            raise Refusal(f"norm %{i} (qk-norm) normalizes k after its bias, which is not "
                          "linear")
    for i in chain.modifiers:
        if modifier(rw.nodes[i]) not in SHIFT_SAFE:
            raise Refusal(f"{modifier(rw.nodes[i])} %{i} between scores and softmax is not "
                          "linear, so the row constant q·b does not pass through it unchanged")
    _read_here(rw, [bias, *path])
    return bias_of(rw, bias)[0]  # type: ignore[index]


def _add_output_bias(rw: Rewriter, o: Linear, extra: Call, v_bias: int, like: int) -> None:
    """Add `extra` (an expression of a vector) to the output projection's bias."""
    old = [s.inputs[0] for s in o.steps if s.fn == "bias"]
    # named after both biases: layers.0.attn.o.bias + layers.0.attn.v.bias → layers.0.attn.o+v.bias
    name = merged_name([rw.nodes[o.weight].name.removesuffix(".weight") + ".bias",
                        rw.nodes[v_bias].name])
    b = rw.add_param(name, E.call("add", rw.param_expr(old[0]), extra) if old else extra,
                     (rw.shape(o.weight)[0],), rw.nodes[o.weight].dtype, like=[like], at=o.root)
    found = bias_of(rw, o.root)
    if not o.steps and rw.op(o.root) == Op.MATMUL:     # x·W_oᵀ → x·W_oᵀ + b
        new = rw.emit(Op.ADD, [o.root, b], like=[like], at=o.root)
        for u in rw.users(o.root):
            if u != new:
                rw.rewire(u, [new if j == o.root else j for j in rw.nodes[u].inputs])
    elif found is not None:                             # x·W_oᵀ + b_o → x·W_oᵀ + b
        rw.replace(o.root, rw.emit(Op.ADD, [found[0], b], like=[o.root, like]))
    else:                                               # an epilogue bias step reads b
        steps = tuple(step("bias", b) if s.fn == "bias" else s for s in o.steps)
        new = o.replace(steps=steps if old else (*steps, step("bias", b)))
        rw.replace(o.root, emit(rw, new, like=o.covers))


def _value_bias(rw: Rewriter, path: list[int], bias: int, merge: int | None, no_merge: str,
                refusal: str | None) -> int:
    """Move the value bias into the output projection reading the merged heads `merge`."""
    if refusal is not None:
        raise Refusal(refusal)
    for i in path:
        if rw.op(i) not in (Op.SPLIT_HEADS, Op.KV_CACHE, Op.REPEAT_KV):
            raise Refusal(f"{rw.op(i).value} %{i} acts on v after its bias")
    _read_here(rw, [bias, *path])
    if merge is None:
        raise Refusal(no_merge)
    users = rw.users(merge)
    o = view_with_bias(rw, users[0]) if len(users) == 1 else None
    if o is None or o.operands != (merge,):
        raise Refusal(f"the attention output %{merge} is not read by one output projection")
    if o.prologue or any(s.fn != "bias" for s in o.steps):
        raise Refusal(f"the output projection %{o.root} already has an epilogue")
    if rw.op(o.weight) != Op.PARAM:
        raise Refusal(f"the output projection weight %{o.weight} is not a parameter")
    # Σ_j p_ij (v_j + b_v) W_oᵀ + b_o = (Σ_j p_ij v_j) W_oᵀ + (W_o b_v + b_o),  as Σ_j p_ij = 1;
    # query head h reads KV head h // g, so b_v is repeated g times along the merged heads.
    x, b_v = bias_of(rw, bias)  # type: ignore[misc]
    groups = int(rw.shape(merge)[-1]) // int(rw.shape(b_v)[0])
    split = next(i for i in path if rw.op(i) == Op.SPLIT_HEADS)
    expanded = rw.param_expr(b_v) if groups == 1 else E.call(
        "repeat_heads", rw.param_expr(b_v), groups=groups, heads=rw.nodes[split].attr("heads"))
    _add_output_bias(rw, o, E.call("mm", rw.param_expr(o.weight), expanded), b_v, like=bias)
    return x


@register_rewrite_pass("fold-biases", "drop zero and key biases; fold value biases through "
                       "attention (softmax or linear) into the output-projection bias")
def fold_biases(rw: Rewriter) -> None:
    # 1. Zero biases: the zero-bias rule, to a fixed point.
    # 2. Key bias (softmax only: φ(k + b) is not φ(k) shifted): trace k up to its projection;
    #    drop the bias if only views, the cache and repeat_kv lie between, and only shift-safe
    #    modifiers between scores and softmax.
    # 3. Value bias: trace v up to its projection; if no row can be fully masked and the heads
    #    go straight into one output projection, move the bias into that projection's bias.
    #    Neither 2 nor 3 under sinks or a sigmoid: their weights see a shift and need not sum
    #    to 1.
    #    Linear attention likewise: out_i = φq_i·S_i / φq_i·z_i, S_i = Σ_j φk_j v_jᵀ,
    #    z_i = Σ_j φk_j, so the weights φq_i·φk_j / φq_i·z_i are positive (φ = elu + 1 > 0) and
    #    sum to 1 over j ≤ i, as softmax's do; the heads come out merged.
    apply_rules(rw, ZERO_BIAS_RULES)
    moved = "folded into the output projection's bias"
    for i in rw.order():
        if rw.op(i) == Op.LINEAR_ATTENTION:
            _fold_bias(rw, "value-bias", rw.nodes[i].inputs[2], moved, _value_bias, i, "", None)
        chain = score_chain(rw, i) if rw.op(i) == Op.SCORES else None
        if chain is None or chain.wsum is None:
            continue
        _fold_bias(rw, "key-bias", rw.nodes[i].inputs[1],
                   "dropped: a key bias is constant along each softmax row", _key_bias, chain)
        mask = next((j for j in chain.modifiers if rw.op(j) == Op.MASK), None)
        padded = mask is not None and rw.nodes[mask].attr("padding")
        _fold_bias(rw, "value-bias", rw.nodes[chain.wsum].inputs[1], moved, _value_bias,
                   chain.merge, chain.problem,
                   _plain_softmax(rw, chain) or (
                       f"mask %{mask} takes a padding mask: a fully padded row has no "
                       "probabilities summing to 1 to carry the bias through" if padded
                       else None))
