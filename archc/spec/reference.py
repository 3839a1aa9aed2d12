"""The spec language reference, generated from the field declarations in ``schema.py`` that the
loader reads: ``docs/spec-reference.md`` is this text, and a test keeps the two equal."""

from __future__ import annotations

import dataclasses
from typing import Any

from archc.spec.load import describe, required, section_type, sections, typed_fields


def _default_text(f: dataclasses.Field, tp: Any) -> str:
    meta = f.metadata
    if meta.get("derived") or meta.get("required_when"):
        return "derived" if meta.get("derived") else f"required when {meta['required_when']}"
    if required(f, tp):
        return "required"
    if f.default is None:
        return "null"
    return str(f.default).lower() if isinstance(f.default, bool) else f"`{f.default!r}`"


def reference() -> str:
    lines = ["# The spec language", "", "Generated from `archc/spec/schema.py` (`python -m "
             "archc.spec.reference`); a test keeps it current.",
             "A spec is YAML read with a safe loader. A *derived* size not given is computed as "
             "its meaning says. A field marked *only when* applies to that `kind` of its section; "
             "anywhere else it is refused. Bad input is refused with the file, the field path, "
             "the value and what is allowed."]
    for prefix, cls in sections():
        lines += ["", f"## {prefix.rstrip('.') or 'Top level'}", "",
                  "| field | allowed | default | meaning |", "|---|---|---|---|"]
        for f, tp in typed_fields(cls):
            if section_type(tp) is None:
                only = f.metadata.get("only")
                doc = f.metadata["doc"].replace("|", "\\|") + \
                    (f"; only when kind is {' or '.join(only)}" if only else "")
                lines.append(f"| `{prefix}{f.name}` | {describe(tp, f.metadata)} | "
                             f"{_default_text(f, tp)} | {doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
