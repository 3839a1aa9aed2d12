"""Boundary, linear-algebra, elementwise, normalization and view ops."""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F

import archc.ir.expr as E
from archc.ir.attrs import Attrs, Call
from archc.ir.ops.base import (
    Args,
    Attr,
    EagerCtx,
    Op,
    OpDef,
    ShapeError,
    Sig,
    broadcast,
    float_dtype,
    operands,
    per_element,
    register,
    require,
    same_as_input,
    same_dim,
    same_shape,
    variadic,
    zero,
)
from archc.ir.ops.steps import RowStats, apply_epilogue, check_epilogue, epilogue_roles
from archc.ir.shapes import DTYPE_BYTES, Shape, numel


def _declared(sig: Sig) -> tuple[Shape, str]:
    # input and param nodes carry their shape; the builder passes it in, so this never runs
    raise ShapeError("input/param nodes must be given their shape")


def _bound_by_interpreter(ctx: EagerCtx, args: Args, attrs: Attrs) -> torch.Tensor:
    raise RuntimeError("inputs and params are bound by the interpreter, not run")


def _name() -> Attr:
    return Attr("name", str, doc="the name callers and checkpoints know it by")


register(OpDef(
    Op.INPUT, "A runtime input: token ids, positions, masks, encoder states.",
    '%0 : i64[B,T] = input() {name="tokens"}', operands(), _declared, _bound_by_interpreter,
    attrs=(_name(),), bytes=zero, arity=(0, 0)))

register(OpDef(
    Op.PARAM, "A weight or buffer; `expr` says how to build it from checkpoint tensors.",
    '%1 : f32[97,64] = param() {name="embed.weight"}', operands(), _declared,
    _bound_by_interpreter, attrs=(_name(), Attr("expr", Call, None)), bytes=zero,
    arity=(0, 0)))

register(OpDef(
    Op.OUTPUT, "A named result of the graph.",
    '%40 : f32[B,T,97] = output(%39) {name="logits"}', operands("x"), same_as_input,
    lambda ctx, a, at: a["x"], attrs=(_name(),), bytes=zero, arity=(1, 1)))


# ---- embedding and matmul -------------------------------------------------------------------

def _embedding_infer(sig: Sig) -> tuple[Shape, str]:
    table, ids = sig.shape("table"), sig.shape("ids")
    require(len(table) == 2, f"table must be 2-D, got {list(table)}")
    require(sig.dtype("ids") == "i64", f"ids must be i64, got {sig.dtype('ids')}")
    return (*ids, table[1]), sig.dtype("table")


def _embedding_bytes(sig: Sig) -> sympy.Expr:
    # reads only the gathered rows, and the ids
    rows = numel(sig.out_shape) * DTYPE_BYTES[sig.out_dtype]
    return 2 * rows + numel(sig.shape("ids")) * DTYPE_BYTES["i64"]


register(OpDef(
    Op.EMBEDDING, "Gather rows of a table by integer ids.",
    "%3 : f32[B,T,64] = embedding(%1, %0)", operands("table", "ids"), _embedding_infer,
    lambda ctx, a, at: F.embedding(a["ids"], a["table"]), bytes=_embedding_bytes,
    template="embedding", arity=(2, 2), docs={"ids": "integer ids, one per row"}))


def _matmul_infer(sig: Sig) -> tuple[Shape, str]:
    x, w = sig.shapes
    require(len(w) == 2, f"weight must be 2-D [N, K], got {list(w)}")
    require(same_dim(x[-1], w[1]), f"x has K={x[-1]} but weight [N, K] has K={w[1]}")
    return (*x[:-1], w[0]), float_dtype(sig)


def matmul_flops(sig: Sig) -> sympy.Expr:
    x, w = sig.shape("x"), sig.shape("weight")
    return 2 * numel(x[:-1]) * w[0] * w[1]


register(OpDef(
    Op.MATMUL, "x @ wᵀ with the weight stored [N, K] as torch.nn.Linear does.",
    "%9 : f32[B,T,64] = matmul(%8, %2)", operands("x", "weight"), _matmul_infer,
    lambda ctx, a, at: F.linear(a["x"], a["weight"]), flops=matmul_flops, arity=(2, 2)))


# ---- elementwise: each op is an expression of the elementwise language ---------------------

def elementwise_expr(op: Op, attrs: Attrs) -> Call:
    """The expression an elementwise node computes over its inputs x(0), x(1)…."""
    if op == Op.POINTWISE:
        return attrs["expr"]
    if op == Op.ACT:
        return E.call("act", E.x(0), fn=attrs["fn"])
    return E.call(op.value, E.x(0), E.x(1))


def _elementwise_infer(op: Op) -> object:
    def infer(sig: Sig) -> tuple[Shape, str]:
        try:
            E.check(elementwise_expr(op, sig.attrs), len(sig.shapes))
        except E.ExprError as err:
            raise ShapeError(str(err)) from None
        out = sig.shapes[0]
        for s, d in zip(sig.shapes[1:], sig.dtypes[1:]):
            require(d == sig.dtypes[0], f"dtypes differ: {sig.dtypes[0]} and {d}")
            out = broadcast(out, s)
        return out, float_dtype(sig)
    return infer


def _elementwise(op: Op, summary: str, example: str, roles: object, *attrs: Attr,
                 commutative: bool = False, arity: tuple[int, int] = (2, 2)) -> None:
    def eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
        xs = list(a.values())
        return E.evaluate(elementwise_expr(op, at), xs).to(xs[0].dtype)

    def flops(sig: Sig) -> sympy.Expr:
        return max(1, E.flops(elementwise_expr(op, sig.attrs))) * numel(sig.out_shape)

    register(OpDef(op, summary, example, roles, _elementwise_infer(op), eager, attrs=attrs,
                   flops=flops, commutative=commutative, arity=arity,
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
             variadic("x"), Attr("expr", Call), arity=(1, -1))


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


register(OpDef(
    Op.SOFTMAX, "Softmax over the last dim, computed in f32.",
    "%15 : f32[B,4,T,P+T] = softmax(%14)", operands("x"), same_as_input,
    lambda ctx, a, at: softmax(a["x"]), flops=per_element(5), arity=(1, 1)))


# ---- norm ----------------------------------------------------------------------------------

def normalize(x: torch.Tensor, kind: str, eps: float) -> tuple[torch.Tensor, RowStats]:
    """x normalized over its last dim, in f32, and the statistics: rms — x/sqrt(mean(x²) + eps);
    layer — (x − mean)/sqrt(var + eps)."""
    xf = x.float()
    if kind == "rms":
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return xf * rstd, RowStats(None, rstd, x.dtype)
    mean = xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + eps)
    return (xf - mean) * rstd, RowStats(mean, rstd, x.dtype)


def _norm_roles(attrs: object, n: int) -> list[str]:
    return operands("x", "weight", ("residual", "add_before"))(attrs, n) + epilogue_roles(attrs)


def _norm_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shape("x")
    w = sig.shape("weight")
    require(len(w) == 1 and same_dim(w[0], x[-1]),
            f"the gain {list(w)} does not match the last dim of {list(x)}")
    if sig.has("residual"):
        require(same_shape(sig.shape("residual"), x), f"the residual "
                f"{list(sig.shape('residual'))} does not match x {list(x)}")
    require(not (sig.attr("unit_offset") and sig.attr("kind") == "layer"),
            "unit_offset is for rms norms")
    check_epilogue(sig, Op.NORM, int(x[-1]), 3 if sig.has("residual") else 2, x[:-1])
    return x, float_dtype(sig)


def norm(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    x = a["x"]
    if "residual" in a:   # the residual stream is stored in the model dtype before the norm
        x = (x.float() + a["residual"].float()).to(x.dtype)
    y, stats = normalize(x, at["kind"], at["eps"])
    gain = a["weight"].float()
    y = y * (1.0 + gain if at["unit_offset"] else gain)
    rest = [v for k, v in a.items() if k not in ("x", "weight", "residual")]
    return apply_epilogue(ctx, y, at["epilogue"], rest, stats).to(x.dtype)


register(OpDef(
    Op.NORM, "RMSNorm or LayerNorm over the last dim, times its gain (1 + w with unit_offset); "
    "with add_before, of x + residual; then an epilogue (the LayerNorm bias, a residual add).",
    '%5 : f32[B,T,64] = norm(%4, %2, %3) {epilogue=[bias()], eps=1e-05, kind="layer"}',
    _norm_roles, _norm_infer, norm,
    attrs=(Attr("kind", str, choices=("rms", "layer")), Attr("eps", float),
           Attr("unit_offset", bool, False, doc="Gemma's gain 1 + w"),
           Attr("add_before", bool, False, doc="normalize x + residual (post-norm)"),
           Attr("epilogue", tuple, ())),
    flops=lambda sig: (4 if sig.attr("kind") == "rms" else 8) * numel(sig.out_shape),
    template="norm", arity=(2, -1),
    docs={"x": "rows to normalize", "weight": "gain", "residual": "residual, added before"}))


# ---- head views ----------------------------------------------------------------------------

def _split_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    heads = sig.attr("heads")
    require(len(x) == 3, f"split_heads takes [B, T, H·D], got {list(x)}")
    width = x[2]
    require(isinstance(width, sympy.Integer) and int(width) % heads == 0,
            f"width {width} is not a multiple of heads={heads}")
    return (x[0], sympy.Integer(heads), x[1], sympy.Integer(int(width) // heads)), sig.dtypes[0]


def _split_eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    x = a["x"]
    b, t, w = x.shape
    return x.view(b, t, at["heads"], w // at["heads"]).transpose(1, 2)  # (B, H, T, D)


def _merge_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    require(len(x) == 4, f"merge_heads takes [B, H, T, D], got {list(x)}")
    return (x[0], x[2], x[1] * x[3]), sig.dtypes[0]


def _merge_eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    x = a["x"]
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (B, T, H·D)


register(OpDef(
    Op.SPLIT_HEADS, "View [B, T, H·D] as [B, H, T, D].",
    "%11 : f32[B,4,T,16] = split_heads(%10) {heads=4}", operands("x"), _split_infer,
    _split_eager, attrs=(Attr("heads", int, at_least=1),), bytes=zero, arity=(1, 1)))

register(OpDef(
    Op.MERGE_HEADS, "View [B, H, T, D] as [B, T, H·D].",
    "%30 : f32[B,T,64] = merge_heads(%29)", operands("x"), _merge_infer, _merge_eager,
    bytes=zero, arity=(1, 1)))


def _slice_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    start, stop = sig.attr("start"), sig.attr("stop")
    require(0 <= start < stop <= int(x[-1]), f"columns [{start}, {stop}) outside width {x[-1]}")
    return (*x[:-1], sympy.Integer(stop - start)), sig.dtypes[0]


register(OpDef(
    Op.SLICE, "View columns [start, stop) of the last dim (e.g. q, k, v of a fused QKV).",
    "%12 : f32[B,T,32] = slice(%11) {start=64, stop=96}", operands("x"), _slice_infer,
    lambda ctx, a, at: a["x"][..., at["start"]:at["stop"]],
    attrs=(Attr("start", int, at_least=0), Attr("stop", int, at_least=1)), bytes=zero,
    arity=(1, 1)))
