"""Arguments and helpers shared by subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from archc.spec.schema import Spec
from archc.spec.zoo import load_spec


def add_spec_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC",
                   help="a spec YAML path or a zoo name (see `archc specs`)")


def spec_of(args: argparse.Namespace) -> Spec:
    return load_spec(args.spec)


def _int_at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} must be ≥ {lo}")
        return value
    return parse


positive_int = _int_at_least(1)
nonnegative_int = _int_at_least(0)
