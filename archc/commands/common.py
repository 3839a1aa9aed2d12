"""Arguments and helpers shared by subcommands."""

from __future__ import annotations

import argparse

from archc.spec.schema import Spec
from archc.spec.zoo import load_spec


def add_spec_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC",
                   help="a spec YAML path or a zoo name (see `archc specs`)")


def spec_of(args: argparse.Namespace) -> Spec:
    return load_spec(args.spec)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 1")
    return value


def nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be ≥ 0")
    return value
