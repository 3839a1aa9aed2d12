"""Attention passes: share KV heads (GQA), flash attention, and the RoPE and KV-cache epilogues.

- share-kv-heads: `repeat_kv` goes; scores and the value sum read KV head h // g directly.
- flash-attention: scores → scale → soft-cap → position bias → mask → softmax → value sum →
  merge_heads becomes one `attention` node.
- fuse-qk-norm: QK-norm of q and k runs in the epilogue of the projection that computes them.
- fuse-rope: RoPE of q and k runs in the epilogue of the projection that computes them.
- fuse-kv-write: the projection's epilogue writes k and v into the cache; attention reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from archc.ir.attrs import Call
from archc.ir.graph import Graph
from archc.ir.ops import Op
from archc.passes.context import PassContext, Refusal
from archc.passes.linear import Linear, bias_of, merged_name, norm_parts, replace_linear, step, view
from archc.passes.patterns import Pat, Rule, register_rule_pass
from archc.passes.registry import register_pass
from archc.passes.rewrite import Rewriter
from archc.passes.sites import modifier, score_chain

# ---- share-kv-heads --------------------------------------------------------------------------


def _read_kv_heads(rw: Rewriter, m: dict[str, int]) -> int:
    n = rw.node(m["root"])
    src = [rw.node(i).inputs[0] if rw.op(i) == Op.REPEAT_KV else i for i in n.inputs]
    return rw.emit(n.op, src, like=[m["root"]], **dict(n.attrs))


GQA_RULES = (
    # q_h · repeat_kv(k, g)_hᵀ = q_h · k_{h//g}ᵀ: scores read KV head h // g in place
    Rule("share-kv-heads", Pat({Op.SCORES}, "root", (None, Pat({Op.REPEAT_KV}, one_use=True))),
         _read_kv_heads),
    # Σ_j p_hj · repeat_kv(v, g)_hj = Σ_j p_hj · v_{h//g, j}
    Rule("share-kv-heads",
         Pat({Op.WEIGHTED_SUM}, "root", (None, Pat({Op.REPEAT_KV}, one_use=True))),
         _read_kv_heads),
    # attention over repeated k and v = attention reading KV head h // g
    Rule("share-kv-heads", Pat({Op.ATTENTION}, "root", (
        None, Pat({Op.REPEAT_KV}, one_use=True), Pat({Op.REPEAT_KV}, one_use=True))),
        _read_kv_heads),
)


register_rule_pass("share-kv-heads",
                   "GQA/MQA: drop repeat_kv; attention reads KV head h // group directly",
                   GQA_RULES)


# ---- flash-attention -------------------------------------------------------------------------

# The order the attention op applies score modifiers in; a chain in another order is refused.
MODIFIER_ORDER = {"scale": 0, "softcap": 1, "alibi": 2, "rel_bias": 2, "mask": 3}


def _flash(rw: Rewriter, scores: int) -> int:
    chain = score_chain(rw, scores)
    if chain.merge is None or chain.wsum is None:
        raise Refusal(chain.problem)
    kinds = [modifier(rw, i) or "" for i in chain.modifiers]
    ranks = [MODIFIER_ORDER[k] for k in kinds]
    if ranks != sorted(set(ranks)):
        raise Refusal("the score modifiers " + " → ".join(kinds)
                      + " are not in the order attention applies them (scale, softcap, "
                        "position bias, mask), each at most once")
    q, k = rw.node(scores).inputs
    v = rw.node(chain.wsum).inputs[1]
    if rw.shape(k) != rw.shape(v):
        raise Refusal(f"k %{k} {list(rw.shape(k))} and v %{v} {list(rw.shape(v))} differ in "
                      "shape (share-kv-heads must treat both)")
    attrs: dict[str, object] = {"scale": 1.0, "causal": False, "padding": False,
                                "prefix": False}
    extra: list[int] = []
    bias_input: list[int] = []
    for i, kind in zip(chain.modifiers, kinds):
        n = rw.node(i)
        if kind == "scale":
            attrs["scale"] = n.attr("expr").kw("by")
        elif kind == "softcap":
            attrs["softcap"] = n.attr("expr").kw("cap")
        elif n.op == Op.ALIBI:
            attrs["bias"] = Call("alibi")
            bias_input = [n.inputs[1]]
        elif n.op == Op.REL_BIAS:
            attrs["bias"] = Call("t5", (), (("bidirectional", n.attr("bidirectional")),
                                            ("max_distance", n.attr("max_distance"))))
            bias_input = [n.inputs[1]]
        else:
            attrs.update(causal=n.attr("causal"), padding=n.attr("padding"),
                         prefix=n.attr("prefix"), window=n.attr("window"),
                         global_tokens=n.attr("global_tokens"))
            extra = list(n.inputs[1:])   # padding, then prefix_len, as the mask takes them
    like = [scores, *chain.modifiers, chain.softmax, chain.wsum, chain.merge]
    return rw.emit(Op.ATTENTION, [q, k, v, *extra, *bias_input], like=like,  # type: ignore
                   at=chain.merge, **attrs)


@register_pass("flash-attention", "exact",
               "scores → scale → softcap → bias → mask → softmax → value sum: one attention node")
def flash_attention(g: Graph, ctx: PassContext) -> Graph:
    # 1. For each scores node, follow single users: modifiers, softmax, weighted_sum,
    #    merge_heads. Every intermediate must be read by the next step only (no one else may
    #    see the scores or probabilities a flash kernel never stores).
    # 2. The modifiers must come in the order the attention op applies them.
    # 3. Emit attention(q, k, v, [padding], [prefix_len], [slopes | rel_table]) with scale,
    #    softcap, bias, causal, window, global_tokens, padding and prefix as attributes, in place of
    #    merge_heads: its output is [B, T, H·D].
    rw = Rewriter(g, ctx)
    for i in rw.order():
        if rw.op(i) != Op.SCORES:
            continue
        try:
            new = _flash(rw, i)
        except Refusal as r:
            ctx.refused("flash-attention", rw.describe(i), r.why)
            continue
        merge = score_chain(rw, i).merge
        assert merge is not None
        rw.replace(merge, new)
        ctx.applied("flash-attention", rw.describe(i), "one attention node")
    return rw.finish()


# ---- column views of a projection ------------------------------------------------------------

@dataclass(frozen=True)
class ColumnView:
    """A head view split from columns [start, stop) of a projection's output."""

    split: int          # the split_heads node
    slice: int | None   # the slice between, if any
    source: int         # the node sliced
    start: int
    stop: int
    heads: int
    head_dim: int


def column_view(rw: Rewriter, i: int) -> ColumnView | None:
    n = rw.node(i)
    if n.op != Op.SPLIT_HEADS:
        return None
    heads, hd = n.attr("heads"), int(n.shape[3])
    src = n.inputs[0]
    if rw.op(src) == Op.SLICE:
        s = rw.node(src)
        return ColumnView(i, src, s.inputs[0], s.attr("start"), s.attr("stop"), heads, hd)
    return ColumnView(i, None, src, 0, rw.width(src), heads, hd)


def _readers(rw: Rewriter, root: int) -> list[tuple[int, int, int, ColumnView | None]]:
    """Every node reading the output of `root`, with the columns it reads: (reader, start,
    stop, head view or None)."""
    out: list[tuple[int, int, int, ColumnView | None]] = []
    for u in rw.users(root):
        if rw.op(u) == Op.SLICE:
            s = rw.node(u)
            for w in rw.users(u):
                out.append((w, s.attr("start"), s.attr("stop"), column_view(rw, w)))
        else:
            out.append((u, 0, rw.width(root), column_view(rw, u)))
    return out


def _linear_roots(rw: Rewriter) -> list[Linear]:
    """Linear layers, each seen at its outermost node (a bias_add over a matmul, if any)."""
    out = []
    for i in rw.order():
        lin = view(rw, i)
        if lin is None:
            continue
        users = rw.users(i)
        if len(users) == 1 and bias_of(rw, users[0]) is not None and view(rw, users[0]):
            continue
        out.append(lin)
    return out


# ---- per-head epilogues: fuse-qk-norm, fuse-rope -----------------------------------------------

@dataclass(frozen=True)
class HeadReader:
    """A node reading heads split from columns [start, stop) of a projection."""

    start: int
    stop: int
    view: ColumnView
    reader: int


def leading_heads(rw: Rewriter, lin: Linear, ops: frozenset[Op], what: str,
                  later: tuple[str, ...]) -> list[HeadReader]:
    """The head views of `lin` read by one node of `ops` each, if an epilogue step over the
    first n heads can stand for those nodes: the columns they read are [0, n·D), each view is
    read by that node only, and no other reader sees those columns. [] if none is; Refusal if
    some are but the epilogue cannot serve them. `later`: epilogue steps that must come after
    the new one."""
    readers = _readers(rw, lin.root)
    found = [(a, b, cv) for _, a, b, cv in readers
             if cv is not None and any(rw.op(u) in ops for u in rw.users(cv.split))]
    if not found:
        return []
    out: list[HeadReader] = []
    for a, b, cv in sorted(found, key=lambda t: t[0]):
        users = rw.users(cv.split)
        if len(users) != 1:
            raise Refusal(f"the head view %{cv.split} is also read without being {what} by "
                          + ", ".join(f"%{u}" for u in users if rw.op(u) not in ops))
        if cv.slice is not None and len(rw.users(cv.slice)) != 1:
            raise Refusal(f"columns [{a}, {b}) %{cv.slice} are also read without being {what}")
        out.append(HeadReader(a, b, cv, users[0]))
    end = 0
    for h in out:
        if h.view.head_dim != out[0].view.head_dim:
            raise Refusal(f"heads of {h.view.head_dim} and {out[0].view.head_dim} dims")
        if h.start != end:
            raise Refusal(f"the columns to be {what} are not contiguous from column 0 (a gap "
                          f"before column {h.start}); the epilogue serves the first heads only")
        end = h.stop
    served = {h.view.split for h in out}
    for r, a, b, cv in readers:
        if (cv is None or cv.split not in served) and a < end:
            raise Refusal(f"%{r} ({rw.op(r).value}) reads columns [{a}, {b}), which the "
                          f"epilogue would have {what}")
    late = [s.fn for s in lin.steps if s.fn in later]
    if late:
        raise Refusal(f"%{lin.root} already ends in {late[-1]}, which must come after")
    return out


def _fuse_rope(rw: Rewriter, lin: Linear, ctx: PassContext) -> None:
    try:
        heads = leading_heads(rw, lin, frozenset({Op.ROPE}), "rotated",
                              ("rope", "kv_write", "glu"))
        if not heads:
            return
        r0 = rw.node(heads[0].reader)
        for h in heads:
            n = rw.node(h.reader)
            if n.inputs[1:] != r0.inputs[1:] or n.attrs != r0.attrs:
                raise Refusal(f"rope %{h.reader} and %{heads[0].reader} differ in positions, "
                              "frequencies or attributes")
    except Refusal as r:
        ctx.refused("fuse-rope", rw.describe(lin.root), r.why)
        return
    hd = heads[0].view.head_dim
    # rope(x·Wᵀ)[heads] in the epilogue = the same rotation applied to the stored heads
    dynamic = {"dynamic": r0.attr("dynamic")} if r0.attr("dynamic") is not None else {}
    rope_step = step("rope", *r0.inputs[1:], heads=heads[-1].stop // hd, head_dim=hd,
                     rotary_dim=r0.attr("rotary_dim"), interleaved=r0.attr("interleaved"),
                     mscale=r0.attr("mscale", 1.0), **dynamic)
    replace_linear(rw, lin, lin.then(rope_step))
    for h in heads:
        rw.replace(h.reader, h.view.split)
        ctx.applied("fuse-rope", rw.describe(h.reader),
                    f"rotated in the epilogue of %{lin.root}")


@register_pass("fuse-rope", "exact",
               "rotate q and k in the epilogue of the projection that computes them")
def fuse_rope(g: Graph, ctx: PassContext) -> Graph:
    # 1. For each linear layer, find its readers and the columns each reads; the rotated ones
    #    are head views (slice → split_heads) read only by a rope.
    # 2. Legal if the rotated columns are [0, n·D) — the epilogue rotates the first n heads —
    #    with one set of positions, frequencies and attributes, and no other reader sees them.
    # 3. Append rope(heads=n) to the epilogue; each rope node is replaced by its head view.
    rw = Rewriter(g, ctx)
    for lin in _linear_roots(rw):
        _fuse_rope(rw, lin, ctx)
    for i in rw.order():
        if rw.op(i) == Op.ROPE and column_view(rw, rw.node(i).inputs[0]) is None:
            src = rw.node(i).inputs[0]
            ctx.refused("fuse-rope", rw.describe(i),
                        f"it rotates %{src} ({rw.op(src).value}), not heads split from a "
                        "projection's columns, so no matmul epilogue computes its input")
    return rw.finish()


def _fuse_qk_norm(rw: Rewriter, lin: Linear, ctx: PassContext) -> None:
    try:
        heads = leading_heads(rw, lin, frozenset({Op.NORM}), "normalized",
                              ("head_norm", "rope", "kv_write", "glu"))
        if not heads:
            return
        first = rw.node(heads[0].reader)
        gains: list[Call] = []
        shifts: list[Call] = []
        for h in heads:
            n = rw.node(h.reader)
            if n.attr("kind") != first.attr("kind") or n.attr("eps") != first.attr("eps"):
                raise Refusal(f"%{h.reader} and %{heads[0].reader} are different norms")
            _, gain_node, shift_node = norm_parts(rw, h.reader)
            count = h.view.heads
            gain = rw.param_expr(gain_node)
            if n.attr("unit_offset"):
                gain = Call("offset", (gain,), (("by", 1.0),))       # Gemma: γ = 1 + w
            gains.append(Call("tile", (gain,), (("times", count),)))
            width = h.stop - h.start
            shifts.append(Call("tile", (rw.param_expr(shift_node),), (("times", count),))
                          if shift_node is not None else
                          Call("zeros", (), (("shape", (width,)),)))
    except Refusal as r:
        ctx.refused("fuse-qk-norm", rw.describe(lin.root), r.why)
        return
    cols = heads[-1].stop
    like = [h.reader for h in heads]
    dtype = rw.node(first.inputs[1]).dtype
    names = [rw.node(rw.node(h.reader).inputs[1]).name for h in heads]
    gain = rw.add_param(merged_name(names) + ".tiled", Call("cat", tuple(gains), (("dim", 0),)),
                        (cols,), dtype, like=like, at=lin.root)
    shift = rw.add_param(merged_name(names).removesuffix(".weight") + ".shift",
                         Call("cat", tuple(shifts), (("dim", 0),)), (cols,), dtype, like=like,
                         at=lin.root)
    hd = heads[0].view.head_dim
    # norm over each head's D columns of x·Wᵀ, in the epilogue: the tile holds whole heads
    norm = step("head_norm", gain, shift, kind=first.attr("kind"), eps=first.attr("eps"),
                heads=cols // hd,
                head_dim=hd)
    replace_linear(rw, lin, lin.then(norm))
    for h in heads:
        rw.replace(h.reader, h.view.split)
        ctx.applied("fuse-qk-norm", rw.describe(h.reader),
                    f"normalized in the epilogue of %{lin.root}")


@register_pass("fuse-qk-norm", "exact",
               "QK-norm: normalize the heads of q and k in the epilogue of their projection")
def fuse_qk_norm(g: Graph, ctx: PassContext) -> Graph:
    # 1. For each linear layer, find the head views read only by a per-head rmsnorm or
    #    layernorm (QK-norm normalizes each head over its head_dim).
    # 2. Legal if those columns are [0, n·D) — q then k, first in a merged QKV — with one
    #    kind of norm and one eps, and no other reader sees them un-normalized.
    # 3. Append head_norm(kind, eps, heads=n) reading a gain and a shift built at load time:
    #    each head's norm weight tiled over its heads (zeros shift for RMSNorm). Each norm
    #    node is replaced by its head view, so fuse-rope then finds the rotation there.
    rw = Rewriter(g, ctx)
    for lin in _linear_roots(rw):
        _fuse_qk_norm(rw, lin, ctx)
    return rw.finish()


# ---- fuse-kv-write ---------------------------------------------------------------------------

@dataclass(frozen=True)
class _CacheSite:
    lin: Linear           # the projection computing q, k and v
    k_cache: int          # the kv_cache writes the epilogue replaces
    v_cache: int
    k: ColumnView
    v: ColumnView
    layer: int


def _cache_site(rw: Rewriter, att: int) -> _CacheSite:
    """The projection whose epilogue can write the cache this attention reads; else Refusal."""
    n = rw.node(att)
    q, kc, vc = n.inputs[:3]
    if rw.op(kc) != Op.KV_CACHE or rw.op(vc) != Op.KV_CACHE:
        raise Refusal("k and v are not read from kv_cache writes")
    k_node, v_node = rw.node(kc), rw.node(vc)
    layer = k_node.attr("layer")
    if (k_node.attr("kind"), v_node.attr("kind")) != ("k", "v") or v_node.attr("layer") != layer:
        raise Refusal(f"%{kc} and %{vc} are not the k and v cache of one layer")
    for c in (kc, vc):
        if rw.users(c) != [att]:
            raise Refusal(f"the cache values %{c} are read outside this attention")
    kv, vv = (column_view(rw, rw.node(c).inputs[0]) for c in (kc, vc))
    if kv is None or vv is None:
        src = rw.node(kc if kv is None else vc).inputs[0]
        raise Refusal(f"%{src} ({rw.op(src).value}) stands between the projection and the "
                      "cache write (fuse-rope must fold RoPE into the projection first)")
    if kv.source != vv.source:
        raise Refusal("k and v come from different projections (merge-qkv must merge them "
                      "first)")
    lin = view(rw, kv.source)
    if lin is None:
        raise Refusal(f"k and v are not computed by a linear layer (%{kv.source})")
    if (kv.heads, kv.head_dim) != (vv.heads, vv.head_dim):
        raise Refusal("k and v have different head layouts")
    qv = column_view(rw, q)
    if qv is None or qv.source != kv.source:
        raise Refusal(f"q %{q} is not computed by the kernel that writes the cache, so the "
                      "cache read would not be ordered after the write")
    for c in (kv.split, vv.split):
        if len(rw.users(c)) != 1:
            raise Refusal(f"the head view %{c} is read outside the cache write")
    if any(s.fn == "kv_write" for s in lin.steps):
        raise Refusal(f"%{lin.root} already writes a cache")
    return _CacheSite(lin, kc, vc, kv, vv, layer)


def _fuse_kv_write(rw: Rewriter, att: int, ctx: PassContext) -> None:
    try:
        site = _cache_site(rw, att)
    except Refusal as r:
        ctx.refused("fuse-kv-write", rw.describe(att), r.why)
        return
    # writing k and v from the accumulator = writing the stored k and v: same values, no
    # round trip through memory
    write = step("kv_write", head_dim=site.k.head_dim, k_start=site.k.start,
                 v_start=site.v.start, kv_heads=site.k.heads, layer=site.layer)
    replace_linear(rw, site.lin, site.lin.then(write))
    n = rw.node(att)
    attrs = dict(n.attrs)
    attrs.update(cache_layer=site.layer, kv_heads=site.k.heads)
    new = rw.emit(Op.ATTENTION, [n.inputs[0], *n.inputs[3:]],
                  like=[att, site.k_cache, site.v_cache], **attrs)
    rw.replace(att, new)
    rw.kill(site.k_cache)
    rw.kill(site.v_cache)
    ctx.applied("fuse-kv-write", rw.describe(att),
                f"layer {site.layer} cache written by %{site.lin.root}")


@register_pass("fuse-kv-write", "exact",
               "write k and v to the cache from the projection's epilogue; attention reads it")
def fuse_kv_write(g: Graph, ctx: PassContext) -> Graph:
    # 1. For each attention reading k and v from kv_cache writes of one layer, find the
    #    projection both are column views of.
    # 2. Legal if the cache values are read by this attention only, nothing (RoPE) stands
    #    between the projection and the write, and q comes from the same projection — the
    #    kernel that writes the cache then runs before the attention that reads it.
    # 3. Append kv_write(layer, k_start, v_start) to the projection; the attention reads
    #    cache_layer; the kv_cache nodes go.
    rw = Rewriter(g, ctx)
    for i in rw.order():
        n = rw.node(i)
        if n.op == Op.ATTENTION and n.attr("cache_layer") is None and \
                rw.op(n.inputs[1]) == Op.KV_CACHE:
            _fuse_kv_write(rw, i, ctx)
    return rw.finish()
