"""The gated delta rule's two eager forms against a plain float64 loop written here, and a
decode after a chunked prefill against one recurrent run from the start."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from archc.ir.ops.delta_rule import delta_chunked, delta_recurrent


def loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         s0: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token, head by head, in float64: S = S·e^g; δ = β(v − Sᵀk); S += k δᵀ;
    o = Sᵀ(scale·q)."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    b, t, h, _ = q.shape
    s = s0.double().clone()
    o = torch.zeros(b, t, h, v.shape[-1], dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            st = s[bi, hi]
            for ti in range(t):
                st = st * torch.exp(g[bi, ti, hi])
                kt = k[bi, ti, hi]
                delta = beta[bi, ti, hi] * (v[bi, ti, hi] - st.T @ kt)
                st = st + torch.outer(kt, delta)
                o[bi, ti, hi] = st.T @ (scale * q[bi, ti, hi])
            s[bi, hi] = st
    return o, s


def inputs(t: int, seed: int = 0, b: int = 2, h: int = 3, dk: int = 5,
           dv: int = 4) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    k = F.normalize(torch.randn(b, t, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, t, h, dv, generator=gen)
    g = -torch.rand(b, t, h, generator=gen) * 0.7
    beta = torch.rand(b, t, h, generator=gen)
    s0 = torch.randn(b, h, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, s0


@pytest.mark.parametrize(("t", "chunk"), [(1, 4), (7, 4), (8, 4), (19, 8), (19, 1), (13, 64),
                                          (16, 5)])
def test_both_forms_equal_the_loop(t: int, chunk: int) -> None:
    q, k, v, g, beta, s0 = inputs(t, seed=t * 7 + chunk)
    scale = 5 ** -0.5
    want_o, want_s = loop(q, k, v, g, beta, s0, scale)
    for o, s in (delta_chunked(q, k, v, g, beta, s0, scale=scale, chunk=chunk),
                 delta_recurrent(q, k, v, g, beta, s0, scale=scale)):
        assert o.shape == want_o.shape and s.dtype == torch.float32
        torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(s.double(), want_s, rtol=1e-4, atol=1e-5)


def test_no_state_is_zeros() -> None:
    q, k, v, g, beta, s0 = inputs(6)
    want_o, want_s = loop(q, k, v, g, beta, torch.zeros_like(s0), 0.5)
    o, s = delta_chunked(q, k, v, g, beta, None, scale=0.5, chunk=4)
    torch.testing.assert_close(o.double(), want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s.double(), want_s, rtol=1e-4, atol=1e-5)


def test_decode_after_a_chunked_prefill() -> None:
    """A 19-token chunked prefill, then 3 one-token recurrent steps from its state, give the
    22 outputs and the final state of one recurrent run."""
    q, k, v, g, beta, _ = inputs(22, seed=3)
    whole_o, whole_s = delta_recurrent(q, k, v, g, beta, None, scale=0.4)
    o, s = delta_chunked(*(x[:, :19] for x in (q, k, v, g, beta)), None, scale=0.4, chunk=8)
    outs = [o]
    for i in range(19, 22):
        step, s = delta_recurrent(*(x[:, i:i + 1] for x in (q, k, v, g, beta)), s, scale=0.4)
        outs.append(step)
    torch.testing.assert_close(torch.cat(outs, dim=1), whole_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, whole_s, rtol=1e-4, atol=1e-5)
