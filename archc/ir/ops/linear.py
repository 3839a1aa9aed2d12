"""``fused_linear``: ``x @ wᵀ`` with a prologue and an epilogue chain, one kernel.

The prologue gathers the row statistics of a folded norm along the K loop the matmul runs anyway
(Σx² for rms; Σx and Σx² for layer); the epilogue (``archc.ir.ops.steps``) applies the row scale,
the LayerNorm rank-1 correction, bias, activations, RoPE, the KV-cache write, residual add,
soft-cap, scale and per-head norms to the f32 accumulator before the one store. With
``concat_k``, x is two operands concatenated along K (a parallel block's attention-out and
FFN-down in one matmul).
"""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F

from archc.ir.attrs import Attrs
from archc.ir.ops.base import (
    Args,
    Attr,
    EagerCtx,
    Op,
    OpDef,
    Sig,
    float_dtype,
    operands,
    register,
    require,
    same_dim,
)
from archc.ir.ops.steps import RowStats, apply_epilogue, check_epilogue, epilogue_roles
from archc.ir.shapes import DTYPE_BYTES, Shape, numel

OPERANDS = operands(("x", "single"), ("x1", "concat_k"), ("x2", "concat_k"), "weight")


def linear_roles(attrs: object, n: int) -> list[str]:
    single = {**attrs, "single": not attrs.get("concat_k")}  # type: ignore[dict-item]
    return OPERANDS(single, n) + epilogue_roles(attrs)  # type: ignore[arg-type]


def activations(sig_or_args: Sig | Args) -> list[str]:
    """The activation operands: x, or x1 and x2."""
    has = sig_or_args.has if isinstance(sig_or_args, Sig) else sig_or_args.__contains__
    return ["x1", "x2"] if has("x1") else ["x"]


def _infer(sig: Sig) -> tuple[Shape, str]:
    xs = [sig.shape(r) for r in activations(sig)]
    w = sig.shape("weight")
    x = xs[0]
    k = sum((s[-1] for s in xs), sympy.Integer(0))
    if len(xs) == 2:
        require(len(xs[1]) == len(x) and all(same_dim(a, b) for a, b in zip(x[:-1], xs[1][:-1])),
                f"concatenated operands {list(x)} and {list(xs[1])} differ before K")
        require(sig.attr("prologue") is None, "a prologue needs a single operand")
    require(len(w) == 2 and same_dim(k, w[1]), f"x {[list(s) for s in xs]} and weight "
            f"{list(w)} do not match as x @ wᵀ")
    require((sig.attr("prologue") is None) == (sig.attr("eps") is None),
            "eps goes with a prologue")
    width = check_epilogue(sig, Op.FUSED_LINEAR, int(w[0]), len(xs) + 1, x[:-1])
    return (*x[:-1], sympy.Integer(width)), float_dtype(sig)


def row_stats(x: torch.Tensor, prologue: str | None, eps: float | None) -> RowStats:
    if prologue is None:
        return RowStats(None, None, x.dtype)
    xf = x.float()
    if prologue == "rms":
        return RowStats(None, torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    # the kernel gathers Σx and Σx² along its K loop: var = E[x²] − E[x]²
    mean = xf.mean(-1, keepdim=True)
    var = xf.pow(2).mean(-1, keepdim=True) - mean.pow(2)
    return RowStats(mean, torch.rsqrt(var + eps), x.dtype)


def fused_linear(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    xs = [a[r] for r in activations(a)]
    w = a["weight"]
    stats = row_stats(xs[0], at["prologue"], at["eps"])
    acc = F.linear(xs[0].float(), w[:, :xs[0].shape[-1]].float())
    if len(xs) == 2:  # the K loop runs over x1's columns, then x2's
        acc = acc + F.linear(xs[1].float(), w[:, xs[0].shape[-1]:].float())
    rest = list(a.values())[len(xs) + 1:]
    return apply_epilogue(ctx, acc, at["epilogue"], rest, stats).to(xs[0].dtype)


def _flops(sig: Sig) -> sympy.Expr:
    x, w = sig.shapes[0], sig.shape("weight")
    return 2 * numel(x[:-1]) * w[0] * w[1] + 4 * numel(sig.out_shape)


def _bytes(sig: Sig) -> sympy.Expr:
    total = numel(sig.out_shape) * DTYPE_BYTES[sig.out_dtype]
    for s, d in zip(sig.shapes, sig.dtypes):
        total += numel(s) * DTYPE_BYTES[d]
    for st in sig.attr("epilogue", ()):
        if st.fn == "kv_write":  # k and v rows go to the cache as well
            rows = numel(sig.shapes[0][:-1])
            total += 2 * rows * st.kw("kv_heads") * st.kw("head_dim") * DTYPE_BYTES[
                sig.out_dtype]
    return total


register(OpDef(
    Op.FUSED_LINEAR, "x @ wᵀ with a norm prologue and an epilogue chain, one kernel; with "
    "concat_k, x is two operands concatenated along K (parallel blocks' out + down).",
    '%9 : f32[B,T,128] = fused_linear(%3, %8, %1, %7) {epilogue=[rms_scale(), rope(heads=6, '
    'head_dim=16, interleaved=false, rotary_dim=16), kv_write(head_dim=16, k_start=64, '
    'kv_heads=2, layer=0, v_start=96)], eps=1e-05, prologue="rms"}',
    linear_roles, _infer, fused_linear,
    attrs=(Attr("prologue", str, None, ("rms", "layer"),
                doc="row statistics of a folded norm, gathered along K"),
           Attr("eps", float, None), Attr("epilogue", tuple, ()),
           Attr("concat_k", bool, False, doc="x is two operands concatenated along K")),
    flops=_flops, bytes=_bytes, template="matmul", arity=(2, -1),
    docs={"x": "activations", "x1": "first operand", "x2": "second operand",
          "weight": "weight, K-contiguous"}))

