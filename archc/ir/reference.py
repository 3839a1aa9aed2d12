"""The operator reference, generated from the op table (``archc/ir/ops``).

``docs/ir-reference.md`` is this text; a test keeps the two equal, so the reference lists every
op the IR has, with the one-line form the text printer writes for it.
"""

from __future__ import annotations

from archc.ir.ops import KERNEL_LEVEL, META, OP_TABLE, RECURRENT, VIEW, Op, OpDef

GROUPS = (
    ("Graph structure", "inputs, parameters and outputs: no computation", META),
    ("Views", "reshape or select without moving data; codegen folds them into the kernels that "
     "read them", VIEW),
    ("Kernel-level", "what the default pipeline leaves: each becomes one generated kernel, "
     "the embedding gather as lowering emits it", KERNEL_LEVEL | {Op.EMBEDDING}),
)


def _arity(d: OpDef) -> str:
    lo, hi = d.arity
    if hi == -1:
        return f"{lo} or more"
    return str(lo) if lo == hi else f"{lo} to {hi}"


def _attrs(d: OpDef) -> str:
    required = ", ".join(f"`{a}`" for a in d.attrs)
    optional = ", ".join(f"`{a}`" for a in d.optional)
    if required and optional:
        return f"{required}; optional {optional}"
    return required or (f"optional {optional}" if optional else "—")


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
                 "operation each", [op for op in OP_TABLE if op not in grouped])]
    sections += [(title, why, [op for op in OP_TABLE if op in members])
                 for title, why, members in GROUPS]
    for title, why, ops in sections:
        lines += [f"## {title}", "", why[0].upper() + why[1:] + ".", ""]
        lines += _table(ops)
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(reference(), end="")
