"""Boundary, linear-algebra, pointwise and normalization ops, as lowering emits them."""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch
import torch.nn.functional as F

from archc.ir.attrs import Attrs
from archc.ir.ops.base import (
    EagerCtx,
    Op,
    OpDef,
    ShapeError,
    Sig,
    broadcast,
    float_dtype,
    per_element,
    register,
    require,
    same_as_input,
    same_dim,
    zero,
)
from archc.ir.shapes import DTYPE_BYTES, Shape, numel

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu", "sigmoid", "identity", "softplus",
               "elu_plus_one")


def activation(x: torch.Tensor, fn: str) -> torch.Tensor:
    """The one place activations are defined for eager execution."""
    if fn == "relu":
        return F.relu(x)
    if fn == "gelu":
        return F.gelu(x)
    if fn == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if fn == "silu":
        return F.silu(x)
    if fn == "sigmoid":
        return torch.sigmoid(x)
    if fn == "identity":
        return x
    if fn == "softplus":  # log(1 + eˣ): Mamba's step size Δ
        return F.softplus(x)
    if fn == "elu_plus_one":  # elu(x) + 1 > 0: the feature map φ of linear attention
        return F.elu(x) + 1.0
    raise ValueError(f"unknown activation {fn!r}")


def _declared(sig: Sig) -> tuple[Shape, str]:
    # input and param nodes carry their shape; the builder passes it in, so this never runs
    raise ShapeError("input/param nodes must be given their shape")


def _boundary_eager(ctx: EagerCtx, xs: Sequence[torch.Tensor], attrs: Attrs) -> torch.Tensor:
    raise RuntimeError("inputs and params are bound by the interpreter, not run")


register(OpDef(
    Op.INPUT, "A runtime input: token ids, positions, masks, encoder states.",
    '%0 : i64[B,T] = input() {name="tokens"}', (0, 0), _declared, _boundary_eager,
    bytes=zero, attrs=("name",)))

register(OpDef(
    Op.PARAM, "A weight or buffer; `expr` says how to build it from checkpoint tensors.",
    '%1 : f32[97,64] = param() {name="embed.weight"}', (0, 0), _declared, _boundary_eager,
    bytes=zero, attrs=("name",), optional=("expr",)))

register(OpDef(
    Op.OUTPUT, "A named result of the graph.",
    '%40 : f32[B,T,97] = output(%39) {name="logits"}', (1, 1), same_as_input,
    lambda ctx, xs, a: xs[0], bytes=zero, attrs=("name",)))


# ---- embedding -----------------------------------------------------------------------------

def _embedding_infer(sig: Sig) -> tuple[Shape, str]:
    table, ids = sig.shapes
    require(len(table) == 2, f"table must be 2-D, got {list(table)}")
    require(sig.dtypes[1] == "i64", f"ids must be i64, got {sig.dtypes[1]}")
    return (*ids, table[1]), sig.dtypes[0]


def _embedding_bytes(sig: Sig) -> sympy.Expr:
    # reads only the gathered rows, and the ids
    rows = numel(sig.out_shape) * DTYPE_BYTES[sig.out_dtype]
    return 2 * rows + numel(sig.shapes[1]) * DTYPE_BYTES["i64"]


register(OpDef(
    Op.EMBEDDING, "Gather rows of a table by integer ids.",
    "%3 : f32[B,T,64] = embedding(%1, %0)", (2, 2), _embedding_infer,
    lambda ctx, xs, a: F.embedding(xs[1], xs[0]), bytes=_embedding_bytes))


# ---- matmul --------------------------------------------------------------------------------

def _matmul_infer(sig: Sig) -> tuple[Shape, str]:
    x, w = sig.shapes
    require(len(w) == 2, f"weight must be 2-D [N, K], got {list(w)}")
    require(same_dim(x[-1], w[1]), f"x has K={x[-1]} but weight [N, K] has K={w[1]}")
    return (*x[:-1], w[0]), float_dtype(sig)


def _matmul_flops(sig: Sig) -> sympy.Expr:
    x, w = sig.shapes
    return 2 * numel(x[:-1]) * w[0] * w[1]


register(OpDef(
    Op.MATMUL, "x @ wᵀ with the weight stored [N, K] as torch.nn.Linear does.",
    "%9 : f32[B,T,64] = matmul(%8, %2)", (2, 2), _matmul_infer,
    lambda ctx, xs, a: F.linear(xs[0], xs[1]), flops=_matmul_flops))


# ---- pointwise -----------------------------------------------------------------------------

def _bias_infer(sig: Sig) -> tuple[Shape, str]:
    x, b = sig.shapes
    require(len(b) == 1 and same_dim(b[0], x[-1]),
            f"bias {list(b)} does not match the last dim of {list(x)}")
    return x, float_dtype(sig)


register(OpDef(
    Op.BIAS_ADD, "Add a bias vector along the last dim.",
    "%10 : f32[B,T,64] = bias_add(%9, %3)", (2, 2), _bias_infer,
    lambda ctx, xs, a: xs[0] + xs[1], flops=per_element(1)))


def _broadcast_infer(sig: Sig) -> tuple[Shape, str]:
    require(sig.dtypes[0] == sig.dtypes[1], f"dtypes differ: {sig.dtypes[0]} and "
            f"{sig.dtypes[1]}")
    return broadcast(sig.shapes[0], sig.shapes[1]), float_dtype(sig)


register(OpDef(
    Op.ADD, "Elementwise sum, broadcasting (residual adds, parallel branches).",
    "%20 : f32[B,T,64] = add(%4, %19)", (2, 2), _broadcast_infer,
    lambda ctx, xs, a: xs[0] + xs[1], flops=per_element(1)))

register(OpDef(
    Op.MUL, "Elementwise product, broadcasting (gated FFNs).",
    "%15 : f32[B,T,176] = mul(%13, %14)", (2, 2), _broadcast_infer,
    lambda ctx, xs, a: xs[0] * xs[1], flops=per_element(1)))

register(OpDef(
    Op.SCALE, "Multiply by a constant.",
    "%12 : f32[B,4,T,P+T] = scale(%11) {factor=0.25}", (1, 1), same_as_input,
    lambda ctx, xs, a: xs[0] * a["factor"], flops=per_element(1), attrs=("factor",)))


def _act_infer(sig: Sig) -> tuple[Shape, str]:
    require(sig.attr("fn") in ACTIVATIONS, f"unknown activation {sig.attr('fn')!r}")
    return sig.shapes[0], float_dtype(sig)


register(OpDef(
    Op.ACT, "An activation: relu, gelu (erf), gelu_tanh, silu, sigmoid, softplus, elu + 1.",
    '%14 : f32[B,T,256] = act(%13) {fn="gelu"}', (1, 1), _act_infer,
    lambda ctx, xs, a: activation(xs[0], a["fn"]), flops=per_element(8), attrs=("fn",)))


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return cap * torch.tanh(x / cap)


register(OpDef(
    Op.SOFTCAP, "Soft-capping cap·tanh(x/cap) (Gemma 2 attention and final logits).",
    "%13 : f32[B,4,T,P+T] = softcap(%12) {cap=50.0}", (1, 1), same_as_input,
    lambda ctx, xs, a: softcap(xs[0], a["cap"]), flops=per_element(3), attrs=("cap",)))


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x.float(), dim=-1).to(x.dtype)


register(OpDef(
    Op.SOFTMAX, "Softmax over the last dim, computed in f32.",
    "%15 : f32[B,4,T,P+T] = softmax(%14)", (1, 1), same_as_input,
    lambda ctx, xs, a: softmax(xs[0]), flops=per_element(5)))


# ---- norms ---------------------------------------------------------------------------------

def layernorm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
              eps: float) -> torch.Tensor:
    y = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    if weight is not None:
        y = y * weight.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
            unit_offset: bool = False) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * (1.0 + weight.float() if unit_offset else weight.float())
    return y.to(x.dtype)


def _norm_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    for i, p in enumerate(sig.shapes[1:], 1):
        require(len(p) == 1 and same_dim(p[0], x[-1]),
                f"norm parameter {i} {list(p)} does not match the last dim of {list(x)}")
    return x, float_dtype(sig)


register(OpDef(
    Op.LAYERNORM, "LayerNorm over the last dim: (x − mean)/sqrt(var + eps)·γ (+ β).",
    "%5 : f32[B,T,64] = layernorm(%4, %2, %3) {eps=1e-05}", (2, 3), _norm_infer,
    lambda ctx, xs, a: layernorm(xs[0], xs[1], xs[2] if len(xs) > 2 else None, a["eps"]),
    flops=per_element(8), attrs=("eps",)))

register(OpDef(
    Op.RMSNORM, "RMSNorm over the last dim: x/sqrt(mean(x²) + eps)·γ, γ = 1 + w if "
    "unit_offset.",
    "%5 : f32[B,T,64] = rmsnorm(%4, %2) {eps=1e-05, unit_offset=false}", (2, 2), _norm_infer,
    lambda ctx, xs, a: rmsnorm(xs[0], xs[1], a["eps"], a.get("unit_offset", False)),
    flops=per_element(4), attrs=("eps",), optional=("unit_offset",)))


# ---- head views ----------------------------------------------------------------------------

def _split_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    heads = sig.attr("heads")
    require(len(x) == 3, f"split_heads takes [B, T, H·D], got {list(x)}")
    width = x[2]
    require(isinstance(width, sympy.Integer) and int(width) % heads == 0,
            f"width {width} is not a multiple of heads={heads}")
    return (x[0], sympy.Integer(heads), x[1], sympy.Integer(int(width) // heads)), sig.dtypes[0]


def _split_eager(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    x = xs[0]
    b, t, w = x.shape
    return x.view(b, t, a["heads"], w // a["heads"]).transpose(1, 2)  # (B, H, T, D)


def _merge_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    require(len(x) == 4, f"merge_heads takes [B, H, T, D], got {list(x)}")
    return (x[0], x[2], x[1] * x[3]), sig.dtypes[0]


def _merge_eager(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    x = xs[0]
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (B, T, H·D)


register(OpDef(
    Op.SPLIT_HEADS, "View [B, T, H·D] as [B, H, T, D].",
    "%11 : f32[B,4,T,16] = split_heads(%10) {heads=4}", (1, 1), _split_infer, _split_eager,
    bytes=zero, attrs=("heads",)))

register(OpDef(
    Op.MERGE_HEADS, "View [B, H, T, D] as [B, T, H·D].",
    "%30 : f32[B,T,64] = merge_heads(%29)", (1, 1), _merge_infer, _merge_eager, bytes=zero))


def _slice_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    start, stop = sig.attr("start"), sig.attr("stop")
    require(0 <= start < stop <= int(x[-1]), f"columns [{start}, {stop}) outside width {x[-1]}")
    return (*x[:-1], sympy.Integer(stop - start)), sig.dtypes[0]


register(OpDef(
    Op.SLICE, "View columns [start, stop) of the last dim (e.g. q, k, v of a fused QKV).",
    "%12 : f32[B,T,32] = slice(%11) {start=64, stop=96}", (1, 1), _slice_infer,
    lambda ctx, xs, a: xs[0][..., a["start"]:a["stop"]], bytes=zero, attrs=("start", "stop")))
