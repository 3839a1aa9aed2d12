"""A spec's attention expressions: its named per-head parameters and per-token inputs as
written, the typed environment they make, and the checks of `attention.score`, `attention.mask`
(where it is an expression) and `attention.normalizer`. Every refusal is one SpecError line
naming the field — for an expression, with the column and what is allowed (``parse_field``)."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from typing import Any

from archc.errors import SpecError
from archc.ir.modifiers import Env, Expr, check_int32, leaves, parse_field
from archc.ir.modifiers.language import CALLS, KEYWORDS, MAX_FLOAT, MAX_INT, VARIABLES
from archc.spec.schema import MASK_KINDS, HeadParam, Normalizer, Spec, TokenInput

# names a graph or an attention op already gives a meaning to
RESERVED = ("q", "k", "v", "tokens", "positions", "attention_mask", "padding", "prefix_len",
            "token_types", "encoder_hidden", "encoder_mask", "block_table", "rel_table")
WEIGHT_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
        raise SpecError(where, "is not a name", allowed="letters, digits and _, starting with a "
                        "letter")
    if name in VARIABLES or name in CALLS or name in KEYWORDS or name in RESERVED:
        raise SpecError(where, f"{name!r} is taken", allowed="a name other than " + ", ".join(
            (*VARIABLES, *KEYWORDS, *CALLS, *RESERVED)))
    return name


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
        abs(v) <= MAX_FLOAT


def head_params(data: Any, path: str) -> tuple[HeadParam, ...]:
    """`attention.params` as written: NAME: a checkpoint tensor name, a number, or a list."""
    allowed = ("NAME: a checkpoint tensor name ({layer}: the layer's index), a number for "
               "every head, or a list of one number per head")
    if not isinstance(data, Mapping) or not data:
        raise SpecError(path, "is an empty mapping" if data == {} else "is not a mapping",
                        allowed=allowed)
    out = []
    for key, v in data.items():
        where = f"{path}.{key}"
        name = _name(key, where)
        if isinstance(v, str) and WEIGHT_RE.match(v.replace("{layer}", "0")):
            out.append(HeadParam(name, weight=v))
        elif _number(v):
            out.append(HeadParam(name, values=(float(v),)))
        elif isinstance(v, list) and v and all(_number(x) for x in v):
            out.append(HeadParam(name, values=tuple(float(x) for x in v)))
        else:
            raise SpecError(where, f"{v!r} is not a tensor name, a number or a list of numbers",
                            allowed=allowed)
    return tuple(out)


def token_inputs(data: Any, path: str) -> tuple[TokenInput, ...]:
    """`attention.inputs` as written: NAME: its default (a whole number), or null."""
    allowed = "NAME: a whole number (its value where a call gives none), or null (required)"
    if not isinstance(data, Mapping) or not data:
        raise SpecError(path, "is an empty mapping" if data == {} else "is not a mapping",
                        allowed=allowed)
    out = []
    for key, v in data.items():
        where = f"{path}.{key}"
        name = _name(key, where)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or abs(v) > MAX_INT):
            raise SpecError(where, f"{v!r} is not a whole number or null", allowed=allowed)
        out.append(TokenInput(name, v))
    return tuple(out)


def expression_env(spec: Spec) -> Env:
    """What a layer's expressions may name beyond the variables."""
    att = spec.attention
    return Env(head_params={p.name: float for p in att.params or ()},
               token_inputs={i.name: int for i in att.inputs or ()})


def has_expressions(spec: Spec) -> bool:
    att = spec.attention
    return att.score is not None or att.mask not in MASK_KINDS or \
        att.normalizer != Normalizer() or bool(att.params) or bool(att.inputs)


def _mask_word(text: str) -> None:
    """A mask written as one unknown word is a misspelt kind, not an expression."""
    if text.isidentifier() and text not in ("true", "false"):
        close = difflib.get_close_matches(text, MASK_KINDS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise SpecError("attention.mask", f"{text!r} is not a known choice{hint}",
                        allowed=", ".join(MASK_KINDS) + ", or a bool expression of q_pos, "
                        "kv_pos, head, kv_head, params and inputs")


def expressions(spec: Spec) -> tuple[Expr | None, Expr | None]:
    """A layer's `score` and `mask` expressions as trees (None: not given)."""
    att, env = spec.attention, expression_env(spec)
    score = None if att.score is None else \
        parse_field(att.score, "attention.score", "score", env)
    mask = None if att.mask in MASK_KINDS else \
        parse_field(att.mask, "attention.mask", "mask", env)
    return score, mask


def head_count(spec: Spec, name: str) -> int:
    """How many values per-head parameter `name` holds: one per query head where an
    expression reads it at `head` (or it is the sinks), else one per KV head."""
    att = spec.attention
    at_head = name == att.normalizer.sinks or any(
        x.fn == "index" and x.args[0] == name and x.args[1].args[0] == "head"
        for e in expressions(spec) if e is not None and not isinstance(e, bool)
        for x in leaves(e))
    return att.heads if at_head else att.kv_heads


def check_expressions(spec: Spec) -> None:
    """The rules of one kind of layer's expressions (a uniform spec, as ``Spec.layer``)."""
    if not has_expressions(spec):
        return
    att, env = spec.attention, expression_env(spec)
    if spec.family == "encoder-decoder":
        raise SpecError("attention", "has expressions (score, mask, normalizer, params or "
                        "inputs) in an encoder-decoder, whose two stacks mask differently",
                        allowed="family decoder or encoder")
    if spec.position.kind == "alibi" and "slopes" in env.head_params:
        raise SpecError("attention.params.slopes", "is the name of position.kind alibi's "
                        "slopes", allowed="another name")
    if att.mask not in MASK_KINDS:
        _mask_word(att.mask)
    score, mask = expressions(spec)
    for e, field in ((score, "attention.score"), (mask, "attention.mask")):
        if e is not None:
            check_int32(e, field, env, spec.max_seq_len)
    if mask is not None:
        for name in ("window", "global_tokens"):
            if getattr(att, name) is not None:
                raise SpecError(f"attention.{name}", "is set, but attention.mask is an "
                                "expression, which replaces it", allowed="remove it; write it "
                                "in the expression (q_pos - kv_pos < 512)")
    sinks = att.normalizer.sinks
    if sinks is not None and sinks not in env.head_params:
        raise SpecError("attention.normalizer.sinks", f"{sinks!r} is not in attention.params",
                        allowed=", ".join(env.head_params) or "declare it in attention.params")
    read = {x.args[0] for e in (score, mask) if e is not None and not isinstance(e, bool)
            for x in leaves(e)} | {sinks}
    for p in att.params or ():
        if p.name not in read:
            raise SpecError(f"attention.params.{p.name}", "is declared, but no expression "
                            "reads it", allowed="remove it, or read it as "
                            f"{p.name}[head] or {p.name}[kv_head]")
        want = head_count(spec, p.name)
        if p.values is not None and len(p.values) not in (1, want):
            raise SpecError(f"attention.params.{p.name}", f"has {len(p.values)} values",
                            allowed=f"one number, or a list of {want} (one per head)")
    for i in att.inputs or ():
        if i.name not in read:
            raise SpecError(f"attention.inputs.{i.name}", "is declared, but no expression "
                            "reads it", allowed=f"remove it, or read it as {i.name}[q_pos] or "
                            f"{i.name}[kv_pos]")
