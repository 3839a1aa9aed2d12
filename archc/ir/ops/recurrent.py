"""The recurrent mixers keep a fixed-size per-layer state instead of a KV cache, read and updated
in place, so a decode step costs the same at any context length.

Mamba (Gu & Dao 2023) is ``causal_conv`` and ``ssm_scan``, the selective scan. Causal linear
attention (Katharopoulos et al. 2020): with a positive feature map φ (elu(x) + 1), softmax(q·kᵀ)·v
becomes

    out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,   z_i = Σ_{j≤i} φ(k_j),

so a layer keeps two running sums per KV head, S [D, Dv] and z [D] in f32 (query head h reads
KV head h // (H / H_kv)). Eager semantics run a call's tokens in chunks: within one the causal
sum is the masked product (φq·φkᵀ ⊙ causal)·v, and the sums carry the chunks before — the
recurrence's function in far fewer steps.
"""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F

import archc.ir.expr as E
from archc.ir.attrs import Attr, Attrs
from archc.ir.ops.attention import groups
from archc.ir.ops.base import (
    LAYER,
    Args,
    EagerCtx,
    Op,
    OpDef,
    Sig,
    StateDecl,
    float_dtype,
    operands,
    register,
    require,
    same_dim,
    same_shape,
    vector,
)
from archc.ir.ops.steps import normalize
from archc.ir.shapes import Shape, numel


def _conv_infer(sig: Sig) -> tuple[Shape, str]:
    x, w = sig.shape("x"), sig.shape("weight")
    require(len(x) == 3, f"causal_conv takes x [B, T, C], got {list(x)}")
    require(len(w) == 2 and same_dim(w[0], x[2]) and int(w[1]) >= 2,
            f"the filter {list(w)} must be [{x[2]}, K] with K ≥ 2")
    if sig.has("bias"):
        vector(sig, "bias", x[2])
    return x, float_dtype(sig)


def _conv_eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """y_t[c] = Σ_k w[c, k]·x_{t−K+1+k}[c] in f32, over the conv state and then x."""
    x, w, layer = a["x"], a["weight"], at["layer"]
    b, c, k = x.shape[0], x.shape[2], w.shape[1]
    past = ctx.state_read(layer, "conv", (b, c, k - 1), x.dtype, x.device)   # (B, C, K−1)
    window = torch.cat([past, x.transpose(1, 2)], dim=-1)                    # (B, C, K−1+T)
    ctx.state_write(layer, "conv", window[:, :, window.shape[-1] - (k - 1):].contiguous())
    y = F.conv1d(window.float(), w.float()[:, None, :], groups=c).transpose(1, 2)  # (B, T, C)
    if "bias" in a:
        y = y + a["bias"].float()
    return E.ACTIVATIONS[at["act"]].torch(y).to(x.dtype)


register(OpDef(
    Op.CAUSAL_CONV, "Causal depthwise conv (+ bias + activation) in one kernel; the conv state "
    "(the last K − 1 inputs) is read and updated in place.",
    '%14 : f32[B,T,128] = causal_conv(%12, %13, %5) {act="silu", bias=true, layer=0}',
    operands("x", "weight", ("bias", "bias")), _conv_infer, _conv_eager,
    attrs=(LAYER, Attr("act", str, "identity", tuple(E.ACTIVATIONS)), Attr("bias", bool, False)),
    flops=lambda sig: 2 * numel(sig.shape("x")) * sig.shape("weight")[1] + (
        9 * numel(sig.out_shape) if sig.attr("bias") or sig.attr("act") != "identity" else 0),
    states=lambda sig: (StateDecl("conv", (sig.shape("x")[0], sig.shape("x")[2],
                                           sig.shape("weight")[1] - 1), sig.dtype("x")),),
    template="causal_conv", arity=(2, 3), docs={"x": "input", "weight": "depthwise filter"}))


def _scan_infer(sig: Sig) -> tuple[Shape, str]:
    x, dt, a = sig.shape("x"), sig.shape("dt"), sig.shape("a")
    require(len(x) == 3, f"the scan takes x [B, T, C], got {list(x)}")
    require(same_shape(dt, x), f"Δ {list(dt)} must match x {list(x)}")
    require(len(a) == 2 and same_dim(a[0], x[2]), f"A {list(a)} must be [{x[2]}, N]")
    for name in ("b", "c"):
        m = sig.shape(name)
        require(same_shape(m, (x[0], x[1], a[1])), f"{name} {list(m)} must be [B, T, {a[1]}]")
    if sig.attr("gate"):
        vector(sig, "skip", x[2])
        require(same_shape(sig.shape("z"), x),
                f"the gate z {list(sig.shape('z'))} must match x {list(x)}")
    if sig.attr("norm_eps") is not None:
        vector(sig, "b_gain", a[1])
        vector(sig, "c_gain", a[1])
    return x, float_dtype(sig)


def _scan_eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """The selective scan in f32, one token at a time from the layer's SSM state h [B, C, N]."""
    x, dt, af = a["x"].float(), a["dt"].float(), a["a"].float()
    bm, cm, eps, layer = a["b"].float(), a["c"].float(), at["norm_eps"], at["layer"]
    if eps is not None:  # Jamba: B and C normalized per token before the scan
        bm = normalize(bm, "rms", eps)[0] * a["b_gain"].float()
        cm = normalize(cm, "rms", eps)[0] * a["c_gain"].float()
    b, t, c = x.shape
    h = ctx.state_read(layer, "ssm", (b, c, af.shape[1]), torch.float32, x.device)  # (B, C, N)
    ys = []
    for i in range(t):
        decay = torch.exp(dt[:, i, :, None] * af)                           # (B, C, N)
        h = decay * h + (dt[:, i] * x[:, i])[:, :, None] * bm[:, i, None, :]
        ys.append((h * cm[:, i, None, :]).sum(-1))                          # (B, C)
    ctx.state_write(layer, "ssm", h)
    y = torch.stack(ys, dim=1) if ys else x.new_zeros(b, 0, c)              # (B, T, C)
    if at["gate"]:
        y = (y + a["skip"].float() * x) * F.silu(a["z"].float())
    return y.to(a["x"].dtype)


def _scan_flops(sig: Sig) -> sympy.Expr:
    # per (token, channel, state dim): Δ·A, exp, ·B, h·decay + input, ·C and the sum; the skip
    # and gate per (token, channel)
    x = sig.shape("x")
    return 8 * numel(x) * sig.shape("a")[1] + (12 * numel(x) if sig.attr("gate") else 0)


register(OpDef(
    Op.SSM_SCAN, "Mamba's selective scan h ← exp(Δ·A)·h + Δ·x·B, y = C·h over T, from and into "
    "the layer's SSM state [B, C, N] (f32); with `gate`, (y + D·x)·silu(z); with `norm_eps`, B "
    "and C RMS-normalized first.",
    "%30 : f32[B,T,128] = ssm_scan(%14, %27, %28, %20, %21, %9, %11) {gate=true, layer=0}",
    # Δ, A, B, C, D of the paper as dt, a, b, c and skip
    operands("x", "dt", "a", "b", "c", ("skip", "gate"), ("z", "gate"), ("b_gain", "norm_eps"),
             ("c_gain", "norm_eps")), _scan_infer, _scan_eager,
    attrs=(LAYER, Attr("gate", bool, False), Attr("norm_eps", float, None)),
    flops=_scan_flops, template="ssm_scan", arity=(5, 9),
    states=lambda sig: (StateDecl("ssm", (sig.shape("x")[0], sig.shape("x")[2],
                                          sig.shape("a")[1]), "f32"),),
    docs={"x": "scan input", "dt": "step sizes Δ (after softplus)", "a": "A = −exp(A_log)",
          "b": "input matrix B_t", "c": "output matrix C_t", "skip": "skip D", "z": "gate z",
          "b_gain": "RMSNorm gain of B", "c_gain": "RMSNorm gain of C"}))


CHUNK = 64                   # tokens per chunk of the eager semantics
FEATURE_MAPS = ("identity", "elu_plus_one")


def _linear_attention_states(sig: Sig) -> tuple[StateDecl, ...]:
    q, k, v = sig.shapes
    return (StateDecl("S", (q[0], k[1], k[3], v[3]), "f32"),
            StateDecl("z", (q[0], k[1], k[3]), "f32"))


def _linear_attention_infer(sig: Sig) -> tuple[Shape, str]:
    q, k, v = sig.shapes
    require(len(q) == 4 and len(k) == 4 and len(v) == 4,
            "takes q [B, H, T, D], k [B, H_kv, T, D] and v [B, H_kv, T, Dv]")
    groups(q[1], k[1])
    require(same_shape(k[:3], v[:3]), f"k {list(k)} and v {list(v)} differ before the head dim")
    require(same_shape((q[0], q[2], q[3]), (k[0], k[2], k[3])),
            f"q {list(q)} and k {list(k)} do not match")
    return (q[0], q[2], q[1] * v[3]), float_dtype(sig)


def _linear_attention_eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """φ on q and k, then the running sums S and z in chunks of CHUNK tokens, in f32."""
    phi_q, phi_k = (E.ACTIVATIONS[at["feature"]].torch(a[r].float()) for r in ("q", "k"))
    (b, h, t, d), hkv, dv = phi_q.shape, phi_k.shape[1], a["v"].shape[-1]
    layer, dev = at["layer"], phi_q.device
    s = ctx.state_read(layer, "S", (b, hkv, d, dv), torch.float32, dev)
    z = ctx.state_read(layer, "z", (b, hkv, d), torch.float32, dev)
    q, k, v = phi_q.reshape(b, hkv, h // hkv, t, d), phi_k, a["v"].float()  # q: (B, H_kv, G, T, D)
    outs = []
    for start in range(0, t, CHUNK):
        stop = min(t, start + CHUNK)
        qc, kc, vc = q[:, :, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
        causal = torch.ones(stop - start, stop - start, dtype=torch.bool, device=dev).tril()
        within = (qc @ kc[:, :, None].transpose(-1, -2)) * causal   # (B, H_kv, G, c, c)
        num = qc @ s[:, :, None] + within @ vc[:, :, None]          # (B, H_kv, G, c, Dv)
        den = qc @ z[:, :, None, :, None] + within.sum(-1, keepdim=True)
        outs.append(num / den)
        s = s + kc.transpose(-1, -2) @ vc
        z = z + kc.sum(dim=2)
    ctx.state_write(layer, "S", s)
    ctx.state_write(layer, "z", z)
    out = torch.cat(outs, dim=3).reshape(b, h, t, dv) if outs else q.new_zeros(b, h, 0, dv)
    return out.transpose(1, 2).flatten(2).to(a["q"].dtype)             # (B, T, H·Dv)


def _linear_attention_flops(sig: Sig) -> sympy.Expr:
    q, k, v = sig.shapes
    d, dv = q[3], v[3]
    # per token: S += φk vᵀ and z += φk per KV head; φq·S, φq·z and the division per query
    # head; the feature map on every q and k element
    phi = 4 * (q[1] + k[1]) * d if sig.attr("feature") != "identity" else 0
    return q[0] * q[2] * (k[1] * (2 * d * dv + d) + q[1] * (2 * d * dv + 2 * d + dv) + phi)


register(OpDef(
    Op.LINEAR_ATTENTION, "Causal linear attention: φ (the feature map) on q and k, the running "
    "sums S and z (per KV head, f32) read and updated in place, heads merged [B, T, H·Dv].",
    '%20 : f32[B,T,48] = linear_attention(%17, %18, %19) {feature="elu_plus_one", layer=0}',
    operands("q", "k", "v"), _linear_attention_infer, _linear_attention_eager,
    attrs=(LAYER, Attr("feature", str, "identity", FEATURE_MAPS)), flops=_linear_attention_flops,
    states=_linear_attention_states, template="linear_attention", arity=(3, 3)))
