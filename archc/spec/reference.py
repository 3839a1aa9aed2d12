"""The spec language reference, generated from the field declarations in ``schema.py`` that the
loader reads: ``docs/spec-reference.md`` is this text, and a test keeps the two equal."""

from __future__ import annotations

import dataclasses
from typing import Any

from archc.spec.load import describe, required, section_type, sections, typed_fields
from archc.spec.schema import LAYER_SECTIONS


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
    return "\n".join(lines + LAYER_TYPES) + "\n"


LAYER_TYPES = ["", "## Layer types", "",
               "`layer_types` names kinds of layer, each a mapping of the fields it sets in the "
               f"per-layer sections ({', '.join(f'`{s}`' for s in LAYER_SECTIONS)}); "
               "`layer_pattern` gives each layer its type, repeated over the layers (an "
               "encoder-decoder's two stacks alike), or one entry per layer. Every other field "
               "is the model's. For example:", "",
               "```yaml",
               "layer_types:",
               "  local:  {attention: {window: 1024}, position: {theta: 10000}}",
               "  global: {position: {theta: 1000000, scaling: {kind: linear, factor: 8}}}",
               "  nope:   {position: {kind: none}, ffn: {kind: moe, moe: {experts: 8, top_k: 2}}}",
               "layer_pattern: [local, local, global, nope]",
               "```", "",
               "- A type starts from the model's fields as loaded, derived sizes included, and "
               "sets its own over them; a field it does not set is the model's.",
               "- Setting a section's `kind` drops the model's fields that only the old kind "
               "takes (a new `position.kind: none` drops `theta`; an FFN changing kind keeps "
               "its `d_ff`).",
               "- Each kind of layer is checked as a model of its own; a refusal names "
               "`layer_types.TYPE.FIELD`, or the type and the model's field it makes invalid.",
               "- A type sets only what acts in its layers (no score fields in a mamba layer), "
               "and no per-layer pattern. Learned, sinusoidal and relative positions are the "
               "model's.",
               "- Every type is used by some layer. Layer types load in one order: by first use "
               "in the pattern.",
               "- `mixer.pattern`, `attention.pattern` (local: the window; global: none) and "
               "`ffn.pattern` (moe, or dense: one FFN of kind `ffn.moe.expert`) are shorthand "
               "for layer types, named after their entries (`mamba+dense` where two combine), "
               "and may not be given beside `layer_pattern`.",
               "- A parameter computed at load that layers share (the RoPE cos/sin table, ALiBi "
               "slopes) is one per distinct value, named after the first type that has it "
               "(`rope.global.cos_sin`) when types differ.",
               "", "## Borrowed weights", "",
               "`weights: PATH` runs this spec's program over a checkpoint's tensors: a Hugging "
               "Face directory, a GGUF file, an archc checkpoint directory or quantized file, "
               "relative to the spec file. The checkpoint's own spec maps its tensors to "
               "archc's names; each must have the shape this spec's program wants, checked "
               "before any tensor is read, and a misfit is refused naming the tensor and both "
               "shapes. `archc export-spec SRC` writes a spec to edit and run this way."]


if __name__ == "__main__":
    print(reference(), end="")
