"""YAML (or a plain mapping) → a validated, resolved ``Spec``.

The walk is driven by the dataclass declarations in ``schema.py``: their type hints say what a
value may be, their metadata the bounds and when a field applies. Then derived fields are
resolved (``head_dim``, ``kv_heads``, ``d_ff``) and the cross-field rules checked. Every refusal
is one ``SpecError`` naming the file, the field path, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from archc.errors import SpecError
from archc.spec.schema import (
    FFN,
    AttentionBias,
    Mamba,
    Spec,
)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
EMBEDDING_SCALE_WORDS = ("sqrt_d_model",)
# Every size becomes a tensor dimension, and generated kernels index with int32 offsets.
MAX_WHOLE_NUMBER = 2**31 - 1


# ---- the generic walk ---------------------------------------------------------------------

def _fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _all_paths(cls: type, prefix: str = "") -> list[str]:
    """Every field path of a section, for 'did you mean' across sections."""
    hints = typing.get_type_hints(cls)
    paths = []
    for name in _fields(cls):
        path = f"{prefix}{name}"
        paths.append(path)
        inner = _dataclass_in(hints[name])
        if inner is not None:
            paths.extend(_all_paths(inner, path + "."))
    return paths


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass inside `tp` (itself, or `X | None`), if any."""
    if dataclasses.is_dataclass(tp):
        return tp
    if get_origin(tp) in (typing.Union, types.UnionType):
        for arg in get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def _show(value: Any) -> str:
    """A value as the YAML author wrote it: true/false, null, 'text', a number."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    text = str(value)
    if isinstance(value, int) and len(text) > 24:  # keep the message on one readable line
        return f"{text[:6]}… ({len(text.lstrip('-'))} digits)"
    return text


def _show_list(values: tuple[Any, ...] | list[Any]) -> str:
    return "[" + ", ".join(str(v) for v in values) + "]"


def _show_key(key: Any) -> str:
    """A mapping key for a field path: plain words as they are, anything else quoted."""
    if isinstance(key, str) and re.fullmatch(r"[\w\-]+", key):
        return key
    return repr(key) if isinstance(key, str) else _show(key)


def _suggest(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _unknown_key(key: str, cls: type, path: str) -> SpecError:
    """'unknown key', with a hint: the same key in another section first (a key put in the
    wrong place is the likelier slip), else a close spelling here, else one anywhere."""
    names = list(_fields(cls))
    elsewhere = [p for p in _all_paths(Spec) if p.rsplit(".", 1)[-1] == key]
    if elsewhere:
        shown = [f"'{p}'" for p in elsewhere[:3]]
        hint = f"; did you mean {' or '.join(shown)}?"
    else:
        hint = _suggest(key, names)
        if not hint:
            paths = {p.rsplit(".", 1)[-1]: p for p in reversed(_all_paths(Spec))}
            close = difflib.get_close_matches(key, list(paths), n=1, cutoff=0.6)
            hint = f"; did you mean '{paths[close[0]]}'?" if close else ""
    where = f"{path}.{key}" if path else key
    return SpecError(where, f"unknown key{hint}", allowed=", ".join(names))


def _coerce(tp: Any, value: Any, path: str, meta: Mapping[str, Any]) -> Any:
    """Check `value` against type hint `tp`; return the value to store."""
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        rest = [a for a in args if a is not type(None)]
        return _coerce(rest[0], value, path, meta)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if value is None:
        raise SpecError(path, "is null but a value is required", allowed=_describe(tp, meta))
    if origin is Literal:
        choices = [str(c) for c in get_args(tp)]
        if not isinstance(value, str) or value not in choices:
            hint = _suggest(str(value), choices) if isinstance(value, str) else ""
            raise SpecError(path, f"{_show(value)} is not a known choice{hint}",
                            allowed=", ".join(choices))
        return value
    if origin is tuple:
        if not isinstance(value, list) or not value:
            problem = "is an empty list" if value == [] else f"{_show(value)} is not a list"
            raise SpecError(path, problem, allowed=_describe(tp, meta))
        item = get_args(tp)[0]
        return tuple(_coerce(item, v, f"{path}[{i}]", {}) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"{_show(value)} is not true/false", allowed="true, false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"{_show(value)} is not a whole number",
                            allowed=_describe(tp, meta))
        _check_bounds(value, path, meta)
        if value > MAX_WHOLE_NUMBER:
            raise SpecError(path, f"{_show(value)} is too large", allowed=f"a whole number from "
                            f"{meta.get('min', 0)} to {MAX_WHOLE_NUMBER} (2³¹ − 1)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"{_show(value)} is not a number", allowed=_describe(tp, meta))
        try:
            value = float(value)
        except OverflowError:  # a whole number too large for a float
            raise SpecError(path, f"{_show(value)} is too large",
                            allowed=_describe(tp, meta)) from None
        if not math.isfinite(value):
            raise SpecError(path, f"{value} is not finite", allowed=_describe(tp, meta))
        _check_bounds(value, path, meta)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, f"{_show(value)} is not text", allowed="a string")
        return value
    raise TypeError(f"spec schema: unhandled type {tp!r} at {path}")  # a bug in schema.py


def _describe(tp: Any, meta: Mapping[str, Any]) -> str:
    if get_origin(tp) is tuple:
        item = get_args(tp)[0]
        if get_origin(item) is Literal:
            return "a non-empty list of " + ", ".join(map(str, get_args(item)))
        return "a non-empty list"
    lo, hi = meta.get("min"), meta.get("max")
    kind = {int: "a whole number", float: "a number"}.get(tp, "a value")
    if lo is not None and hi is not None:
        return f"{kind} from {lo} to {hi}"
    if lo is not None:
        strict = " > 0" if lo == 0 and tp is float else f" ≥ {lo}"
        return f"{kind}{strict}"
    return kind


def _check_bounds(value: float, path: str, meta: Mapping[str, Any]) -> None:
    lo, hi = meta.get("min"), meta.get("max")
    # A float bound of 0.0 means strictly positive: scales, caps and eps of 0 make no model.
    too_low = lo is not None and (value <= lo if (lo == 0 and isinstance(lo, float)) else
                                  value < lo)
    if too_low or (hi is not None and value > hi):
        raise SpecError(path, f"{value} is out of range", allowed=_describe(
            float if isinstance(lo, float) else int, meta))


def _build(cls: type, data: Any, path: str) -> Any:
    """Build section `cls` from mapping `data`; derived fields missing from YAML stay None."""
    if cls is AttentionBias and isinstance(data, bool):
        return AttentionBias(q=data, k=data, v=data, o=data)
    if not isinstance(data, Mapping):
        either = "true, false, or a mapping with " if cls is AttentionBias else "a mapping with "
        problem = "is empty" if data is None and not path else f"{_show(data)} is not a mapping"
        raise SpecError(path, problem, allowed=either + "keys " + ", ".join(_fields(cls)))
    hints = typing.get_type_hints(cls)
    fields = _fields(cls)
    for key in data:
        if not isinstance(key, str) or key not in fields:
            raise _unknown_key(_show_key(key), cls, path)
    kind = data.get("kind", fields["kind"].default if "kind" in fields else None)
    values: dict[str, Any] = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name not in data:
            if dataclasses.is_dataclass(f.default_factory):  # a section: its own defaults
                values[name] = _build(f.default_factory, {}, where)
                continue
            if f.default is None and f.default_factory is dataclasses.MISSING and \
                    not f.metadata.get("derived") and not f.metadata.get("required_when") \
                    and type(None) not in get_args(hints[name]):
                raise SpecError(where, "is missing", allowed=f.metadata.get("doc"))
            continue
        only = f.metadata.get("only")
        raw = data[name]
        if only and kind not in only:
            raise SpecError(where, f"{_show(raw)} is set, but it applies only when "
                            f"{path + '.' if path else ''}kind is {' or '.join(only)} "
                            f"(kind is {kind!r})", allowed="remove it")
        if cls.__name__ == "Embedding" and name == "scale" and isinstance(raw, str):
            if raw not in EMBEDDING_SCALE_WORDS:
                raise SpecError(where, f"{raw!r} is not a number or a known word",
                                allowed="a number > 0, sqrt_d_model")
            values[name] = raw  # resolved once d_model is known
            continue
        values[name] = _coerce(hints[name], raw, where, f.metadata)
    return cls(**values)


# ---- derived fields and cross-field rules --------------------------------------------------

def gated_d_ff(d_model: int, multiple_of: int, multiplier: float) -> int:
    """The gated-FFN sizing rule: 2/3 of the 4·d_model MLP (parameter-matched), times an
    optional multiplier, rounded up to a multiple (Llama's rule: 4096 → 11008 at 256)."""
    hidden = int(2 * 4 * d_model / 3)
    hidden = int(multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def _resolve(spec: Spec) -> Spec:
    att, ffn, mixer = spec.attention, spec.ffn, spec.mixer
    replace = dataclasses.replace
    if att.heads is None and spec.attends:
        raise SpecError("attention.heads", f"is missing, and {_mixers_text(spec)} attends",
                        allowed="query heads: a whole number ≥ 1")
    if att.heads is not None and att.head_dim is None:
        if spec.d_model % att.heads:
            raise SpecError("attention.heads", f"{att.heads} does not divide d_model "
                            f"({spec.d_model}) and attention.head_dim is not given",
                            allowed=f"a divisor of {spec.d_model}, or set attention.head_dim")
        att = replace(att, head_dim=spec.d_model // att.heads)
    if att.heads is not None and att.kv_heads is None:
        att = replace(att, kv_heads=att.heads)
    if "mamba" in spec.all_mixers:
        mamba = mixer.mamba or Mamba()
        if mamba.dt_rank is None:
            mamba = replace(mamba, dt_rank=mamba_dt_rank(spec.d_model))
        mixer = replace(mixer, mamba=mamba)
    if ffn.d_ff is None and ffn.kind != "none":
        if ffn.gated:
            d_ff = gated_d_ff(spec.d_model, ffn.multiple_of, ffn.multiplier)
        else:
            d_ff = 4 * spec.d_model
        ffn = replace(ffn, d_ff=d_ff)
    emb = spec.embedding
    if isinstance(emb.scale, str):
        emb = replace(emb, scale=math.sqrt(spec.d_model))
    dec = spec.decoder_layers
    if spec.family == "encoder-decoder" and dec is None:
        dec = spec.layers
    return replace(spec, attention=att, ffn=ffn, embedding=emb, decoder_layers=dec,
                   mixer=mixer)


def mamba_dt_rank(d_model: int) -> int:
    """Mamba's default rank of the Δ projection: ⌈d_model / 16⌉ (Gu & Dao 2023)."""
    return -(-d_model // 16)


def _mixers_text(spec: Spec) -> str:
    """Where the spec says which mixers its layers have, as the author wrote it."""
    if spec.mixer.pattern is not None:
        return f"mixer.pattern {_show_list(spec.mixer.pattern)}"
    return f"mixer.kind {spec.mixer.kind!r}"


# Attention fields that act only inside softmax attention (scores, masks, windows), as
# (field, value that means "not set").
SOFTMAX_ONLY = (("mask", "causal"), ("window", None), ("pattern", None), ("softcap", None),
                ("scale", None), ("qk_norm", False))


def _check_mixers(spec: Spec) -> None:
    """Rules on the per-layer mixers and on what applies to the layers they make."""
    mixer, att = spec.mixer, spec.attention
    if mixer.pattern is not None:
        pattern = _show_list(mixer.pattern)
        if mixer.kind != "attention":
            raise SpecError("mixer.kind", f"{mixer.kind!r} is set beside mixer.pattern "
                            f"{pattern}", allowed="one of them: kind for every layer, or "
                            "pattern per layer")
        layers = max(spec.layers, spec.decoder_layers or 0)
        if len(mixer.pattern) > layers:
            raise SpecError("mixer.pattern", f"{pattern} has {len(mixer.pattern)} entries for "
                            f"{layers} layers", allowed=f"at most {layers} entries")
    where = "mixer.pattern" if mixer.pattern is not None else "mixer.kind"
    mixers = set(spec.all_mixers)
    recurrent = sorted(mixers - {"attention"})
    if recurrent and spec.family != "decoder":
        raise SpecError(where, f"{_mixers_text(spec).split(' ', 1)[1]} in an {spec.family}: "
                        f"{' and '.join(recurrent)} layers are causal recurrences",
                        allowed="attention, or family: decoder")
    if mixer.mamba is not None and "mamba" not in mixers:
        raise SpecError("mixer.mamba", f"is set, but no layer is mamba ({_mixers_text(spec)})",
                        allowed="remove it, or give some layers the mamba mixer")
    if not spec.attends:
        given = [(n, v) for n, v in (("heads", att.heads), ("kv_heads", att.kv_heads),
                                     ("head_dim", att.head_dim)) if v is not None]
        if att.bias.any:
            given.append(("bias", "a bias"))
        for name, value in given:
            raise SpecError(f"attention.{name}", f"{_show(value)} is set, but no layer attends "
                            f"({_mixers_text(spec)})", allowed="remove it")
    if not spec.softmax_attends:
        for name, unset in SOFTMAX_ONLY:
            value = getattr(att, name)
            if value != unset:
                shown = _show_list(value) if isinstance(value, tuple) else _show(value)
                raise SpecError(f"attention.{name}", f"{shown} is set, but it acts in softmax "
                                f"attention and no layer has it ({_mixers_text(spec)})",
                                allowed="remove it")
        if spec.position.kind in ("rope", "alibi", "relative"):
            raise SpecError("position.kind", f"{spec.position.kind!r} acts inside softmax "
                            f"attention, and no layer has it ({_mixers_text(spec)})",
                            allowed="none, learned, sinusoidal")


def _check(spec: Spec) -> None:
    """Cross-field rules. Single-field types and ranges were checked by the walk."""
    att, ffn, pos, norm = spec.attention, spec.ffn, spec.position, spec.norm
    if not NAME_RE.match(spec.name):
        raise SpecError("name", f"{spec.name!r} is not a valid model name",
                        allowed="1-64 letters, digits, '.', '_', '-', starting alphanumeric")
    _check_mixers(spec)
    if spec.attends and att.heads % att.kv_heads:
        divisors = [d for d in range(1, att.heads + 1) if att.heads % d == 0]
        raise SpecError("attention.kv_heads", f"{att.kv_heads} does not divide attention.heads "
                        f"({att.heads})", allowed="one of " + ", ".join(map(str, divisors)))
    if att.pattern is not None:
        pattern = _show_list(att.pattern)
        if "local" in att.pattern and att.window is None:
            raise SpecError("attention.pattern", f"{pattern} has local layers but "
                            "attention.window is not set",
                            allowed="set attention.window, or only global layers")
        if "local" not in att.pattern and att.window is not None:
            raise SpecError("attention.window", f"{att.window} is set but attention.pattern "
                            f"{pattern} has no local layer to use it",
                            allowed="remove it, or put local layers in attention.pattern")
        layers = max(spec.layers, spec.decoder_layers or 0)
        if len(att.pattern) > layers:
            raise SpecError("attention.pattern", f"{pattern} has {len(att.pattern)} entries for "
                            f"{layers} layers", allowed=f"at most {layers} entries")
    if att.global_tokens is not None:
        g = att.global_tokens
        if att.window is None:
            raise SpecError("attention.global_tokens", f"{g} is set but attention.window is not: "
                            "global tokens are seen beside a sliding window",
                            allowed="set attention.window, or remove it")
        if att.mask == "prefix":
            raise SpecError("attention.global_tokens", f"{g} with attention.mask 'prefix', whose "
                            "prompt every query sees already", allowed="remove it, or mask: causal")
        if g > spec.max_seq_len:
            raise SpecError("attention.global_tokens", f"{g} is more than max_seq_len "
                            f"({spec.max_seq_len})", allowed=f"1 to {spec.max_seq_len}")
    if spec.family == "encoder" and att.mask != "bidirectional":
        raise SpecError("attention.mask", f"{att.mask!r} in an encoder: encoders see the "
                        "whole input", allowed="bidirectional")
    if spec.family != "encoder" and att.mask == "bidirectional":
        raise SpecError("attention.mask", f"'bidirectional' in a {spec.family}: the decoder "
                        "must not see future tokens", allowed="causal, prefix")
    if spec.family == "encoder-decoder" and att.mask == "prefix":
        raise SpecError("attention.mask", "'prefix' in an encoder-decoder: the encoder already "
                        "sees the whole prompt", allowed="causal")
    if spec.decoder_layers is not None and spec.family != "encoder-decoder":
        raise SpecError("decoder_layers", f"{spec.decoder_layers} is set for a {spec.family}",
                        allowed="only with family: encoder-decoder")
    if spec.family == "encoder" and spec.embedding.tied is False:
        raise SpecError("embedding.tied", "false for an encoder, which has no output head",
                        allowed="leave unset")
    if spec.family == "encoder":
        for name in ("softcap", "bias", "scale"):
            value = getattr(spec.output, name)
            if value:
                raise SpecError(f"output.{name}", f"{_show(value)} is set for an encoder, "
                                "which has no output head: it returns hidden states",
                                allowed="remove it; an encoder takes only output.final_norm")
    if spec.family == "decoder" and spec.embedding.token_types:
        raise SpecError("embedding.token_types", f"{spec.embedding.token_types} for a decoder, "
                        "which takes no token types", allowed="0, or family: encoder")
    if pos.kind == "rope":
        if att.head_dim % 2:
            raise SpecError("attention.head_dim", f"{att.head_dim} is odd but RoPE rotates "
                            "pairs of dims", allowed="an even number")
        rot = spec.rotary_dim
        if rot < 2 or rot % 2:
            raise SpecError("position.fraction", f"{pos.fraction} of head_dim {att.head_dim} "
                            f"gives {rot} rotary dims", allowed="a fraction giving an even "
                            "number ≥ 2 of dims")
        sc = pos.scaling
        if sc is not None and sc.kind in ("yarn", "llama3", "dynamic") and \
                sc.original_max_seq_len is None:
            raise SpecError("position.scaling.original_max_seq_len",
                            f"is missing for {sc.kind} scaling", allowed="a whole number ≥ 1")
        if sc is not None and sc.kind == "dynamic" and rot < 4:
            # θ'_j = θ_j · s^(−2j/(d − 2)): no frequency to rescale with d = 2
            raise SpecError("position.scaling.kind", f"'dynamic' with {rot} rotary dims: "
                            "dynamic NTK rescales the base by s^(d/(d−2))",
                            allowed="4 or more rotary dims, or another scaling kind")
        if sc is not None and sc.kind == "llama3" and sc.high_freq_factor <= sc.low_freq_factor:
            raise SpecError("position.scaling.high_freq_factor",
                            f"{sc.high_freq_factor} is not above low_freq_factor "
                            f"({sc.low_freq_factor})", allowed="a number > low_freq_factor")
    if pos.kind == "sinusoidal" and spec.d_model % 2:
        raise SpecError("d_model", f"{spec.d_model} is odd but sinusoidal positions come in "
                        "sin/cos pairs", allowed="an even number")
    if pos.kind == "relative" and pos.max_distance < pos.buckets:
        raise SpecError("position.max_distance", f"{pos.max_distance} is below "
                        f"position.buckets ({pos.buckets})",
                        allowed=f"a whole number ≥ {pos.buckets}")
    if spec.block.parallel and norm.placement != "pre":
        raise SpecError("block.parallel", f"true, but a parallel block needs pre-norm "
                        f"(norm.placement is {norm.placement!r})",
                        allowed="norm.placement: pre, or block.parallel: false")
    if not spec.block.parallel and not spec.block.shared_norm:
        raise SpecError("block.shared_norm", "false in a serial block, which always has one "
                        "norm per sublayer", allowed="set block.parallel: true, or remove it")
    if ffn.kind == "moe":
        if ffn.moe is None:
            raise SpecError("ffn.moe", "is missing for kind moe",
                            allowed="a mapping with experts, top_k")
        if ffn.moe.top_k > ffn.moe.experts:
            raise SpecError("ffn.moe.top_k", f"{ffn.moe.top_k} is more than ffn.moe.experts "
                            f"({ffn.moe.experts})", allowed=f"1 to {ffn.moe.experts}")
        if ffn.bias:
            raise SpecError("ffn.bias", "true, but MoE experts have no biases",
                            allowed="false, or a dense ffn.kind")
        if ffn.pattern is not None:
            pattern = _show_list(ffn.pattern)
            if "moe" not in ffn.pattern:
                raise SpecError("ffn.pattern", f"{pattern} has no moe layer",
                                allowed=f"a pattern with moe layers, or ffn.kind: "
                                f"{ffn.moe.expert}")
            layers = max(spec.layers, spec.decoder_layers or 0)
            if len(ffn.pattern) > layers:
                raise SpecError("ffn.pattern", f"{pattern} has {len(ffn.pattern)} entries for "
                                f"{layers} layers", allowed=f"at most {layers} entries")
        if ffn.moe.expert != "mlp" and ffn.activation != FFN().activation:
            raise SpecError("ffn.activation", f"{ffn.activation!r}, but {ffn.moe.expert} "
                            "experts take their activation from their kind",
                            allowed="remove it, or ffn.moe.expert: mlp")


def _check_given(spec: Spec) -> None:
    """Rules on what the spec gave before derived fields are filled in."""
    ffn = spec.ffn
    if ffn.kind == "none":
        for name, value, unset in (("d_ff", ffn.d_ff, None), ("bias", ffn.bias, False)):
            if value != unset:
                raise SpecError(f"ffn.{name}", f"{_show(value)} is set, but ffn.kind is 'none'",
                                allowed="remove it, or choose an ffn.kind")
        if spec.block.parallel:
            raise SpecError("block.parallel", "true, but ffn.kind is 'none': a parallel block "
                            "runs the mixer and an FFN side by side",
                            allowed="false, or choose an ffn.kind")
    rule = {"ffn.multiple_of": (ffn.multiple_of, 1), "ffn.multiplier": (ffn.multiplier, 1.0)}
    for path, (value, default) in rule.items():
        if value != default and not ffn.gated:
            raise SpecError(path, f"{value} is set, but the gated sizing rule it tunes does not "
                            f"apply to a non-gated {ffn.moe.expert if ffn.moe else ffn.kind} FFN",
                            allowed="remove it, or set ffn.d_ff")
    if ffn.d_ff is not None and ffn.gated and (ffn.multiple_of, ffn.multiplier) != (1, 1.0):
        rule_d_ff = gated_d_ff(spec.d_model, ffn.multiple_of, ffn.multiplier)
        if ffn.d_ff != rule_d_ff:
            raise SpecError("ffn.d_ff", f"{ffn.d_ff} disagrees with the sizing rule of "
                            f"ffn.multiple_of ({ffn.multiple_of}) and ffn.multiplier "
                            f"({ffn.multiplier}), which gives {rule_d_ff}",
                            allowed=f"{rule_d_ff}, or remove ffn.multiple_of and ffn.multiplier")


def from_dict(data: Any, source: str | None = None) -> Spec:
    """Validate and resolve a spec given as a mapping (parsed YAML)."""
    try:
        spec = _build(Spec, data, "")
        _check_given(spec)
        spec = _resolve(spec)
        _check(spec)
    except SpecError as err:
        raise (err.with_source(source) if source else err) from None
    return spec


class _SpecYAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain data only, never Python objects) that reads ``1e-5`` as a
    number, as YAML 1.2 does (YAML 1.1 wants ``1.0e-5`` and would read ``1e-5`` as text)."""


_SpecYAMLLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _refuse_repeated_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    """A key given twice in one mapping is refused with its field path; plain YAML would keep
    the last one silently."""
    if id(node) in seen:  # an alias already walked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            where = f"{path}.{key}" if path else str(key)
            if key is not None and key in lines:
                raise SpecError(where, f"is given twice (lines {lines[key]} and "
                                f"{key_node.start_mark.line + 1})", allowed="each key once")
            if key is not None:
                lines[key] = key_node.start_mark.line + 1
            _refuse_repeated_keys(value_node, where, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _refuse_repeated_keys(item, f"{path}[{i}]", seen)


def _parse_yaml(text: str) -> Any:
    """The document in `text` as plain data, with every mapping's keys distinct."""
    loader = _SpecYAMLLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_repeated_keys(node, "", set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_yaml(path: str | Path) -> Spec:
    """Read a spec file with a YAML safe loader (plain data; never a full loader)."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise SpecError("", f"cannot read the file: {err.strerror}", source=source) from None
    except UnicodeDecodeError:
        raise SpecError("", "is not UTF-8 text", source=source) from None
    try:
        data = _parse_yaml(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "malformed"
        raise SpecError("", f"is not valid YAML{at}: {problem}", source=source) from None
    except SpecError as err:
        raise err.with_source(source) from None
    return from_dict(data, source=source)


def to_dict(spec: Spec, *, full: bool = False) -> dict[str, Any]:
    """The spec as plain data for YAML. Without `full`, a field is left out when it holds its
    default, or, for a derived field, what the loader would derive."""
    att, ffn = spec.attention, spec.ffn
    derived = {
        "attention.head_dim": spec.d_model // att.heads if att.heads is not None and
        spec.d_model % att.heads == 0 else None,
        "attention.kv_heads": att.heads,
        "ffn.d_ff": None if ffn.kind == "none" else
        gated_d_ff(spec.d_model, ffn.multiple_of, ffn.multiplier) if ffn.gated
        else 4 * spec.d_model,
        "decoder_layers": spec.layers if spec.family == "encoder-decoder" else None,
        "mixer.mamba.dt_rank": mamba_dt_rank(spec.d_model),
    }

    def section(obj: Any, path: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            where = f"{path}{f.name}"
            value = getattr(obj, f.name)
            if value is None and type(None) not in get_args(hints[f.name]):
                continue  # a field the spec does not have (attention.heads of a pure Mamba)
            only = f.metadata.get("only")
            if only and getattr(obj, "kind", None) not in only:
                continue  # the loader refuses a field that does not apply to its section's kind
            if dataclasses.is_dataclass(value):
                inner = section(value, where + ".")
                if inner or full or f.default_factory is dataclasses.MISSING:
                    out[f.name] = inner
                continue
            default = derived.get(where, f.default)
            if not full and value == default and where != "name":
                continue
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    return section(spec, "")


def dump_yaml(spec: Spec, *, full: bool = False) -> str:
    return yaml.safe_dump(to_dict(spec, full=full), sort_keys=False, default_flow_style=None)
