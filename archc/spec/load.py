"""YAML (a file, a zoo name from ``specs/``, or a plain mapping) → a validated, resolved ``Spec``:
a walk driven by the declarations in ``schema.py``, then derived fields filled in and the
cross-field rules checked. Every refusal is one ``SpecError`` naming the file, the field path, the
value and what is allowed."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
import os
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from archc.errors import SpecError
from archc.spec.expressions import check_expressions, head_params, token_inputs
from archc.spec.schema import (
    HEADLESS_MIXERS,
    LAYER_SECTIONS,
    MASK_KINDS,
    AttentionBias,
    FFNLayerKind,
    HeadParam,
    LayerKind,
    LayerType,
    Mamba,
    Normalizer,
    Spec,
    TokenInput,
)

ZOO_DIR = Path(__file__).resolve().parents[2] / "specs"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
TYPE_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_+\-]{0,63}$")
# Every size becomes a tensor dimension, and generated kernels index with int32 offsets.
MAX_WHOLE_NUMBER = 2**31 - 1
# The bounds a number may declare, as a refusal writes them, and the test the value must pass.
BOUNDS = {"min": ("≥", operator.ge), "above": (">", operator.gt), "max": ("≤", operator.le)}
# The YAML values each scalar type takes (never a bool for a number), what a refusal calls a
# wrong value's type, and what it allows.
SCALARS: dict[type, tuple[tuple[type, ...], str, str]] = {
    bool: ((bool,), "true/false", "true, false"), str: ((str,), "text", "a string"),
    int: ((int,), "a whole number", "a whole number"),
    float: ((int, float), "a number", "a number"),
}


# ---- reading the declarations (here, in to_dict and in the reference) -----------------------

def typed_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def section_type(tp: Any) -> type | None:
    """The section a field holds (`tp` itself, or X of `X | None`), if it holds one."""
    return next((t for t in (tp, *get_args(tp)) if dataclasses.is_dataclass(t)), None)


def sections(cls: type = Spec, prefix: str = "") -> list[tuple[str, type]]:
    """Every section with its path prefix, depth first: ('', Spec), ('mixer.', Mixer), …"""
    out = [(prefix, cls)]
    for f, tp in typed_fields(cls):
        if (inner := section_type(tp)) is not None:
            out += sections(inner, f"{prefix}{f.name}.")
    return out


def required(f: dataclasses.Field, tp: Any) -> bool:
    """A field the spec must give (when it applies, for an `only` field)."""
    return f.default is None and type(None) not in get_args(tp) and \
        not f.metadata.keys() & {"derived", "required_when"}


# Every field path, for "did you mean" across sections.
PATHS = [prefix + f.name for prefix, cls in sections() for f in dataclasses.fields(cls)]


# ---- the generic walk ---------------------------------------------------------------------

def _show(value: Any) -> str:
    """A value as the YAML author wrote it: true/false, null, 'text', a number, [a, b]."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (Mapping, list)):
        return "a mapping" if isinstance(value, Mapping) else "a list"
    if isinstance(value, tuple):  # a pattern as loaded
        return "[" + ", ".join(map(str, value)) + "]"
    text = str(value)
    if isinstance(value, int) and len(text) > 24:  # keep the message on one readable line
        return f"{text[:6]}… ({len(text.lstrip('-'))} digits)"
    return text


def _did_you_mean(candidates: list[str]) -> str:
    return f"; did you mean {' or '.join(map(repr, candidates))}?" if candidates else ""


def _unknown_key(key: Any, names: list[str], path: str) -> SpecError:
    """'unknown key', with a hint: the same key in another section first (a key put in the
    wrong place is the likelier slip), else a close spelling here, else one anywhere."""
    shown = key if isinstance(key, str) and re.fullmatch(r"[\w\-]+", key) else _show(key)
    hint = [p for p in PATHS if p.rsplit(".", 1)[-1] == key][:3]
    if not hint:
        anywhere = {p.rsplit(".", 1)[-1]: p for p in reversed(PATHS)}
        hint = difflib.get_close_matches(shown, names, n=1) or [
            anywhere[c] for c in difflib.get_close_matches(shown, list(anywhere), n=1)]
    return SpecError(f"{path}.{shown}" if path else shown, f"unknown key{_did_you_mean(hint)}",
                     allowed=", ".join(names))


def describe(tp: Any, meta: Mapping[str, Any]) -> str:
    """What a field allows, for refusals and the reference: 'a whole number ≥ 1', 'a number > 0,
    ≤ 1.0', 'a non-empty list of a, b', 'a string, or null'."""
    if type(None) in get_args(tp):
        return describe(get_args(tp)[0], meta) + ", or null"
    if get_origin(tp) is tuple and get_args(tp)[0] is LayerType:
        return "a mapping of type names to the fields each sets in " + ", ".join(LAYER_SECTIONS)
    if get_origin(tp) is tuple and get_args(tp)[0] is HeadParam:
        return "a mapping of names to a tensor name, a number or a list of numbers"
    if get_origin(tp) is tuple and get_args(tp)[0] is TokenInput:
        return "a mapping of names to a whole number or null"
    if get_origin(tp) is tuple:
        item = get_args(tp)[0]
        return "a non-empty list of " + (", ".join(get_args(item)) if get_origin(item) is Literal
                                         else "numbers" if item is float else "layer type names")
    if get_origin(tp) is Literal:
        return ", ".join(get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    bounds = ", ".join(f"{sign} {meta[key]}" for key, (sign, _) in BOUNDS.items() if key in meta)
    return ", ".join([f"{SCALARS[tp][2]} {bounds}".rstrip(), *meta.get("words", ())])


def _coerce(tp: Any, value: Any, path: str, meta: Mapping[str, Any]) -> Any:
    """Check `value` against type hint `tp`; return the value to store."""
    if type(None) in get_args(tp):  # X | None
        return None if value is None else _coerce(get_args(tp)[0], value, path, meta)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if get_origin(tp) is tuple and get_args(tp)[0] is LayerType:
        return _layer_types(value, path)
    if get_origin(tp) is tuple and get_args(tp)[0] is HeadParam:
        return head_params(value, path)
    if get_origin(tp) is tuple and get_args(tp)[0] is TokenInput:
        return token_inputs(value, path)
    allowed = describe(tp, meta)
    if value is None:
        raise SpecError(path, "is null but a value is required", allowed=allowed)
    if get_origin(tp) is Literal:
        if not isinstance(value, str) or value not in get_args(tp):
            close = difflib.get_close_matches(str(value), get_args(tp), n=1)
            raise SpecError(path, f"{_show(value)} is not a known choice{_did_you_mean(close)}",
                            allowed=allowed)
        return value
    if get_origin(tp) is tuple:
        if not isinstance(value, list) or not value:
            problem = "is an empty list" if value == [] else f"{_show(value)} is not a list"
            raise SpecError(path, problem, allowed=allowed)
        return tuple(_coerce(get_args(tp)[0], v, f"{path}[{i}]", {}) for i, v in enumerate(value))
    accepts, word, _ = SCALARS[tp]
    if value in meta.get("words", ()):
        return value  # a word for a number that _resolve works out
    if not isinstance(value, accepts) or (isinstance(value, bool) and tp is not bool):
        raise SpecError(path, f"{_show(value)} is not {word}", allowed=allowed)
    if tp is float:
        if not abs(value) <= sys.float_info.max:  # also nan, which fails every comparison
            too = "too large" if isinstance(value, int) else "not finite"
            raise SpecError(path, f"{_show(value)} is {too}", allowed=allowed)
        value = float(value)
    if not all(holds(value, meta[key]) for key, (_, holds) in BOUNDS.items() if key in meta):
        raise SpecError(path, f"{_show(value)} is out of range", allowed=allowed)
    if tp is int and value > MAX_WHOLE_NUMBER:
        raise SpecError(path, f"{_show(value)} is too large", allowed=f"a whole number from "
                        f"{meta.get('min', 0)} to {MAX_WHOLE_NUMBER} (2³¹ − 1)")
    return value


def _build(cls: type, data: Any, path: str) -> Any:
    """Section `cls` from mapping `data`; derived fields it leaves out stay None."""
    if cls is AttentionBias and isinstance(data, bool):
        return AttentionBias(q=data, k=data, v=data, o=data)
    if cls is Normalizer and isinstance(data, str):
        data = {"kind": data}     # a word is its kind
    fields = {f.name: (f, tp) for f, tp in typed_fields(cls)}
    if not isinstance(data, Mapping):
        either = "true, false, or " if cls is AttentionBias else ""
        problem = "is empty" if data is None and not path else f"{_show(data)} is not a mapping"
        raise SpecError(path, problem, allowed=either + describe(cls, {}))
    for key in data:
        if key not in fields:
            raise _unknown_key(key, list(fields), path)
    kind = data.get("kind", getattr(cls(), "kind", None))
    values: dict[str, Any] = {}
    for name, (f, tp) in fields.items():
        where, only = f"{path}.{name}" if path else name, f.metadata.get("only")
        if name not in data:
            if required(f, tp) and (not only or kind in only):
                raise SpecError(where, "is missing" + (f" for {kind}" if only else ""),
                                allowed=f"{f.metadata['doc']}: {describe(tp, f.metadata)}")
        elif only and kind not in only:
            raise SpecError(where, f"{_show(data[name])} is set, but it applies only when "
                            f"{path + '.' if path else ''}kind is {' or '.join(only)} "
                            f"(kind is {kind!r})", allowed="remove it")
        else:
            values[name] = _coerce(tp, data[name], where, f.metadata)
    return cls(**values)


def _layer_types(data: Any, path: str) -> tuple[LayerType, ...]:
    """`layer_types` as written: type name → {section: {field: value}}, each field a known one
    of a per-layer section. The values are checked, and typed, where each type is resolved on
    the model (``_layer_spec``)."""
    if not isinstance(data, Mapping) or not data:
        problem = "is an empty mapping" if data == {} else f"{_show(data)} is not a mapping"
        raise SpecError(path, problem, allowed=describe(tuple[LayerType, ...], {}))
    out = []
    for name, overrides in data.items():
        where = f"{path}.{name}"
        if not isinstance(name, str) or not TYPE_NAME_RE.match(name):
            raise SpecError(f"{path}.{_show(name)}", "is not a valid layer type name",
                            allowed="1-64 letters, digits, '_', '+', '-', starting with a letter")
        overrides = {} if overrides is None else overrides
        if not isinstance(overrides, Mapping):
            raise SpecError(where, f"{_show(overrides)} is not a mapping",
                            allowed="the fields the type sets: {section: {field: value}} for "
                            "sections " + ", ".join(LAYER_SECTIONS))
        leaves: list[tuple[str, Any]] = []
        for key, section in overrides.items():
            if key not in LAYER_SECTIONS:
                if key in {f.name for f in dataclasses.fields(Spec)}:
                    raise SpecError(f"{where}.{key}", "is the model's, not a layer's",
                                    allowed="fields of " + ", ".join(LAYER_SECTIONS))
                raise _unknown_key(key, list(LAYER_SECTIONS), where)
            cls = section_type(typing.get_type_hints(Spec)[key])
            if not isinstance(section, Mapping):
                raise SpecError(f"{where}.{key}", f"{_show(section)} is not a mapping",
                                allowed=describe(cls, {}))
            leaves += _leaves(cls, section, f"{where}.{key}", f"{key}.")
        out.append(LayerType(name, tuple(leaves)))
    return tuple(out)


def _leaves(cls: type, data: Mapping[str, Any], path: str, prefix: str) -> list[tuple[str, Any]]:
    """The (field path, value) pairs a layer type's section mapping sets; a nested section
    given as a mapping sets its fields one by one (an empty one: the section at its
    defaults)."""
    fields = dict((f.name, tp) for f, tp in typed_fields(cls))
    out: list[tuple[str, Any]] = []
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(key, list(fields), path)
        if key == "pattern":
            raise SpecError(f"{path}.{key}", f"{_show(value)} is set in a layer type, which "
                            "is one kind of layer", allowed="remove it; layer_pattern gives "
                            "each layer its type")
        inner = section_type(fields[key])
        if inner is not None and isinstance(value, Mapping) and value:
            out += _leaves(inner, value, f"{path}.{key}", f"{prefix}{key}.")
        else:
            out.append((prefix + key, value))
    return out


# ---- derived fields and cross-field rules --------------------------------------------------

def _derived(spec: Spec) -> dict[str, Any]:
    """The value of each derived field when the spec leaves it out (None: it stays None)."""
    att, ffn, d = spec.attention, spec.ffn, spec.d_model
    # A gated FFN takes 2/3 of the 4·d_model MLP (parameter-matched), times an optional
    # multiplier, rounded up to a multiple (Llama's rule: 4096 → 11008 at 256).
    gated = ffn.multiple_of * -(-int(ffn.multiplier * int(8 * d / 3)) // ffn.multiple_of)
    return {
        "attention.head_dim": d // att.heads if att.heads and d % att.heads == 0 else None,
        "attention.kv_heads": att.heads,
        "ffn.d_ff": None if ffn.kind == "none" else gated if ffn.gated else 4 * d,
        "decoder_layers": spec.layers if spec.family == "encoder-decoder" else None,
        "ffn.moe.top_groups": ffn.moe.groups if ffn.moe is not None else None,
        "mixer.mamba": Mamba() if "mamba" in spec.all_mixers else None,
        # ⌈d_model / 16⌉ (Gu & Dao 2023)
        "mixer.mamba.dt_rank": -(-d // 16) if "mamba" in spec.all_mixers else None,
        "attention.latent.v_dim": (att.head_dim or d // att.heads) - att.latent.rope_dims
        if att.latent is not None and att.heads and att.latent.rope_dims is not None else None,
    }


def _get(obj: Any, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), obj)


def _with(obj: Any, path: str, value: Any) -> Any:
    """`obj` with the field at dotted `path` replaced."""
    name, _, rest = path.partition(".")
    return dataclasses.replace(obj, **{name: _with(getattr(obj, name), rest, value) if rest
                                       else value})


def _resolve(spec: Spec) -> Spec:
    att = spec.attention
    if att.heads is not None and att.head_dim is None and spec.d_model % att.heads:
        raise SpecError("attention.heads", f"{att.heads} does not divide d_model "
                        f"({spec.d_model}) and attention.head_dim is not given",
                        allowed=f"a divisor of {spec.d_model}, or set attention.head_dim")
    if isinstance(spec.embedding.scale, str):
        spec = _with(spec, "embedding.scale", math.sqrt(spec.d_model))
    for path, value in _derived(spec).items():
        if value is not None and _get(spec, path) is None:
            spec = _with(spec, path, value)
    return spec


def _refuse_set(spec: Spec, paths: str, why: str, allowed: str = "remove it") -> None:
    """Refuse the first of the space-separated `paths` that is set (not its default)."""
    for path in paths.split():
        section, _, name = path.rpartition(".")
        obj = _get(spec, section) if section else spec
        value = getattr(obj, name)
        if value != getattr(type(obj)(), name):
            shown = "" if dataclasses.is_dataclass(value) else _show(value) + " "
            raise SpecError(path, f"{shown}is set, but {why}", allowed=allowed)


# ---- layer types: what each kind of layer runs ------------------------------------------

def _override(data: dict[str, Any], path: str, value: Any) -> None:
    """Set field `path` of the spec mapping `data` to `value`. A new `kind` first drops the
    fields that only the old kind takes, so a section changing kind keeps what still applies
    (an FFN's d_ff, a norm's eps) and nothing that no longer does."""
    *parents, key = path.split(".")
    node, cls = data, Spec
    for name in parents:
        cls = section_type(typing.get_type_hints(cls)[name])
        sub = node.get(name)
        if isinstance(sub, bool):   # attention.bias: one bool for all four
            sub = dict.fromkeys((f.name for f in dataclasses.fields(AttentionBias)), sub)
        node[name] = dict(sub) if isinstance(sub, Mapping) else {}
        node = node[name]
    if key == "kind" and value != node.get("kind", getattr(cls(), "kind", None)):
        for f in dataclasses.fields(cls):
            if f.metadata.get("only") and value not in f.metadata["only"]:
                node.pop(f.name, None)
    node[key] = _plain(value)


def _layer_spec(spec: Spec, t: LayerType) -> Spec:
    """What layers of type `t` run: the model's resolved fields (derived sizes included) with
    the type's set over them, as a uniform spec — no layer types, no per-layer patterns."""
    if not t.overrides and spec.layer_types is None and \
            all(_get(spec, p) is None for p in SHORTHANDS):
        return spec
    data = to_dict(spec, full=True)
    for key in ("layer_types", "layer_pattern", "weights"):
        data.pop(key, None)
    for path in SHORTHANDS:
        data[path.split(".")[0]].pop("pattern", None)
    # kinds first, outer sections before inner, so that a kind drops only the model's fields
    for path, value in sorted(t.overrides, key=lambda o: (not o[0].endswith(".kind"),
                                                          o[0].count("."))):
        _override(data, path, value)
    return _resolve(_build(Spec, data, ""))


@functools.lru_cache(maxsize=64)
def layer_specs(spec: Spec) -> tuple[Spec, ...]:
    """What each of `spec`'s layer types runs, in ``Spec.layer_plan`` order (``layer_spec``)."""
    return tuple(_layer_spec(spec, t) for t in spec.layer_plan()[0])


def longrope_switch(spec: Spec) -> int | None:
    """The sequence length past which LongRoPE layers rotate by their long factors (None: no
    layer has LongRoPE)."""
    lengths = {ls.position.scaling.original_max_seq_len
               for ls in layer_specs(spec)
               if ls.position.kind == "rope" and ls.position.scaling is not None
               and ls.position.scaling.kind == "longrope"}
    if len(lengths) > 1:
        raise SpecError(f"{spec.name}: LongRoPE layers trained on different contexts "
                         f"({', '.join(map(str, sorted(lengths)))}) cannot switch together")
    return lengths.pop() if lengths else None


def layer_spec(spec: Spec, i: int) -> Spec:
    """What layer i runs: the model with its layer type's fields set, and no layer types or
    patterns (a uniform spec, whose every section is this layer's). Both stacks of an
    encoder-decoder repeat the pattern alike."""
    types, pattern = spec.layer_plan()
    return layer_specs(spec)[[t.name for t in types].index(pattern[i % len(pattern)])]


def layer_ffns(spec: Spec, layers: int | None = None) -> tuple[FFNLayerKind, ...]:
    """Dense or MoE FFN for each layer."""
    return tuple("moe" if layer_spec(spec, i).ffn.kind == "moe" else "dense"
                 for i in range(layers or spec.layers))


def layer_kinds(spec: Spec, layers: int | None = None) -> tuple[LayerKind, ...]:
    """Local (windowed) or global attention for each layer."""
    return tuple("local" if layer_spec(spec, i).attention.window else "global"
                 for i in range(layers or spec.layers))


# The masks each family allows, and why.
MASKS = {"encoder": ("bidirectional", "an encoder sees the whole input"),
         "decoder": ("causal, prefix", "a decoder must not see future tokens"),
         "encoder-decoder": ("causal", "the encoder sees the whole prompt; the decoder, the past")}
# The per-layer shorthands for layer types.
SHORTHANDS = ("mixer.pattern", "attention.pattern", "ffn.pattern")
# The attention fields that act on softmax scores.
SCORE_FIELDS = ("mask", "window", "pattern", "softcap", "scale", "qk_norm", "qk_norm_over",
                "global_tokens", "score", "normalizer", "params", "inputs")
# Positions that are the model's, not a layer's: added to the embeddings once (learned,
# sinusoidal), or one bias table that every layer reads (relative).
MODEL_POSITIONS = ("learned", "sinusoidal", "relative")


def _check(spec: Spec) -> Spec:
    """`spec`, once it obeys the cross-field rules (the walk checked each field on its own):
    how its layers are laid out, each kind of layer on its own (``_check_layer``), then the
    model as a whole."""
    _check_layout(spec)
    spec = _check_layers(spec)
    _check_model(spec)
    return spec


def _mixers_written(spec: Spec) -> str:
    """Where the spec says which mixers its layers have, as the author wrote it."""
    if spec.mixer.pattern:
        return f"mixer.pattern {_show(spec.mixer.pattern)}"
    if spec.layer_types and any(t.get("mixer.kind", None) for t in spec.layer_types):
        return f"layer_types ({' and '.join(sorted(set(spec.all_mixers)))})"
    return f"mixer.kind {spec.mixer.kind!r}"


def _check_layout(spec: Spec) -> None:
    """The name, and how the spec gives its layers their kinds."""
    mixer, family, mixers = spec.mixer, spec.family, _mixers_written(spec)
    if not NAME_RE.match(spec.name):
        raise SpecError("name", f"{spec.name!r} is not a valid model name",
                        allowed="1-64 letters, digits, '.', '_', '-', starting alphanumeric")
    layers = max(spec.layers, spec.decoder_layers or 0)
    for where in (*SHORTHANDS, "layer_pattern"):
        pattern = _get(spec, where)
        if pattern is not None and len(pattern) > layers:
            raise SpecError(where, f"{_show(pattern)} has {len(pattern)} entries for {layers} "
                            "layers", allowed=f"at most {layers} entries")
    # ---- layer types
    types, pattern = spec.layer_types, spec.layer_pattern
    if types is not None and pattern is None:
        raise SpecError("layer_pattern", "is missing, and layer_types names types", allowed=(
            "the type of each layer, repeated: a list of " + ", ".join(t.name for t in types)))
    if pattern is not None and types is None:
        raise SpecError("layer_pattern", f"{_show(pattern)} names layer types, but "
                        "layer_types is not set", allowed="set layer_types, or remove it")
    if types is not None and pattern is not None:
        for where in SHORTHANDS:
            if _get(spec, where) is not None:
                raise SpecError(where, f"{_show(_get(spec, where))} is set beside layer_pattern",
                                allowed="one of them: layer types, or this shorthand for them")
        names = [t.name for t in types]
        for i, name in enumerate(pattern):
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                raise SpecError(f"layer_pattern[{i}]", f"{name!r} is not a layer type"
                                f"{_did_you_mean(close)}", allowed=", ".join(names))
        used = set(spec.layer_type_names(layers))
        for name in names:
            if name not in used:
                raise SpecError(f"layer_types.{name}", f"no layer has this type (layer_pattern "
                                f"{_show(pattern)} over {layers} layers)",
                                allowed="remove it, or name it in layer_pattern")
    # ---- mixers
    if mixer.pattern is not None and mixer.kind != "attention":
        raise SpecError("mixer.kind", f"{mixer.kind!r} is set beside {mixers}",
                        allowed="one of them: kind for every layer, or pattern per layer")
    recurrent = sorted(set(spec.all_mixers) - {"attention"})
    if recurrent and family != "decoder":
        where, written = mixers.split(" ", 1)
        raise SpecError(where, f"{written} in an {family}: {' and '.join(recurrent)} layers are "
                        "causal recurrences", allowed="attention, or family: decoder")
    plan = {t.name: t for t in spec.layer_plan()[0]}
    if spec.attention.heads is None and any(
            plan[name].get("mixer.kind", mixer.kind) not in HEADLESS_MIXERS and
            plan[name].get("attention.heads", None) is None
            for name in spec.layer_type_names(layers)):
        raise SpecError("attention.heads", f"is missing, and {mixers} attends",
                        allowed="query heads: a whole number ≥ 1")
    ffn = spec.ffn
    if ffn.kind == "moe" and ffn.pattern is not None and "moe" not in ffn.pattern:
        raise SpecError("ffn.pattern", f"{_show(ffn.pattern)} has no moe layer",
                        allowed=f"a pattern with moe layers, or ffn.kind: {ffn.moe.expert}")


def _check_layers(spec: Spec) -> Spec:
    """`spec` once each of its layer types makes a valid layer, with the values its layer types
    set as loaded (10000 → 10000.0). A refusal within a type the spec names says which."""
    named = spec.layer_types is not None
    loaded = []
    for t in spec.layer_plan()[0]:
        try:
            layer = _layer_spec(spec, t)
            if named:
                _check_type(spec, t, layer)
            _check_layer(layer)
        except SpecError as err:
            raise (_in_type(err, t) if named else err) from None
        loaded.append(LayerType(t.name, tuple(sorted(
            ((p, _get(layer, p)) for p, _ in t.overrides),
            key=lambda o: [(name != "kind", name) for name in o[0].split(".")]))))
    if not named:
        return spec
    # in a canonical order, so that one model is one spec: types by first use, fields by path
    # (a section's kind first)
    first = {name: i for i, name in reversed(list(enumerate(spec.layer_pattern or ())))}
    return dataclasses.replace(spec, layer_types=tuple(sorted(loaded,
                                                              key=lambda t: first[t.name])))


def _in_type(err: SpecError, t: LayerType) -> SpecError:
    """A refusal met resolving layer type `t`: at the field the type sets, or else naming the
    type and the model's field that its values make invalid."""
    parent = err.path.rpartition(".")[0]
    if any(err.path == p or err.path.startswith((p + ".", p + "[")) or p.startswith(err.path + ".")
           or err.problem.startswith("is missing") and p.rpartition(".")[0] == parent
           for p, _ in t.overrides):   # (a field missing beside those the type sets: there)
        return SpecError(f"layer_types.{t.name}.{err.path}", err.problem, allowed=err.allowed)
    return SpecError(f"layer_types.{t.name}", f"makes {err.path} invalid: {err.problem}"
                     if err.path else err.problem, allowed=err.allowed)


def _check_type(spec: Spec, t: LayerType, layer: Spec) -> None:
    """A layer type sets only what acts in its kind of layer."""
    mixer = layer.mixer.kind
    for path, _ in t.overrides:
        section, name = path.split(".")[:2]
        acts = {"attention": mixer not in HEADLESS_MIXERS and (name not in SCORE_FIELDS or
                                                              mixer == "attention"),
                "position": mixer == "attention",
                "mixer": {"mamba": mixer == "mamba", "deltanet": mixer == "gated_deltanet"}.get(
                    name, True)}.get(section, True)
        if not acts:
            raise SpecError(path, f"is set, but layers of this type are {mixer} layers",
                            allowed="remove it, or set what acts in them")
    moved = [p for p, _ in t.overrides if p.startswith("position.")]
    kinds = {spec.position.kind, layer.position.kind} & set(MODEL_POSITIONS)
    if moved and kinds:
        raise SpecError(moved[0], f"is set, but {' and '.join(sorted(kinds))} positions are "
                        "the model's, not a layer's", allowed="remove it; a layer type may set "
                        "rope, alibi or none positions")


def _check_latent(spec: Spec) -> None:
    """Latent attention: a decoder's softmax self-attention with RoPE on the last rope_dims of
    each head, every head its own query of one shared latent."""
    att, lat = spec.attention, spec.attention.latent
    assert lat is not None
    if spec.family != "decoder" or spec.layer_mixers().count("attention") < len(
            [m for m in spec.layer_mixers() if m not in HEADLESS_MIXERS]):
        raise SpecError("attention.latent", "is set, but latent attention is a decoder's "
                        "softmax self-attention", allowed="family: decoder and softmax "
                        "attention layers, or remove it")
    if spec.position.kind != "rope":
        raise SpecError("attention.latent", f"is set, but position.kind is "
                        f"{spec.position.kind!r}: rope_dims of each head rotate",
                        allowed="position.kind: rope")
    if lat.rope_dims % 2 or lat.rope_dims >= att.head_dim:
        raise SpecError("attention.latent.rope_dims", f"{lat.rope_dims} of head_dim "
                        f"{att.head_dim}", allowed=f"an even number below {att.head_dim} "
                        "(head_dim counts the no-RoPE dims too)")
    if att.kv_heads != att.heads:
        raise SpecError("attention.kv_heads", f"{att.kv_heads} with attention.latent: every "
                        f"head has its own keys and values from the shared latent",
                        allowed=f"{att.heads} (attention.heads), or remove it")
    _refuse_set(spec, "position.fraction", "latent attention rotates rope_dims, the last dims "
                "of each head", allowed="remove it; attention.latent.rope_dims says how many")
    _refuse_set(spec, "attention.qk_norm attention.bias.v", "latent attention has neither (its "
                "latents are normalized; k's bias is the latent projection's, which v shares)")


def _check_layer(spec: Spec) -> None:
    """The rules within one kind of layer (a uniform spec, as ``layer_spec`` gives), each where
    its mixer has what it constrains."""
    att, ffn, pos, family = spec.attention, spec.ffn, spec.position, spec.family
    # ---- attention
    if spec.attends and att.heads % att.kv_heads:
        divisors = [d for d in range(1, att.heads + 1) if att.heads % d == 0]
        raise SpecError("attention.kv_heads", f"{att.kv_heads} does not divide attention.heads "
                        f"({att.heads})", allowed="one of " + ", ".join(map(str, divisors)))
    if att.latent is not None and spec.attends:
        _check_latent(spec)
    if att.window is None:
        _refuse_set(spec, "attention.global_tokens", "global tokens are seen beside a sliding "
                    "window, and attention.window is not set", allowed="remove it, or a window")
    if att.mask == "prefix":
        _refuse_set(spec, "attention.global_tokens", "attention.mask is 'prefix', whose prompt "
                    "every query sees already", allowed="remove it, or mask: causal")
    if (att.global_tokens or 0) > spec.max_seq_len:
        raise SpecError("attention.global_tokens", f"{att.global_tokens} is more than "
                        f"max_seq_len ({spec.max_seq_len})", allowed=f"1 to {spec.max_seq_len}")
    if not att.qk_norm:
        _refuse_set(spec, "attention.qk_norm_over attention.qk_norm_gain",
                    "attention.qk_norm is false", allowed="remove it, or set attention.qk_norm")
    masks, why = MASKS[family]
    if att.mask in MASK_KINDS and att.mask not in masks.split(", "):
        raise SpecError("attention.mask", f"{att.mask!r} with family {family}: {why}",
                        allowed=masks + (", or an expression" if family != "encoder-decoder"
                                         else ""))
    if spec.softmax_attends:
        check_expressions(spec)
    # ---- positions
    if pos.kind == "rope" and spec.softmax_attends:
        if att.head_dim % 2:
            raise SpecError("attention.head_dim", f"{att.head_dim} is odd but RoPE rotates "
                            "pairs of dims", allowed="an even number")
        rot, sc = spec.rotary_dim, pos.scaling
        if rot < 2 or rot % 2:
            raise SpecError("position.fraction", f"{pos.fraction} of head_dim {att.head_dim} "
                            f"gives {rot} rotary dims", allowed="an even number ≥ 2 of dims")
        if sc is not None and sc.kind == "dynamic" and rot < 4:
            # θ'_j = θ_j · s^(−2j/(d − 2)): no frequency to rescale with d = 2
            raise SpecError("position.scaling.kind", f"'dynamic' with {rot} rotary dims: "
                            "dynamic NTK rescales the base by s^(d/(d−2))",
                            allowed="4 or more rotary dims, or another scaling kind")
        if sc is not None and sc.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                factors = getattr(sc, name)
                if len(factors) != rot // 2:
                    raise SpecError(f"position.scaling.{name}", f"has {len(factors)} factors for "
                                    f"{rot // 2} rotary pairs", allowed=f"{rot // 2} numbers > 0")
                if min(factors) <= 0:
                    raise SpecError(f"position.scaling.{name}", f"{min(factors)} is not above 0",
                                    allowed=f"{rot // 2} numbers > 0")
        if sc is not None and sc.kind == "llama3" and sc.high_freq_factor < sc.low_freq_factor:
            raise SpecError("position.scaling.high_freq_factor", f"{sc.high_freq_factor} is "
                            f"below low_freq_factor ({sc.low_freq_factor})",
                            allowed="a number ≥ low_freq_factor")
    if pos.kind == "relative" and pos.max_distance < pos.buckets:
        raise SpecError("position.max_distance", f"{pos.max_distance} is below position.buckets "
                        f"({pos.buckets})", allowed=f"a whole number ≥ {pos.buckets}")
    # ---- blocks and FFNs
    if spec.norm.placement != "pre":
        _refuse_set(spec, "block.parallel", f"a parallel block needs pre-norm, not "
                    f"{spec.norm.placement!r}", allowed="norm.placement: pre, or false")
    if ffn.kind == "none":
        _refuse_set(spec, "ffn.d_ff ffn.bias", "ffn.kind is 'none'",
                    allowed="remove it, or choose an ffn.kind")
        _refuse_set(spec, "block.parallel", "ffn.kind is 'none': a parallel block runs the "
                    "mixer and an FFN side by side", allowed="false, or choose an ffn.kind")
    if not ffn.gated:
        _refuse_set(spec, "ffn.multiple_of ffn.multiplier", "the gated sizing rule it tunes "
                    f"does not apply to a non-gated {ffn.moe.expert if ffn.moe else ffn.kind} "
                    "FFN", allowed="remove it, or set ffn.d_ff")
    rule_d_ff = _derived(spec)["ffn.d_ff"]
    if ffn.gated and (ffn.multiple_of, ffn.multiplier) != (1, 1.0) and ffn.d_ff != rule_d_ff:
        raise SpecError("ffn.d_ff", f"{ffn.d_ff} disagrees with the sizing rule of "
                        f"ffn.multiple_of ({ffn.multiple_of}) and ffn.multiplier "
                        f"({ffn.multiplier}), which gives {rule_d_ff}",
                        allowed=f"{rule_d_ff}, or remove ffn.multiple_of and ffn.multiplier")
    if ffn.kind == "moe":
        if ffn.moe.top_k > ffn.moe.experts:
            raise SpecError("ffn.moe.top_k", f"{ffn.moe.top_k} is more than ffn.moe.experts "
                            f"({ffn.moe.experts})", allowed=f"1 to {ffn.moe.experts}")
        _check_groups(spec)
        _refuse_set(spec, "ffn.bias", "the experts' biases are ffn.moe.bias",
                    allowed="false, and ffn.moe.bias: true for biased experts")
        if ffn.moe.expert != "mlp":
            _refuse_set(spec, "ffn.activation", f"{ffn.moe.expert} experts take their "
                        "activation from their kind", allowed="remove it, or ffn.moe.expert: mlp")
        if ffn.moe.expert != "swiglu":
            _refuse_set(spec, "ffn.moe.swish_beta", f"{ffn.moe.expert} experts have no swish "
                        "gate", allowed="remove it, or ffn.moe.expert: swiglu")
        if not ffn.gated:
            _refuse_set(spec, "ffn.moe.clamp ffn.moe.up_offset", f"{ffn.moe.expert} experts "
                        "have no gate and up projections", allowed="remove it, or gated experts")


def _check_groups(spec: Spec) -> None:
    """Grouped routing: equal groups, no more kept than there are, enough experts in the kept
    groups for the top k, and two experts a group for a top-2 score."""
    moe = spec.ffn.moe
    experts, groups = moe.experts, moe.groups
    kept = groups if moe.top_groups is None else moe.top_groups
    if experts % groups:
        divisors = ", ".join(str(d) for d in range(1, experts + 1) if experts % d == 0)
        raise SpecError("ffn.moe.groups", f"{groups} does not divide ffn.moe.experts "
                        f"({experts})", allowed=f"a divisor of {experts}: {divisors}")
    if kept > groups:
        raise SpecError("ffn.moe.top_groups", f"{kept} is more than ffn.moe.groups ({groups})",
                        allowed=f"1 to {groups}")
    per_group = experts // groups
    if moe.top_k > kept * per_group:
        raise SpecError("ffn.moe.top_k", f"{moe.top_k} is more than the {kept * per_group} "
                        f"experts of the {kept} kept groups of {per_group}",
                        allowed=f"1 to {kept * per_group}, or more ffn.moe.top_groups")
    if groups > 1 and moe.group_score == "top2" and per_group < 2:
        raise SpecError("ffn.moe.group_score", f"'top2' sums a group's two best, and the "
                        f"{groups} groups have {per_group} expert each",
                        allowed="max, or fewer ffn.moe.groups")
    if groups == 1:
        _refuse_set(spec, "ffn.moe.group_score", "ffn.moe.groups is 1: no groups to score",
                    allowed="remove it, or set ffn.moe.groups")


def _check_model(spec: Spec) -> None:
    """The rules over the whole model: what no layer uses, and what each family has."""
    att, pos, family, mixers = spec.attention, spec.position, spec.family, _mixers_written(spec)
    if "mamba" not in spec.all_mixers:
        _refuse_set(spec, "mixer.mamba", f"no layer is mamba ({mixers})",
                    allowed="remove it, or give some layers the mamba mixer")
    if "gated_deltanet" not in spec.all_mixers:
        _refuse_set(spec, "mixer.deltanet", f"no layer is gated_deltanet ({mixers})",
                    allowed="remove it, or give some layers the gated_deltanet mixer")
    elif spec.mixer.deltanet is None:
        raise SpecError("mixer.deltanet", f"is missing, and {mixers} has gated_deltanet layers",
                        allowed="{key_heads, value_heads, key_dim, value_dim}")
    elif spec.mixer.deltanet.value_heads % spec.mixer.deltanet.key_heads:
        dn = spec.mixer.deltanet
        raise SpecError("mixer.deltanet.key_heads", f"{dn.key_heads} does not divide "
                        f"value_heads ({dn.value_heads})",
                        allowed="a divisor of mixer.deltanet.value_heads")
    if spec.ffn.moe is not None and not spec.ffn.moe.shared_expert_d_ff:
        _refuse_set(spec, "ffn.moe.shared_expert_gate", "there is no shared expert",
                    allowed="remove it, or set ffn.moe.shared_expert_d_ff")
    if not spec.attends:
        _refuse_set(spec, "attention.heads attention.kv_heads attention.head_dim attention.bias",
                    f"no layer attends ({mixers})")
    if not spec.softmax_attends:
        _refuse_set(spec, " ".join(f"attention.{name}" for name in SCORE_FIELDS),
                    f"it acts in softmax attention and no layer has it ({mixers})")
        if pos.kind in ("rope", "alibi", "relative"):
            raise SpecError("position.kind", f"{pos.kind!r} acts inside softmax attention, and "
                            f"no layer has it ({mixers})", allowed="none, learned, sinusoidal")
    if att.pattern is not None and "local" in att.pattern and att.window is None:
        raise SpecError("attention.pattern", f"{_show(att.pattern)} has local layers but "
                        "attention.window is not set",
                        allowed="set attention.window, or only global layers")
    if att.pattern is not None and "local" not in att.pattern:
        _refuse_set(spec, "attention.window", f"attention.pattern {_show(att.pattern)} has no "
                    "local layer to use it",
                    allowed="remove it, or put local layers in attention.pattern")
    if family == "encoder":
        _refuse_set(spec, "embedding.tied output.softcap output.bias output.scale "
                    "output.logit_scale",
                    "an encoder has no output head: it returns hidden states",
                    allowed="remove it; an encoder takes only output.final_norm")
    if family == "decoder":
        _refuse_set(spec, "embedding.token_types", "a decoder takes no token types",
                    allowed="0, or family: encoder")
    if family != "encoder-decoder":
        _refuse_set(spec, "decoder_layers", f"a {family} has one stack",
                    allowed="only with family: encoder-decoder")
    if pos.kind == "sinusoidal" and spec.d_model % 2:
        raise SpecError("d_model", f"{spec.d_model} is odd but sinusoidal positions come in "
                        "sin/cos pairs", allowed="an even number")
    if spec.weights is not None and not spec.weights.strip():
        raise SpecError("weights", "is an empty string", allowed="the path of a checkpoint")
    if not spec.block.parallel:
        _refuse_set(spec, "block.shared_norm", "a serial block always has one norm per "
                    "sublayer", allowed="set block.parallel: true, or remove it")


def from_dict(data: Any, source: str | None = None) -> Spec:
    """Validate and resolve a spec given as a mapping (parsed YAML)."""
    try:
        return _check(_resolve(_build(Spec, data, "")))
    except SpecError as err:
        raise (err.with_source(source) if source else err) from None


class _SpecYAMLLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain data only, never Python objects) that reads ``1e-5`` as a
    number, as YAML 1.2 does (YAML 1.1 wants ``1.0e-5`` and would read ``1e-5`` as text)."""


_SpecYAMLLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def _refuse_repeated_keys(node: yaml.Node, path: str, seen: set[int]) -> None:
    """A key given twice in one mapping is refused with its field path; plain YAML would keep
    the last one silently. (A spec's lists hold only names, so mappings alone are walked.)"""
    if not isinstance(node, yaml.MappingNode) or id(node) in seen:  # seen: an alias walked
        return
    seen.add(id(node))
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
        where, line = f"{path}.{key}" if path else str(key), key_node.start_mark.line + 1
        if key in lines:
            raise SpecError(where, f"is given twice (lines {lines[key]} and {line})",
                            allowed="each key once")
        if key is not None:
            lines[key] = line
        _refuse_repeated_keys(value_node, where, seen)


def load_yaml(path: str | Path) -> Spec:
    """Read a spec file with a YAML safe loader (plain data; never a full loader)."""
    source = str(Path(path))
    try:
        loader = _SpecYAMLLoader(Path(source).read_text(encoding="utf-8"))
        node = loader.get_single_node()
        _refuse_repeated_keys(node, "", set())
        spec = from_dict(None if node is None else loader.construct_document(node))
        if spec.weights is not None:   # a checkpoint beside the spec file
            spec = dataclasses.replace(spec, weights=os.path.normpath(
                (Path(source).parent / spec.weights).absolute()))
        return spec
    except OSError as err:
        raise SpecError("", f"cannot read the file: {err.strerror}", source=source) from None
    except UnicodeDecodeError:
        raise SpecError("", "is not UTF-8 text", source=source) from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "malformed"
        raise SpecError("", f"is not valid YAML{at}: {problem}", source=source) from None
    except SpecError as err:
        raise err.with_source(source) from None


def zoo_names() -> list[str]:
    """Names of the bundled specs, real sizes first, then the tiny ones."""
    return sorted((p.stem for p in ZOO_DIR.glob("*.yaml")),
                  key=lambda name: (name.startswith("tiny-"), name))


def load_spec(spec: str | Path) -> Spec:
    """Load a spec from a YAML file, or by the name of a zoo spec."""
    path, zoo = Path(spec), ZOO_DIR / f"{spec}.yaml"
    if path.suffix in (".yaml", ".yml") or path.exists():  # load_yaml says why it cannot read
        return load_yaml(path)
    if zoo.is_file():
        return load_yaml(zoo)
    close = difflib.get_close_matches(str(spec), zoo_names(), n=3)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise SpecError("", f"{spec!r} is neither a spec file nor a zoo name{hint}",
                    allowed="a .yaml path or one of `archc specs`")


def _plain(value: Any) -> Any:
    """A loaded value as plain data for YAML: a section as its mapping, a tuple as a list."""
    if isinstance(value, tuple) and value and isinstance(value[0], HeadParam):
        return {p.name: p.weight if p.weight is not None else
                list(p.values) if len(p.values) > 1 else p.values[0] for p in value}
    if isinstance(value, tuple) and value and isinstance(value[0], TokenInput):
        return {i.name: i.default for i in value}
    if dataclasses.is_dataclass(value):
        return _data(value, "", {}, full=True)
    return list(value) if isinstance(value, tuple) else value


def _nested(overrides: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """A layer type's (field path, value) pairs as the mapping a spec writes."""
    out: dict[str, Any] = {}
    for path, value in overrides:
        *parents, key = path.split(".")
        node = out
        for name in parents:
            node = node.setdefault(name, {})
        node[key] = _plain(value)
    return out


def _data(obj: Any, path: str, derived: Mapping[str, Any], full: bool) -> dict[str, Any]:
    """Section `obj` (at `path`) as plain data: see ``to_dict``."""
    out: dict[str, Any] = {}
    for f, tp in typed_fields(type(obj)):
        value, where, only = getattr(obj, f.name), path + f.name, f.metadata.get("only")
        if value is None and type(None) not in get_args(tp) or \
                only and getattr(obj, "kind", None) not in only:
            continue  # a field the spec does not have, or one its section's kind refuses
        if dataclasses.is_dataclass(value):
            inner = _data(value, where + ".", derived, full)
            if inner or full or f.default_factory is dataclasses.MISSING:
                out[f.name] = inner
        elif f.name == "layer_types" and value is not None:
            out[f.name] = {t.name: _nested(t.overrides) for t in value}
        elif full or value != derived.get(where, f.default):
            out[f.name] = _plain(value)
    return out


def to_dict(spec: Spec, *, full: bool = False) -> dict[str, Any]:
    """The spec as plain data for YAML. Without `full`, a field is left out when it holds its
    default, or, for a derived field, what the loader would derive. A layer type writes the
    fields it sets."""
    return _data(spec, "", _derived(spec), full)


def dump_yaml(spec: Spec, *, full: bool = False) -> str:
    return yaml.safe_dump(to_dict(spec, full=full), sort_keys=False, default_flow_style=None)
