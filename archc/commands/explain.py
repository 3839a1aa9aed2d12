"""`archc explain SOURCE`: every fusion the pipeline did not make, and the rule that refused
it."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from archc.commands.common import inspection_dtype, spec_of
from archc.commands.passes import add_pipeline_arguments
from archc.commands.vocabulary import add
from archc.ir.lower import lower
from archc.passes import Decision, run_pipeline
from archc.ui import console

NAME = "explain"
HELP = "say, for every fusion the pass pipeline did not make, which rule refused it and why"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add_pipeline_arguments(p)
    add(p, "dtype")
    p.add_argument("--applied", action="store_true",
                   help="also list the rewrites that were made, counted per rule")


@dataclass
class Group:
    """Refusals of one rule for one reason, at several nodes (the layers of a model)."""

    first: Decision
    graphs: list[str] = field(default_factory=list)
    count: int = 0


def _shape_of_reason(d: Decision) -> tuple[str, str, str, str]:
    """What makes two refusals the same up to node numbers and layer indices."""
    reason = re.sub(r"%\d+", "%_", d.reason)
    reason = re.sub(r"layers\.\d+", "layers.N", reason)
    reason = re.sub(r"layer \d+", "layer N", reason)
    return d.pass_name, d.rule, d.verdict, reason


def group(decisions: list[Decision]) -> list[Group]:
    groups: dict[tuple[str, str, str, str], Group] = {}
    for d in decisions:
        if d.applied:
            continue
        g = groups.setdefault(_shape_of_reason(d), Group(d))
        g.count += 1
        if d.graph not in g.graphs:
            g.graphs.append(d.graph)
    return list(groups.values())


def run(args: argparse.Namespace) -> int:
    spec = spec_of(args)
    result = run_pipeline(lower(spec, inspection_dtype(args, spec)), args.passes)
    decisions = result.decisions()
    groups = group(decisions)
    made = sum(d.applied for d in decisions)
    console.print(f"[bold]{spec.name}[/]: {made} rewrites made; "
                  f"{sum(g.count for g in groups)} refused "
                  f"({len(groups)} distinct reason{'' if len(groups) == 1 else 's'})")
    if args.applied:
        counts: dict[tuple[str, str], int] = {}
        for d in decisions:
            if d.applied:
                counts[(d.pass_name, d.rule)] = counts.get((d.pass_name, d.rule), 0) + 1
        for (pass_name, rule), n in counts.items():
            console.print(f"  made  {pass_name} · {rule} ×{n}", highlight=False, markup=False)
    if not groups:
        console.print("every fusion the pipeline looked for was made")
        return 0
    for g in groups:
        d = g.first
        kind = "not legal" if d.verdict == "legality" else "not profitable"
        times = f" ×{g.count}" if g.count > 1 else ""
        console.print(f"\n{d.pass_name} · {d.rule} — {kind}{times} "
                      f"(graph {', '.join(g.graphs)})", highlight=False, markup=False,
                      style="bold")
        console.print(f"  why: {d.reason}", highlight=False, soft_wrap=True, markup=False)
        console.print(f"  at:  {d.node}", highlight=False, soft_wrap=True, markup=False)
    return 0
