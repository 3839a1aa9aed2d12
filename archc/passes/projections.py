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
from dataclasses import dataclass

from archc.ir.attrs import Call
from archc.ir.graph import Graph
from archc.ir.ops import Op
from archc.passes.context import PassContext, Refusal
from archc.passes.linear import Linear, Step, emit, merged_name, step, view
from archc.passes.registry import register_pass
from archc.passes.rewrite import Rewriter
from archc.passes.sites import MODIFIERS, attention_operands, attention_sites, trace_up

COLUMN_STEPS = ("act",)             # steps that move with their columns
FIRST_ONLY = ("rope", "kv_write")   # steps valid only where columns do not move


@dataclass(frozen=True)
class _Form:
    """A member's epilogue split into its column-wise parts."""

    scale: Step | None     # rms_scale or ln_scale (from a folded norm)
    bias: int | None       # the bias vector
    tail: tuple[Step, ...]  # act on columns; rope and kv_write (first member only)


def _form(rw: Rewriter, lin: Linear, first: bool) -> _Form:
    scale: Step | None = None
    bias: int | None = None
    tail: list[Step] = []
    for k, s in enumerate(lin.steps):
        if s.fn in ("rms_scale", "ln_scale") and k == 0:
            scale = s
        elif s.fn == "bias" and bias is None and not tail:
            bias = s.inputs[0]
        elif s.fn in COLUMN_STEPS or (first and s.fn in FIRST_ONLY):
            tail.append(s)
        else:
            raise Refusal(f"%{lin.root} has a {s.fn} step, which does not act column by column")
    return _Form(scale, bias, tuple(tail))


def concat_rows(rw: Rewriter, members: Sequence[Linear], acts: Sequence[int | None] = (),
                ) -> tuple[Linear, list[int]]:
    """One linear layer computing every member's columns side by side (in member order), and
    each member's column offset. `acts[i]` is an act node reading member i that becomes
    act(start, stop) over its columns. Raises Refusal when it would change the function."""
    acts = list(acts) or [None] * len(members)
    first = members[0]
    for m in members[1:]:
        if m.operands != first.operands:
            raise Refusal(f"%{first.root} and %{m.root} read different inputs")
        if (m.prologue, m.eps) != (first.prologue, first.eps):
            raise Refusal(f"%{first.root} and %{m.root} have different prologues")
    if len(first.operands) != 1:
        raise Refusal(f"%{first.root} already concatenates two operands along K")
    forms = [_form(rw, m, k == 0) for k, m in enumerate(members)]
    scales = {f.scale.fn if f.scale else None for f in forms}
    if len(scales) > 1:
        raise Refusal("the members fold different norms: " + ", ".join(map(str, scales)))
    dtypes = {rw.node(m.weight).dtype for m in members}
    if len(dtypes) > 1:
        raise Refusal(f"weights of different dtypes {sorted(dtypes)}")
    widths = [int(rw.shape(m.weight)[0]) for m in members]
    offsets = [sum(widths[:k]) for k in range(len(members))]
    total = sum(widths)
    dtype = dtypes.pop()
    like = [c for m in members for c in m.covers]
    at = min((m.root for m in members), key=lambda i: rw.key[i])
    names = [rw.node(m.weight).name for m in members]
    weight = rw.add_param(merged_name(names),
                          Call("cat", tuple(rw.param_expr(m.weight) for m in members),
                               (("dim", 0),)),
                          (total, rw.shape(first.weight)[1]), dtype, like=like, at=at)
    steps: list[Step] = []
    if forms[0].scale is not None and forms[0].scale.fn == "rms_scale":
        steps.append(forms[0].scale)
    elif forms[0].scale is not None:  # ln_scale: the column sums concatenate
        sums = [f.scale.inputs[0] for f in forms if f.scale is not None]
        colsum = rw.add_param(merged_name([rw.node(c).name for c in sums]),
                              Call("cat", tuple(rw.param_expr(c) for c in sums), (("dim", 0),)),
                              (total,), rw.node(sums[0]).dtype, like=like, at=at)
        steps.append(step("ln_scale", colsum))
    if any(f.bias is not None for f in forms):
        parts = [rw.param_expr(f.bias) if f.bias is not None else
                 Call("zeros", (), (("shape", (w,)),)) for f, w in zip(forms, widths)]
        named = [rw.node(f.bias).name for f in forms if f.bias is not None]
        bias = rw.add_param(merged_name(named) if len(named) > 1 else named[0] + ".padded",
                            Call("cat", tuple(parts), (("dim", 0),)), (total,), dtype,
                            like=like, at=at)
        steps.append(step("bias", bias))
    for f, off, w, act in zip(forms, offsets, widths, acts):
        for s in f.tail:
            if s.fn == "act":
                steps.append(step("act", fn=s.kw("fn"), start=off + s.kw("start", 0),
                                  stop=off + s.kw("stop", w)))
            else:
                steps.append(s)
        if act is not None:
            steps.append(step("act", fn=rw.node(act).attr("fn"), start=off, stop=off + w))
    merged = Linear(at, first.operands, weight, first.prologue, first.eps, tuple(steps),
                    covers=tuple(like))
    return merged, offsets


def emit_with_slices(rw: Rewriter, merged: Linear, members: Sequence[Linear],
                     offsets: Sequence[int], acts: Sequence[int | None] = ()) -> int:
    """Emit `merged`; every member's output (or its absorbed act) becomes a column slice."""
    acts = list(acts) or [None] * len(members)
    new = emit(rw, merged, like=list(merged.covers), at=merged.root)
    for m, off, act in zip(members, offsets, acts):
        out = act if act is not None else m.root
        w = int(rw.shape(m.weight)[0])
        sl = rw.emit(Op.SLICE, [new], like=[out], start=off, stop=off + w)
        rw.replace(out, sl)
        for u in rw.users(sl):   # a slice of a slice is one slice
            if rw.op(u) == Op.SLICE:
                n = rw.node(u)
                rw.replace(u, rw.emit(Op.SLICE, [new], like=[u], start=off + n.attr("start"),
                                      stop=off + n.attr("stop")))
    return new


def _projection(rw: Rewriter, operand: int) -> Linear | None:
    path, end = trace_up(rw, operand)
    if any(rw.op(i) == Op.SLICE for i in path):
        return None     # already a slice of a merged projection
    return view(rw, end)


# ---- merge-qkv -------------------------------------------------------------------------------

@register_pass("merge-qkv", "exact",
               "q, k and v projections of one input → one matmul over concatenated weights")
def merge_qkv(g: Graph, ctx: PassContext) -> Graph:
    # 1. For each attention site, trace q, k and v up through head views, per-head norms, RoPE,
    #    the cache and repeat_kv to their projections.
    # 2. Group the projections that read the same input: q, k and v of self-attention; k and v
    #    of cross-attention (q reads the decoder, k and v the encoder).
    # 3. Concatenate their weight rows in q, k, v order — the RoPE epilogue rotates the first
    #    heads — into one linear; each projection's output becomes a column slice of it.
    rw = Rewriter(g, ctx)
    for site in attention_sites(rw):
        ops = attention_operands(rw, site)
        if not ops or len(ops) < 3:
            continue
        projections = {role: _projection(rw, i) for role, i in ops.items()}
        groups: dict[int, list[Linear]] = {}
        for role in ("q", "k", "v"):
            lin = projections[role]
            if lin is None:
                continue
            groups.setdefault(lin.x, []).append(lin)
        for members in groups.values():
            if len(members) < 2:
                continue
            try:
                merged, offsets = concat_rows(rw, members)
            except Refusal as r:
                ctx.refused("merge-qkv", rw.describe(members[0].root), r.why)
                continue
            emit_with_slices(rw, merged, members, offsets)
            ctx.applied("merge-qkv", rw.describe(members[0].root),
                        f"{len(members)} projections in one")
    return rw.finish()


# ---- fuse-glu --------------------------------------------------------------------------------

def _glu_members(rw: Rewriter, mul: int) -> tuple[Linear, int, Linear] | None:
    """(gate, act, up) of mul(act(gate), up) in either order, or None if it is not that."""
    a, b = rw.node(mul).inputs
    for act, up in ((a, b), (b, a)):
        if rw.op(act) != Op.ACT:
            continue
        gate = view(rw, rw.node(act).inputs[0])
        up_lin = view(rw, up)
        if gate is not None and up_lin is not None:
            return gate, act, up_lin
    return None


@register_pass("fuse-glu", "exact",
               "gated FFN: gate and up in one matmul whose epilogue computes act(gate)·up")
def fuse_glu(g: Graph, ctx: PassContext) -> Graph:
    # 1. Find mul(act(x·W_gᵀ), x·W_uᵀ): gate and up projections of one input.
    # 2. Legal if the gate pre-activation, the activation and the up projection are read by
    #    this product only (the 2·d_ff intermediate is never stored).
    # 3. One linear with weight [W_g; W_u] and epilogue glu(fn):
    #    act(x·W_gᵀ)·(x·W_uᵀ) = act(acc[:, :F])·acc[:, F:],  acc = x·[W_g; W_u]ᵀ.
    rw = Rewriter(g, ctx)
    for i in rw.order():
        if rw.op(i) != Op.MUL or rw.is_dead(i):
            continue
        found = _glu_members(rw, i)
        if found is None:
            continue
        gate, act, up = found
        try:
            for node, reader in ((gate.root, act), (act, i), (up.root, i)):
                others = [u for u in rw.users(node) if u != reader]
                if others:
                    raise Refusal(f"%{node} ({rw.op(node).value}) is also read by "
                                  + ", ".join(f"%{u}" for u in others))
            if any(s.fn not in ("rms_scale", "ln_scale", "bias") for m in (gate, up)
                   for s in m.steps):
                raise Refusal("gate or up already has a nonlinear epilogue")
            merged, _ = concat_rows(rw, [gate, up])
        except Refusal as r:
            ctx.refused("fuse-glu", rw.describe(i), r.why)
            continue
        glu = merged.then(step("glu", fn=rw.node(act).attr("fn")))
        new = emit(rw, glu, like=[*gate.covers, act, *up.covers, i], at=i)
        rw.replace(i, new)
        ctx.applied("fuse-glu", rw.describe(i), f"glu({rw.node(act).attr('fn')}) epilogue")
    return rw.finish()


# ---- merge-parallel --------------------------------------------------------------------------

def _sum_of_two_linears(rw: Rewriter, outer: int) -> tuple[int, int, Linear, Linear] | None:
    """(inner add, residual, A, F) for add(add(x, A), F), A and F linear layers."""
    a, b = rw.node(outer).inputs
    for inner, f in ((a, b), (b, a)):
        if rw.op(inner) != Op.ADD or rw.users(inner) != [outer]:
            continue
        f_lin = view(rw, f)
        if f_lin is None:
            continue
        x, y = rw.node(inner).inputs
        for res, att in ((x, y), (y, x)):
            a_lin = view(rw, att)
            if a_lin is not None and rw.shape(res) == rw.shape(outer):
                return inner, res, a_lin, f_lin
    return None


def _merge_out(rw: Rewriter, outer: int, inner: int, res: int, a: Linear, f: Linear) -> int:
    for m, reader in ((a, inner), (f, outer)):
        if rw.users(m.root) != [reader]:
            raise Refusal(f"%{m.root} is read outside the block's sum")
        if m.prologue or len(m.operands) != 1 or any(s.fn != "bias" for s in m.steps):
            raise Refusal(f"%{m.root} has a prologue or a non-bias epilogue")
    if rw.shape(a.weight)[0] != rw.shape(f.weight)[0]:
        raise Refusal("the two projections have different output widths")
    dtype = rw.node(a.weight).dtype
    names = [rw.node(a.weight).name, rw.node(f.weight).name]
    at = a.root if rw.key[a.root] < rw.key[f.root] else f.root
    like = [*a.covers, *f.covers, inner, outer]
    k = rw.shape(a.weight)[1] + rw.shape(f.weight)[1]
    weight = rw.add_param(merged_name(names), Call("cat", (rw.param_expr(a.weight),
                                                           rw.param_expr(f.weight)),
                                                   (("dim", 1),)),
                          (rw.shape(a.weight)[0], k), dtype, like=like, at=at)
    biases = [s.inputs[0] for m in (a, f) for s in m.steps]
    steps: list[Step] = []
    if biases:
        expr = rw.param_expr(biases[0]) if len(biases) == 1 else Call(
            "add", tuple(rw.param_expr(b) for b in biases))
        name = merged_name([rw.node(b).name for b in biases])
        bias = rw.add_param(name, expr, (rw.shape(a.weight)[0],), dtype, like=like, at=at)
        steps.append(step("bias", bias))
    steps.append(step("residual", res))
    # x + (a·W_Aᵀ + b_A) + (h·W_Fᵀ + b_F) = [a, h]·[W_A, W_F]ᵀ + (b_A + b_F) + x
    out = Linear(at, (a.x, f.x), weight, steps=tuple(steps), covers=tuple(like))
    return emit(rw, out, like=like, at=outer)


def _attention_projections(rw: Rewriter, attn_out: int) -> list[Linear]:
    """The distinct projections feeding q, k and v of the attention whose merged output is
    attn_out (an attention node, or merge_heads of a decomposed one), q first."""
    site = attn_out
    if rw.op(site) == Op.MERGE_HEADS:
        wsum = rw.node(site).inputs[0]
        if rw.op(wsum) != Op.WEIGHTED_SUM:
            return []
        site = rw.node(wsum).inputs[0]
        while rw.op(site) in (Op.SOFTMAX, *MODIFIERS):
            site = rw.node(site).inputs[0]
    ops = attention_operands(rw, site) or {}
    out: list[Linear] = []
    for role in ("q", "k", "v"):
        if role not in ops:
            continue
        _, end = trace_up(rw, ops[role])
        lin = view(rw, end)
        if lin is not None and lin.root not in [m.root for m in out]:
            out.append(lin)
    return out


def _ffn_input(rw: Rewriter, h: int) -> tuple[Linear, int | None] | None:
    """The FFN's input projection behind hidden h: act(U) → (U, act), or U with its
    activation already in the epilogue → (U, None)."""
    if rw.op(h) == Op.ACT:
        lin = view(rw, rw.node(h).inputs[0])
        if lin is not None and rw.users(lin.root) == [h]:
            return lin, h
        return None
    lin = view(rw, h)
    return (lin, None) if lin is not None else None


@register_pass("merge-parallel", "exact",
               "parallel blocks: attention and FFN input projections in one matmul; "
               "attention-out and FFN-down in one matmul over the concatenated hidden")
def merge_parallel(g: Graph, ctx: PassContext) -> Graph:
    # 1. Find parallel blocks by their sum: add(add(x, A), F) with A the attention output
    #    projection and F the FFN down projection, linear layers read only by the sum.
    # 2. Out: one linear over the two hidden states concatenated along K (concat_k), weight
    #    [W_A, W_F] (columns), bias b_A + b_F, and x as a residual epilogue.
    # 3. In: the attention's q/k/v projections and the FFN's up projection read the same
    #    (norm-folded) input: concatenate their rows, q/k/v first; the FFN activation becomes
    #    act over the up columns. A GLU epilogue pairs columns and cannot share.
    rw = Rewriter(g, ctx)
    for i in rw.order():
        if rw.op(i) != Op.ADD or rw.is_dead(i) or not rw.users(i):
            continue
        found = _sum_of_two_linears(rw, i)
        if found is None:
            continue
        inner, res, a, f = found
        attn = _attention_projections(rw, a.x)
        ffn = _ffn_input(rw, f.x)
        if not attn or ffn is None:
            continue
        try:
            out = _merge_out(rw, i, inner, res, a, f)
        except Refusal as r:
            ctx.refused("merge-parallel-out", rw.describe(i), r.why)
            continue
        rw.replace(i, out)
        ctx.applied("merge-parallel-out", rw.describe(i),
                    "attention-out and FFN-down in one matmul")
        up, act = ffn
        members = [*attn, up]
        try:
            if any(s.fn == "glu" for s in up.steps):
                raise Refusal(f"the FFN projection %{up.root} ends in glu, which pairs gate "
                              "and up columns and cannot share a matmul with other rows")
            merged, offsets = concat_rows(rw, members, [None] * len(attn) + [act])
        except Refusal as r:
            ctx.refused("merge-parallel-in", rw.describe(up.root), r.why)
            continue
        emit_with_slices(rw, merged, members, offsets, [None] * len(attn) + [act])
        ctx.applied("merge-parallel-in", rw.describe(up.root),
                    f"{len(members)} input projections in one matmul")
    return rw.finish()
