"""Boundary ops; matmuls, fused, and grouped over routed experts; elementwise ops, norms, views.
A fused matmul's prologue is a folded norm's (``archc.passes.norms``), its epilogue steps are
``archc.ir.ops.steps``."""

from __future__ import annotations

from typing import NoReturn

import sympy
import torch
import torch.nn.functional as F

import archc.ir.expr as E
from archc.dtypes import FLOAT_DTYPES, TORCH_DTYPES
from archc.ir.attrs import Attr, Attrs, Call, Widths
from archc.ir.ops.attention import rotation_bytes
from archc.ir.ops.base import (
    Args,
    EagerCtx,
    Op,
    OpDef,
    RolesFn,
    ShapeError,
    Sig,
    broadcast,
    float_dtype,
    io_bytes,
    operands,
    per_element,
    register,
    require,
    same_as_input,
    same_dim,
    same_shape,
    vector,
    zero,
)
from archc.ir.ops.steps import (
    PAIRING,
    RowStats,
    apply_epilogue,
    check_epilogue,
    epilogue_roles,
    normalize,
    unpair,
)
from archc.ir.shapes import DTYPE_BYTES, QUANT_DTYPES, Shape, numel
from archc.quant.tensor import QTensor, by_rows, linear


def _given(*_: object) -> NoReturn:
    raise ShapeError("input and param nodes are given their shape and value, not computed")


NAME = Attr("name", str)
EPILOGUE = Attr("epilogue", tuple, ())

register(OpDef(
    Op.INPUT, "A runtime input: token ids, positions, masks, encoder states, an attention's "
    "per-token inputs (with the `default` value a position takes where the caller gives none).",
    '%0 : i64[B,T] = input() {name="tokens"}', operands(), _given, _given,
    attrs=(NAME, Attr("default", int, None)),
    bytes=zero, arity=(0, 0)))

register(OpDef(
    Op.PARAM, "A weight or buffer; `expr` says how to build it from checkpoint tensors.",
    '%1 : f32[97,64] = param() {name="embed.weight"}', operands(), _given, _given,
    attrs=(NAME, Attr("expr", Call, None)), bytes=zero, arity=(0, 0)))

register(OpDef(
    Op.OUTPUT, "A named result of the graph.",
    '%40 : f32[B,T,97] = output(%39) {name="logits"}', operands("x"), same_as_input,
    lambda ctx, a, at: a["x"], attrs=(NAME,), bytes=zero, arity=(1, 1)))


# ---- embedding and matmuls ------------------------------------------------------------------

def _embedding_infer(sig: Sig) -> tuple[Shape, str]:
    table, ids = sig.shape("table"), sig.shape("ids")
    require(len(table) == 2, f"table must be 2-D, got {list(table)}")
    require(sig.dtype("ids") == "i64", f"ids must be i64, got {sig.dtype('ids')}")
    quantized = sig.dtype("table") in QUANT_DTYPES
    require(quantized == (sig.attr("dtype") is not None),
            "a quantized table needs dtype= (the rows' dtype), a float one none")
    return (*ids, table[1]), sig.attr("dtype") or sig.dtype("table")


def _embedding(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    table, ids = a["table"], a["ids"]
    mine = None
    if at["parts"] > 1:   # this tp rank's rows: ids of other parts read row 0, then give 0
        rows = table.shape[0]
        ids = ids - ctx.comm("tp").rank * rows
        mine = (ids >= 0) & (ids < rows)
        ids = torch.where(mine, ids, torch.zeros_like(ids))
    if isinstance(table, QTensor):       # only the gathered rows are dequantized
        out = table.take(ids).dequantize(TORCH_DTYPES[at["dtype"]])
    else:
        out = F.embedding(ids, table)
    return out if mine is None else out * mine.unsqueeze(-1).to(out.dtype)


register(OpDef(
    Op.EMBEDDING, "Gather rows of a table by integer ids.",
    "%3 : f32[B,T,64] = embedding(%1, %0)", operands("table", "ids"), _embedding_infer,
    _embedding, attrs=(Attr("dtype", str, None, FLOAT_DTYPES),
                       # vocabulary-parallel (archc.passes.shard): the table is tp rank r's
                       # part r of `parts` equal parts of the vocabulary; ids outside it give 0
                       # rows, and an all_reduce over the ranks makes the whole embedding
                       Attr("parts", int, 1, at_least=1)),
    # reads only the gathered rows, and the ids
    bytes=lambda sig: numel(sig.out_shape) * (DTYPE_BYTES[sig.dtype("table")]
                                              + DTYPE_BYTES[sig.out_dtype])
    + numel(sig.shape("ids")) * DTYPE_BYTES["i64"],
    template="embedding", arity=(2, 2), quantized=("table",),
    docs={"ids": "integer ids, one per row",
          "table": "table, or a quantized one (`dtype`: its rows' dtype)"}))


def matmul_flops(sig: Sig) -> sympy.Expr:
    x, w = sig.shapes[0], sig.shape("weight")
    return 2 * numel(x[:-1]) * w[0] * w[1]


def matmul_infer(sig: Sig) -> tuple[Shape, str]:
    x, w = sig.shapes[0], sig.shape("weight")
    require(len(w) == 2, f"weight must be 2-D [N, K], got {list(w)}")
    require(same_dim(x[-1], w[1]), f"x has K={x[-1]} but weight [N, K] has K={w[1]}")
    return (*x[:-1], w[0]), float_dtype(sig)


register(OpDef(
    Op.MATMUL, "x @ wᵀ with the weight stored [N, K] as torch.nn.Linear does.",
    "%9 : f32[B,T,64] = matmul(%8, %2)", operands("x", "weight"), matmul_infer,
    lambda ctx, a, at: linear(a["x"], a["weight"]), flops=matmul_flops,
    arity=(2, 2), quantized=("weight",)))


def activations(roles: Sig | Args) -> list[str]:
    """The activation operands of a fused_linear: x, or x1 and x2 concatenated along K."""
    has = roles.has if isinstance(roles, Sig) else roles.__contains__
    return ["x1", "x2"] if has("x1") else ["x"]


def _linear_infer(sig: Sig) -> tuple[Shape, str]:
    xs = [sig.shape(r) for r in activations(sig)]
    x, w = xs[0], sig.shape("weight")
    if len(xs) == 2:
        require(len(xs[1]) == len(x) and same_shape(x[:-1], xs[1][:-1]),
                f"concatenated operands {list(x)} and {list(xs[1])} differ before K")
        require(sig.attr("prologue") is None, "a prologue needs a single operand")
    require(len(w) == 2 and same_dim(sum(s[-1] for s in xs), w[1]),
            f"x {[list(s) for s in xs]} and weight {list(w)} do not match as x @ wᵀ")
    require((sig.attr("prologue") is None) == (sig.attr("eps") is None), "eps goes with a prologue")
    if sig.attr("gain"):
        require(len(xs) == 1, "a gain scales a single operand")
        vector(sig, "gain", w[1])
    width = check_epilogue(sig, Op.FUSED_LINEAR, int(w[0]), len(xs) + 1 + bool(sig.attr("gain")),
                           x[:-1])
    require(not any(st.fn == "glu" and st.kw("interleaved", False)
                    for st in sig.attr("epilogue", ())),
            "glu(interleaved=true) is for expert weights (moe_linear); a fused_linear's paired "
            "rows are marked by paired=true")
    if sig.attr("paired"):
        pairing = [st.fn for st in sig.attr("epilogue", ()) if st.fn in PAIRING]
        require(len(pairing) == 1, "paired weight rows need exactly one glu() or rope() step, "
                f"got {pairing or 'none'}")
    return (*x[:-1], sympy.Integer(width)), float_dtype(sig)


def fused_linear(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    xs = [a[r] for r in activations(a)]
    k = xs[0].shape[-1]
    x = xs[0].float() * a["gain"].float() if at["gain"] else xs[0].float()

    def product(w: torch.Tensor) -> torch.Tensor:
        w = w.float()
        acc = F.linear(x, w[:, :k])
        if len(xs) == 2:  # the K loop runs over x1's columns, then x2's
            acc = acc + F.linear(xs[1].float(), w[:, k:])
        return acc

    acc = by_rows(a["weight"], xs[0].dtype, product)
    if at["paired"]:   # the weight rows are paired-adjacent: back to column order
        acc = unpair(acc, at["epilogue"])
    prologue = at["prologue"]
    stats = normalize(xs[0], prologue, at["eps"])[1] if prologue else RowStats(xs[0].dtype)
    rest = list(a.values())[len(xs) + 1 + bool(at["gain"]):]
    return apply_epilogue(ctx, acc, at["epilogue"], rest, stats).to(xs[0].dtype)


def _row_kernel_bytes(sig: Sig) -> sympy.Expr:
    """Bytes of a kernel that writes rows (fused_linear, norm): its operands and output, and
    what its epilogue moves beside them."""
    # k and v rows go to the cache as well; a rope step reads only the cos/sin table rows at
    # its positions, not the whole table io_bytes counts
    rows = numel(sig.shapes[0][:-1]) * DTYPE_BYTES[sig.out_dtype]
    total = io_bytes(sig) + sum(2 * rows * st.kw("kv_heads") * st.kw("head_dim")
                                for st in sig.attr("epilogue") if st.fn == "kv_write")
    for k, st in enumerate(sig.attr("epilogue")):
        if st.fn == "rope":
            pos, rotation = sig.shape(f"pos{k}"), sig.shape(f"rotation{k}")
            total += rotation_bytes(pos, rotation, st.kw("dynamic")) - \
                numel(rotation) * DTYPE_BYTES[sig.dtype(f"rotation{k}")]
    return total


register(OpDef(
    Op.FUSED_LINEAR, "x @ wᵀ with a norm prologue and an epilogue chain, one kernel; with "
    "concat_k, x is two operands concatenated along K (parallel blocks' out + down); with "
    "paired, the weight rows are in the order of the glu/rope step's pairs, partners side by "
    "side (the accumulator is put back in column order before the epilogue); with gain, x is "
    "multiplied by a [K] gain as it is read (a norm's gain folded into a quantized weight's "
    "activations, since the weight's stored values cannot change).",
    '%9 : f32[B,T,128] = fused_linear(%3, %8, %1, %7) {epilogue=[rms_scale(), rope(heads=6, '
    'head_dim=16, interleaved=false, rotary_dim=16), kv_write(head_dim=16, k_start=64, '
    'kv_heads=2, layer=0, v_start=96)], eps=1e-05, prologue="rms"}',
    lambda attrs, n: (["x1", "x2"] if attrs.get("concat_k") else ["x"]) + ["weight"]
    + (["gain"] if attrs.get("gain") else []) + epilogue_roles(attrs), _linear_infer,
    fused_linear,
    attrs=(Attr("prologue", str, None, ("rms", "layer")), Attr("eps", float, None), EPILOGUE,
           Attr("concat_k", bool, False), Attr("paired", bool, False), Attr("gain", bool, False)),
    quantized=("weight",),
    flops=lambda sig: matmul_flops(sig) + 4 * numel(sig.out_shape), bytes=_row_kernel_bytes,
    template="matmul", arity=(2, -1),
    docs={"x": "activations", "x1": "first operand", "x2": "second operand",
          "weight": "weight, K-contiguous", "gain": "a gain over K applied to x as it is read"}))


# ---- mixture of experts: only routed experts are computed, and costs count only them ------

def _router_infer(sig: Sig) -> tuple[Shape, str]:
    gates, dtype = matmul_infer(sig) if sig.has("weight") else (sig.shape("x"), float_dtype(sig))
    experts, top_k = int(gates[-1]), sig.attr("top_k")
    groups, kept = sig.attr("groups"), kept_groups(sig.attrs)
    require(experts % groups == 0, f"{groups} groups of {experts} experts")
    require(kept <= groups, f"top_groups {kept} of {groups} groups")
    require(top_k <= kept * (experts // groups), f"top_k {top_k} of {experts} experts" + (
        f" ({kept} kept groups of {experts // groups})" if groups > 1 else ""))
    require(groups == 1 or sig.attr("group_score") == "max" or experts // groups >= 2,
            f"a top-2 group score over groups of {experts // groups} expert")
    require(sig.attr("scale") > 0, f"scale {sig.attr('scale')} is not above 0")
    for role in ("bias", "choice_bias"):
        if sig.has(role):
            vector(sig, role, gates[-1])
    return gates, dtype


def kept_groups(attrs: Attrs) -> int:
    """The groups a router keeps for the choice: top_groups, all of them by default."""
    return attrs["groups"] if attrs.get("top_groups") is None else attrs["top_groups"]


def route(logits: torch.Tensor, fn: str, top_k: int, normalize: bool, *,
          choice_bias: torch.Tensor | None = None, groups: int = 1, top_groups: int | None = None,
          group_score: str = "top2", scale: float = 1.0) -> torch.Tensor:
    """Dense gates from router logits [..., E] in f32, zero off the k chosen experts.

    1. weights: softmax over all the experts, or sigmoid of each logit;
    2. choice values: the logits (they order as the weights do) — or, with a choice bias or
       groups, the weights plus the choice bias (DeepSeek's routers choose by these);
    3. with groups: the E experts in `groups` equal groups in index order, each scored by its
       best choice value ("max") or the sum of its two best ("top2"); the choice is confined to
       the `top_groups` best groups (the lowest group first among equal scores);
    4. the k largest choice values choose (the lowest expert first among equal ones, as
       `selected_experts`); the chosen weigh by their weights, not their choice values;
    5. renormalized to sum to 1 if asked (+1e-20 below, DeepSeek-V3's guard: no change unless
       the k weights sum below ~1e-13), then times `scale`."""
    logits = logits.float()
    weights = torch.softmax(logits, dim=-1) if fn == "softmax" else torch.sigmoid(logits)
    choice = logits
    if choice_bias is not None or groups > 1:
        choice = weights if choice_bias is None else weights + choice_bias.float()
    if groups > 1:
        grouped = choice.unflatten(-1, (groups, -1))                    # (..., G, E/G)
        score = grouped.amax(dim=-1) if group_score == "max" else \
            grouped.topk(2, dim=-1).values.sum(dim=-1)                  # (..., G)
        kept = torch.sort(score, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros_like(score, dtype=torch.bool).scatter(
            -1, kept[..., :top_groups or groups], True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=-1),
                                    float("-inf"))
    idx = torch.sort(choice, dim=-1, descending=True, stable=True).indices[..., :top_k]
    top = weights.gather(-1, idx)
    if normalize:
        top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    if scale != 1.0:
        top = top * scale
    return torch.zeros_like(logits).scatter(-1, idx, top)


def _router(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    x = a["x"]
    logits = by_rows(a["weight"], torch.float32, lambda w: F.linear(x.float(), w.float())) \
        if "weight" in a else x.float()
    if "bias" in a:
        logits = logits + a["bias"].float()
    return route(logits, at["fn"], at["top_k"], at["normalize"], choice_bias=a.get("choice_bias"),
                 groups=at["groups"], top_groups=kept_groups(at), group_score=at["group_score"],
                 scale=at["scale"]).to(x.dtype)


def router_roles(attrs: Attrs, n: int) -> list[str]:
    """x (the logits, or the activations), then the router weight and bias when fused, then
    the choice bias when the router has one."""
    extra = ["choice_bias"] if attrs.get("choice_bias") else []
    return ["x", "weight", "bias"][:max(1, min(n - len(extra), 3))] + extra


def _router_flops(sig: Sig) -> sympy.Expr:
    # the matmul of a fused router, or the weights and argmax rounds over given logits (6 a
    # gate); a choice bias adds one a gate, groups two (their scores and the masking)
    extra = int(sig.attr("choice_bias")) + 2 * int(sig.attr("groups") > 1)
    return (matmul_flops(sig) if sig.has("weight") else 6 * numel(sig.out_shape)) + \
        extra * numel(sig.out_shape)


register(OpDef(
    Op.ROUTER, "Top-k routing: dense gates (zeros off the top k) from router logits, or from x, "
    "the router weight and a bias in one kernel (the logits never stored). `fn` gives the "
    "weights: softmax over all the experts, or sigmoid of each. The top k logits choose — or, "
    "with a choice bias or groups, the top k weights plus the choice bias, within the "
    "top_groups best of `groups` equal groups (scored by their best, or two best, values); the "
    "chosen weights, renormalized if asked, times `scale`.",
    "%30 : f32[B,T,4] = router(%28, %29) {normalize=true, top_k=2}",
    router_roles, _router_infer, _router,
    attrs=(Attr("top_k", int, at_least=1), Attr("normalize", bool),
           Attr("fn", str, "softmax", ("softmax", "sigmoid")),
           Attr("choice_bias", bool, False), Attr("groups", int, 1, at_least=1),
           Attr("top_groups", int, None, at_least=1),
           Attr("group_score", str, "top2", ("top2", "max")),
           Attr("scale", float, 1.0)),
    flops=_router_flops, template="moe", arity=(1, 4), quantized=("weight",),
    docs={"x": "activations", "weight": "router weight", "bias": "router bias",
          "choice_bias": "per-expert bias added to the weights for the choice only"}))


def selected_experts(gates: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts each token was routed to, in ascending expert order: [..., top_k]. The
    largest gates, the lowest expert first among equal gates (as the router picks them, and as
    the routing kernel does): a stable sort, since `topk` breaks ties arbitrarily on a CPU."""
    order = torch.sort(gates.float(), dim=-1, descending=True, stable=True).indices
    return order[..., :top_k].sort(dim=-1).values


def moe_linear(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """Expert by expert over the (token, slot) pairs routed to it, in f32: x·W_eᵀ, times the
    pair's gate where the gates scale the input (`gate_input`: (g·x)·W_eᵀ = g·(x·W_eᵀ)), plus
    the expert's bias; `down` sums each token's pairs, weighted by their gates unless the gates
    scaled the input."""
    x, gates, w = a["x"], a["gates"], a["weight"]
    k, up, gate_input = at["top_k"], at["stage"] == "up", at["gate_input"]
    bias = a["bias"].float() if at["bias"] else None
    n_experts, n = w.shape[:2]
    pairs = selected_experts(gates, k).reshape(-1, k)                # (M, k)
    g = gates.reshape(-1, n_experts).float()
    rows = x.reshape(-1, x.shape[-1]) if up else x.reshape(-1, k, x.shape[-1])
    acc = torch.zeros((rows.shape[0], k, n) if up else (rows.shape[0], n), device=x.device)
    for e in range(n_experts):
        tok, slot = torch.nonzero(pairs == e, as_tuple=True)
        if not len(tok):      # unrouted: its weights are not even converted to f32
            continue
        we = w.select(e) if isinstance(w, QTensor) else w[e]
        picked = (rows[tok] if up else rows[tok, slot]).float()
        out = by_rows(we, x.dtype, lambda v, picked=picked: F.linear(picked, v.float()))
        if up and gate_input:
            out = out * g[tok, e, None]
        if bias is not None:
            out = out + bias[e]
        if up:
            acc[tok, slot] = out
        else:
            acc.index_add_(0, tok, out if gate_input else out * g[tok, e, None])
    acc = acc.reshape(*_tokens(x.shape, up), *((k, n) if up else (n,)))
    rest = list(a.values())[3 + bool(bias is not None):]
    return apply_epilogue(ctx, acc, at["epilogue"], rest, RowStats(x.dtype)).to(x.dtype)


def _tokens(x: Shape | torch.Size, up: bool) -> Shape:
    """The token dims of x: [..., K] (up) or [..., k, K] (down)."""
    return tuple(x[:-1] if up else x[:-2])


def _moe_infer(sig: Sig) -> tuple[Shape, str]:
    x, gates, w = sig.shape("x"), sig.shape("gates"), sig.shape("weight")
    k, up = sig.attr("top_k"), sig.attr("stage") == "up"
    require(len(w) == 3 and same_dim(gates[-1], w[0]), f"weights {list(w)} for {gates[-1]} "
            "experts")
    require(same_dim(x[-1], w[2]), f"x width {x[-1]} ≠ expert input {w[2]}")
    require(up or (len(x) >= 2 and int(x[-2]) == k), f"hidden {list(x)} must be [..., {k}, "
            f"{w[2]}]")
    rows = (*x[:-1], sympy.Integer(k)) if up else x[:-2]      # [..., k] (up) or [...] (down)
    if sig.attr("bias"):
        b = sig.shape("bias")
        require(len(b) == 2 and same_dim(b[0], w[0]) and same_dim(b[1], w[1]),
                f"expert biases {list(b)} must be [{w[0]}, {w[1]}]")
    width = check_epilogue(sig, Op.MOE_LINEAR, int(w[1]), 3 + bool(sig.attr("bias")), rows)
    return (*rows, sympy.Integer(width)), float_dtype(sig)


def routed_pairs(sig: Sig) -> sympy.Expr:
    """(token, slot) pairs: each is one row through one expert."""
    return numel(_tokens(sig.shape("x"), sig.attr("stage") == "up")) * sig.attr("top_k")


def _moe_bytes(sig: Sig) -> sympy.Expr:
    # every input and the output once, but only the weights of experts some token is routed to
    w = sig.shape("weight")
    unread = w[0] - sympy.Min(w[0], routed_pairs(sig))
    return io_bytes(sig) - unread * w[1] * w[2] * DTYPE_BYTES[sig.dtype("weight")]


register(OpDef(
    Op.MOE_LINEAR, "Grouped expert matmul over the routed (token, slot) pairs: `up` gives a row "
    "per pair [..., k, N]; `down` projects the pairs back and sums them weighted by the gates; "
    "with `bias`, each expert's bias [E, N] joins its rows; with `gate_input`, the gates scale "
    "the pairs' input rows instead (up: g·(x·Wᵀ); down: an unweighted sum); then an epilogue "
    "(glu or an activation after up, a residual add after down).",
    '%31 : f32[B,T,2,96] = moe_linear(%28, %30, %26) {epilogue=[glu(fn="silu")], stage="up", '
    'top_k=2}',
    lambda attrs, n: ["x", "gates", "weight", *(["bias"] if attrs.get("bias") else []),
                      *epilogue_roles(attrs)], _moe_infer, moe_linear,
    attrs=(Attr("stage", str, choices=("up", "down")), Attr("top_k", int, at_least=1), EPILOGUE,
           Attr("bias", bool, False), Attr("gate_input", bool, False)),
    flops=lambda sig: 2 * routed_pairs(sig) * sig.shape("weight")[1] * sig.shape("weight")[2],
    bytes=_moe_bytes, template="moe", arity=(3, -1), quantized=("weight",),
    docs={"x": "activations, or one row per (token, slot)", "gates": "dense gates",
          "weight": "expert weights", "bias": "expert biases"}))


# ---- elementwise: each op is an expression of the elementwise language ---------------------

def elementwise_expr(op: Op, attrs: Attrs) -> Call:
    """The expression an elementwise node computes over its inputs x(0), x(1)…."""
    if op == Op.POINTWISE:
        return attrs["expr"]
    if op == Op.ACT:
        return E.call("act", E.x(0), fn=attrs["fn"])
    return E.call(op.value, E.x(0), E.x(1))


def _elementwise(op: Op, summary: str, example: str, roles: RolesFn, *attrs: Attr,
                 commutative: bool = False, arity: tuple[int, int] = (2, 2)) -> None:
    def infer(sig: Sig) -> tuple[Shape, str]:
        problem = E.problem(elementwise_expr(op, sig.attrs), len(sig.shapes))
        require(problem is None, str(problem))
        out = sig.shapes[0]
        for s, d in zip(sig.shapes[1:], sig.dtypes[1:]):
            require(d == sig.dtypes[0], f"dtypes differ: {sig.dtypes[0]} and {d}")
            out = broadcast(out, s)
        return out, float_dtype(sig)

    def eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
        xs = list(a.values())
        return E.evaluate(elementwise_expr(op, at), xs).to(xs[0].dtype)

    def flops(sig: Sig) -> sympy.Expr:
        return max(1, E.flops(elementwise_expr(op, sig.attrs))) * numel(sig.out_shape)

    register(OpDef(op, summary, example, roles, infer, eager, attrs=attrs, flops=flops,
                   commutative=commutative, arity=arity,
                   template="pointwise" if op == Op.POINTWISE else None))


_elementwise(Op.ADD, "Elementwise sum, broadcasting: residual adds, biases, parallel branches.",
             "%20 : f32[B,T,64] = add(%4, %19)", operands("a", "b"), commutative=True)
_elementwise(Op.MUL, "Elementwise product, broadcasting (gated FFNs).",
             "%15 : f32[B,T,176] = mul(%13, %14)", operands("a", "b"), commutative=True)
_elementwise(Op.ACT, "An activation: " + ", ".join(E.ACTIVATIONS) + ".",
             '%14 : f32[B,T,256] = act(%13) {fn="gelu"}', operands("x"),
             Attr("fn", str, choices=tuple(E.ACTIVATIONS)), arity=(1, 1))
_elementwise(Op.POINTWISE, "An elementwise expression over inputs x(0), x(1)… "
             "(archc.ir.expr): scales, soft-caps, fused chains.",
             '%15 : f32[B,T,176] = pointwise(%13, %14) {expr=mul(act(x(0), fn="silu"), x(1))}',
             lambda attrs, n: [f"x{i}" for i in range(max(n, 1))], Attr("expr", Call),
             arity=(1, -1))

register(OpDef(
    Op.SOFTMAX, "Softmax over the last dim, computed in f32.",
    "%15 : f32[B,4,T,P+T] = softmax(%14)", operands("x"), same_as_input,
    lambda ctx, a, at: torch.softmax(a["x"].float(), dim=-1).to(a["x"].dtype),
    flops=per_element(5), arity=(1, 1)))


def _norm_infer(sig: Sig) -> tuple[Shape, str]:
    x, w = sig.shape("x"), sig.shape("weight")
    spans = sig.attr("spans")
    if spans is None:
        require(len(w) == 1 and same_dim(w[0], x[-1]),
                f"the gain {list(w)} does not match the last dim of {list(x)}")
    else:
        normed = sum(spans)
        require(isinstance(x[-1], sympy.Integer) and normed <= int(x[-1]),
                f"the spans {list(spans)} cover {normed} columns, more than the {x[-1]} of "
                f"{list(x)}")
        require(len(w) == 1 and same_dim(w[0], normed),
                f"the gain {list(w)} does not match the {normed} columns the spans "
                f"{list(spans)} normalize")
        require(not sig.attr("add_before"), "spans normalize x alone, not x + residual")
    if sig.has("residual"):
        require(same_shape(sig.shape("residual"), x),
                f"the residual {list(sig.shape('residual'))} does not match x {list(x)}")
    require(not (sig.attr("unit_offset") and sig.attr("kind") == "layer"),
            "unit_offset is for rms norms")
    check_epilogue(sig, Op.NORM, int(x[-1]), 3 if sig.has("residual") else 2, x[:-1])
    return x, float_dtype(sig)


def norm(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    x = a["x"]
    if "residual" in a:   # the residual stream is stored in the model dtype before the norm
        x = (x.float() + a["residual"].float()).to(x.dtype)
    gain = a["weight"].float()
    gain = 1.0 + gain if at["unit_offset"] else gain
    if at["spans"] is None:
        y, stats = normalize(x, at["kind"], at["eps"])
        y = y * gain
    else:   # each span on its own statistics; the columns past the spans pass through
        parts, start = [], 0
        for width in at["spans"]:
            parts.append(normalize(x[..., start:start + width], at["kind"], at["eps"])[0])
            start += width
        y = torch.cat([torch.cat(parts, dim=-1) * gain, x[..., start:].float()], dim=-1)
        stats = RowStats(x.dtype)
    rest = [v for k, v in a.items() if k not in ("x", "weight", "residual")]
    return apply_epilogue(ctx, y, at["epilogue"], rest, stats).to(x.dtype)


register(OpDef(
    Op.NORM, "RMSNorm or LayerNorm over the last dim, times its gain (1 + w with unit_offset); "
    "with add_before, of x + residual; with spans, each span of columns from column 0 on its "
    "own statistics (the q and k columns of a projection normalized whole), the gain over the "
    "spans, the columns past them passed through; then an epilogue (the LayerNorm bias, a "
    "residual add, RoPE and the KV-cache write after a QK-norm).",
    '%5 : f32[B,T,64] = norm(%4, %2, %3) {epilogue=[bias()], eps=1e-05, kind="layer"}',
    lambda attrs, n: operands("x", "weight", ("residual", "add_before"))(attrs, n)
    + epilogue_roles(attrs), _norm_infer, norm,
    attrs=(Attr("kind", str, choices=("rms", "layer")), Attr("eps", float),
           Attr("unit_offset", bool, False), Attr("add_before", bool, False),
           Attr("spans", Widths, None), EPILOGUE),
    flops=lambda sig: (4 if sig.attr("kind") == "rms" else 8) * numel(sig.out_shape),
    bytes=_row_kernel_bytes, template="norm", arity=(2, -1),
    docs={"x": "rows to normalize", "weight": "gain", "residual": "residual, added before"}))


# ---- views -----------------------------------------------------------------------------------

def _split_infer(sig: Sig) -> tuple[Shape, str]:
    x, heads = sig.shapes[0], sig.attr("heads")
    require(len(x) == 3, f"split_heads takes [B, T, H·D], got {list(x)}")
    require(isinstance(x[2], sympy.Integer) and int(x[2]) % heads == 0,
            f"width {x[2]} is not a multiple of heads={heads}")
    return (x[0], sympy.Integer(heads), x[1], sympy.Integer(int(x[2]) // heads)), sig.dtypes[0]


def _merge_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    require(len(x) == 4, f"merge_heads takes [B, H, T, D], got {list(x)}")
    return (x[0], x[2], x[1] * x[3]), sig.dtypes[0]


def _slice_infer(sig: Sig) -> tuple[Shape, str]:
    x, start, stop = sig.shapes[0], sig.attr("start"), sig.attr("stop")
    require(0 <= start < stop <= int(x[-1]), f"columns [{start}, {stop}) outside width {x[-1]}")
    return (*x[:-1], sympy.Integer(stop - start)), sig.dtypes[0]


register(OpDef(
    Op.SPLIT_HEADS, "View [B, T, H·D] as [B, H, T, D].",
    "%11 : f32[B,4,T,16] = split_heads(%10) {heads=4}", operands("x"), _split_infer,
    lambda ctx, a, at: a["x"].unflatten(-1, (at["heads"], -1)).transpose(1, 2),
    attrs=(Attr("heads", int, at_least=1),), bytes=zero, arity=(1, 1)))

register(OpDef(
    Op.MERGE_HEADS, "View [B, H, T, D] as [B, T, H·D].",
    "%30 : f32[B,T,64] = merge_heads(%29)", operands("x"), _merge_infer,
    lambda ctx, a, at: a["x"].transpose(1, 2).flatten(2), bytes=zero, arity=(1, 1)))

def _last_token_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    require(len(x) == 3, f"last_token takes [B, T, D], got {list(x)}")
    return (x[0], sympy.Integer(1), x[2]), sig.dtypes[0]


register(OpDef(
    Op.LAST_TOKEN, "View the last token of each sequence, row T − 1 of [B, T, D]: the rows "
    "whose logits a prefill's caller uses (`last-token-logits`).",
    "%40 : f32[B,1,64] = last_token(%39)", operands("x"), _last_token_infer,
    lambda ctx, a, at: a["x"][:, -1:], bytes=zero, arity=(1, 1)))

register(OpDef(
    Op.SLICE, "View columns [start, stop) of the last dim (e.g. q, k, v of a fused QKV).",
    "%12 : f32[B,T,32] = slice(%11) {start=64, stop=96}", operands("x"), _slice_infer,
    lambda ctx, a, at: a["x"][..., at["start"]:at["stop"]], bytes=zero, arity=(1, 1),
    attrs=(Attr("start", int, at_least=0), Attr("stop", int, at_least=1))))
