"""Mamba's selective state-space layer (Gu & Dao 2023): as lowering emits it, and as kernels.

Unfused, as lowering emits them:
- ``conv1d``: the depthwise causal convolution over time of x [B, T, C] with a [C, K] filter,
  continuing from the layer's conv state — the last K − 1 inputs of the sequence so far.
- ``selective_scan``: per inner channel c and state dim n, h_t = exp(Δ_t·A)·h_{t−1} + Δ_t·B_t·x_t
  and y_t = C_t·h_t, with Δ [B, T, C] (after softplus), A [C, N] (= −exp(A_log)) and the
  input-dependent B, C [B, T, N]; h is the layer's SSM state [B, C, N], kept in f32.

Kernel-level, as the passes leave them:
- ``causal_conv``: the convolution with its bias and activation, updating the conv state in place.
- ``ssm_scan``: the selective scan with the skip D·x and the gate y·silu(z) — and, for Jamba, the
  RMSNorm of B and C — updating the SSM state in place.
"""

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
    Sig,
    float_dtype,
    io_bytes,
    register,
    require,
    same_dim,
)
from archc.ir.ops.core import ACTIVATIONS, activation, rmsnorm
from archc.ir.ops.state import StateDecl, state_bytes
from archc.ir.shapes import Shape, numel

# ---- the causal convolution ------------------------------------------------------------------


def causal_conv1d(ctx: EagerCtx, x: torch.Tensor, weight: torch.Tensor, layer: int) -> torch.Tensor:
    """y_t[c] = Σ_k w[c, k]·x_{t−K+1+k}[c] over the inputs so far (the conv state holds the last
    K − 1 of the previous calls), in f32; the state keeps the last K − 1 inputs. [B, T, C]."""
    b, t, c = x.shape
    k = weight.shape[1]
    past = ctx.state_read(layer, "conv", (b, c, k - 1), x.dtype, x.device)   # (B, C, K−1)
    window = torch.cat([past, x.transpose(1, 2)], dim=-1)                    # (B, C, K−1+T)
    ctx.state_write(layer, "conv", window[:, :, window.shape[-1] - (k - 1):].contiguous())
    y = F.conv1d(window.float(), weight.float()[:, None, :], groups=c)       # (B, C, T)
    return y.transpose(1, 2)


def _conv_states(sig: Sig) -> tuple[StateDecl, ...]:
    x, w = sig.shapes[0], sig.shapes[1]
    return (StateDecl("conv", (x[0], x[2], w[1] - 1), sig.dtypes[0]),)


def _conv_check(sig: Sig) -> Shape:
    x, w = sig.shapes[0], sig.shapes[1]
    require(len(x) == 3, f"conv1d takes x [B, T, C], got {list(x)}")
    require(len(w) == 2 and same_dim(w[0], x[2]) and int(w[1]) >= 2,
            f"the filter {list(w)} must be [{x[2]}, K] with K ≥ 2")
    return x


def _conv_infer(sig: Sig) -> tuple[Shape, str]:
    return _conv_check(sig), float_dtype(sig)


def _conv_flops(sig: Sig) -> sympy.Expr:
    return 2 * numel(sig.shapes[0]) * sig.shapes[1][1]


def _stateful_bytes(states: object) -> object:
    """io bytes plus the op's state, read once and written once."""
    def cost(sig: Sig) -> sympy.Expr:
        return io_bytes(sig) + 2 * state_bytes(states(sig))  # type: ignore[operator]
    return cost


register(OpDef(
    Op.CONV1D, "Depthwise causal convolution over time, continuing from the layer's conv state.",
    "%14 : f32[B,T,128] = conv1d(%12, %13) {layer=0}", (2, 2), _conv_infer,
    lambda ctx, xs, a: causal_conv1d(ctx, xs[0], xs[1], a["layer"]).to(xs[0].dtype),
    flops=_conv_flops, bytes=_stateful_bytes(_conv_states), attrs=("layer",),
    extra={"state": _conv_states}))


def _causal_conv_infer(sig: Sig) -> tuple[Shape, str]:
    x = _conv_check(sig)
    require(sig.attr("act") in ACTIVATIONS, f"unknown activation {sig.attr('act')!r}")
    n = 3 if sig.attr("bias") else 2
    require(len(sig.shapes) == n, f"causal_conv with bias={sig.attr('bias')} takes {n} inputs")
    if sig.attr("bias"):
        b = sig.shapes[2]
        require(len(b) == 1 and same_dim(b[0], x[2]), f"bias {list(b)} ≠ [{x[2]}]")
    return x, float_dtype(sig)


def _causal_conv_eager(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    y = causal_conv1d(ctx, xs[0], xs[1], a["layer"])
    if a["bias"]:
        y = y + xs[2].float()
    return activation(y, a["act"]).to(xs[0].dtype)


register(OpDef(
    Op.CAUSAL_CONV, "Causal depthwise conv + bias + activation in one kernel; the conv state "
    "(the last K − 1 inputs) is read and updated in place.",
    '%14 : f32[B,T,128] = causal_conv(%12, %13, %5) {act="silu", bias=true, layer=0}', (2, 3),
    _causal_conv_infer, _causal_conv_eager,
    flops=lambda sig: _conv_flops(sig) + 9 * numel(sig.out_shape),
    bytes=_stateful_bytes(_conv_states), attrs=("layer", "act", "bias"),
    extra={"state": _conv_states}))


# ---- the selective scan ----------------------------------------------------------------------

def scan(ctx: EagerCtx, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, bm: torch.Tensor,
         cm: torch.Tensor, layer: int) -> torch.Tensor:
    """The selective scan in f32, one step at a time from the layer's SSM state [B, C, N]:
    h ← exp(Δ_t·A)·h + (Δ_t·x_t)·B_t, y_t = Σ_n h·C_t. Returns y [B, T, C] in f32."""
    b, t, c = x.shape
    n = a.shape[1]
    h = ctx.state_read(layer, "ssm", (b, c, n), torch.float32, x.device)   # (B, C, N)
    xf, dtf, af = x.float(), dt.float(), a.float()
    bf, cf = bm.float(), cm.float()
    ys = []
    for i in range(t):
        decay = torch.exp(dtf[:, i, :, None] * af)                          # (B, C, N)
        h = decay * h + (dtf[:, i] * xf[:, i])[:, :, None] * bf[:, i, None, :]
        ys.append((h * cf[:, i, None, :]).sum(-1))                          # (B, C)
    ctx.state_write(layer, "ssm", h)
    if not ys:
        return xf.new_zeros(b, 0, c)
    return torch.stack(ys, dim=1)                                            # (B, T, C)


def _scan_states(sig: Sig) -> tuple[StateDecl, ...]:
    x, a = sig.shapes[0], sig.shapes[2]
    return (StateDecl("ssm", (x[0], x[2], a[1]), "f32"),)


def _scan_check(sig: Sig) -> Shape:
    x, dt, a, bm, cm = sig.shapes[:5]
    require(len(x) == 3, f"the scan takes x [B, T, C], got {list(x)}")
    require(len(dt) == 3 and all(same_dim(p, q) for p, q in zip(dt, x)),
            f"Δ {list(dt)} must match x {list(x)}")
    require(len(a) == 2 and same_dim(a[0], x[2]), f"A {list(a)} must be [{x[2]}, N]")
    for name, m in (("B", bm), ("C", cm)):
        require(len(m) == 3 and same_dim(m[0], x[0]) and same_dim(m[1], x[1]) and
                same_dim(m[2], a[1]), f"{name} {list(m)} must be [B, T, {a[1]}]")
    return x


def _scan_flops(sig: Sig) -> sympy.Expr:
    # per (token, channel, state dim): Δ·A, exp, ·B, h·decay + input, ·C and the sum
    return 8 * numel(sig.shapes[0]) * sig.shapes[2][1]


register(OpDef(
    Op.SELECTIVE_SCAN, "Mamba's selective scan h ← exp(Δ·A)·h + Δ·x·B, y = C·h over T, from "
    "and into the layer's SSM state [B, C, N] (f32).",
    "%30 : f32[B,T,128] = selective_scan(%14, %27, %28, %20, %21) {layer=0}", (5, 5),
    lambda sig: (_scan_check(sig), float_dtype(sig)),
    lambda ctx, xs, a: scan(ctx, *xs, a["layer"]).to(xs[0].dtype),
    flops=_scan_flops, bytes=_stateful_bytes(_scan_states), attrs=("layer",),
    extra={"state": _scan_states}))


def _ssm_scan_infer(sig: Sig) -> tuple[Shape, str]:
    x = _scan_check(sig)
    normed = sig.attr("norm_eps") is not None
    n = 9 if normed else 7
    require(len(sig.shapes) == n, f"ssm_scan takes x, Δ, A, B, C, D, z"
            f"{', B gain, C gain' if normed else ''}: {n} inputs, got {len(sig.shapes)}")
    d, z = sig.shapes[5], sig.shapes[6]
    require(len(d) == 1 and same_dim(d[0], x[2]), f"D {list(d)} ≠ [{x[2]}]")
    require(len(z) == 3 and all(same_dim(p, q) for p, q in zip(z, x)),
            f"the gate z {list(z)} must match x {list(x)}")
    state = sig.shapes[2][1]
    for g in sig.shapes[7:]:
        require(len(g) == 1 and same_dim(g[0], state), f"a B/C norm gain {list(g)} ≠ [{state}]")
    return x, float_dtype(sig)


def _ssm_scan_eager(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    x, dt, am, bm, cm, d, z = xs[:7]
    eps = a.get("norm_eps")
    if eps is not None:  # Jamba: B and C normalized per token before the scan
        bm, cm = rmsnorm(bm.float(), xs[7], eps), rmsnorm(cm.float(), xs[8], eps)
    y = scan(ctx, x, dt, am, bm, cm, a["layer"]) + d.float() * x.float()
    return (y * activation(z.float(), "silu")).to(x.dtype)


register(OpDef(
    Op.SSM_SCAN, "Selective scan + skip D·x + gate ·silu(z) (+ RMSNorm of B and C) in one "
    "kernel; the SSM state [B, C, N] (f32) is read and updated in place.",
    "%30 : f32[B,T,128] = ssm_scan(%14, %27, %28, %20, %21, %9, %11) {layer=0}", (7, 9),
    _ssm_scan_infer, _ssm_scan_eager,
    flops=lambda sig: _scan_flops(sig) + 12 * numel(sig.out_shape),
    bytes=_stateful_bytes(_scan_states), attrs=("layer",), optional=("norm_eps",),
    extra={"state": _scan_states}))
