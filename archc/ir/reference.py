"""The operator reference, ``docs/ir-reference.md``, generated from the op table (a test keeps
the two equal): every op the IR has, with the one-line form the text printer writes for it."""

from __future__ import annotations

from archc.ir.attrs import REQUIRED, Attr, Call, Expression, Widths, format_value
from archc.ir.ops import COLLECTIVE, KERNEL_LEVEL, META, OP_TABLE, VIEW, Op
from archc.ir.ops.base import RECURRENT, OpDef
from archc.quant.schemes import SCHEMES

# the sections after "Unfused" (every op in none of these): title, what they hold, their ops
GROUPS = (
    ("Graph structure", "Inputs, parameters and outputs: no computation.", META),
    ("Views", "Reshape or select without moving data; codegen folds them into the kernels that "
     "read them.", VIEW),
    ("Collectives", "What a sharded program exchanges between ranks (`archc.passes.shard`): "
     "each names its group (tp or cp) and its size; its bytes go over the link between GPUs.",
     COLLECTIVE),
    ("Kernel-level", "Ops with a template: each node becomes one generated kernel. Lowering "
     "emits some of them plainly (a norm, a router over logits, the expert matmuls, the "
     "recurrent mixers); the passes fuse more into them.", KERNEL_LEVEL),
)
TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", Call: "call", tuple: "steps",
              Expression: "expression", Widths: "list of int"}


def _arity(d: OpDef) -> str:
    lo, hi = d.arity
    return f"{lo} or more" if hi == -1 else str(lo) if lo == hi else f"{lo} to {hi}"


def _attr(a: Attr) -> str:
    kind = " \\| ".join(f"{c}()" if a.type is Call else format_value(c) for c in a.choices) \
        if a.choices else TYPE_NAMES[a.type]
    default = "" if a.default is REQUIRED else ", optional" if a.default is None else \
        f" = {format_value(a.default)}"
    return f"`{a.name}`: {kind}{default}"


def _table(ops: list[Op]) -> list[str]:
    lines = ["| op | inputs | attributes | what it computes |", "|---|---|---|---|"]
    for op in ops:
        d = OP_TABLE[op]
        attrs = "; ".join(_attr(a) for a in d.attrs) or "—"
        state = " Keeps a per-layer recurrent state between calls." if op in RECURRENT else ""
        lines.append(f"| `{op.value}` | {_arity(d)} | {attrs} | {d.summary}{state} |")
    return [*lines, "", "Examples, as the text form prints them:", "", "```",
            *(OP_TABLE[op].example for op in ops), "```"]


def reference() -> str:
    lines = ["# archc IR reference", "",
             "Generated from the op table by `python -m archc.ir.reference`; a test keeps this "
             "file current. Every node has an op, inputs (earlier nodes), attributes, a shape over "
             "the symbols `B` (batch), `T` (new tokens), `P` (tokens already cached) and `S` "
             "(encoder length), and a dtype. Each op below declares its shape rule, its eager "
             "semantics and its FLOP and byte counts in one place.", ""]
    grouped = {op for _, _, members in GROUPS for op in members}
    for title, why, members in (("Unfused", "What lowering emits from a spec: faithful to the "
                                 "model, one operation each.", set(Op) - grouped), *GROUPS):
        lines += [f"## {title}", "", why, "", *_table([op for op in Op if op in members]), ""]
    return "\n".join(lines + _schemes())


def _schemes() -> list[str]:
    """The quantization schemes a param's dtype may name, and the operands that may read one."""
    readers = ", ".join(f"`{op.value}` {' and '.join(f'`{r}`' for r in d.quantized)}"
                        for op, d in OP_TABLE.items() if d.quantized)
    lines = ["## Quantized weights", "",
             "A param's dtype may be a quantization scheme: the weight stays quantized in memory "
             "and the kernel that reads it dequantizes inside its K loop. The stored layout and "
             "the formula of a value are in `archc/quant/schemes.py`. Only these operands may "
             f"read a quantized param: {readers}.", "",
             "| dtype | code bits | group | bytes per element | stores |", "|---|---|---|---|---|"]
    for name, s in SCHEMES.items():
        group = "row" if s.group >= 1 << 30 else str(s.group)
        lines.append(f"| `{name}` | {s.bits} | {group} | {float(s.bytes_per_element):.4g} | "
                     f"{s.summary} |")
    return [*lines, ""]


if __name__ == "__main__":
    print(reference(), end="")
