"""Merging projections: Q/K/V into one matmul, gate and up into one with a GLU epilogue, and the
two halves of a parallel block into one matmul in and one out.

Shared algebra: linear layers over the same input are one linear layer with their weight rows
concatenated, x·[W₁; W₂]ᵀ = [x·W₁ᵀ, x·W₂ᵀ]; each old output is a column slice of the new one.
Epilogue steps that act column by column (row scale of a folded norm, bias, activation on a
column range) concatenate too; RoPE and the KV-cache write stay valid for the first member, whose
columns do not move.
"""

from __future__ import annotations

from collections.abc import Sequence

import archc.ir.expr as E
from archc.ir.ops import Op
from archc.passes.attention import score_chain, trace_up
from archc.passes.linear import LINEAR, Linear, Step, cat_params, emit, merged_name, step, view
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.rewrite import Refusal, Rewriter, register_rewrite_pass


def _split(lin: Linear, first: bool) -> tuple[Step | None, int | None, list[Step]]:
    """A member's epilogue as (row scale of a folded norm, bias vector, the column-wise rest)."""
    scale: Step | None = None
    bias: int | None = None
    tail: list[Step] = []
    for k, s in enumerate(lin.steps):
        if s.fn in ("rms_scale", "ln_scale") and k == 0:
            scale = s
        elif s.fn == "bias" and bias is None and not tail:
            bias = s.inputs[0]
        elif s.fn == "act" or (first and s.fn in ("rope", "kv_write")):
            tail.append(s)
        else:
            raise Refusal(f"%{lin.root} has a {s.fn} step, which does not act column by column")
    return scale, bias, tail


def concat_rows(rw: Rewriter, members: Sequence[Linear], acts: Sequence[int | None] = (),
                ) -> tuple[Linear, list[int]]:
    """One linear layer computing every member's columns side by side, and each member's column
    offset; `acts[i]`, an act node reading member i, becomes act(start, stop) over its columns."""
    first = members[0]
    for m in members[1:]:
        if m.operands != first.operands:
            raise Refusal(f"%{first.root} and %{m.root} read different inputs")
        if (m.prologue, m.eps) != (first.prologue, first.eps):
            raise Refusal(f"%{first.root} and %{m.root} have different prologues")
        if m.gain != first.gain:   # the merged layer scales x by one gain, or none
            raise Refusal(f"%{first.root} and %{m.root} scale their input by different gains")
    if len(first.operands) != 1:
        raise Refusal(f"%{first.root} already concatenates two operands along K")
    forms = [_split(m, k == 0) for k, m in enumerate(members)]
    scales = {scale.fn if scale else None for scale, _, _ in forms}
    if len(scales) > 1:
        raise Refusal("the members fold different norms: " + ", ".join(map(str, scales)))
    dtypes = {rw.nodes[m.weight].dtype for m in members}
    if len(dtypes) > 1:
        raise Refusal(f"weights of different dtypes {sorted(dtypes)}")
    widths = [int(rw.shape(m.weight)[0]) for m in members]
    offsets = [sum(widths[:k]) for k in range(len(members))]
    like = [c for m in members for c in m.covers]
    at = min((m.root for m in members), key=rw.key.__getitem__)

    def vector(parts: list[int | None], dtype: str) -> int:
        """The members' vectors side by side, zeros where a member has none."""
        names = [rw.nodes[p].name for p in parts if p is not None]
        return rw.add_param(
            merged_name(names) if len(names) > 1 else names[0] + ".padded",
            E.call("cat", *(rw.param_expr(p) if p is not None else E.call("zeros", shape=(w,))
                            for p, w in zip(parts, widths)), dim=0),
            (sum(widths),), dtype, like=like, at=at)

    weight = cat_params(rw, [m.weight for m in members], 0, like=like, at=at)
    scale = forms[0][0]
    steps: list[Step] = []
    if scale is not None:     # rms_scale as it is; ln_scale's column sums concatenate
        steps.append(scale if scale.fn == "rms_scale" else step("ln_scale", vector(
            [s.inputs[0] for s, _, _ in forms], rw.nodes[scale.inputs[0]].dtype)))
    if any(b is not None for _, b, _ in forms):
        steps.append(step("bias", vector([b for _, b, _ in forms], rw.nodes[first.weight].dtype)))
    for (_, _, tail), off, w, act in zip(forms, offsets, widths, acts or [None] * len(members)):
        steps += [step("act", fn=s.call.kw("fn"), start=off + s.call.kw("start", 0),
                       stop=off + s.call.kw("stop", w)) if s.fn == "act" else s for s in tail]
        if act is not None:
            steps.append(step("act", fn=rw.nodes[act].attr("fn"), start=off, stop=off + w))
    return Linear(at, first.operands, weight, first.prologue, first.eps, tuple(steps),
                  covers=tuple(like), gain=first.gain), offsets


def emit_with_slices(rw: Rewriter, merged: Linear, members: Sequence[Linear],
                     offsets: Sequence[int], acts: Sequence[int | None] = ()) -> int:
    """Emit `merged`; every member's output (or its absorbed act) becomes a column slice."""
    new = emit(rw, merged, like=list(merged.covers), at=merged.root)
    for m, off, act in zip(members, offsets, acts or [None] * len(members)):
        out = m.root if act is None else act
        sl = rw.emit(Op.SLICE, [new], like=[out], start=off, stop=off + int(rw.shape(m.weight)[0]))
        rw.replace(out, sl)
        for u in rw.users(sl):   # a slice of a slice is one slice
            if rw.op(u) == Op.SLICE:
                n = rw.nodes[u]
                rw.replace(u, rw.emit(Op.SLICE, [new], like=[u], start=off + n.attr("start"),
                                      stop=off + n.attr("stop")))
    return new


def _projections(rw: Rewriter, site: int) -> list[tuple[list[int], Linear]]:
    """The linear layers of q, k and v (in that order, each with the path up to it) when `site`
    is attention: softmax (decomposed at its `scores`, or flash) or linear; else []."""
    n = rw.nodes[site]
    operands: tuple[int, ...] = ()
    if n.op == Op.SCORES:
        wsum = score_chain(rw, site).wsum
        operands = () if wsum is None else (*n.inputs, rw.nodes[wsum].inputs[1])
    elif n.op in (Op.ATTENTION, Op.LINEAR_ATTENTION):
        operands = n.inputs[:1] if n.attr("cache_layer") is not None else n.inputs[:3]
    found = [trace_up(rw, i) for i in operands]
    return [(path, lin) for path, end in found if (lin := view(rw, end)) is not None]


@register_rewrite_pass("merge-qkv", "q, k and v projections of one input → one matmul over "
                       "concatenated weights")
def merge_qkv(rw: Rewriter) -> None:
    # 1. For each attention site, trace q, k and v up to their projections (a slice on the
    #    way: merged already) and group those that read one input: q, k, v of self-attention;
    #    k and v of cross-attention (q reads the decoder, k and v the encoder).
    # 2. Concatenate their weight rows in q, k, v order (a RoPE epilogue rotates the first
    #    heads) into one linear; each projection's output becomes a column slice of it.
    for site in rw.order():
        groups: dict[int, list[Linear]] = {}
        for path, lin in _projections(rw, site):
            if not any(rw.op(j) == Op.SLICE for j in path):
                groups.setdefault(lin.x, []).append(lin)
        for members in [ms for ms in groups.values() if len(ms) > 1]:
            found = rw.attempt("merge-qkv", members[0].root, concat_rows, rw, members)
            if found is not None:
                emit_with_slices(rw, found[0], members, found[1])
                rw.ctx.applied("merge-qkv", members[0].root, f"{len(members)} projections in one")


def _glu(rw: Rewriter, m: Bindings) -> int | None:
    gate, up = view(rw, m["gate"]), view(rw, m["up"])
    if gate is None or up is None:
        return None
    if any(s.fn not in ("rms_scale", "ln_scale", "bias") for s in (*gate.steps, *up.steps)):
        raise Refusal("gate or up already has a nonlinear epilogue")
    merged, _ = concat_rows(rw, [gate, up])
    return emit(rw, merged.then(step("glu", fn=rw.nodes[m["act"]].attr("fn"))),
                like=[*gate.covers, m["act"], *up.covers, m["root"]], at=m["root"])


# act(x·W_gᵀ)·(x·W_uᵀ) = act(acc[:, :F])·acc[:, F:],  acc = x·[W_g; W_u]ᵀ: one linear with weight
# [W_g; W_u] and epilogue glu(fn), when the gate pre-activation, the activation and the up
# projection are read by this product only (the 2·d_ff intermediate is never stored)
register_rule_pass("fuse-glu", "gated FFN: gate and up in one matmul whose epilogue computes "
                   "act(gate)·up", (Rule("fuse-glu", Pat({Op.MUL}, "root", (
    Pat({Op.ACT}, "act", (Pat(LINEAR | {Op.ADD}, "gate", one_use=True),), one_use=True),
    Pat(LINEAR | {Op.ADD}, "up", one_use=True))), _glu),))


def _parallel_sum(rw: Rewriter, outer: int) -> tuple[int | None, int | None, Linear, Linear] | None:
    """(inner add, residual, A, F) for add(add(x, A), F), A and F linear layers; or
    (None, None, A, F) for add(A, F) read only by an all_reduce: a tensor-parallel rank's
    partial sums of the block, its residual added after the all_reduce."""
    a, b = rw.nodes[outer].inputs
    if [rw.op(u) for u in rw.users(outer)] == [Op.ALL_REDUCE]:
        a_lin, f_lin = view(rw, a), view(rw, b)
        return None if a_lin is None or f_lin is None else (None, None, a_lin, f_lin)
    for inner, f in ((a, b), (b, a)):
        f_lin = view(rw, f)
        if rw.op(inner) != Op.ADD or rw.users(inner) != [outer] or f_lin is None:
            continue
        x, y = rw.nodes[inner].inputs
        for res, att in ((x, y), (y, x)):
            a_lin = view(rw, att)
            if a_lin is not None and rw.shape(res) == rw.shape(outer):
                return inner, res, a_lin, f_lin
    return None


def _merge_out(rw: Rewriter, outer: int, inner: int | None, res: int | None, a: Linear,
               f: Linear) -> int:
    # x + (a·W_Aᵀ + b_A) + (h·W_Fᵀ + b_F) = [a, h]·[W_A, W_F]ᵀ + (b_A + b_F) + x (no x: no
    # residual step)
    for m, reader in ((a, outer if inner is None else inner), (f, outer)):
        if rw.users(m.root) != [reader]:
            raise Refusal(f"%{m.root} is read outside the block's sum")
        if m.prologue or len(m.operands) != 1 or any(s.fn != "bias" for s in m.steps):
            raise Refusal(f"%{m.root} has a prologue or a non-bias epilogue")
    if rw.shape(a.weight)[0] != rw.shape(f.weight)[0]:
        raise Refusal("the two projections have different output widths")
    at = min(a.root, f.root, key=rw.key.__getitem__)
    like = [*a.covers, *f.covers, *([] if inner is None else [inner]), outer]
    weight = cat_params(rw, [a.weight, f.weight], 1, like=like, at=at)
    biases = [s.inputs[0] for m in (a, f) for s in m.steps]
    steps: list[Step] = []
    if biases:
        exprs = [rw.param_expr(b) for b in biases]
        bias = rw.add_param(merged_name([rw.nodes[b].name for b in biases]),
                            exprs[0] if len(exprs) == 1 else E.call("add", *exprs),
                            (rw.shape(a.weight)[0],), rw.nodes[a.weight].dtype, like=like, at=at)
        steps.append(step("bias", bias))
    residual = () if res is None else (step("residual", res),)
    return emit(rw, Linear(at, (a.x, f.x), weight, steps=(*steps, *residual),
                           covers=tuple(like)), like=like, at=outer)


def _ffn_input(rw: Rewriter, h: int) -> tuple[Linear, int | None] | None:
    """The FFN's input projection behind hidden h: act(U) → (U, act), or U with its
    activation already in the epilogue → (U, None)."""
    if rw.op(h) != Op.ACT:
        lin = view(rw, h)
        return (lin, None) if lin is not None else None
    lin = view(rw, rw.nodes[h].inputs[0])
    return (lin, h) if lin is not None and rw.users(lin.root) == [h] else None


def _merge_in(rw: Rewriter, members: list[Linear], acts: list[int | None]) -> int:
    if any(s.fn == "glu" for s in members[-1].steps):
        raise Refusal(f"the FFN projection %{members[-1].root} ends in glu, which pairs gate "
                      "and up columns and cannot share a matmul with other rows")
    merged, offsets = concat_rows(rw, members, acts)
    return emit_with_slices(rw, merged, members, offsets, acts)


@register_rewrite_pass("merge-parallel", "parallel blocks: attention and FFN input projections in "
                       "one matmul; attention-out and FFN-down in one matmul over the concatenated "
                       "hidden")
def merge_parallel(rw: Rewriter) -> None:
    # 1. A parallel block by its sum: add(add(x, A), F), A the attention output projection
    #    and F the FFN down projection, linear layers read only by the sum.
    # 2. Out: one linear over both hidden states concatenated along K, weight [W_A, W_F]
    #    (columns), bias b_A + b_F, and x as a residual epilogue.
    # 3. In: q/k/v and the FFN's up projection read the same (norm-folded) input: their rows
    #    concatenate, q/k/v first; the FFN activation becomes act over the up columns.
    for i in rw.order():
        found = _parallel_sum(rw, i) if rw.op(i) == Op.ADD and rw.users(i) else None
        if found is None:
            continue
        inner, res, a, f = found
        attn = list({lin.root: lin for _, lin in _projections(rw, a.x)}.values())
        ffn = _ffn_input(rw, f.x)
        out = rw.attempt("merge-parallel-out", i, _merge_out, rw, i, inner, res, a, f) \
            if attn and ffn is not None else None
        if out is None:
            continue
        rw.replace(i, out)
        rw.ctx.applied("merge-parallel-out", i, "attention-out and FFN-down in one matmul")
        up, act = ffn   # type: ignore[misc]
        if rw.attempt("merge-parallel-in", up.root, _merge_in, rw, [*attn, up],
                      [None] * len(attn) + [act]) is not None:
            rw.ctx.applied("merge-parallel-in", up.root,
                        f"{len(attn) + 1} input projections in one matmul")
