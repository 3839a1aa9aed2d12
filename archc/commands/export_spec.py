"""Print the YAML spec of a model (a Hugging Face directory, GGUF file, spec or zoo name), to read,
edit and compile."""

from __future__ import annotations

import argparse

from archc.commands.common import check_output, emit, spec_of
from archc.commands.vocabulary import add
from archc.spec import dump_yaml


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    p.add_argument("--full", action="store_true",
                   help="write every field, including those at their default")
    add(p, "output", detail="a file: the YAML, instead of standard output")


def run(args: argparse.Namespace) -> int:
    check_output(args.output, "file")
    emit(dump_yaml(spec_of(args), full=args.full), args.output)
    return 0
