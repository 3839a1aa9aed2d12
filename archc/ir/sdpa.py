"""The `attention` op's eager semantics through PyTorch's fused attention.

``torch.nn.functional.scaled_dot_product_attention`` computes softmax(scale·q·kᵀ + M)·v without
storing the [B, H, T, L] scores (a flash-style kernel on CPUs and GPUs), which is what makes a
long eager prefill affordable: at 8192 tokens the scores of one layer of SmolLM2 are 2.4 GB in f32.
Everything the decomposed op applies between the scores and the softmax is expressible as the
additive mask M except tanh soft-capping, which acts on the raw scores; with a soft-cap this
returns None and the caller computes the decomposed form.

    M = bias − ∞·(not visible)        bias: ALiBi or T5 relative bias, [H, T, L]; else 0

"−∞" is f32's most negative finite value, as the decomposed mask fills it: a row whose keys are
all hidden (padding) then gets the same uniform weights, not NaN. A causal prefill (T = L) and a
causal decode step (T = 1) need no mask at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from archc.ir.ops.attention import alibi_bias, expand_kv, relative_bias, visible


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attrs: Mapping[str, Any],
                   *, padding: torch.Tensor | None = None,
                   prefix_len: torch.Tensor | int | None = None,
                   bias_input: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of q [B, H, T, D] over k, v [B, H_kv, L, D] (query row i at position
    L − T + i), as the `attention` op defines it by its attributes (`scale`, `causal`, `window`,
    `global_tokens`, `bias`, `softcap`), computed in f32 and returned with heads merged,
    [B, T, H·D] in q's dtype; None when a soft-cap makes it inexpressible."""
    if attrs.get("softcap") is not None:
        return None
    b, h, t, d = q.shape
    length = k.shape[2]
    kf, vf = expand_kv(k, h).float(), expand_kv(v, h).float()        # (B, H, L, D)
    mask, is_causal = additive_mask(attrs, t, length, padding=padding,
                                    prefix_len=prefix_len, bias_input=bias_input,
                                    device=q.device)
    out = F.scaled_dot_product_attention(q.float(), kf, vf, attn_mask=mask, is_causal=is_causal,
                                         scale=attrs["scale"])       # (B, H, T, D)
    return out.transpose(1, 2).reshape(b, t, h * d).to(q.dtype)


def additive_mask(attrs: Mapping[str, Any], t: int, length: int, *,
                  padding: torch.Tensor | None, prefix_len: torch.Tensor | int | None,
                  bias_input: torch.Tensor | None,
                  device: torch.device) -> tuple[torch.Tensor | None, bool]:
    """(M, is_causal) for scaled_dot_product_attention: M is None when no key is hidden and
    there is no bias, or when `is_causal` says it all (a causal prefill, T = L)."""
    causal, window, bias = attrs["causal"], attrs.get("window"), attrs.get("bias")
    if window is None and padding is None and prefix_len is None and bias is None:
        if not causal or t == 1:        # every key visible (a decode step sees all its past)
            return None, False
        if t == length:                 # a causal prefill: SDPA's own (top-left) causal mask
            return None, True
    prefix = None if prefix_len is None else int(prefix_len)
    keep = visible(t, length, causal, window, prefix, attrs.get("global_tokens"),
                   device=device)[None, None]                        # (1, 1, T, L)
    if padding is not None:
        keep = keep & padding.to(device).bool()[:, None, None, :]    # (B, 1, T, L)
    if bias is None:
        additive = torch.zeros(1, 1, t, length, device=device)
    elif bias.fn == "alibi":
        assert bias_input is not None
        additive = alibi_bias(bias_input, t, length)[None].to(device)              # (1, H, T, L)
    else:
        assert bias_input is not None
        additive = relative_bias(bias_input.float(), t, length, bias.kw("bidirectional"),
                                 bias.kw("max_distance"))[None].to(device)
    return additive.float().masked_fill(~keep, torch.finfo(torch.float32).min), False
