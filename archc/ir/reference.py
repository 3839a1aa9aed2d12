"""The operator reference, generated from the op table (``archc/ir/ops``).

``docs/ir-reference.md`` is this text; a test keeps the two equal, so the reference lists every
op the IR has, with the one-line form the text printer writes for it.
"""

from __future__ import annotations

from archc.ir.attrs import Call, format_value
from archc.ir.ops import KERNEL_LEVEL, META, OP_TABLE, RECURRENT, VIEW, Attr, Op, OpDef
from archc.ir.ops.base import REQUIRED

GROUPS = (
    ("Graph structure", "inputs, parameters and outputs: no computation", META),
    ("Views", "reshape or select without moving data; codegen folds them into the kernels that "
     "read them", VIEW),
    ("Kernel-level", "ops with a template: each node becomes one generated kernel. Lowering "
     "emits some of them plainly (a norm, a router over logits, the expert matmuls, the "
     "recurrent mixers); the passes fuse more into them", KERNEL_LEVEL),
)


def _arity(d: OpDef) -> str:
    lo, hi = d.arity
    if hi == -1:
        return f"{lo} or more"
    return str(lo) if lo == hi else f"{lo} to {hi}"


TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", Call: "call",
              tuple: "steps"}


def _attr(a: Attr) -> str:
    kind = " \\| ".join(f"{c}()" if a.type is Call else format_value(c) for c in a.choices) \
        if a.choices else TYPE_NAMES[a.type]
    if a.default is REQUIRED:
        return f"`{a.name}`: {kind}"
    if a.default is None:
        return f"`{a.name}`: {kind}, optional"
    return f"`{a.name}`: {kind} = {format_value(a.default)}"


def _attrs(d: OpDef) -> str:
    return "; ".join(_attr(a) for a in d.attrs) or "—"


def _table(ops: list[Op]) -> list[str]:
    lines = ["| op | inputs | attributes | what it computes |", "|---|---|---|---|"]
    for op in ops:
        d = OP_TABLE[op]
        state = " Keeps a per-layer recurrent state between calls." if op in RECURRENT else ""
        lines.append(f"| `{op.value}` | {_arity(d)} | {_attrs(d)} | {d.summary}{state} |")
    lines.append("")
    lines.append("Examples, as the text form prints them:")
    lines.append("")
    lines.append("```")
    lines += [OP_TABLE[op].example for op in ops]
    lines.append("```")
    return lines


def reference() -> str:
    lines = [
        "# archc IR reference",
        "",
        "Generated from the op table by `python -m archc.ir.reference`; a test keeps this file "
        "current. Every node has an op, inputs (earlier nodes), attributes, a shape over the "
        "symbols `B` (batch), `T` (new tokens), `P` (tokens already cached) and `S` (encoder "
        "length), and a dtype. Each op below declares its shape rule, its eager semantics and "
        "its FLOP and byte counts in one place.",
        "",
    ]
    grouped = {op for _, _, members in GROUPS for op in members}
    sections = [("Unfused", "what lowering emits from a spec: faithful to the model, one "
                 "operation each", [op for op in Op if op not in grouped])]
    sections += [(title, why, [op for op in Op if op in members])
                 for title, why, members in GROUPS]
    for title, why, ops in sections:
        lines += [f"## {title}", "", why[0].upper() + why[1:] + ".", ""]
        lines += _table(ops)
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
