"""What the passes decided, as `archc passes`, `archc explain` and the report tell it: the
rewrites a pass made, counted per rule, and its refusals grouped by what makes them the same."""

from __future__ import annotations

import re
from collections import Counter

from archc.passes.manager import Decision, PassStep
from archc.passes.measure import op_delta


def _same_refusal(d: Decision) -> tuple[str, str, str, str]:
    """What makes two refusals the same up to node numbers and layer indices."""
    reason = d.reason
    for place, any_place in ((r"%\d+", "%_"), (r"layers\.\d+", "layers.N"),
                             (r"layer \d+", "layer N")):
        reason = re.sub(place, any_place, reason)
    return d.pass_name, d.rule, d.verdict, reason


def _note(d: Decision) -> str:
    """What an applied rewrite says beyond its count (after "; "): how it was made otherwise."""
    return _same_refusal(d)[3].partition("; ")[2]


Refusals = dict[tuple[str, str, str, str], list[Decision]]


def grouped(decisions: list[Decision]) -> tuple[Counter[tuple[str, str, str]], Refusals]:
    """The rewrites made, counted by (pass, rule, note), and the refusals grouped by what makes
    them the same up to node numbers and layers (each group: one decision per node)."""
    refused: Refusals = {}
    for d in decisions:
        if not d.applied:
            refused.setdefault(_same_refusal(d), []).append(d)
    return Counter((d.pass_name, d.rule, _note(d)) for d in decisions if d.applied), refused


def changed(step: PassStep) -> str:
    """What a pass changed: 'merge-qkv ×2: −6 matmul, …', or 'not applied'."""
    if not step.changed:
        return "not applied"
    rules = Counter(d.rule for d in step.applied())
    return ", ".join(f"{rule} ×{n}" for rule, n in rules.items()) + \
        f": {op_delta(step.before, step.after)}"
