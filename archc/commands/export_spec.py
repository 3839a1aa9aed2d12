"""`archc export-spec SOURCE`: the spec of a model as YAML, to read, edit and compile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from archc.errors import ArchcError
from archc.spec import dump_yaml

NAME = "export-spec"
HELP = "print the YAML spec of a Hugging Face directory, GGUF file, spec file or zoo name"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE",
                   help="a Hugging Face model directory, a .gguf file, a spec YAML or zoo name")
    p.add_argument("--full", action="store_true",
                   help="write every field, including those at their default")
    p.add_argument("-o", "--output", type=Path, metavar="FILE",
                   help="write to FILE instead of standard output")


def run(args: argparse.Namespace) -> int:
    from archc.sources import source_spec
    text = dump_yaml(source_spec(args.source), full=args.full)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    try:
        args.output.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ArchcError(f"cannot write {args.output}: {err.strerror}") from None
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
