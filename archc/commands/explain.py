"""Say, for every fusion the pass pipeline did not make, which rule refused it and why — and for
every one it made another way than usual (a norm's gain applied to the activations of a quantized
weight), how and why."""

from __future__ import annotations

import argparse

from archc.commands.common import quant_of
from archc.commands.passes import add_pipeline_arguments
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.ir.lower import lower
from archc.passes import run_pipeline
from archc.passes.decisions import grouped
from archc.perf.attention_tiles import AttentionTiles, attention_tiles
from archc.ui import console


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add_pipeline_arguments(p)
    p.add_argument("--applied", action="store_true",
                   help="also list the rewrites that were made, counted per rule")
    p.add_argument("--length", type=int, metavar="N",
                   help="classify each attention kernel's tiles over a prefill of N tokens "
                   "(default: max_seq_len, at most 4096)")


def run(args: argparse.Namespace) -> int:
    spec, quant = quant_of(args)
    length = args.length or min(spec.max_seq_len, 4096)
    if length < 1:
        raise ArchcError(f"--length {length}: a prefill of at least 1 token")
    run_ = run_pipeline(lower(spec, args.dtype or spec.dtype, quant), args.passes)
    made, refused = grouped(run_.decisions())
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
    _attention(attention_tiles(run_.program, length, args.dtype or spec.dtype))
    return 0


def _attention(kernels: list[AttentionTiles]) -> None:
    """Each attention kernel's modifiers and its tiles: full, partial, empty, visited."""
    for a in kernels:
        nodes = ", ".join(f"%{i}" for i in a.nodes)
        console.print(f"\nattention {nodes} (graph {a.graph}) at {a.length} tokens, tiles of "
                      f"{a.block_m} × {a.block_n}", highlight=False, markup=False, style="bold")
        for what, text in (("score", a.score), ("mask", a.mask), ("normalizer", a.normalizer)):
            console.print(f"  {what:<11}{text}", highlight=False, markup=False, soft_wrap=True)
        console.print(f"  {'tiles':<11}{a.tiles}: {a.full} full, {a.partial} partial, {a.empty} "
                      f"empty; {a.visited:.4f} visited", highlight=False, markup=False)
