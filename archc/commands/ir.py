"""Print the IR of a model, one line per node (or Graphviz DOT with --dot), before, after or
between passes."""

from __future__ import annotations

import argparse

from archc.commands.common import check_output, emit, quant_of
from archc.commands.passes import add_quant_arguments
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.ir.text import format_program
from archc.ir.view import to_dot
from archc.passes import PASSES, run_pipeline
from archc.passes.manager import known, step_diff


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    p.add_argument("--dot", action="store_true", help="print Graphviz DOT instead of text")
    p.add_argument("--params", action="store_true", help="with --dot: draw parameter nodes too")
    p.add_argument("--provenance", action="store_true",
                   help="show the spec field that made each node and the passes that rewrote it")
    add(p, "dtype")
    add_quant_arguments(p)
    add(p, "passes", detail="run it before printing (default: none, or default with "
        "--after, --diff or --print-after-all). Passes: " + known(pipelines=False))
    show = p.add_mutually_exclusive_group()
    show.add_argument("--after", metavar="PASS", help="print the IR right after PASS")
    show.add_argument("--print-after-all", action="store_true", help="print the IR after every "
                      "pass (a header only when one changed nothing)")
    show.add_argument("--diff", metavar="PASS",
                      help="a unified diff of the text form before and after PASS")
    add(p, "output", detail="a file: the IR text (or DOT), instead of standard output")


def run(args: argparse.Namespace) -> int:
    check_output(args.output, "file")
    for flag, name in (("--after", args.after), ("--diff", args.diff)):
        if name is not None and name not in PASSES:
            raise ArchcError(f"{flag}: unknown pass {name!r}; known: {known(pipelines=False)}")
    if args.diff and args.dot:
        raise ArchcError("--diff compares the text form; it does not combine with --dot")
    spec, quant = quant_of(args)
    staged = args.after or args.diff or args.print_after_all
    result = run_pipeline(lower(spec, args.dtype or spec.dtype, quant),
                          args.passes or ("default" if staged else "none"))

    def text(p: Program) -> str:
        return to_dot(p, params=args.params) if args.dot else \
            format_program(p, provenance=args.provenance)

    if args.print_after_all:
        parts = [f"; *** IR after lowering ***\n{text(result.initial)}"]
        for k, step in enumerate(result.steps, 1):
            header = f"; *** IR after {step.name} ({step.kind}, pass {k} of " \
                     f"{len(result.steps)}) ***"
            log = "".join(f"; {line}\n" for line in step.log)
            parts.append(f"{header}\n{log}{text(step.after)}" if step.changed else
                         f"{header} not applied\n")
        emit("\n".join(parts), args.output)
    elif args.diff:
        step = result.step(args.diff)
        emit(step_diff(step, provenance=args.provenance) or f"; {step.name} changed nothing\n",
             args.output)
    else:
        emit(text(result.step(args.after).after if args.after else result.program),
             args.output)
    return 0
