"""Score modifiers as ops: what an op's modifiers (``archc.ir.modifiers``) read and how eager
computes them, and the unfused ops lowering emits between the scores and the value sum — ALiBi,
T5's relative bias, an explicit score expression, the mask, a normalizer other than softmax —
which the flash-attention pass folds into one attention node.

Positions come from shapes: scores are [B, H, T, L] for T new queries over L keys, and query row
i sits at position L − T + i (P over the cache; an encoder has L = T).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import sympy
import torch

from archc.ir.attrs import Attr, Attrs, Call, Expression
from archc.ir.modifiers import (
    NORMALIZER_PARAMS,
    SOFTMAX,
    EagerValues,
    ExprError,
    Modifiers,
    builtin,
    evaluate,
    from_attention_attrs,
    leaves,
    var,
    weights,
)
from archc.ir.modifiers.library import library_env
from archc.ir.ops.base import (
    Args,
    EagerCtx,
    Op,
    OpDef,
    ShapeError,
    Sig,
    float_dtype,
    operands,
    per_element,
    register,
    require,
    same_dim,
)
from archc.ir.shapes import Shape

# ---- score modifiers -----------------------------------------------------------------------
#
# What an attention does between q·kᵀ·scale and the value sum is its Modifiers
# (``archc.ir.modifiers``): a score expression, a mask expression and a normalizer, from the
# shorthand attributes (MASK_ATTRS, softcap, an ALiBi bias) and the explicit ones (`score`,
# `mask`, `normalizer`). Every name they read is an operand of that name: per-head parameters
# (f32 [H], or [H_kv] when read at kv_head), per-token inputs ([B, L] over the key positions,
# `padding` among them) and per-sequence scalars (`prefix_len`, i64[]). T5's bucketed bias is
# not an expression: it is added to the score the expressions give.

ALIBI = builtin("alibi")


def query_key_positions(t: int, length: int, device: torch.device | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions of the T query rows (the last T of L) and of the L keys."""
    return (torch.arange(length - t, length, device=device), torch.arange(length, device=device))


def modifiers_of(at: Mapping[str, Any]) -> Modifiers:
    """The modifiers of an attention, mask or score_mod node's (full) attributes (a T5 bias
    left out: ``t5_bias``)."""
    at = at if isinstance(at, Attrs) else Attrs(at)
    bias = at.get("bias")
    return from_attention_attrs(at.replace(bias=None) if bias is not None and bias.fn == "t5"
                                else at)


def modifier_roles(at: Mapping[str, Any]) -> list[str]:
    """The operands the modifiers read, in order: padding, prefix_len, ALiBi slopes (where
    they are read), then every other name they read — per-head parameters, per-token inputs
    and scalars — sorted by name."""
    env = modifiers_of(at).env
    heads, tokens, scalars = (set(names) for names in
                              (env.head_params, env.token_inputs, env.scalars))
    fixed = [r for r, used in (("padding", "padding" in tokens or at.get("padding")),
                               ("prefix_len", "prefix_len" in scalars or at.get("prefix")),
                               ("slopes", "slopes" in heads)) if used]
    return [*fixed, *sorted((heads | tokens | scalars) - set(fixed))]


def eager_values(mods: Modifiers, a: Mapping[str, torch.Tensor], q_pos: torch.Tensor,
                 kv_pos: torch.Tensor, heads: int, kv_heads: int,
                 score: torch.Tensor | None = None) -> EagerValues:
    """What `mods` read of one call: positions, head counts, the scores, their operands."""
    env = mods.env
    return EagerValues(q_pos, kv_pos, heads, kv_heads, score,
                       {n: a[n] for n in env.head_params}, {n: a[n] for n in env.token_inputs},
                       {n: a[n] for n in env.scalars})


def check_modifiers(sig: Sig, heads: sympy.Expr, kv_heads: sympy.Expr,
                    length: sympy.Expr) -> None:
    """The modifiers type-check, and each operand they read has its shape: per-head f32 [H]
    (or [H_kv] when read at kv_head only), per-token [B, L] integers, scalars i64[]."""
    try:
        mods = modifiers_of(sig.attrs)
    except ExprError as err:
        raise ShapeError(str(err)) from None
    if sig.attr("mask") is not None:
        shorthand = [n for n in ("causal", "prefix", "window", "global_tokens") if sig.attr(n)]
        require(not shorthand, f"an explicit mask replaces {', '.join(shorthand)}: give one")
    env, at_head = mods.env, {x.args[0] for e in (mods.score, mods.mask) for x in leaves(e)
                              if x.fn == "index" and x.args[1] == var("head")}
    for name in env.head_params:
        want = heads if name in at_head or name == mods.normalizer.kw("sinks") else kv_heads
        s, dt = sig.shape(name), sig.dtype(name)
        require(len(s) == 1 and same_dim(s[0], want) and dt == "f32",
                f"per-head parameter {name} must be f32[{want}], got {dt}{list(s)}")
    for name in env.token_inputs:
        s, dt = sig.shape(name), sig.dtype(name)
        require(len(s) == 2 and same_dim(s[1], length) and dt in ("i32", "i64"),
                f"per-token input {name} must be [B, {length}] integers, got {dt}{list(s)}")
    for name in env.scalars:
        require(len(sig.shape(name)) == 0 and sig.dtype(name) == "i64", f"{name} must be i64[]")


def _positions_from(ctx_scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return query_key_positions(*ctx_scores.shape[-2:], ctx_scores.device)


def _mask(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    s = a["scores"]
    mods = modifiers_of(at)
    keep = evaluate(mods.mask, mods.env, eager_values(mods, a, *_positions_from(s), s.shape[1],
                                                      at["kv_heads"] or s.shape[1]))
    return s.masked_fill(~keep, torch.finfo(s.dtype).min)


def check_mask(sig: Sig, length: sympy.Expr) -> None:
    """The mask operands over L keys, and global tokens only beside a window, with no prefix."""
    if sig.has("padding"):
        pad = sig.shape("padding")
        require(len(pad) == 2 and same_dim(pad[1], length),
                f"padding mask {list(pad)} must be [B, L] with L = {length}")
    if sig.has("prefix_len"):
        require(len(sig.shape("prefix_len")) == 0 and sig.dtype("prefix_len") == "i64",
                "prefix_len must be i64[]")
    if sig.attr("global_tokens") is not None:
        require(sig.attr("window") is not None,
                "global_tokens are seen beside a window, and there is none")
        require(not sig.attr("prefix"), "global_tokens with a prefix-LM mask")


def _unfused_infer(sig: Sig) -> tuple[Shape, str]:
    s = sig.shape("scores")
    require(len(s) == 4, f"takes scores [B, H, T, L], got {list(s)}")
    check_mask(sig, s[3])
    kv_heads = sympy.Integer(sig.attr("kv_heads")) if sig.attr("kv_heads") else s[1]
    check_modifiers(sig, s[1], kv_heads, s[3])
    return s, float_dtype(sig)


# what a mask (and the attention kernel) knows of which keys a query sees, and its operands
MASK_ATTRS = (Attr("causal", bool, False), Attr("padding", bool, False),
              Attr("prefix", bool, False), Attr("window", int, None, at_least=1),
              Attr("global_tokens", int, None, at_least=1), Attr("mask", Expression, None))
# an unfused mask or score_mod after repeat_kv: the KV heads that `kv_head` counts
UNFUSED_KV_HEADS = Attr("kv_heads", int, None, at_least=1)


def _modifier_operands(first: str) -> Callable[[Mapping[str, Any], int], list[str]]:
    return lambda attrs, n: [first, *modifier_roles(attrs)]


register(OpDef(
    Op.MASK, "Hide keys a query may not see: causal, sliding window with global tokens, "
    "prefix-LM, padding, or an explicit `mask` expression (with padding).",
    "%19 : f32[B,4,T,P+T] = mask(%18) {causal=true, window=8}",
    _modifier_operands("scores"), _unfused_infer, _mask, attrs=(*MASK_ATTRS, UNFUSED_KV_HEADS),
    flops=per_element(1), arity=(1, -1)))


def _score_mod(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    s = a["scores"]
    mods = modifiers_of(at)
    values = eager_values(mods, a, *_positions_from(s), s.shape[1],
                          at["kv_heads"] or s.shape[1], score=s)
    return evaluate(mods.score, mods.env, values).expand(s.shape).to(s.dtype)


register(OpDef(
    Op.SCORE_MOD, "The scores through an explicit `score` expression of the score, positions, "
    "heads and the named per-head parameters and per-token inputs it reads (its operands).",
    '%18 : f32[B,4,T,P+T] = score_mod(%17, %3) {score=sub(var("score"), mul(index("slope", '
    'var("head")), sub(var("q_pos"), var("kv_pos"))))}',
    _modifier_operands("scores"), _unfused_infer, _score_mod,
    attrs=(Attr("score", Expression), UNFUSED_KV_HEADS), flops=per_element(4), arity=(1, -1)))

NORMALIZER = Attr("normalizer", Call, SOFTMAX, NORMALIZER_PARAMS)


def _normalize_infer(sig: Sig) -> tuple[Shape, str]:
    x = sig.shape("x")
    if sig.has("sinks"):
        require(len(x) == 4 and sig.shape("sinks") == (x[1],), f"sinks "
                f"{list(sig.shape('sinks'))} must be one per head of {list(x)}")
    return x, float_dtype(sig)


register(OpDef(
    Op.NORMALIZE, "Attention weights from masked scores by a normalizer other than softmax: "
    "softmax with sinks (a per-head logit in the denominator only), or sigmoid(score + bias).",
    '%20 : f32[B,4,T,P+T] = normalize(%19, %4) {normalizer=softmax(sinks="sinks")}',
    lambda attrs, n: ["x", *(["sinks"] if attrs["normalizer"].kw("sinks") else [])],
    _normalize_infer,
    lambda ctx, a, at: weights(at["normalizer"], a["x"], torch.tensor(True), a.get("sinks")
                               ).to(a["x"].dtype),
    attrs=(NORMALIZER,), flops=per_element(5), arity=(1, 2)))


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
    large = (exact + (
        torch.log(relative.float().clamp(min=1) / exact) / math.log(max_distance / exact)
        * (buckets - exact)).long()).clamp(max=buckets - 1)
    return out + torch.where(relative < exact, relative, large)


T5 = (Attr("bidirectional", bool), Attr("max_distance", int, at_least=1))


def t5_bias(table: torch.Tensor, q: torch.Tensor, k: torch.Tensor, at: Mapping[str, Any]
            ) -> torch.Tensor:
    """[H, T, L]: T5's bias, read from a [buckets, H] table at each query and key position
    (`at`: bidirectional, max_distance)."""
    q, k = q.cpu(), k.cpu()
    bucket = t5_buckets(k[None, :] - q[:, None], at["bidirectional"], table.shape[0],
                        at["max_distance"])
    return table.float()[bucket.to(table.device)].permute(2, 0, 1)


def _bias_infer(sig: Sig) -> tuple[Shape, str]:
    s, heads = sig.shape("scores"), sig.shapes[1][-1]
    require(len(s) == 4, f"takes scores [B, H, T, L], got {list(s)}")
    require(same_dim(heads, s[1]), f"table has {heads} heads, scores have {s[1]}")
    return s, float_dtype(sig)


def _alibi(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    s = a["scores"]
    values = EagerValues(*_positions_from(s), s.shape[1], s.shape[1], s,
                         head_params={"slopes": a["slopes"]})
    return evaluate(ALIBI, library_env(), values).to(s.dtype)


def _rel_bias(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    s = a["scores"]
    return (s.float() + t5_bias(a["table"], *_positions_from(s), at)[None]).to(s.dtype)


register(OpDef(Op.ALIBI, "Add the ALiBi bias −slope_h·(i − j) to scores.",
               "%18 : f32[B,4,T,P+T] = alibi(%17, %3)", operands("scores", "slopes"),
               _bias_infer, _alibi, flops=per_element(2), arity=(2, 2)))
register(OpDef(Op.REL_BIAS, "Add T5's bucketed relative-position bias (a [buckets, H] table) to "
               "scores.", "%18 : f32[B,4,T,P+T] = rel_bias(%17, %5) {bidirectional=false, "
               "max_distance=128}", operands("scores", "table"), _bias_infer, _rel_bias,
               attrs=T5, flops=per_element(2), arity=(2, 2)))
