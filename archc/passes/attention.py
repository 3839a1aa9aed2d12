"""Attention: finding it in a graph — the score chain after `scores`, the path from q, k and v
up to their projections (bias folding and the projection merges use these too) — and the passes
that fuse it: share-kv-heads and flash-attention, then QK-norm, RoPE and the KV-cache write in
the epilogue of the projection that computes q, k and v."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import archc.ir.expr as E
from archc.ir.attrs import Call
from archc.ir.graph import Graph, Node
from archc.ir.ops import Op, canonical, full_attrs, roles_of
from archc.ir.ops.steps import STEPS
from archc.passes.linear import (
    LINEAR,
    Step,
    emit,
    epilogue_steps,
    extend,
    merged_name,
    norm_parts,
    step,
    unary,
    view,
    view_with_bias,
)
from archc.passes.patterns import Bindings, Pat, Rule, register_rule_pass
from archc.passes.rewrite import Refusal, Rewriter, register_rewrite_pass

# Score modifiers as lowering emits them, ranked in the order the `attention` op applies them: a
# scale and a soft-cap (pointwise), a position bias, an explicit score expression, the mask.
MODIFIERS = {"scale": 0, "softcap": 1, "alibi": 2, "rel_bias": 2, "score_mod": 3, "mask": 4}
NORMALIZERS = (Op.SOFTMAX, Op.NORMALIZE)

# Ops a q/k/v value may pass through between its projection and the attention that reads it.
HEAD_PATH = frozenset({Op.SPLIT_HEADS, Op.SLICE, Op.ROPE, Op.NORM, Op.KV_CACHE, Op.REPEAT_KV})


def modifier(n: Node) -> str | None:
    """Which score modifier n is, if any (a pointwise scale or soft-cap of one input included)."""
    kind = unary(n) if n.op == Op.POINTWISE else n.op.value
    return kind if kind in MODIFIERS else None


@dataclass
class ScoreChain:
    """scores → modifiers → softmax → weighted_sum → merge_heads, following single users."""

    modifiers: list[int] = field(default_factory=list)
    softmax: int | None = None
    wsum: int | None = None
    merge: int | None = None
    problem: str = ""          # why the chain stops short, if it does


def score_chain(rw: Rewriter, scores: int) -> ScoreChain:
    chain, cur = ScoreChain(), scores
    while rw.op(cur) not in NORMALIZERS:
        users = rw.users(cur)
        if len(users) != 1:
            chain.problem = (f"%{cur} ({rw.op(cur).value}) is read by "
                             f"{len(users)} nodes, not only by the next step of attention")
            return chain
        nxt = users[0]
        if rw.op(nxt) not in NORMALIZERS:
            if modifier(rw.nodes[nxt]) is None or rw.nodes[nxt].inputs[0] != cur:
                chain.problem = (f"%{nxt} ({rw.op(nxt).value}) between scores and softmax is "
                                 "not a score modifier")
                return chain
            chain.modifiers.append(nxt)
        cur = nxt
    chain.softmax = cur
    users = rw.users(cur)
    if len(users) != 1 or rw.op(users[0]) != Op.WEIGHTED_SUM or rw.nodes[users[0]].inputs[0] != cur:
        chain.problem = f"the probabilities %{cur} are read by something other than one " \
                        "weighted_sum"
        return chain
    chain.wsum = users[0]
    users = rw.users(chain.wsum)
    if len(users) == 1 and rw.op(users[0]) == Op.MERGE_HEADS:
        chain.merge = users[0]
    else:
        chain.problem = f"the head outputs %{chain.wsum} are not merged by one merge_heads"
    return chain


def trace_up(rw: Rewriter, i: int) -> tuple[list[int], int]:
    """The head-path ops above node i along first inputs (nearest first), and where they end."""
    path: list[int] = []
    while rw.op(i) in HEAD_PATH:
        path.append(i)
        i = rw.nodes[i].inputs[0]
    return path, i


# ---- share-kv-heads, flash-attention ---------------------------------------------------------

def _read_kv_heads(rw: Rewriter, m: Bindings) -> int:
    n = rw.nodes[m["root"]]
    src = [rw.nodes[i].inputs[0] if rw.op(i) == Op.REPEAT_KV else i for i in n.inputs]
    return rw.emit(n.op, src, like=[m["root"]], **n.attrs)


REPEATED = Pat({Op.REPEAT_KV}, one_use=True)
register_rule_pass("share-kv-heads", "GQA/MQA: drop repeat_kv; attention reads KV head h // group "
                   "directly", (
    # q_h · repeat_kv(k, g)_hᵀ = q_h · k_{h//g}ᵀ, and Σ_j p_hj · repeat_kv(v, g)_hj =
    # Σ_j p_hj · v_{h//g, j}: scores and the value sum read KV head h // g in place
    Rule("share-kv-heads", Pat({Op.SCORES, Op.WEIGHTED_SUM}, "root", (None, REPEATED)),
         _read_kv_heads),
    # attention over repeated k and v = attention reading KV head h // g
    Rule("share-kv-heads", Pat({Op.ATTENTION}, "root", (None, REPEATED, REPEATED)),
         _read_kv_heads),
))


SCORE_SUM = E.call("add", E.x(0), E.x(1))


def score_sum(rw: Rewriter, scores: int) -> tuple[int, int, float | None] | None:
    """(the pointwise, the second scores node, its scale or None) when `scores` is the first
    term of a pointwise q·kᵀ + q2·k2ᵀ — scaled or not — that alone reads both; else None."""
    users = rw.users(scores)
    if len(users) != 1 or rw.op(users[0]) not in (Op.ADD, Op.POINTWISE):
        return None
    n = rw.nodes[users[0]]
    expr, by = n.attr("expr") if n.op == Op.POINTWISE else SCORE_SUM, None
    if expr.fn == "scale" and len(expr.args) == 1:
        expr, by = expr.args[0], expr.kw("by")
    if expr != SCORE_SUM or len(n.inputs) != 2 or n.inputs[0] != scores:
        return None
    second = n.inputs[1]
    if rw.op(second) != Op.SCORES or rw.users(second) != [users[0]] or second == scores:
        return None
    return users[0], second, by


def _second_term(rw: Rewriter, scores: int) -> bool:
    """Is `scores` the second term of a score sum (fused with its first)?"""
    users = rw.users(scores)
    if len(users) != 1 or rw.op(users[0]) not in (Op.ADD, Op.POINTWISE):
        return False
    first = rw.nodes[users[0]].inputs[0]
    found = score_sum(rw, first) if rw.op(first) == Op.SCORES else None
    return found is not None and found[1] == scores


def _flash(rw: Rewriter, scores: int) -> tuple[int, int]:
    """(merge_heads, the attention node that replaces it) for the chain from `scores`; or, for
    heads that a head_linear reads unmerged, (the value sum, a head view of the attention)."""
    summed = score_sum(rw, scores)
    chain = score_chain(rw, scores if summed is None else summed[0])
    if chain.wsum is not None and chain.merge is None and \
            [rw.op(u) for u in rw.users(chain.wsum)] == [Op.HEAD_LINEAR]:
        chain.problem = ""
    elif chain.merge is None or chain.wsum is None:
        raise Refusal(chain.problem)
    kinds = [modifier(rw.nodes[i]) or "" for i in chain.modifiers]
    ranks = [MODIFIERS[k] for k in kinds]
    if ranks != sorted(set(ranks)):
        raise Refusal("the score modifiers " + " → ".join(kinds)
                      + " are not in the order attention applies them (scale, softcap, "
                        "position bias, score expression, mask), each at most once")
    q, k = rw.nodes[scores].inputs
    v = rw.nodes[chain.wsum].inputs[1]
    if rw.shape(k) != rw.shape(v):
        raise Refusal(f"k %{k} {list(rw.shape(k))} and v %{v} {list(rw.shape(v))} differ in "
                      "shape (share-kv-heads must treat both)")
    attrs: dict[str, object] = {"scale": 1.0}
    named = {"q": q, "k": k, "v": v}     # every operand by its role in the attention node
    if summed is not None:   # q·kᵀ + q2·k2ᵀ, then the sum's scale
        attrs["second_score"] = True
        named["q2"], named["k2"] = rw.nodes[summed[1]].inputs
        if rw.shape(named["k2"])[:3] != rw.shape(k)[:3]:
            raise Refusal(f"the second term's keys %{named['k2']} are not beside k %{k}")
        if summed[2] is not None:
            if chain.modifiers and kinds[0] == "scale":
                raise Refusal("the score sum and the next step both scale")
            attrs["scale"] = summed[2]
    for i, kind in zip(chain.modifiers, kinds):
        n = rw.nodes[i]
        if kind in ("scale", "softcap"):
            attrs[kind] = n.attr("expr").kw("by" if kind == "scale" else "cap")
            continue
        if kind == "mask":      # causal, window, global_tokens, padding, prefix, mask
            attrs.update((a, x) for a, x in n.attrs.items() if a != "kv_heads")
        elif kind == "score_mod":
            attrs["score"] = n.attr("score")
        else:
            attrs["bias"] = E.call("alibi") if kind == "alibi" else E.call(
                "t5", bidirectional=n.attr("bidirectional"), max_distance=n.attr("max_distance"))
        roles = roles_of(n.op, full_attrs(n.op, n.attrs), len(n.inputs))
        named.update(zip(roles[1:], n.inputs[1:]))
        if kind == "rel_bias":
            named["rel_table"] = n.inputs[1]
    soft = rw.nodes[chain.softmax]
    if soft.op == Op.NORMALIZE:
        attrs["normalizer"] = soft.attr("normalizer")
        named.update({soft.attr("normalizer").kw("sinks"): soft.inputs[1]}
                     if len(soft.inputs) > 1 else {})
    full = full_attrs(Op.ATTENTION, canonical(Op.ATTENTION, attrs))
    inputs = [named[r] for r in roles_of(Op.ATTENTION, full, 0)]
    like = [scores, *([summed[1], summed[0]] if summed else []), *chain.modifiers,
            chain.softmax, chain.wsum, *([chain.merge] if chain.merge is not None else [])]
    if chain.merge is None:     # heads read unmerged: a view of the merged output
        assert chain.wsum is not None
        att = rw.emit(Op.ATTENTION, inputs, like=like, at=chain.wsum, **attrs)  # type: ignore
        return chain.wsum, rw.emit(Op.SPLIT_HEADS, [att], like=[chain.wsum],
                                   heads=int(rw.shape(q)[1]))
    return chain.merge, rw.emit(Op.ATTENTION, inputs, like=like,  # type: ignore
                                at=chain.merge, **attrs)


@register_rewrite_pass("flash-attention", "scores → scale → softcap → bias → score_mod → mask → "
                       "softmax or normalize → value sum: one attention node")
def flash_attention(rw: Rewriter) -> None:
    # 1. From each scores node follow single users — modifiers, softmax, weighted_sum,
    #    merge_heads: nothing else may see the scores or probabilities a flash kernel never stores.
    # 2. The modifiers must come in the order the attention op applies them.
    # 3. In place of merge_heads: attention(q, k, v, then the operands its modifiers read, by
    #    name) with the modifiers as attributes; its output is [B, T, H·D].
    for i in rw.order():
        if rw.op(i) != Op.SCORES or _second_term(rw, i):
            continue
        found = rw.attempt("flash-attention", i, _flash, rw, i)
        if found is not None:
            rw.replace(*found)
            rw.ctx.applied("flash-attention", i, "one attention node")


# ---- epilogues over a projection's heads: fuse-qk-norm, fuse-rope, fuse-kv-write ---------------

@dataclass(frozen=True)
class ColumnView:
    """A head view split from columns [start, stop) of a projection's output."""

    split: int          # the split_heads node
    source: int         # the node whose columns it reads, through a slice or not
    start: int
    stop: int
    heads: int
    head_dim: int


def column_view(rw: Rewriter, i: int) -> ColumnView | None:
    n = rw.nodes[i]
    if n.op != Op.SPLIT_HEADS:
        return None
    heads, hd, src = n.attr("heads"), int(n.shape[3]), n.inputs[0]
    if rw.op(src) == Op.SLICE:
        s = rw.nodes[src]
        return ColumnView(i, s.inputs[0], s.attr("start"), s.attr("stop"), heads, hd)
    return ColumnView(i, src, 0, int(rw.shape(src)[-1]), heads, hd)


Heads = list[tuple[ColumnView, int]]     # head views, each with the one node reading it


@dataclass(frozen=True)
class RowKernel:
    """A kernel whose rows hold the heads of q, k and v: a projection, or a norm over its
    columns (a QK-norm over the whole projection, which column tiles cannot compute). `steps`:
    its epilogue; `then(step)` builds it with one step more, for the caller to put in place."""

    root: int
    steps: tuple[Step, ...]
    then: Callable[[Step], int]


def row_kernel(rw: Rewriter, i: int, fn: str) -> RowKernel | None:
    """Node i as a kernel that can take epilogue step `fn` — a linear layer (with the bias add
    that alone reads it), a norm where `fn` allows — or None."""
    if rw.op(i) == Op.NORM:
        if Op.NORM not in STEPS[fn].kernels:
            return None
        taken = 3 if rw.nodes[i].attr("add_before") else 2     # x, gain [, residual]
        return RowKernel(i, epilogue_steps(rw, i, taken), lambda st: extend(rw, i, st, like=[]))
    lin = view_with_bias(rw, i) if rw.op(i) in LINEAR else view(rw, i)
    if lin is None:
        return None
    return RowKernel(lin.root, lin.steps, lambda st: emit(rw, lin.then(st), like=lin.covers))


HeadStep = Callable[[Rewriter, RowKernel, Heads], Step]


def head_epilogue(rw: Rewriter, kern: RowKernel, op: Op, what: str, later: tuple[str, ...],
                  make: HeadStep) -> tuple[Step, Heads] | None:
    """The step `make` builds for the head views of `kern` read by one `op` node each, with
    those views and nodes, if they are columns [0, n·D) that nothing else reads; None if no view
    is read by `op`. `later`: epilogue steps that must come after the new one."""
    readers: list[tuple[int, int, int, ColumnView | None]] = []   # (node, start, stop, view)
    for u in rw.users(kern.root):
        s = rw.nodes[u]
        if s.op == Op.SLICE:
            readers += [(w, s.attr("start"), s.attr("stop"), column_view(rw, w))
                        for w in rw.users(u)]
        else:
            readers.append((u, 0, int(rw.shape(kern.root)[-1]), column_view(rw, u)))
    views = sorted((cv for _, _, _, cv in readers
                    if cv is not None and any(rw.op(u) == op for u in rw.users(cv.split))),
                   key=lambda cv: cv.start)
    if not views:
        return None
    heads: Heads = []
    end = 0
    for cv in views:
        users = rw.users(cv.split)
        if len(users) != 1:
            raise Refusal(f"the head view %{cv.split} is also read without being {what} by "
                          + ", ".join(f"%{u}" for u in users if rw.op(u) != op))
        if cv.head_dim != views[0].head_dim:
            raise Refusal(f"heads of {cv.head_dim} and {views[0].head_dim} dims")
        if cv.start != end:
            raise Refusal(f"the columns to be {what} are not contiguous from column 0 (a gap "
                          f"before column {cv.start}); the epilogue serves the first heads only")
        heads.append((cv, users[0]))
        end = cv.stop
    for r, a, b, cv in readers:
        if (cv is None or cv not in views) and a < end:
            raise Refusal(f"%{r} ({rw.op(r).value}) reads columns [{a}, {b}), which the "
                          f"epilogue would have {what}")
    late = [s.fn for s in kern.steps if s.fn in later]
    if late:
        raise Refusal(f"%{kern.root} already ends in {late[-1]}, which must come after")
    return make(rw, kern, heads), heads


def fuse_heads(rw: Rewriter, rule: str, op: Op, fn: str, what: str, later: tuple[str, ...],
               make: HeadStep) -> None:
    """For each kernel that can take step `fn` (a linear layer; a norm where `fn` allows), the
    `op` nodes reading its first heads become the step `make` builds; each is replaced by the
    head view it read."""
    for kern in [row_kernel(rw, i, fn) for i in rw.order() if rw.op(i) in (*LINEAR, Op.NORM)]:
        if kern is None:
            continue
        found = rw.attempt(rule, kern.root, head_epilogue, rw, kern, op, what, later, make)
        if found is None:
            continue
        rw.replace(kern.root, kern.then(found[0]))
        for cv, reader in found[1]:
            rw.replace(reader, cv.split)
            rw.ctx.applied(rule, reader, f"{what} in the epilogue of %{kern.root}")


def _rope(rw: Rewriter, kern: RowKernel, heads: Heads) -> Step:
    # rope(x·Wᵀ)[heads] in the epilogue = the same rotation applied to the stored heads
    r0 = rw.nodes[heads[0][1]]
    for _, reader in heads:
        n = rw.nodes[reader]
        if n.inputs[1:] != r0.inputs[1:] or n.attrs != r0.attrs:
            raise Refusal(f"rope %{reader} and %{heads[0][1]} differ in positions, "
                          "cos/sin table (or frequencies) or attributes")
    hd = heads[0][0].head_dim
    return step("rope", *r0.inputs[1:], heads=heads[-1][0].stop // hd, head_dim=hd,
                rotary_dim=r0.attr("rotary_dim"), interleaved=r0.attr("interleaved"),
                dynamic=r0.attr("dynamic"))


@register_rewrite_pass("fuse-rope", "rotate q and k in the epilogue of the projection that "
                       "computes them")
def fuse_rope(rw: Rewriter) -> None:
    # 1. For each linear layer, the head views (slice → split_heads) read only by a rope.
    # 2. Legal if they are columns [0, n·D) — the epilogue rotates the first n heads — with one
    #    set of positions, frequencies and attributes, and no other reader sees them.
    # 3. Append rope(heads=n) to the epilogue; each rope node is replaced by its head view.
    fuse_heads(rw, "fuse-rope", Op.ROPE, "rope", "rotated", ("rope", "kv_write", "glu"), _rope)
    for i in rw.order():
        if rw.op(i) == Op.ROPE:
            found = rw.attempt("fuse-rope", i, _rope_tail, rw, i)
            if found is not None:
                rw.replace(found[0].root, found[0].then(found[1]))
                rw.replace(i, rw.nodes[i].inputs[0])
                rw.ctx.applied("fuse-rope", i, f"the heads' last {rw.nodes[i].attr('rotary_dim')} "
                               f"dims rotated in the epilogue of %{found[0].root}")
    for i in rw.order():
        src = rw.nodes[i].inputs[0] if rw.op(i) == Op.ROPE else None
        if src is not None and column_view(rw, src) is None:
            rw.ctx.refused("fuse-rope", i, f"it rotates %{src} ({rw.op(src).value}), not heads "
                        "split from a projection's columns, so no matmul epilogue computes its "
                        "input")


def _rope_tail(rw: Rewriter, i: int) -> tuple[RowKernel, Step] | None:
    """The kernel and its rope() step for a rope over the last dims of heads of a kernel's
    columns [0, H·D) — a slice [a, D) of heads split from them (latent attention's query RoPE
    part), or one head that is the row's last columns [a, W) (its shared RoPE key): the step
    rotates dims [a, D) of each head (rotary_start a), and the rope is replaced by its input.
    None where the rope reads no such view (fuse_heads took the others)."""
    n = rw.nodes[i]
    x = n.inputs[0]
    if rw.op(x) == Op.SLICE and rw.op(rw.nodes[x].inputs[0]) == Op.SPLIT_HEADS:
        cv = column_view(rw, rw.nodes[x].inputs[0])
        if cv is None or rw.nodes[x].attr("stop") != cv.head_dim:
            return None
        heads, hd, start = cv.heads, cv.head_dim, rw.nodes[x].attr("start")
    elif rw.op(x) == Op.SPLIT_HEADS and rw.nodes[x].attr("heads") == 1:
        cv = column_view(rw, x)
        if cv is None or cv.stop != int(rw.shape(cv.source)[-1]):
            return None
        heads, hd, start = 1, cv.stop, cv.start
    else:
        return None
    if cv.start != 0 and heads != 1:
        raise Refusal(f"the heads %{cv.split} do not start at column 0 of %{cv.source}")
    if n.attr("rotary_dim") != hd - start:
        raise Refusal(f"rope %{i} rotates {n.attr('rotary_dim')} of the {hd - start} dims "
                      "it is given")
    if rw.users(x) != [i]:
        raise Refusal(f"the rotated dims %{x} are also read unrotated")
    # every other reader of the kernel's columns must read unrotated ones only: slices of the
    # heads before dim `start`, or (one head) of the row before column `start`
    path = {i, x, cv.split, rw.nodes[cv.split].inputs[0]}
    for u in [*rw.users(cv.split), *rw.users(cv.source)]:
        if u not in path and (rw.op(u) != Op.SLICE or rw.nodes[u].attr("stop") > start):
            raise Refusal(f"%{u} ({rw.op(u).value}) reads columns the epilogue would rotate")
    kern = row_kernel(rw, cv.source, "rope")
    if kern is None:
        raise Refusal(f"%{cv.source} ({rw.op(cv.source).value}) is not a kernel with an "
                      "epilogue that can rotate")
    late = [s.fn for s in kern.steps if s.fn in ("rope", "kv_write", "glu")]
    if late:
        raise Refusal(f"%{kern.root} already ends in {late[-1]}, which must come after")
    return kern, step("rope", *n.inputs[1:], heads=heads, head_dim=hd,
                      rotary_dim=n.attr("rotary_dim"), interleaved=n.attr("interleaved"),
                      dynamic=n.attr("dynamic"), rotary_start=start)


def _head_norm(rw: Rewriter, kern: RowKernel, heads: Heads) -> Step:
    # norm over each head's D columns of x·Wᵀ, in the epilogue: the tile holds whole heads
    first = rw.nodes[heads[0][1]]
    gains: list[Call] = []
    shifts: list[Call] = []
    for cv, reader in heads:
        n = rw.nodes[reader]
        if (n.attr("kind"), n.attr("eps")) != (first.attr("kind"), first.attr("eps")):
            raise Refusal(f"%{reader} and %{heads[0][1]} are different norms")
        _, gain, shift = norm_parts(rw, reader)
        g = rw.param_expr(gain)
        if n.attr("unit_offset"):
            g = E.call("offset", g, by=1.0)        # Gemma: γ = 1 + w
        gains.append(E.call("tile", g, times=cv.heads))
        shifts.append(E.call("tile", rw.param_expr(shift), times=cv.heads) if shift is not None
                      else E.call("zeros", shape=(cv.stop - cv.start,)))
    cols, hd = heads[-1][0].stop, heads[0][0].head_dim
    like = [reader for _, reader in heads]
    name = merged_name([rw.nodes[rw.nodes[reader].inputs[1]].name for reader in like])
    gain_p, shift_p = (rw.add_param(n, E.call("cat", *parts, dim=0), (cols,),
                                    rw.nodes[first.inputs[1]].dtype, like=like, at=kern.root)
                       for n, parts in ((name + ".tiled", gains),
                                        (name.removesuffix(".weight") + ".shift", shifts)))
    return step("head_norm", gain_p, shift_p, kind=first.attr("kind"), eps=first.attr("eps"),
                heads=cols // hd, head_dim=hd)


@dataclass(frozen=True)
class SpanNorm:
    """A norm over columns [start, stop) of a projection, read only as heads (a QK-norm over the
    whole q or k projection): the norm, and the slice it reads (the projection itself when it
    reads every column)."""

    norm: int
    read: int
    start: int
    stop: int


def _span_norms(rw: Rewriter, root: int) -> tuple[list[SpanNorm], list[tuple[int, int, int]]]:
    """The norms over column spans of `root` whose every reader is a head split, and the other
    readers of `root`'s columns (node, start, stop)."""
    width = int(rw.shape(root)[-1])
    spans: list[SpanNorm] = []
    others: list[tuple[int, int, int]] = []
    for u in rw.users(root):
        start, stop = (rw.nodes[u].attr("start"), rw.nodes[u].attr("stop")) \
            if rw.op(u) == Op.SLICE else (0, width)
        readers = rw.users(u) if rw.op(u) == Op.SLICE else [u]
        norm = readers[0] if len(readers) == 1 else None
        if norm is not None and rw.op(norm) == Op.NORM and rw.nodes[norm].inputs[0] == u and \
                rw.users(norm) and all(rw.op(h) == Op.SPLIT_HEADS for h in rw.users(norm)):
            spans.append(SpanNorm(norm, u, start, stop))
        else:
            others.append((u, start, stop))
    return sorted(spans, key=lambda sn: sn.start), others


def _projection_norm(rw: Rewriter, root: int, spans: list[SpanNorm],
                     others: list[tuple[int, int, int]]) -> int:
    """One norm over `root`'s whole rows that normalizes each span on its own and passes the
    columns after them through."""
    first = rw.nodes[spans[0].norm]
    end = 0
    for sn in spans:
        n = rw.nodes[sn.norm]
        if sn.start != end:
            raise Refusal(f"the norms' columns are not contiguous from column 0 (a gap before "
                          f"column {sn.start})")
        if (n.attr("kind"), n.attr("eps"), n.attr("unit_offset")) != \
                (first.attr("kind"), first.attr("eps"), first.attr("unit_offset")):
            raise Refusal(f"%{sn.norm} and %{spans[0].norm} are different norms")
        end = sn.stop
    for r, a, b in others:
        if a < end:
            raise Refusal(f"%{r} ({rw.op(r).value}) reads columns [{a}, {b}) un-normalized")
    parts = [norm_parts(rw, sn.norm) for sn in spans]
    like = [sn.norm for sn in spans]
    width = int(rw.shape(root)[-1])
    names = [rw.nodes[gain].name for _, gain, _ in parts]
    gain = rw.add_param(merged_name(names), E.call("cat", *(rw.param_expr(g) for _, g, _ in parts),
                                                   dim=0), (end,),
                        rw.nodes[parts[0][1]].dtype, like=like, at=spans[0].norm)
    inputs, epilogue = [root, gain], None
    if any(shift is not None for _, _, shift in parts):   # LayerNorm biases; none past the spans
        shifts = [rw.param_expr(shift) if shift is not None else
                  E.call("zeros", shape=(sn.stop - sn.start,))
                  for sn, (_, _, shift) in zip(spans, parts)]
        shifts += [E.call("zeros", shape=(width - end,))] if width > end else []
        inputs.append(rw.add_param(merged_name(names).removesuffix(".weight") + ".bias",
                                   E.call("cat", *shifts, dim=0), (width,),
                                   rw.nodes[parts[0][1]].dtype, like=like, at=spans[0].norm))
        epilogue = (step("bias").call,)
    return rw.emit(Op.NORM, inputs, like=like, kind=first.attr("kind"), eps=first.attr("eps"),
                   unit_offset=first.attr("unit_offset") or None,
                   spans=tuple(sn.stop - sn.start for sn in spans), epilogue=epilogue)


def merge_projection_norms(rw: Rewriter) -> None:
    """QK-norms over the whole q and k projections, columns of one projection's rows: one norm
    over those rows, each span on its own statistics; fuse-rope and fuse-kv-write then complete
    its epilogue, as they do a projection's."""
    for i in rw.order():
        if rw.op(i) not in LINEAR or rw.is_dead(i):
            continue
        lin = view_with_bias(rw, i)
        assert lin is not None
        spans, others = _span_norms(rw, lin.root)
        if not spans or (len(spans) == 1 and spans[0].read == lin.root):
            continue   # none, or one norm over every column: a norm kernel's epilogue as it is
        norm = rw.attempt("fuse-qk-norm", spans[0].norm, _projection_norm, rw, lin.root, spans,
                          others)
        if norm is None:
            continue
        for sn in spans:
            rw.replace(sn.norm, _columns(rw, norm, sn.start, sn.stop, sn.norm))
            rw.ctx.applied("fuse-qk-norm", sn.norm, f"columns [{sn.start}, {sn.stop}) of %"
                           f"{lin.root} normalized by %{norm} with the other spans")
        for r, a, b in others:   # the columns after the spans, passed through the norm
            rw.replace(r, _columns(rw, norm, a, b, r))


def _columns(rw: Rewriter, i: int, start: int, stop: int, like: int) -> int:
    """Columns [start, stop) of node i: i itself, or a slice of it."""
    return i if (start, stop) == (0, int(rw.shape(i)[-1])) else \
        rw.emit(Op.SLICE, [i], like=[like], start=start, stop=stop)


@register_rewrite_pass("fuse-qk-norm", "QK-norm: normalize the heads of q and k in the epilogue of "
                       "their projection, or the whole q and k projections in one norm kernel")
def fuse_qk_norm(rw: Rewriter) -> None:
    # 1. For each linear layer, the head views read only by a norm over each head (QK-norm).
    # 2. Legal if they are columns [0, n·D) — q then k, first in a merged QKV — with one kind
    #    of norm and one eps, and no other reader sees them un-normalized.
    # 3. Append head_norm(kind, eps, heads=n) reading a gain and a shift built at load time:
    #    each head's norm weight tiled over its heads (zeros shift for RMSNorm). Each norm is
    #    replaced by its head view, where fuse-rope then finds the rotation.
    fuse_heads(rw, "fuse-qk-norm", Op.NORM, "head_norm", "normalized",
               ("head_norm", "rope", "kv_write", "glu"), _head_norm)
    # 4. A norm over a whole projection (OLMo 2) needs every column of a row, which a column
    #    tile does not hold: norms over column spans of one projection, each read only as
    #    heads and together columns [0, n) with one kind and eps, become one norm over its rows
    #    {spans}: each span on its own statistics, the gains concatenated, the columns after
    #    the spans (v) passed through, so the one kernel holds q, k and v for fuse-rope and
    #    fuse-kv-write.
    merge_projection_norms(rw)


def _cached_columns(rw: Rewriter, att: int, caches: tuple[int, ...], maker: str
                    ) -> list[ColumnView]:
    """The column views of a kernel's output that the caches `att` alone reads are written
    from; refused where one is read elsewhere or something stands between `maker` and it."""
    for c in caches:
        if rw.users(c) != [att]:
            raise Refusal(f"the cache values %{c} are read outside this attention")
    views = [column_view(rw, rw.nodes[c].inputs[0]) for c in caches]
    for c, found in zip(caches, views):
        if found is None:
            src = rw.nodes[c].inputs[0]
            raise Refusal(f"%{src} ({rw.op(src).value}) stands between {maker} and the cache "
                          f"write (fuse-rope must fold RoPE into {maker} first)")
    return views  # type: ignore[return-value]


def _kv_write(rw: Rewriter, att: int) -> tuple[RowKernel, Step]:
    """The projection whose epilogue can write the cache `att` reads, and the step that does."""
    q, kc, vc = rw.nodes[att].inputs[:3]
    k_node, v_node = rw.nodes[kc], rw.nodes[vc]
    layer = k_node.attr("layer")
    if (k_node.attr("kind"), v_node.attr("kind")) != ("k", "v") or v_node.attr("layer") != layer:
        raise Refusal(f"%{kc} and %{vc} are not the k and v cache of one layer")
    kv, vv = _cached_columns(rw, att, (kc, vc), "the projection")
    if kv.source != vv.source:
        raise Refusal("k and v come from different projections (merge-qkv must merge them "
                      "first)")
    kern = row_kernel(rw, kv.source, "kv_write")
    if kern is None:
        raise Refusal(f"k and v are not computed by a linear layer or a norm over its "
                      f"columns (%{kv.source}, {rw.op(kv.source).value})")
    qv = column_view(rw, q)
    if qv is None or qv.source != kv.source:
        raise Refusal(f"q %{q} is not computed by the kernel that writes the cache, so the "
                      "cache read would not be ordered after the write")
    for c in (kv.split, vv.split):
        if len(rw.users(c)) != 1:
            raise Refusal(f"the head view %{c} is read outside the cache write")
    if any(s.fn == "kv_write" for s in kern.steps):
        raise Refusal(f"%{kern.root} already writes a cache")
    if k_node.attr("quant") != v_node.attr("quant"):
        raise Refusal(f"the k and v caches of layer {layer} are held in different formats")
    quant = {} if k_node.attr("quant") is None else {"quant": k_node.attr("quant")}
    return kern, step("kv_write", head_dim=kv.head_dim, k_start=kv.start, v_start=vv.start,
                     kv_heads=kv.heads, layer=layer, **quant)


@register_rewrite_pass("fuse-kv-write", "write k and v to the cache from the projection's "
                       "epilogue; attention reads it")
def fuse_kv_write(rw: Rewriter) -> None:
    # 1. For each attention reading k and v from one layer's cache writes, the projection
    #    both are column views of.
    # 2. Legal if only this attention reads the cache values, nothing (RoPE) stands between
    #    projection and write, and q comes from that projection: the kernel that writes the
    #    cache then runs before the attention that reads it.
    # 3. The projection's epilogue writes k and v from the accumulator (the values it would
    #    store); the attention reads cache_layer; the kv_cache nodes go.
    for i in rw.order():
        n = rw.nodes[i]
        if n.op != Op.ATTENTION or n.attr("cache_layer") is not None or \
                {rw.op(j) for j in n.inputs[1:3]} != {Op.KV_CACHE}:
            continue
        if n.attr("second_score"):
            _fuse_key_row_write(rw, i)
            continue
        found = rw.attempt("fuse-kv-write", i, _kv_write, rw, i)
        if found is None:
            continue
        kern, write = found
        rw.replace(kern.root, kern.then(write))
        layer, kv_heads = write.call.kw("layer"), write.call.kw("kv_heads")
        rw.replace(i, rw.emit(Op.ATTENTION, [n.inputs[0], *n.inputs[3:]], like=[i, *n.inputs[1:3]],
                              **n.attrs.replace(cache_layer=layer, kv_heads=kv_heads,
                                                kv_quant=write.call.kw("quant"))))
        for c in n.inputs[1:3]:
            rw.kill(c)
        rw.ctx.applied("fuse-kv-write", i, f"layer {layer} cache written by %{kern.root}")


def _key_row_write(rw: Rewriter, att: int) -> tuple[RowKernel, Step]:
    """For an attention scoring q·kᵀ + q2·k2ᵀ over cached k and k2 whose values are k itself
    (latent attention over its latent and shared RoPE key): the kernel whose row holds [k ‖ k2]
    as adjacent columns from column 0, one KV head, and the kv_write() step that caches that
    row whole — the values are its first columns, so no value cache is written."""
    n = rw.nodes[att]
    kc, vc, k2c = n.inputs[1], n.inputs[2], n.inputs[4]
    if kc != vc or rw.op(k2c) != Op.KV_CACHE:
        raise Refusal(f"the values %{vc} are not the cached keys %{kc}")
    layer = rw.nodes[kc].attr("layer")
    if rw.nodes[k2c].attr("layer") != layer:
        raise Refusal(f"%{kc} and %{k2c} cache different layers")
    kv, kv2 = _cached_columns(rw, att, (kc, k2c), "the kernel")
    if kv.source != kv2.source or kv.heads != 1 or kv2.heads != 1 or kv.start != 0 or \
            kv2.start != kv.stop:
        raise Refusal(f"the keys %{kv.split} and %{kv2.split} are not one KV head's adjacent "
                      "columns of one kernel from column 0")
    for c in (kv.split, kv2.split):
        if len(rw.users(c)) != 1:
            raise Refusal(f"the head view %{c} is read outside the cache write")
    kern = row_kernel(rw, kv.source, "kv_write")
    if kern is None:
        raise Refusal(f"the keys are not computed by a linear layer or a norm over its "
                      f"columns (%{kv.source}, {rw.op(kv.source).value})")
    if any(s.fn == "kv_write" for s in kern.steps):
        raise Refusal(f"%{kern.root} already writes a cache")
    if rw.order().index(kern.root) > rw.order().index(att):
        raise Refusal(f"%{kern.root} runs after the attention that reads its cache")
    if rw.nodes[kc].attr("quant") is not None:
        raise Refusal("a quantized cache of key rows and values in one")
    return kern, step("kv_write", head_dim=kv2.stop, k_start=0, v_start=0, kv_heads=1,
                      layer=layer, values=False)


def _fuse_key_row_write(rw: Rewriter, i: int) -> None:
    n = rw.nodes[i]
    found = rw.attempt("fuse-kv-write", i, _key_row_write, rw, i)
    if found is None:
        return
    kern, write = found
    caches = (n.inputs[1], n.inputs[4])
    rw.replace(kern.root, kern.then(write))
    layer = write.call.kw("layer")
    rw.replace(i, rw.emit(Op.ATTENTION, [n.inputs[0], n.inputs[3], *n.inputs[5:]],
                          like=[i, *caches], **n.attrs.replace(cache_layer=layer, kv_heads=1)))
    for c in caches:
        rw.kill(c)
    rw.ctx.applied("fuse-kv-write", i, f"layer {layer}'s key rows [k ‖ k2] cached by "
                   f"%{kern.root}; the values are their first columns")


def unfused_cache_writes(g: Graph) -> str | None:
    """What leaves a KV-cache write of `g` outside every kernel (a `kv_cache` node, which only
    the eager interpreter runs), naming where its k and v come from; None if none does."""
    writes = [i for i, n in enumerate(g) if n.op == Op.KV_CACHE]
    if not writes:
        return None

    def source(i: int) -> str:   # the kernel that computes what the cache write stores
        while g.nodes[i].op in (Op.SPLIT_HEADS, Op.SLICE, Op.REPEAT_KV):   # views
            i = g.nodes[i].inputs[0]
        n = g.nodes[i]
        return f"{n.op.value} %{i}" + (f" ({n.origin})" if n.origin else "")
    sources = [source(g.nodes[i].inputs[0]) for i in writes[:2]]
    parts = [f"{g.nodes[i].attr('kind')} of layer {g.nodes[i].attr('layer')} (%{i}) from {src}"
             for i, src in zip(writes, sources)]
    why = "its epilogue does not write them (archc explain says why)" \
        if len(set(sources)) == 1 else "no one kernel computes both"
    return (f"graph {g.name}: the KV cache is written in the epilogue of the projection or "
            f"norm that computes k and v together (fuse-kv-write), but here the "
            + " and the ".join(parts) + f": {why}")
