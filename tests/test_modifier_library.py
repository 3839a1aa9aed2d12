"""The built-in variants as library expressions equal the attention op's shorthand semantics,
written here in plain torch: each combination of the mask attributes equals ``visible_at``
(and the padding mask), its ALiBi bias and soft-cap ``alibi_at`` and ``cap·tanh(s/cap)``, on
random positions — a prefill, odd lengths, a decode step, zig-zag (ring) blocks — and the
whole attention op equals the library's score and mask under the softmax normalizer, GQA 9
heads over 3."""

from __future__ import annotations

import itertools

import pytest
import torch

from archc.ir.attrs import Attrs, Call
from archc.ir.modifiers import (
    SOFTMAX,
    EagerValues,
    attend,
    builtin,
    evaluate,
    format_expr,
    from_attention_attrs,
)
from archc.ir.modifiers.library import LIBRARY, library_env
from archc.ir.ops import Op
from archc.ir.ops.attention import attention, expand_kv
from archc.ir.ops.base import full_attrs

# (T, L): a prefill, odd lengths with a past, a decode step
SHAPES = [(9, 9), (7, 13), (1, 13)]
MASKS = [dict(causal=c, window=w, global_tokens=g, prefix=p, padding=pad)
         for c, w, g, p, pad in itertools.product((False, True), (None, 4), (None, 2),
                                                  (False, True), (False, True))
         if g is None or w is not None]


def visible_at(q: torch.Tensor, k: torch.Tensor, causal: bool, window: int | None,
               prefix_len: int | torch.Tensor | None = None,
               global_tokens: int | None = None) -> torch.Tensor:
    """[T, L] bool, the shorthand's meaning: causal j ≤ i; a window within `window` of the
    query (behind it when causal, either side when not); global tokens beside a window seen
    by every query (and, when not causal, seeing every key); keys < prefix_len seen by all."""
    dist = q[:, None] - k[None, :]
    seen = dist >= 0 if causal else torch.ones(dist.shape, dtype=torch.bool)
    if window is not None:
        near = (dist < window) if causal else (dist.abs() < window)
        if global_tokens is not None:
            near |= k[None, :] < global_tokens
            if not causal:
                near |= q[:, None] < global_tokens
        seen &= near
    if prefix_len is not None:
        seen |= k[None, :] < prefix_len
    return seen


def alibi_at(slopes: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """[H, T, L]: ALiBi's −slope·(query − key)."""
    return slopes.float()[:, None, None] * (k[None, :] - q[:, None]).float()[None]


def _positions(t: int, length: int, zigzag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries the last T of L; zig-zag: a shuffled block of each, as a ring rank holds."""
    q, k = torch.arange(length - t, length), torch.arange(length)
    if zigzag:
        g = torch.Generator().manual_seed(t * 100 + length)
        q, k = q[torch.randperm(t, generator=g)], k[torch.randperm(length, generator=g)]
    return q, k


def _values(q: torch.Tensor, k: torch.Tensor, heads: int = 9, kv_heads: int = 3,
            **kw: object) -> EagerValues:
    g = torch.Generator().manual_seed(7)
    pad = (torch.rand(2, int(k.max()) + 1, generator=g) > 0.3).long()
    return EagerValues(q, k, heads, kv_heads, token_inputs={"padding": pad},
                       scalars={"prefix_len": torch.tensor(3)}, **kw)   # type: ignore[arg-type]


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("t,length", SHAPES)
def test_mask_attrs_equal_visible_at(t: int, length: int, zigzag: bool) -> None:
    q, k = _positions(t, length, zigzag)
    v = _values(q, k)
    for at in MASKS:
        mods = from_attention_attrs(at)
        got = evaluate(mods.mask, mods.env, v).expand(2, 9, t, length)
        want = visible_at(q, k, at["causal"], at["window"],
                          torch.tensor(3) if at["prefix"] else None,
                          at["global_tokens"])[None, None]
        if at["padding"]:
            want = want & v.token_inputs["padding"][:, k].bool()[:, None, None, :]
        assert torch.equal(got, want.expand(2, 9, t, length)), (at, format_expr(mods.mask))


@pytest.mark.parametrize("zigzag", [False, True])
@pytest.mark.parametrize("t,length", SHAPES)
def test_alibi_and_softcap_equal_todays(t: int, length: int, zigzag: bool) -> None:
    """The score expressions against score_bias_at and the soft-cap, within 1e-6 of the scores'
    scale: both sides round the same f32 operations (a reordering would show as ulps)."""
    q, k = _positions(t, length, zigzag)
    g = torch.Generator().manual_seed(1)
    s = torch.randn(2, 9, t, length, generator=g) * 20
    slopes = torch.rand(9, generator=g)
    v = _values(q, k, score=s, head_params={"slopes": slopes})
    bias = alibi_at(slopes, q, k)[None]
    for cap, alibi in itertools.product((None, 30.0), (False, True)):
        mods = from_attention_attrs(dict(softcap=cap, bias=Call("alibi") if alibi else None))
        want = s if cap is None else cap * torch.tanh(s / cap)
        want = want + bias if alibi else want
        got = evaluate(mods.score, mods.env, v).expand_as(s)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6 * 20)
    # BLOOM's placement, slope·k, differs by slope·q along each row: the same softmax
    bloom = evaluate(builtin("alibi_bloom"), library_env(), v)
    torch.testing.assert_close(torch.softmax(bloom, -1), torch.softmax(s + bias, -1),
                               rtol=0, atol=1e-6)


def test_t5_is_refused() -> None:
    with pytest.raises(ValueError, match="the t5 bias is not an expression"):
        from_attention_attrs({"bias": Call("t5", (), (("bidirectional", True),))})


@pytest.mark.parametrize("t,length", [(7, 13), (1, 13), (9, 9)])
def test_attention_op_equals_library_expressions(t: int, length: int) -> None:
    """Today's attention op (F.scaled_dot_product_attention over the additive mask) equals the
    library's score and mask evaluated over materialized scores, normalized by softmax —
    within 2e-6 of unit-scale outputs (f32, different summation orders)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d = 9, 3, 8
    qx = torch.randn(2, heads, t, d, generator=g)
    kx, vx = (torch.randn(2, kv_heads, length, d, generator=g) for _ in range(2))
    pad = (torch.rand(2, length, generator=g) > 0.3).long()
    pad[:, 0] = 1
    slopes = torch.rand(heads, generator=g)
    q_pos, k_pos = _positions(t, length, False)
    for extra in (dict(causal=True, window=4, global_tokens=2, padding=True),
                  dict(causal=True, prefix=True, softcap=5.0, bias=Call("alibi")),
                  dict(window=3, padding=True, bias=Call("alibi"))):
        at = full_attrs(Op.ATTENTION, Attrs(scale=0.35, **extra))
        a = {"q": qx, "k": kx, "v": vx, "slopes": slopes}       # the operands `at` declares
        a.update({"padding": pad} if at["padding"] else {})
        a.update({"prefix_len": torch.tensor(3)} if at["prefix"] else {})
        want = attention(None, a, at).view(2, t, heads, d).transpose(1, 2)     # (B, H, T, D)
        mods = from_attention_attrs(at)
        s = qx @ expand_kv(kx, heads).transpose(-1, -2) * 0.35
        v = EagerValues(q_pos, k_pos, heads, kv_heads, score=s,
                        head_params={"slopes": slopes}, token_inputs={"padding": pad},
                        scalars={"prefix_len": torch.tensor(3)})
        got = attend(SOFTMAX, evaluate(mods.score, mods.env, v),
                     evaluate(mods.mask, mods.env, v), expand_kv(vx, heads))
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_library_entries_parse_and_read_as_documented() -> None:
    constants = dict(window=8, global_tokens=2, chunk=16, dilation=2, softcap=30.0)
    for name, b in LIBRARY.items():
        e = builtin(name, **{k: v for k, v in constants.items() if k in b.text})
        assert format_expr(e)          # each is an expression of its kind, refused otherwise
    assert format_expr(builtin("chunked", chunk=8192)) == \
        "kv_pos <= q_pos and q_pos // 8192 == kv_pos // 8192"
    dilated = builtin("dilated_window", window=3, dilation=2)
    q, k = torch.arange(8), torch.arange(8)
    seen = evaluate(dilated, library_env(), EagerValues(q, k, 1, 1))[0, 0]
    assert seen[7].nonzero()[:, 0].tolist() == [3, 5, 7]       # 3 keys, every 2nd
