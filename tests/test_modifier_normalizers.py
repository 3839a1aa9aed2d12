"""The normalizers' one-shot forms against references written here (and gpt-oss's attention in
transformers for sinks), and their online forms — over key tiles, as a kernel runs them —
against the one-shot forms, at odd lengths, with a row that sees no key.

Tolerance 2e-6, plus 1e-6 of the value: f32 throughout, the online forms sum in another order
and rescale by e^(m − m′) (a few ulps). Softmax's outputs are averages, of unit scale; sigmoid's
weights are not normalized, so its outputs are sums of up to 20 values (|out| up to ~8, where an
ulp is 5e-7 and the summation order alone moved one element by 2.4e-6 on one x86-64 machine).
A wrong rescale or mask moves outputs by 1e-2 and more."""

from __future__ import annotations

import types

import pytest
import torch

from archc.ir.attrs import Call
from archc.ir.modifiers import SOFTMAX, attend, attend_online, weights

B, H, KV_HEADS, T, L, D = 2, 9, 3, 5, 37, 8
TOL = dict(rtol=1e-6, atol=2e-6)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    s = torch.randn(B, H, T, L, generator=g) * 3
    v = torch.randn(B, H, L, D, generator=g)
    q = torch.arange(L - T, L)[:, None]
    k = torch.arange(L)[None, :]
    mask = ((k <= q) & (q - k < 20))[None, None].expand(B, H, T, L).clone()
    mask[1, 2, 3] = False                      # a row that sees no key
    sinks = torch.randn(H, generator=g)
    return s, mask, v, sinks


def test_softmax_equals_reference() -> None:
    s, mask, v, _ = _inputs()
    want = torch.softmax(s.masked_fill(~mask, torch.finfo(torch.float32).min), -1) @ v
    torch.testing.assert_close(attend(SOFTMAX, s, mask, v), want, **TOL)
    # the row that sees nothing averages every value, as eager attention does today
    torch.testing.assert_close(want[1, 2, 3], v[1, 2].mean(0), **TOL)


def test_sinks_equal_gpt_oss() -> None:
    """transformers' gpt-oss attention: the sink joins the softmax's denominator only."""
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    s, mask, v, sinks = _inputs()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, T, D, generator=g)
    k = torch.randn(B, KV_HEADS, L, D, generator=g)
    vk = v[:, ::H // KV_HEADS]                           # one value head per KV head
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=H // KV_HEADS,
                                   training=False)
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    want, _ = gpt_oss.eager_attention_forward(module, q, k, vk, additive, 0.3)
    scores = q @ k.repeat_interleave(3, 1).transpose(-1, -2) * 0.3
    nz = Call("softmax", (), (("sinks", "sinks"),))
    got = attend(nz, scores, mask, vk.repeat_interleave(3, 1), sinks)
    torch.testing.assert_close(got.transpose(1, 2), want, **TOL)     # [B, T, H, D]
    # the row that sees nothing puts its weight on the sink: ~0
    assert got[1, 2, 3].abs().max() < 1e-30


def test_sigmoid_equals_reference() -> None:
    s, mask, v, _ = _inputs()
    nz = Call("sigmoid", (), (("bias", -3.6),))
    want = (torch.sigmoid(s - 3.6) * mask) @ v
    torch.testing.assert_close(attend(nz, s, mask, v), want, **TOL)
    assert weights(nz, s, mask)[1, 2, 3].abs().max() == 0


@pytest.mark.parametrize("normalizer", [
    SOFTMAX, Call("softmax", (), (("sinks", "sinks"),)), Call("sigmoid", (), (("bias", -3.6),)),
    Call("sigmoid")], ids=["softmax", "sinks", "sigmoid", "sigmoid-no-bias"])
@pytest.mark.parametrize("block_n", [1, 8, 16, 64])
def test_online_equals_one_shot(normalizer: Call, block_n: int) -> None:
    s, mask, v, sinks = _inputs()
    torch.testing.assert_close(attend_online(normalizer, s, mask, v, block_n, sinks),
                               attend(normalizer, s, mask, v, sinks), **TOL)
