"""Causal linear attention (Katharopoulos et al. 2020): as lowering emits it, and as a kernel.

With a positive feature map φ (elu(x) + 1), softmax(q·kᵀ)·v becomes

    out_i = φ(q_i)ᵀ S_i / φ(q_i)ᵀ z_i,   S_i = Σ_{j≤i} φ(k_j) v_jᵀ,   z_i = Σ_{j≤i} φ(k_j),

so a layer keeps two running sums per KV head — S [D, Dv] and z [D], in f32 — instead of a KV
cache, and a decode step costs the same at any context length. Query head h reads the sums of KV
head h // (H / H_kv), as grouped-query attention shares keys and values.

- ``linear_scan`` (unfused): the running sums over φ(q), φ(k) and v already split into heads.
- ``linear_attention`` (kernel-level): φ applied to q and k inside, heads merged on the way out,
  S and z read and updated in place.

Both compute a call's tokens in chunks: within a chunk the causal sum is the masked product
(φq·φkᵀ ⊙ causal)·v, and the sums carry the chunks before it — the same function as the
token-by-token recurrence, with far fewer steps.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch

from archc.ir.attrs import Attrs
from archc.ir.ops.attention import groups
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
from archc.ir.ops.core import activation
from archc.ir.ops.state import StateDecl, state_bytes
from archc.ir.shapes import Shape

CHUNK = 64                   # tokens per chunk of the eager semantics
FEATURE_MAPS = ("elu_plus_one",)


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
    q, k, v = sig.shapes[:3]
    return (StateDecl("S", (q[0], k[1], k[3], v[3]), "f32"),
            StateDecl("z", (q[0], k[1], k[3]), "f32"))


def _check(sig: Sig) -> Shape:
    q, k, v = sig.shapes
    require(len(q) == 4 and len(k) == 4 and len(v) == 4,
            "takes q [B, H, T, D], k [B, H_kv, T, D] and v [B, H_kv, T, Dv]")
    groups(q[1], k[1])
    require(same_dim(k[1], v[1]) and all(same_dim(a, b) for a, b in zip(k[:3], v[:3])),
            f"k {list(k)} and v {list(v)} differ before the head dim")
    require(same_dim(q[0], k[0]) and same_dim(q[2], k[2]) and same_dim(q[3], k[3]),
            f"q {list(q)} and k {list(k)} do not match")
    return q


def _flops(sig: Sig) -> sympy.Expr:
    q, k, v = sig.shapes
    tokens = q[0] * q[2]
    d, dv = q[3], v[3]
    # per token: S += φk vᵀ and z += φk per KV head; φq·S, φq·z and the division per query head
    return tokens * (k[1] * (2 * d * dv + d) + q[1] * (2 * d * dv + 2 * d + dv))


def _bytes(sig: Sig) -> sympy.Expr:
    return io_bytes(sig) + 2 * state_bytes(_states(sig))


def _scan_infer(sig: Sig) -> tuple[Shape, str]:
    q = _check(sig)
    v = sig.shapes[2]
    return (q[0], q[1], q[2], v[3]), float_dtype(sig)


register(OpDef(
    Op.LINEAR_SCAN, "Causal linear attention over φ(q), φ(k), v: φq·S_i / φq·z_i with the "
    "running sums S, z (per KV head, f32) carried in the layer's state.",
    "%20 : f32[B,4,T,12] = linear_scan(%17, %18, %19) {layer=0}", (3, 3), _scan_infer,
    lambda ctx, xs, a: running_sums(ctx, xs[0], xs[1], xs[2], a["layer"]).to(xs[0].dtype),
    flops=_flops, bytes=_bytes, attrs=("layer",), extra={"state": _states}))


def _kernel_infer(sig: Sig) -> tuple[Shape, str]:
    q = _check(sig)
    v = sig.shapes[2]
    require(sig.attr("feature") in FEATURE_MAPS,
            f"unknown feature map {sig.attr('feature')!r} (known: {', '.join(FEATURE_MAPS)})")
    return (q[0], q[2], q[1] * v[3]), float_dtype(sig)


def _kernel_eager(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    q, k, v = xs
    phi_q, phi_k = (activation(x.float(), a["feature"]) for x in (q, k))
    out = running_sums(ctx, phi_q, phi_k, v, a["layer"])      # (B, H, T, Dv)
    b, h, t, dv = out.shape
    return out.transpose(1, 2).reshape(b, t, h * dv).to(q.dtype)


register(OpDef(
    Op.LINEAR_ATTENTION, "Causal linear attention in one kernel: φ on q and k, running sums S "
    "and z read and updated in place, heads merged [B, T, H·Dv].",
    '%20 : f32[B,T,48] = linear_attention(%17, %18, %19) {feature="elu_plus_one", layer=0}',
    (3, 3), _kernel_infer, _kernel_eager,
    flops=lambda sig: _flops(sig) + 4 * (sig.shapes[0][0] * sig.shapes[0][2]) * (
        sig.shapes[0][1] + sig.shapes[1][1]) * sig.shapes[0][3],
    bytes=_bytes, attrs=("layer", "feature"), extra={"state": _states}))
