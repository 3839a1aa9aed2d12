"""The gated delta rule (Yang et al. 2024, "Gated Delta Networks"), in plain PyTorch, f32.

Per head, from a state S [Dk, Dv], each token t does

    S   ← S·exp(g_t)                      # decay (g is a log decay, ≤ 0)
    δ   = β_t·(v_t − Sᵀk_t)               # what S mispredicts for k_t, times the step β_t
    S   ← S + k_t δᵀ                      # the delta rule's write
    o_t = Sᵀ(scale·q_t)

`delta_recurrent` runs exactly that, one token at a time (decode). `delta_chunked` gets the same
function from a few matmuls per chunk of C tokens (the WY/UT transform): with c the cumulative
log decay inside the chunk and Γ_ij = exp(c_i − c_j),

    A = strict_lower(β k kᵀ ⊙ Γ),   T = (I + A)⁻¹           # a unit-triangular solve
    u = T (β v),   w = T (β k exp(c))                        # the chunk's writes, untangled
    δ = u − w S                                              # corrected by the state before
    o = (scale·q exp(c)) S + (lower(scale·q kᵀ ⊙ Γ)) δ
    S ← S·exp(c_C) + (k exp(c_C − c))ᵀ δ

so tokens inside a chunk see each other through T and the masked product, and the state carries
what came before. Both take q, k [B, T, H, Dk] (L2-normalized, repeated to the value heads), v
[B, T, H, Dv], g and β [B, T, H], a state [B, H, Dk, Dv] f32 (None: zeros) and return o [B, T, H,
Dv] in v's dtype and the final state f32.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def _heads_first(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                 initial_state: Tensor | None) -> tuple[Tensor, ...]:
    """(B, H, T, ·) f32 views of the inputs and the starting state."""
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    b, h, _, dk = k.shape
    s = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float32, device=v.device) \
        if initial_state is None else initial_state.float()
    return q, k, v, g, beta, s


def delta_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                    initial_state: Tensor | None, *, scale: float) -> tuple[Tensor, Tensor]:
    """The gated delta rule one token at a time."""
    dtype = v.dtype
    q, k, v, g, beta, s = _heads_first(q, k, v, g, beta, initial_state)
    outs = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t, None, None].exp()
        kt = k[:, :, t]                                                   # (B, H, Dk)
        delta = beta[:, :, t, None] * (v[:, :, t] - (s * kt[..., None]).sum(-2))   # (B, H, Dv)
        s = s + kt[..., None] * delta[..., None, :]
        outs.append((s * (scale * q[:, :, t])[..., None]).sum(-2))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o.transpose(1, 2).to(dtype), s


def delta_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                  initial_state: Tensor | None, *, scale: float,
                  chunk: int) -> tuple[Tensor, Tensor]:
    """The gated delta rule in chunks of `chunk` tokens (the last may be shorter)."""
    dtype = v.dtype
    q, k, v, g, beta, s = _heads_first(q, k, v, g, beta, initial_state)
    q = q * scale
    outs = []
    for start in range(0, q.shape[2], chunk):
        stop = min(q.shape[2], start + chunk)
        qc, kc, vc = q[:, :, start:stop], k[:, :, start:stop], v[:, :, start:stop]
        bc = beta[:, :, start:stop, None]
        c = g[:, :, start:stop].cumsum(-1)                                 # (B, H, C)
        n = stop - start
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        gamma = (c[..., :, None] - c[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        a = ((bc * kc) @ kc.transpose(-1, -2) * gamma).tril(-1)              # strictly lower
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + a, bc * vc, upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(eye + a, bc * kc * c[..., None].exp(), upper=False,
                                          unitriangular=True)
        delta = u - w @ s                                                   # (B, H, C, Dv)
        within = (qc @ kc.transpose(-1, -2)) * gamma                        # incl. the diagonal
        outs.append((qc * c[..., None].exp()) @ s + within @ delta)
        last = c[..., -1:]                                                  # (B, H, 1)
        s = s * last[..., None].exp() + (kc * (last - c)[..., None].exp()).transpose(-1, -2) @ delta
    o = torch.cat(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o.transpose(1, 2).to(dtype), s
