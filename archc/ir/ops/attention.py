"""Attention ops, decomposed as lowering emits them: rotary positions, KV cache, GQA head
repetition, scores, score modifiers (scale, soft-cap, ALiBi, T5 relative bias, masks), softmax
and the value-weighted sum.

Positions inside the score ops come from shapes: scores are [B, H, T, L] for T new queries over L
keys, and query row i sits at absolute position L − T + i (the past length P for self-attention
over the cache; an encoder has L = T).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import sympy
import torch

from archc.ir.attrs import Attrs, Call
from archc.ir.ops.base import (
    EagerCtx,
    Op,
    OpDef,
    Sig,
    float_dtype,
    per_element,
    register,
    require,
    same_dim,
)
from archc.ir.shapes import DTYPE_BYTES, P, Shape, numel

# ---- rotary positions ----------------------------------------------------------------------

def dynamic_ntk(inv_freq: torch.Tensor, pos: torch.Tensor, rotary_dim: int,
                dynamic: Call) -> torch.Tensor:
    """Dynamic NTK scaling (transformers' rope_type "dynamic"). L, the sequence length after
    this call, is the last position + 1. Past the trained context the base grows to
    base·s^(d/(d−2)) with s = factor·L/original − (factor − 1), so each default frequency
    θ_j = base^(−2j/d) becomes θ_j·s^(−2j/(d−2)); up to the trained context s = 1 (plain
    RoPE). Keys cached by earlier calls keep the rotation they were written with."""
    factor, original = dynamic.kw("factor"), dynamic.kw("original_max_seq_len")
    length = pos[-1].to(inv_freq.device, torch.float64) + 1
    s = torch.clamp(factor * length / original - (factor - 1), min=1.0)
    j = torch.arange(inv_freq.shape[0], dtype=torch.float64, device=inv_freq.device)
    return (inv_freq.double() * s ** (-2 * j / (rotary_dim - 2))).float()


def rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, rotary_dim: int,
         interleaved: bool, mscale: float = 1.0, dynamic: Call | None = None) -> torch.Tensor:
    """Rotate the first `rotary_dim` dims of each head by angle pos·θ_j (Su et al. 2021).
    Half-split pairs dim j with j + rotary_dim/2 (GPT-NeoX, Llama); interleaved pairs 2j with
    2j + 1 (GPT-J). Remaining dims pass through (partial rotary). `dynamic`: ntk(factor,
    original_max_seq_len) rescales θ from the sequence length (``dynamic_ntk``)."""
    if dynamic is not None and pos.numel():
        inv_freq = dynamic_ntk(inv_freq, pos, rotary_dim, dynamic)
    angles = pos.to(torch.float32)[:, None] * inv_freq.float()[None, :]  # (T, R/2)
    cos, sin = angles.cos() * mscale, angles.sin() * mscale
    rot, rest = x[..., :rotary_dim].float(), x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    else:
        half = rotary_dim // 2
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return torch.cat([out.to(x.dtype), rest], dim=-1)


def _rope_infer(sig: Sig) -> tuple[Shape, str]:
    x, pos, freq = sig.shapes
    rot = sig.attr("rotary_dim")
    require(len(x) == 4, f"rope takes [B, H, T, D], got {list(x)}")
    require(sig.dtypes[1] == "i64" and len(pos) == 1 and same_dim(pos[0], x[2]),
            f"positions must be i64[T] matching {x[2]}, got {sig.dtypes[1]}{list(pos)}")
    require(rot % 2 == 0 and 2 <= rot <= int(x[3]), f"rotary_dim={rot} for head dim {x[3]}")
    require(len(freq) == 1 and int(freq[0]) == rot // 2,
            f"frequencies {list(freq)} do not match rotary_dim={rot}")
    check_dynamic_rope(sig.attr("dynamic"), rot)
    return x, float_dtype(sig)


def check_dynamic_rope(dynamic: object, rotary_dim: int) -> None:
    """A rope's `dynamic` attr: none, or ntk(factor ≥ 1, original_max_seq_len ≥ 1) over ≥ 4
    rotary dims."""
    if dynamic is None:
        return
    require(isinstance(dynamic, Call) and dynamic.fn == "ntk" and not dynamic.args
            and {k for k, _ in dynamic.kwargs} == {"factor", "original_max_seq_len"},
            f"dynamic must be ntk(factor=…, original_max_seq_len=…), got {dynamic!r}")
    assert isinstance(dynamic, Call)
    factor, original = dynamic.kw("factor"), dynamic.kw("original_max_seq_len")
    require(isinstance(factor, float) and math.isfinite(factor) and factor >= 1.0,
            f"ntk() factor must be a number ≥ 1, got {factor!r}")
    require(isinstance(original, int) and not isinstance(original, bool) and original >= 1,
            f"ntk() original_max_seq_len must be a whole number ≥ 1, got {original!r}")
    require(rotary_dim >= 4, f"dynamic NTK needs ≥ 4 rotary dims, got {rotary_dim}")


register(OpDef(
    Op.ROPE, "Rotary position embedding of q or k at the given positions; with `dynamic`, "
    "frequencies rescaled from the sequence length (dynamic NTK).",
    "%12 : f32[B,4,T,16] = rope(%11, %1, %2) {interleaved=false, mscale=1.0, rotary_dim=16}",
    (3, 3), _rope_infer,
    lambda ctx, xs, a: rope(xs[0], xs[1], xs[2], a["rotary_dim"], a["interleaved"],
                            a.get("mscale", 1.0), a.get("dynamic")),
    flops=per_element(3), attrs=("rotary_dim", "interleaved"), optional=("mscale", "dynamic")))


# ---- KV cache and GQA ----------------------------------------------------------------------

def _kv_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    require(len(x) == 4, f"kv_cache takes [B, H, T, D], got {list(x)}")
    require(sig.attr("kind") in ("k", "v"), f"kind must be k or v, got {sig.attr('kind')!r}")
    return (x[0], x[1], P + x[2], x[3]), float_dtype(sig)


def _kv_bytes(sig: Sig) -> sympy.Expr:
    # read the new rows, write them into the cache; readers of the cache pay for reading it
    return 2 * numel(sig.shapes[0]) * DTYPE_BYTES[sig.dtypes[0]]


register(OpDef(
    Op.KV_CACHE, "Write the new keys or values at offset P; return the cache's first P+T.",
    '%14 : f32[B,2,P+T,16] = kv_cache(%13) {kind="k", layer=0}', (1, 1), _kv_infer,
    lambda ctx, xs, a: ctx.cache_append(a["layer"], a["kind"], xs[0]), bytes=_kv_bytes,
    attrs=("layer", "kind")))


def _repeat_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shapes[0]
    g = sig.attr("groups")
    require(len(x) == 4 and g >= 1, "repeat_kv takes [B, H, L, D] and groups ≥ 1")
    return (x[0], x[1] * g, x[2], x[3]), sig.dtypes[0]


register(OpDef(
    Op.REPEAT_KV, "Repeat each KV head `groups` times so GQA heads line up with queries.",
    "%16 : f32[B,4,P+T,16] = repeat_kv(%14) {groups=2}", (1, 1), _repeat_infer,
    lambda ctx, xs, a: xs[0].repeat_interleave(a["groups"], dim=1), attrs=("groups",)))


# ---- scores and the value sum --------------------------------------------------------------

def groups(q_heads: sympy.Expr, kv_heads: sympy.Expr) -> int:
    """Query heads per key/value head: 1 after repeat_kv, H/H_kv when attention reads the KV
    heads directly (query head h uses KV head h // groups)."""
    q, kv = int(q_heads), int(kv_heads)
    require(q % kv == 0, f"{q} query heads are not a multiple of {kv} key/value heads")
    return q // kv


def expand_kv(x: torch.Tensor, q_heads: int) -> torch.Tensor:
    """[B, H_kv, L, D] → [B, H, L, D]: KV head h // g serves query head h."""
    g = q_heads // x.shape[1]
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _scores_infer(sig: Sig) -> tuple[Shape, str]:
    q, k = sig.shapes
    require(len(q) == 4 and len(k) == 4, "scores takes q [B, H, T, D] and k [B, H_kv, L, D]")
    groups(q[1], k[1])
    require(same_dim(q[3], k[3]), f"q head dim {q[3]} ≠ k head dim {k[3]}")
    return (q[0], q[1], q[2], k[2]), float_dtype(sig)


def _scores_flops(sig: Sig) -> sympy.Expr:
    q, k = sig.shapes
    return 2 * numel(q) * k[2]


register(OpDef(
    Op.SCORES, "Attention scores q·kᵀ per head; k may have fewer (KV) heads than q.",
    "%17 : f32[B,4,T,P+T] = scores(%12, %16)", (2, 2), _scores_infer,
    lambda ctx, xs, a: xs[0] @ expand_kv(xs[1], xs[0].shape[1]).transpose(-1, -2),
    flops=_scores_flops))


def _wsum_infer(sig: Sig) -> tuple[Shape, str]:
    p, v = sig.shapes
    require(len(p) == 4 and len(v) == 4,
            "weighted_sum takes p [B, H, T, L] and v [B, H_kv, L, D]")
    groups(p[1], v[1])
    require(same_dim(p[3], v[2]), f"probabilities {list(p)} do not match values {list(v)}")
    return (p[0], p[1], p[2], v[3]), float_dtype(sig)


def _wsum_flops(sig: Sig) -> sympy.Expr:
    p, v = sig.shapes
    return 2 * numel(p) * v[3]


register(OpDef(
    Op.WEIGHTED_SUM, "The value sum p·v per head; v may have fewer (KV) heads than p.",
    "%22 : f32[B,4,T,16] = weighted_sum(%21, %20)", (2, 2), _wsum_infer,
    lambda ctx, xs, a: xs[0] @ expand_kv(xs[1], xs[0].shape[1]), flops=_wsum_flops))


# ---- score modifiers -----------------------------------------------------------------------

def query_key_positions(t: int, length: int, device: torch.device | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions of the T query rows (the last T of L) and of the L keys."""
    return (torch.arange(length - t, length, device=device),
            torch.arange(length, device=device))


def visible(t: int, length: int, causal: bool, window: int | None,
            prefix_len: int | torch.Tensor | None = None, global_tokens: int | None = None,
            device: torch.device | None = None) -> torch.Tensor:
    """[T, L] bool: may query row i see key j? Causal: j ≤ i. Window: within `window` of the
    query (behind it when causal, either side when not). Prefix-LM: keys < prefix_len are seen
    by every query. Global tokens (Longformer, beside a window): the first G positions are
    seen by every query (causally, in a decoder) and, when not causal, see every key. Made on
    `device` (a prefix length there stays there: nothing waits on the host)."""
    q, k = query_key_positions(t, length, device)
    dist = q[:, None] - k[None, :]
    seen = dist >= 0 if causal else torch.ones(t, length, dtype=torch.bool, device=device)
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


def apply_mask(s: torch.Tensor, causal: bool, window: int | None, padding: torch.Tensor | None,
               prefix_len: int | None, global_tokens: int | None = None) -> torch.Tensor:
    t, length = s.shape[-2:]
    keep = visible(t, length, causal, window, prefix_len, global_tokens).to(s.device)[None, None]
    if padding is not None:
        keep = keep & padding.bool()[:, None, None, :]
    return s.masked_fill(~keep, torch.finfo(s.dtype).min)


def _mask_infer(sig: Sig) -> tuple[Shape, str]:
    s = sig.shapes[0]
    require(len(s) == 4, f"mask takes scores [B, H, T, L], got {list(s)}")
    n = 1 + bool(sig.attr("padding")) + bool(sig.attr("prefix"))
    require(len(sig.shapes) == n, f"mask with padding={sig.attr('padding')} "
            f"prefix={sig.attr('prefix')} takes {n} inputs, got {len(sig.shapes)}")
    i = 1
    if sig.attr("padding"):
        pad = sig.shapes[i]
        require(len(pad) == 2 and same_dim(pad[1], s[3]),
                f"padding mask {list(pad)} must be [B, L] with L = {s[3]}")
        i += 1
    if sig.attr("prefix"):
        require(len(sig.shapes[i]) == 0 and sig.dtypes[i] == "i64", "prefix_len must be i64[]")
    check_window(sig.attr("window"), sig.attr("global_tokens"), sig.attr("prefix"))
    return s, float_dtype(sig)


def check_window(window: object, global_tokens: object, prefix: object) -> None:
    """A mask's window (≥ 1) and global tokens (≥ 1, beside a window, not with a prefix)."""
    for name, value in (("window", window), ("global_tokens", global_tokens)):
        require(value is None or (isinstance(value, int) and not isinstance(value, bool)
                                  and value >= 1), f"{name} must be a whole number ≥ 1, got "
                f"{value!r}")
    require(global_tokens is None or window is not None,
            "global_tokens are seen beside a window, and there is none")
    require(global_tokens is None or not prefix, "global_tokens with a prefix-LM mask")


def _mask_eager(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    rest = list(xs[1:])
    padding = rest.pop(0) if a.get("padding") else None
    prefix_len = int(rest.pop(0)) if a.get("prefix") else None
    return apply_mask(xs[0], a["causal"], a.get("window"), padding, prefix_len,
                      a.get("global_tokens"))


register(OpDef(
    Op.MASK, "Hide keys a query may not see: causal, sliding window with global tokens, "
    "prefix-LM, padding.",
    "%19 : f32[B,4,T,P+T] = mask(%18) {causal=true, padding=false, prefix=false, window=8}",
    (1, 3), _mask_infer, _mask_eager, flops=per_element(1),
    attrs=("causal", "padding", "prefix"), optional=("window", "global_tokens")))


def alibi_bias(slopes: torch.Tensor, t: int, length: int) -> torch.Tensor:
    """[H, T, L]: −slope·(query − key) (Press et al. 2021). BLOOM adds slope·key instead; the
    two differ by a constant along each softmax row, so they give the same attention."""
    q, k = query_key_positions(t, length)
    dist = (k[None, :] - q[:, None]).to(slopes.device, torch.float32)
    return slopes.float()[:, None, None] * dist[None]


def _bias_like_scores_infer(sig: Sig) -> tuple[Shape, str]:
    s, table = sig.shapes
    require(len(s) == 4, f"takes scores [B, H, T, L], got {list(s)}")
    heads = table[-1]
    require(same_dim(heads, s[1]), f"table has {heads} heads, scores have {s[1]}")
    return s, float_dtype(sig)


register(OpDef(
    Op.ALIBI, "Add the ALiBi bias −slope_h·(i − j) to scores.",
    "%18 : f32[B,4,T,P+T] = alibi(%17, %3)", (2, 2), _bias_like_scores_infer,
    lambda ctx, xs, a: (xs[0].float() + alibi_bias(xs[1], *xs[0].shape[-2:])[None]).to(
        xs[0].dtype),
    flops=per_element(2)))


def t5_buckets(relative: torch.Tensor, bidirectional: bool, buckets: int,
               max_distance: int) -> torch.Tensor:
    """T5's bucket of each key − query distance: exact for small distances, logarithmic up to
    `max_distance`, then the last bucket; a bidirectional model spends half the buckets on keys
    after the query."""
    out = torch.zeros_like(relative)
    if bidirectional:
        buckets //= 2
        out += (relative > 0).long() * buckets
        relative = relative.abs()
    else:
        relative = -torch.clamp(relative, max=0)
    exact = buckets // 2
    small = relative < exact
    large = exact + (
        torch.log(relative.float().clamp(min=1) / exact) / math.log(max_distance / exact)
        * (buckets - exact)).long()
    large = torch.clamp(large, max=buckets - 1)
    return out + torch.where(small, relative, large)


def relative_bias(table: torch.Tensor, t: int, length: int, bidirectional: bool,
                  max_distance: int) -> torch.Tensor:
    """[H, T, L] bias looked up from a [buckets, H] table."""
    q, k = query_key_positions(t, length)
    bucket = t5_buckets(k[None, :] - q[:, None], bidirectional, table.shape[0], max_distance)
    return table[bucket.to(table.device)].permute(2, 0, 1)


register(OpDef(
    Op.REL_BIAS, "Add T5's bucketed relative-position bias (a [buckets, H] table) to scores.",
    "%18 : f32[B,4,T,P+T] = rel_bias(%17, %5) {bidirectional=false, max_distance=128}",
    (2, 2), _bias_like_scores_infer,
    lambda ctx, xs, a: (xs[0].float() + relative_bias(
        xs[1].float(), *xs[0].shape[-2:], a["bidirectional"], a["max_distance"])[None]).to(
        xs[0].dtype),
    flops=per_element(2), attrs=("bidirectional", "max_distance")))
