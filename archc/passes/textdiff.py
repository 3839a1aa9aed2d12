"""A readable diff of one pass: the text form before and after, with the nodes the pass kept
under their old numbers and the nodes it made numbered %+1, %+2…, so the diff shows what the
pass did rather than every id the renumbering shifted."""

from __future__ import annotations

import difflib
import re

from archc.ir.text import format_node, format_program
from archc.passes.manager import PassStep

_REF = re.compile(r"%(\d+)")


def _relabel(line: str, labels: list[str]) -> str:
    return _REF.sub(lambda m: labels[int(m.group(1))], line)


def after_in_old_numbers(step: PassStep, *, provenance: bool = False) -> str:
    lines = [f"program {step.after.model}"]
    for g in step.after.graphs:
        kept = step.kept.get(g.name, {i: i for i in range(len(g.nodes))})
        old_of = {new: old for old, new in kept.items()}
        made = iter(range(1, len(g.nodes) + 1))
        labels = [f"%{old_of[i]}" if i in old_of else f"%+{next(made)}"
                  for i in range(len(g.nodes))]
        lines += [f"graph {g.name} {{",
                  *("  " + _relabel(format_node(i, n, provenance=provenance), labels)
                    for i, n in enumerate(g.nodes)), "}"]
    return "\n".join(lines) + "\n"


def step_diff(step: PassStep, *, provenance: bool = False) -> str:
    """Unified diff of the program before and after `step` ('' when it changed nothing)."""
    if not step.changed:
        return ""
    before = format_program(step.before, provenance=provenance)
    after = after_in_old_numbers(step, provenance=provenance)
    return "".join(difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True),
        fromfile=f"before {step.name}",
        tofile=f"after {step.name} (kept nodes keep their numbers; %+N are new)"))
