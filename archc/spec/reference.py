"""The spec language reference, generated from the field declarations in ``schema.py``.

``docs/spec-reference.md`` is this text; a test keeps the two equal, so the reference can never
drift from what the loader accepts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, get_args, get_origin

from archc.spec.load import bounds_text, required, section_type, sections, typed_fields


def _type_text(tp: Any) -> str:
    if type(None) in get_args(tp):
        return _type_text(get_args(tp)[0]) + " or null"
    if get_origin(tp) is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(tp))
    if get_origin(tp) is tuple:
        return "list of " + _type_text(get_args(tp)[0])
    return {int: "whole number", float: "number", bool: "true/false", str: "text"}[tp]


def _default_text(f: dataclasses.Field, tp: Any) -> str:
    if f.metadata.get("derived"):
        return "derived"
    if f.metadata.get("required_when"):
        return f"required when {f.metadata['required_when']}"
    if required(f, tp):
        return "required"
    if f.default is None:
        return "null"
    if isinstance(f.default, bool):
        return "true" if f.default else "false"
    return f"`{f.default!r}`"


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
    for prefix, cls in sections():
        lines += ["", f"## {prefix.rstrip('.') or 'Top level'}", "",
                  "| field | type | default | meaning |", "|---|---|---|---|"]
        for f, tp in typed_fields(cls):
            if section_type(tp) is not None:
                continue
            doc, bounds, only = f.metadata["doc"], bounds_text(f.metadata), f.metadata.get("only")
            doc = doc.replace("|", "\\|") + (f" ({bounds})" if bounds else "") + \
                (f"; only when kind is {' or '.join(only)}" if only else "")
            lines.append(f"| `{prefix}{f.name}` | {_type_text(tp)} | {_default_text(f, tp)} | "
                         f"{doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
