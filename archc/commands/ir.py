"""`archc ir SPEC`: the program in its text form (or DOT)."""

from __future__ import annotations

import argparse
from pathlib import Path

from archc.commands.common import add_spec_argument, spec_of
from archc.errors import ArchcError
from archc.ir.lower import lower
from archc.ir.text import format_program
from archc.ir.view import to_dot
from archc.ui import console

NAME = "ir"
HELP = "print the IR of a spec, one line per node (or Graphviz DOT with --dot)"

DTYPES = ("f32", "f16", "bf16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_spec_argument(p)
    p.add_argument("--dot", action="store_true", help="print Graphviz DOT instead of text")
    p.add_argument("--params", action="store_true", help="with --dot: draw parameter nodes too")
    p.add_argument("--provenance", action="store_true",
                   help="show the spec field that made each node and the passes that rewrote it")
    p.add_argument("--dtype", choices=DTYPES, default="f32",
                   help="activation and weight dtype of the lowered graph (default f32)")
    p.add_argument("-o", "--output", type=Path, metavar="FILE", help="write to FILE")


def emit(text: str, output: Path | None) -> None:
    if output is None:
        console.out(text, end="", highlight=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ArchcError(f"cannot write {output}: {err.strerror}") from None
    console.print(f"wrote {output}")


def run(args: argparse.Namespace) -> int:
    program = lower(spec_of(args), args.dtype)
    text = to_dot(program, params=args.params) if args.dot else \
        format_program(program, provenance=args.provenance)
    emit(text, args.output)
    return 0
