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

The gated delta rule (Gated DeltaNet, Yang et al. 2024; Qwen3-Next) keeps one state S [Dk, Dv]
per value head, decayed and corrected by each token (``archc.ir.ops.delta_rule``).
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
from archc.ir.ops.delta_rule import delta_chunked, delta_recurrent
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


DELTA_ALGORITHMS = ("chunked", "recurrent")


def _delta_dims(sig: Sig) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
    """Value heads, key dims and value dims per head."""
    h = sig.attr("heads")
    return h, sig.shape("q")[2] / sig.attr("key_heads"), sig.shape("v")[2] / h


def _delta_infer(sig: Sig) -> tuple[Shape, str]:
    q, k, v = sig.shape("q"), sig.shape("k"), sig.shape("v")
    h, hk = sig.attr("heads"), sig.attr("key_heads")
    require(len(q) == 3 and len(k) == 3 and len(v) == 3,
            "takes q and k [B, T, H_k·Dk] and v [B, T, H·Dv]")
    require(same_shape(q, k), f"q {list(q)} and k {list(k)} differ")
    require(same_dim(q[0], v[0]) and same_dim(q[1], v[1]), f"q {list(q)} and v {list(v)} differ "
            "before the last dim")
    require(h % hk == 0, f"{h} value heads are not a multiple of {hk} key heads")
    for name in ("g", "beta"):
        x = sig.shape(name)
        require(same_shape(x, (q[0], q[1], h)), f"{name} {list(x)} must be [B, T, {h}]")
    return v, float_dtype(sig, 2)


def _delta_eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """q and k L2-normalized per key head (f32, as FLA's kernels do) and repeated to the value
    heads (value head h reads key head h // (H / H_k)), then the delta rule from and into the
    layer's state S [B, H, Dk, Dv]."""
    h, hk, layer = at["heads"], at["key_heads"], at["layer"]
    b, t, width = a["q"].shape
    dk, dv = width // hk, a["v"].shape[-1] // h

    def keys(x: torch.Tensor) -> torch.Tensor:   # (B, T, H, Dk), unit length
        x = x.float().reshape(b, t, hk, dk)
        x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + at["eps"])
        return x.repeat_interleave(h // hk, dim=2)
    q, k = keys(a["q"]), keys(a["k"])
    v = a["v"].float().reshape(b, t, h, dv)
    s = ctx.state_read(layer, "S", (b, h, dk, dv), torch.float32, q.device)
    scale = at["scale"] if at["scale"] is not None else dk ** -0.5
    if at["algorithm"] == "chunked":
        o, s = delta_chunked(q, k, v, a["g"], a["beta"], s, scale=scale, chunk=at["chunk"])
    else:
        o, s = delta_recurrent(q, k, v, a["g"], a["beta"], s, scale=scale)
    ctx.state_write(layer, "S", s)
    return o.reshape(b, t, h * dv).to(a["v"].dtype)


def _delta_flops(sig: Sig) -> sympy.Expr:
    # per token and value head: the decay, Sᵀk, the write k δᵀ and Sᵀq (2·Dk·Dv each, the decay
    # Dk·Dv); the L2 norms of q and k per key head
    h, dk, dv = _delta_dims(sig)
    q = sig.shape("q")
    return q[0] * q[1] * (7 * h * dk * dv + 2 * 3 * q[2])


register(OpDef(
    Op.DELTA_RULE, "The gated delta rule: q and k L2-normalized and repeated to the value "
    "heads, then per head S ← S·exp(g); δ = β(v − Sᵀk); S ← S + kδᵀ; o = Sᵀ(scale·q), from "
    "and into the layer's state S [B, H, Dk, Dv] (f32); chunked (the WY/UT form, `chunk` tokens "
    "a step) or recurrent.",
    '%40 : f32[B,T,24] = delta_rule(%31, %32, %33, %36, %38) {chunk=8, heads=4, key_heads=2, '
    'layer=0}',
    operands("q", "k", "v", "g", "beta"), _delta_infer, _delta_eager,
    attrs=(LAYER, Attr("heads", int, at_least=1), Attr("key_heads", int, at_least=1),
           Attr("algorithm", str, "chunked", DELTA_ALGORITHMS), Attr("chunk", int, 64, at_least=1),
           Attr("eps", float, 1e-6), Attr("scale", float, None)),
    flops=_delta_flops, arity=(5, 5), template="delta_rule",
    states=lambda sig: (StateDecl("S", (sig.shape("q")[0], *_delta_dims(sig)), "f32"),),
    docs={"q": "queries [B, T, H_k·Dk]", "k": "keys [B, T, H_k·Dk]", "v": "values [B, T, H·Dv]",
          "g": "log decay per token and value head (≤ 0)", "beta": "write strength β"}))
