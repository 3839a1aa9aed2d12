"""absorb-mla: multi-head latent attention reads its cached latent in place of per-head keys
and values (DeepSeek-V2 §2.1.2).

Lowered, each step projects every cached latent c up to the heads' keys and values,
k_h = K_h·c and v_h = V_h·c (`kv_b`, [H·(nope + v), r]), over all P + T keys. Since

    q_h·k_hᵀ = q_h·(K_h·c)ᵀ = (q_h·K_h)·cᵀ   and   Σ_j p_hj·V_h·c_j = V_h·(Σ_j p_hj·c_j),

the key up-projection moves to the query side (q_h·K_h: T rows, not P + T) and the value
up-projection after the value sum, and attention runs over the latent itself: one "KV head" of
kv_rank dims (plus the shared RoPE key) for every query head, the latent its values too. Both
up-projections become `head_linear` nodes over one weight per head, cut from kv_b at load.

The choice is the cost model's: the pass compares the two forms' FLOPs and bytes (the nodes it
replaces against those it makes) for a decode step at DECODE_CONTEXT and a prefill of
PREFILL_TOKENS, and absorbs where the decode step is cheaper. One graph serves prefill and
decode, so a prefill runs the absorbed form too; the decision says what that costs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import sympy

from archc.ir.attrs import Call
from archc.ir.cost import Cost, op_cost
from archc.ir.ops import Op
from archc.ir.ops.base import make_sig
from archc.passes.rewrite import Refusal, Rewriter, register_rewrite_pass

NAME = "absorb-mla"
DECODE_CONTEXT = 4096   # keys a decode step attends over, where the forms are compared
PREFILL_TOKENS = 512    # tokens of the prefill compared


def _only_user(rw: Rewriter, i: int, op: Op) -> int:
    users = rw.users(i)
    if len(users) != 1 or rw.op(users[0]) != op:
        raise Refusal(f"%{i} ({rw.op(i).value}) is read by "
                      f"{', '.join(rw.op(u).value for u in users) or 'nothing'}, not by one "
                      f"{op.value}")
    return users[0]


def _cost(rw: Rewriter, nodes: Iterable[int], dims: Mapping[str, int]) -> tuple[int, int]:
    """FLOPs and bytes of `nodes` at `dims`, from the op table."""
    costs = [op_cost(rw.nodes[i].op, make_sig(
        rw.nodes[i].op, [rw.nodes[j].shape for j in rw.nodes[i].inputs],
        [rw.nodes[j].dtype for j in rw.nodes[i].inputs], rw.nodes[i].attrs, rw.nodes[i].shape,
        rw.nodes[i].dtype)) for i in nodes]
    return Cost(sympy.Add(*[c.flops for c in costs]), sympy.Add(*[c.bytes for c in costs])).at(dims)


def _compare(rw: Rewriter, old: list[int], new: list[int]) -> tuple[bool, str]:
    """Whether the absorbed form (`new`) is cheaper for a decode step, and the figures."""
    decode = {"B": 1, "T": 1, "P": DECODE_CONTEXT - 1, "S": 0}
    prefill = {"B": 1, "T": PREFILL_TOKENS, "P": 0, "S": 0}
    (df_old, db_old), (df_new, db_new) = _cost(rw, old, decode), _cost(rw, new, decode)
    (pf_old, _), (pf_new, _) = _cost(rw, old, prefill), _cost(rw, new, prefill)
    better = db_new < db_old and df_new <= df_old
    text = (f"a decode step at context {DECODE_CONTEXT}: {df_new:,} FLOPs and {db_new:,} bytes "
            f"absorbed against {df_old:,} and {db_old:,} expanded, a {PREFILL_TOKENS}-token "
            f"prefill: {pf_new:,} FLOPs against {pf_old:,}")
    return better, text


def _absorb(rw: Rewriter, cache: int) -> tuple[list[tuple[int, int]], str]:
    """The (old, new) node replacements that absorb the up-projections of the latent cached
    by `cache`, and what the cost model said."""
    merge = _only_user(rw, cache, Op.MERGE_HEADS)
    up = _only_user(rw, merge, Op.MATMUL)
    split = _only_user(rw, up, Op.SPLIT_HEADS)
    cuts = rw.users(split)
    if len(cuts) != 2 or any(rw.op(u) != Op.SLICE for u in cuts):
        raise Refusal(f"the heads %{split} projected up from the latent are not cut in two, "
                      "keys and values")
    k_cut, v_cut = sorted(cuts, key=lambda u: rw.nodes[u].attr("start"))
    scores = _only_user(rw, k_cut, Op.SCORES)
    wsum = _only_user(rw, v_cut, Op.WEIGHTED_SUM)
    if rw.nodes[scores].inputs[1] != k_cut or rw.nodes[wsum].inputs[1] != v_cut:
        raise Refusal(f"the latent's keys %{k_cut} and values %{v_cut} are not what scores "
                      "and the value sum read as keys and values")
    heads, nope = int(rw.shape(split)[1]), int(rw.shape(k_cut)[3])
    v_dim = int(rw.shape(v_cut)[3])
    weight = rw.nodes[up].inputs[1]
    expr = rw.param_expr(weight)
    dtype = rw.nodes[weight].dtype
    rank = int(rw.shape(weight)[1])

    def per_head(start: int, stop: int) -> Call:
        return Call("head_rows", (expr,), (("heads", heads), ("start", start), ("stop", stop)))
    base = rw.nodes[weight].name.removesuffix(".weight")
    w_key = rw.add_param(f"{base}.key_up", Call("t", (per_head(0, nope),)),
                         (heads, rank, nope), dtype, like=[weight], at=scores)
    w_value = rw.add_param(f"{base}.value_up", per_head(nope, nope + v_dim),
                           (heads, v_dim, rank), dtype, like=[weight], at=wsum)
    q = rw.nodes[scores].inputs[0]
    q_latent = rw.emit(Op.HEAD_LINEAR, [q, w_key], like=[scores])      # (B, H, T, r)
    new_scores = rw.emit(Op.SCORES, [q_latent, cache], like=[scores])
    probs = rw.nodes[wsum].inputs[0]
    summed = rw.emit(Op.WEIGHTED_SUM, [probs, cache], like=[wsum])     # (B, H, T, r)
    # the heads merged by the up-projection's stores where a merge_heads alone reads them
    users = rw.users(wsum)
    merge = users[0] if len(users) == 1 and rw.op(users[0]) == Op.MERGE_HEADS else None
    out = rw.emit(Op.HEAD_LINEAR, [summed, w_value], like=[wsum] if merge is None else
                  [wsum, merge], merged=merge is not None)   # (B, H, T, v) or (B, T, H·v)
    better, text = _compare(rw, [up, scores, wsum], [q_latent, new_scores, summed, out])
    if not better:
        raise Refusal("the expanded form costs less: " + text, profitability=True)
    return [(scores, new_scores), (wsum if merge is None else merge, out)], text


@register_rewrite_pass(NAME, "latent attention: the key up-projection to the query side, the "
                       "value up-projection after the value sum, attention over the cached "
                       "latent (where the cost model finds a decode step cheaper)")
def absorb_mla(rw: Rewriter) -> None:
    for i in rw.order():
        n = rw.nodes[i]
        if n.op != Op.KV_CACHE or n.attr("kind") != "latent":
            continue
        found = rw.attempt(NAME, i, _absorb, rw, i)
        if found is not None:
            pairs, text = found
            for old, new in pairs:
                rw.replace(old, new)
            rw.ctx.applied(NAME, i, f"layer {n.attr('layer')} attends over its latent; {text} "
                           "(one graph serves both)")
