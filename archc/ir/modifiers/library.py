"""The built-in attention variants as expressions of the modifier language, and the meaning of
the attention op's shorthand attributes (MASK_ATTRS, `bias`, `softcap`) in the same terms.

Each entry is the text a spec would write; its named constants (`window`, `chunk` …) are given
when it is used. The library's inputs have fixed names: per-head `slopes` (ALiBi), per-token
`padding` (1 = key present) and `doc` (a document id per packed token), the per-sequence scalar
`prefix_len`.

T5's relative bias is not here: it is a table lookup at a bucket computed from the distance,
``rel_table[bucket(kv_pos - q_pos), head]`` — the bucket is expressible (integer thresholds on
the distance), but the lookup needs a parameter indexed by a computed integer and the head,
which the language does not have; the attention op keeps it as an attribute.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from archc.ir.attrs import Attrs, Call
from archc.ir.modifiers.check import Kind, check, parse_field
from archc.ir.modifiers.language import (
    HEAD_INDEX,
    VARIABLES,
    Env,
    Expr,
    Type,
    leaves,
    substitute,
    var,
)
from archc.ir.modifiers.normalizers import SOFTMAX
from archc.ir.modifiers.syntax import ExprError

INPUTS = Env(head_params={"slopes": float}, token_inputs={"padding": int, "doc": int},
             scalars={"prefix_len": int})


@dataclass(frozen=True)
class Builtin:
    kind: Kind
    text: str
    doc: str


LIBRARY: dict[str, Builtin] = {
    "causal": Builtin("mask", "kv_pos <= q_pos", "a decoder: each query sees itself and the past"),
    "bidirectional": Builtin("mask", "true", "an encoder: every key"),
    "sliding_window": Builtin("mask", "kv_pos <= q_pos and q_pos - kv_pos < window",
                              "causal, the last `window` keys (Mistral, Gemma's local layers)"),
    "sliding_window_bidirectional": Builtin("mask", "abs(q_pos - kv_pos) < window",
                                            "keys within `window` either side"),
    "prefix_lm": Builtin("mask", "kv_pos <= q_pos or kv_pos < prefix_len",
                         "causal, and every query sees the prefix (UniLM, PaliGemma)"),
    "longformer": Builtin("mask", "kv_pos <= q_pos and (q_pos - kv_pos < window or "
                          "kv_pos < global_tokens)",
                          "a causal window, and the first `global_tokens` keys for every query"),
    "longformer_bidirectional": Builtin(
        "mask", "abs(q_pos - kv_pos) < window or kv_pos < global_tokens or "
        "q_pos < global_tokens", "a two-sided window; the global tokens see and are seen by "
        "all (Beltagy et al. 2020)"),
    "chunked": Builtin("mask", "kv_pos <= q_pos and q_pos // chunk == kv_pos // chunk",
                       "causal within chunks of `chunk` tokens (Llama 4's local layers)"),
    "dilated_window": Builtin(
        "mask", "kv_pos <= q_pos and q_pos - kv_pos < window * dilation and "
        "(q_pos - kv_pos) % dilation == 0",
        "every `dilation`-th of the last window·dilation keys (LongNet, Ding et al. 2023)"),
    "document": Builtin("mask", "kv_pos <= q_pos and doc[q_pos] == doc[kv_pos]",
                        "packed sequences: causal within each document"),
    "padding": Builtin("mask", "padding[kv_pos] != 0", "keys that are present"),
    "alibi": Builtin("score", "score - slopes[head] * (q_pos - kv_pos)",
                     "ALiBi (Press et al. 2021): a per-head linear penalty on distance"),
    "alibi_bloom": Builtin("score", "score + slopes[head] * kv_pos",
                           "BLOOM's ALiBi: differs by a constant per softmax row, so the same "
                           "attention"),
    "softcap": Builtin("score", "softcap * tanh(score / softcap)",
                       "Gemma 2's soft-cap: scores squashed into (−softcap, softcap)"),
}


def builtin(name: str, **constants: bool | int | float) -> Expr:
    """The library's expression `name` with its constants' values (`window=512`)."""
    b = LIBRARY[name]
    return parse_field(b.text, f"library.{name}", b.kind, library_env(constants))


def library_env(constants: Mapping[str, bool | int | float] | None = None) -> Env:
    return Env(INPUTS.head_params, INPUTS.token_inputs, INPUTS.scalars, dict(constants or {}))


@dataclass(frozen=True)
class Modifiers:
    """What an attention computes between q·kᵀ and the value sum: its score expression, its
    mask, its normalizer, and the names they use (every name of `env` is read by one of
    them)."""

    score: Expr = var("score")
    mask: Expr = True
    normalizer: Call = SOFTMAX
    env: Env = field(default_factory=Env)


def _mask_text(at: Mapping[str, Any]) -> str:
    """MASK_ATTRS as text, exactly as ``visible_at`` and ``visible_keys`` define them."""
    causal, window, g = at.get("causal"), at.get("window"), at.get("global_tokens")
    if window is not None:
        name = ("longformer" if g is not None else "sliding_window") + \
            ("" if causal else "_bidirectional")
        text = LIBRARY[name].text
    else:
        text = LIBRARY["causal" if causal else "bidirectional"].text
    if at.get("prefix") and text != "true":
        text = f"{text} or kv_pos < prefix_len"
    if at.get("padding"):
        pad = LIBRARY["padding"].text
        text = pad if text == "true" else f"({text}) and {pad}"
    return text


def env_of(*exprs: Expr) -> Env:
    """The names expressions read from the IR, typed as the attention op's operands hold them:
    ``NAME[head]`` and ``NAME[kv_head]`` a per-head f32 parameter, ``NAME[q_pos]`` and
    ``NAME[kv_pos]`` a per-token integer input, any other name not a variable a per-sequence
    integer scalar. A name read both ways is refused."""
    heads: dict[str, Type] = {}
    tokens: dict[str, Type] = {}
    scalars: dict[str, Type] = {}
    for e in exprs:
        for x in [] if e is None or isinstance(e, (bool, int, float)) else leaves(e):
            name = x.args[0]
            if x.fn == "index" and isinstance(x.args[1], Call) and x.args[1].args:
                (heads if x.args[1].args[0] in HEAD_INDEX else tokens)[name] = \
                    float if x.args[1].args[0] in HEAD_INDEX else int
            elif x.fn == "var" and name not in VARIABLES:
                scalars[name] = int
    for name in heads.keys() & tokens.keys() | (heads.keys() | tokens.keys()) & scalars.keys():
        raise ExprError("attention", None, f"{name} is read both per head and per token, or "
                        "both indexed and not", allowed="one use per name")
    return Env(heads, tokens, scalars)


def _merged(*envs: Env) -> Env:
    return Env({k: v for e in envs for k, v in e.head_params.items()},
               {k: v for e in envs for k, v in e.token_inputs.items()},
               {k: v for e in envs for k, v in e.scalars.items()})


@functools.lru_cache(maxsize=4096)
def _cached(at: Attrs) -> Modifiers:
    return _from_attrs(at)


def from_attention_attrs(at: Mapping[str, Any]) -> Modifiers:
    """The Modifiers of an attention (or mask) op's attributes: the shorthand MASK_ATTRS
    (causal, padding, prefix, window, global_tokens), `softcap` and an ALiBi `bias` as library
    expressions — the soft-cap on the raw scores, the bias after it — combined with the
    explicit ones:

    - ``score``: applied over the shorthand's score (its ``score`` is the scaled score after
      the soft-cap and ALiBi);
    - ``mask``: replaces the shorthand mask (causal, window, global_tokens, prefix); a padding
      mask (``padding``: an encoder's attention_mask) still applies, and-ed with it;
    - ``normalizer``: softmax() by default, softmax(sinks=NAME) with NAME a per-head
      parameter, or sigmoid(bias=b).

    A T5 bias is refused (see the module's note). Cached for the IR's own (hashable) Attrs."""
    if isinstance(at, Attrs):
        return _cached(at)
    return _from_attrs(at)


def _from_attrs(at: Mapping[str, Any]) -> Modifiers:
    bias, cap = at.get("bias"), at.get("softcap")
    if bias is not None and bias.fn != "alibi":
        raise ValueError(f"the {bias.fn} bias is not an expression of the modifier language")
    constants = {k: at[k] for k in ("window", "global_tokens", "softcap")
                 if at.get(k) is not None}
    env = library_env(constants)
    explicit_score, explicit_mask = at.get("score"), at.get("mask")
    own = env_of(explicit_score, explicit_mask)
    if explicit_mask is None:
        mask = parse_field(_mask_text(at), "attention.mask", "mask", env)
    else:
        check(explicit_mask, "attention.mask", "mask", own)
        mask = explicit_mask
        if at.get("padding"):
            pad = parse_field(LIBRARY["padding"].text, "attention.padding", "mask", env)
            mask = pad if mask is True else Call("and_", (mask, pad))
    score: Expr = var("score")
    if cap is not None:
        score = parse_field(LIBRARY["softcap"].text, "attention.softcap", "score", env)
    if bias is not None:
        score = substitute(parse_field(LIBRARY["alibi"].text, "attention.bias", "score", env),
                           {var("score"): score})
    if explicit_score is not None:
        check(explicit_score, "attention.score", "score", own)
        score = substitute(explicit_score, {var("score"): score})
    normalizer = at.get("normalizer") or SOFTMAX
    sinks = normalizer.kw("sinks")
    sink_env = Env({sinks: float}) if sinks is not None else Env()
    return Modifiers(score, mask, normalizer,
                     _merged(used_env(env, score, mask), own, sink_env))


def used_env(env: Env, *exprs: Expr) -> Env:
    """`env` cut to the names `exprs` read (constants are already values in them)."""
    used = {x.args[0] for e in exprs for x in leaves(e)}

    def keep(names: Mapping[str, Type]) -> dict[str, Type]:
        return {n: t for n, t in names.items() if n in used}
    return Env(keep(env.head_params), keep(env.token_inputs), keep(env.scalars))
