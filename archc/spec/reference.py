"""The spec language reference, generated from the field declarations in ``schema.py``.

``docs/spec-reference.md`` is this text; a test keeps the two equal, so the reference can never
drift from what the loader accepts.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, get_args, get_origin

from archc.spec.schema import Spec

SECTION_TITLES = {
    "": "Top level", "attention": "attention", "attention.bias": "attention.bias",
    "ffn": "ffn", "ffn.moe": "ffn.moe", "norm": "norm", "block": "block",
    "position": "position", "position.scaling": "position.scaling", "embedding": "embedding",
    "output": "output",
}


def _type_text(tp: Any) -> str:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _type_text(inner[0]) + " or null"
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(tp))
    if origin is tuple:
        return "list of " + _type_text(get_args(tp)[0])
    if dataclasses.is_dataclass(tp):
        return "section"
    return {int: "whole number", float: "number", bool: "true/false", str: "text"}.get(
        tp, str(tp))


def _default_text(f: dataclasses.Field, tp: Any) -> str:
    if f.metadata.get("derived"):
        return "derived"
    if f.metadata.get("required_when"):
        return f"required when {f.metadata['required_when']}"
    if f.default_factory is not dataclasses.MISSING:
        return "—"
    if f.default is None:  # as the loader decides: None of a non-optional type is required
        return "null" if type(None) in get_args(tp) else "required"
    value = f.default
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"`{value!r}`" if isinstance(value, str) else f"`{value}`"


def _sections(cls: type, prefix: str = "") -> list[tuple[str, type]]:
    out = [(prefix, cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner = tp if dataclasses.is_dataclass(tp) else next(
            (a for a in get_args(tp) if dataclasses.is_dataclass(a)), None)
        if inner is not None:
            out += _sections(inner, f"{prefix}{f.name}.")
    return out


def reference() -> str:
    lines = [
        "# The spec language",
        "",
        "Generated from `archc/spec/schema.py` (`python -m archc.spec.reference`); a test keeps "
        "it current.",
        "A spec is YAML read with `yaml.safe_load`. Sizes not given are derived (`head_dim` = "
        "`d_model / heads`, `kv_heads` = `heads`, `d_ff` = 4·`d_model` for an MLP or the gated "
        "2/3 rule, `mixer.mamba.dt_rank` = ⌈`d_model`/16⌉). A field marked *only when* applies "
        "to that `kind` of its section; anywhere else it is refused. Bad input is refused with "
        "the file, the field path, the value and what is allowed.",
    ]
    for prefix, cls in _sections(Spec):
        hints = typing.get_type_hints(cls)
        title = SECTION_TITLES.get(prefix.rstrip("."), prefix.rstrip("."))
        lines += ["", f"## {title}", "", "| field | type | default | meaning |",
                  "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if _type_text(tp) == "section" or (dataclasses.is_dataclass(
                    next((a for a in get_args(tp) if dataclasses.is_dataclass(a)), None))):
                continue
            meta = f.metadata
            doc = meta.get("doc", "").replace("|", "\\|")
            bounds = []
            if meta.get("min") is not None:
                lo = meta["min"]
                bounds.append("> 0" if lo == 0 and isinstance(lo, float) else f"≥ {lo}")
            if meta.get("max") is not None:
                bounds.append(f"≤ {meta['max']}")
            if bounds:
                doc += f" ({', '.join(bounds)})"
            if meta.get("only"):
                doc += f"; only when kind is {' or '.join(meta['only'])}"
            lines.append(f"| `{prefix}{f.name}` | {_type_text(tp)} | {_default_text(f, tp)} | "
                         f"{doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
