"""A readable diff of one pass: the text form before and after, with the nodes the pass kept
under their old numbers and the nodes it made numbered %+1, %+2…, so the diff shows what the
pass did rather than every id the renumbering shifted."""

from __future__ import annotations

import difflib
import re

from archc.ir.graph import Graph
from archc.ir.text import format_node, format_program
from archc.passes.manager import PassStep

_REF = re.compile(r"%(\d+)")


def _graph_text(g: Graph, labels: dict[int, str], provenance: bool) -> list[str]:
    lines = [f"graph {g.name} {{"]
    for i, n in enumerate(g.nodes):
        line = format_node(i, n, provenance=provenance)
        lines.append("  " + _REF.sub(lambda m: labels[int(m.group(1))], line))
    return lines + ["}"]


def after_in_old_numbers(step: PassStep, *, provenance: bool = False) -> str:
    kept = {name: dict(pairs) for name, pairs in step.kept}
    lines = [f"program {step.after.model}"]
    for g in step.after.graphs:
        if g.name in kept:
            old_of = {new: old for old, new in kept[g.name].items()}
            made = 0
            labels = {}
            for i in range(len(g.nodes)):
                if i in old_of:
                    labels[i] = f"%{old_of[i]}"
                else:
                    made += 1
                    labels[i] = f"%+{made}"
        else:
            labels = {i: f"%{i}" for i in range(len(g.nodes))}
        lines += _graph_text(g, labels, provenance)
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
