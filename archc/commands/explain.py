"""Say, for every fusion the pass pipeline did not make, which rule refused it and why — and for
every one it made another way than usual (a norm's gain applied to the activations of a quantized
weight), how and why."""

from __future__ import annotations

import argparse

from archc.commands.common import quant_of
from archc.commands.passes import add_pipeline_arguments
from archc.commands.vocabulary import add
from archc.ir.lower import lower
from archc.passes import run_pipeline
from archc.passes.decisions import grouped
from archc.ui import console


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add_pipeline_arguments(p)
    p.add_argument("--applied", action="store_true",
                   help="also list the rewrites that were made, counted per rule")


def run(args: argparse.Namespace) -> int:
    spec, quant = quant_of(args)
    made, refused = grouped(run_pipeline(lower(spec, args.dtype or spec.dtype, quant),
                                         args.passes).decisions())
    console.print(f"[bold]{spec.name}[/]: {sum(made.values())} rewrites made; "
                  f"{sum(map(len, refused.values()))} refused "
                  f"({len(refused)} distinct reason{'' if len(refused) == 1 else 's'})")
    for (pass_name, rule, note), n in made.items():
        if args.applied or note:
            console.print(f"  made  {pass_name} · {rule} ×{n}" + (f": {note}" if note else ""),
                          highlight=False, markup=False, soft_wrap=True)
    if not refused:
        console.print("every fusion the pipeline looked for was made")
    for group in refused.values():
        d = group[0]
        kind = "not legal" if d.verdict == "legality" else "not profitable"
        times = f" ×{len(group)}" if len(group) > 1 else ""
        graphs = ", ".join(dict.fromkeys(d.graph for d in group))
        console.print(f"\n{d.pass_name} · {d.rule} — {kind}{times} (graph {graphs})",
                      highlight=False, markup=False, style="bold")
        console.print(f"  why: {d.reason}", highlight=False, soft_wrap=True, markup=False)
        console.print(f"  at:  {d.node}", highlight=False, soft_wrap=True, markup=False)
    return 0
