"""Causal linear attention (Katharopoulos et al. 2020): as lowering emits it, and as a kernel.

With a positive feature map φ (elu(x) + 1), softmax(q·kᵀ)·v becomes

    out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,   z_i = Σ_{j≤i} φ(k_j),

so a layer keeps two running sums per KV head — S [D, Dv] and z [D], in f32 — instead of a KV
cache, and a decode step costs the same at any context length. Query head h reads the sums of KV
head h // (H / H_kv), as grouped-query attention shares keys and values.

One op, ``linear_attention``, computes the running sums over q, k (after the feature map
``feature``) and v split into heads, and writes the heads merged [B, T, H·Dv]; S and z are read and
updated in place. Lowering applies φ as separate ``act`` nodes (feature "identity");
fuse-linear-attention moves φ inside.

It computes a call's tokens in chunks: within a chunk the causal sum is the masked product
(φq·φkᵀ ⊙ causal)·v, and the sums carry the chunks before it — the same function as the
token-by-token recurrence, with far fewer steps.
"""

from __future__ import annotations

import sympy
import torch

import archc.ir.expr as E
from archc.ir.attrs import Attrs
from archc.ir.ops.attention import groups
from archc.ir.ops.base import (
    LAYER,
    Args,
    Attr,
    EagerCtx,
    Op,
    OpDef,
    Sig,
    StateDecl,
    float_dtype,
    operands,
    register,
    require,
    same_shape,
)
from archc.ir.shapes import Shape

CHUNK = 64                   # tokens per chunk of the eager semantics
FEATURE_MAPS = ("identity", "elu_plus_one")


def running_sums(ctx: EagerCtx, phi_q: torch.Tensor, phi_k: torch.Tensor, v: torch.Tensor,
                 layer: int) -> torch.Tensor:
    """φq [B, H, T, D], φk [B, H_kv, T, D], v [B, H_kv, T, Dv] → out [B, H, T, Dv] in f32,
    from and into the layer's sums S [B, H_kv, D, Dv] and z [B, H_kv, D]."""
    b, h, t, d = phi_q.shape
    hkv, dv = phi_k.shape[1], v.shape[-1]
    g = h // hkv
    dev = phi_q.device
    s = ctx.state_read(layer, "S", (b, hkv, d, dv), torch.float32, dev)
    z = ctx.state_read(layer, "z", (b, hkv, d), torch.float32, dev)
    q = phi_q.float().reshape(b, hkv, g, t, d)             # (B, H_kv, G, T, D)
    k, vf = phi_k.float(), v.float()
    outs = []
    for start in range(0, t, CHUNK):
        stop = min(t, start + CHUNK)
        qc, kc, vc = q[:, :, :, start:stop], k[:, :, start:stop], vf[:, :, start:stop]
        causal = torch.ones(stop - start, stop - start, dtype=torch.bool, device=dev).tril()
        within = (qc @ kc[:, :, None].transpose(-1, -2)) * causal   # (B, H_kv, G, c, c)
        num = qc @ s[:, :, None] + within @ vc[:, :, None]          # (B, H_kv, G, c, Dv)
        den = qc @ z[:, :, None, :, None] + within.sum(-1, keepdim=True)
        outs.append(num / den)
        s = s + kc.transpose(-1, -2) @ vc
        z = z + kc.sum(dim=2)
    ctx.state_write(layer, "S", s)
    ctx.state_write(layer, "z", z)
    if not outs:
        return q.new_zeros(b, h, 0, dv)
    return torch.cat(outs, dim=3).reshape(b, h, t, dv)


def _states(sig: Sig) -> tuple[StateDecl, ...]:
    q, k, v = sig.shapes
    return (StateDecl("S", (q[0], k[1], k[3], v[3]), "f32"),
            StateDecl("z", (q[0], k[1], k[3]), "f32"))


def _infer(sig: Sig) -> tuple[Shape, str]:
    q, k, v = sig.shapes
    require(len(q) == 4 and len(k) == 4 and len(v) == 4,
            "takes q [B, H, T, D], k [B, H_kv, T, D] and v [B, H_kv, T, Dv]")
    groups(q[1], k[1])
    require(same_shape(k[:3], v[:3]), f"k {list(k)} and v {list(v)} differ before the head dim")
    require(same_shape((q[0], q[2], q[3]), (k[0], k[2], k[3])),
            f"q {list(q)} and k {list(k)} do not match")
    return (q[0], q[2], q[1] * v[3]), float_dtype(sig)


def _eager(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    q = a["q"]
    phi_q, phi_k = (E.activation(x.float(), at["feature"]) for x in (q, a["k"]))
    out = running_sums(ctx, phi_q, phi_k, a["v"], at["layer"])      # (B, H, T, Dv)
    return out.transpose(1, 2).flatten(2).to(q.dtype)               # (B, T, H·Dv)


def _flops(sig: Sig) -> sympy.Expr:
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
    operands("q", "k", "v"), _infer, _eager,
    attrs=(LAYER, Attr("feature", str, "identity", FEATURE_MAPS)),
    flops=_flops, states=_states, template="linear_attention", arity=(3, 3)))
