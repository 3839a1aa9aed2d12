"""The `archc` command line. Each subcommand is a module in ``archc.commands``.

Bad input (a spec, a checkpoint, an argument) prints one message naming the problem and exits
with status 2; it never shows a traceback.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from archc import __version__
from archc.errors import ArchcError

COMMAND_MODULES = ("specs", "show", "ir", "run", "roofline", "export_spec", "passes", "explain",
                   "diff", "modernize", "compile", "validate", "bench")


def _commands() -> list[ModuleType]:
    import importlib
    return [importlib.import_module(f"archc.commands.{name}") for name in COMMAND_MODULES]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="archc",
        description="A compiler for transformer architectures: spec → IR → passes → Triton "
                    "kernels, validated against an eager PyTorch interpreter.",
        epilog="SPEC is a YAML file or the name of a bundled spec (`archc specs`). "
               "Run `archc COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"archc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in _commands():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP[0].upper() +
                           mod.HELP[1:] + ".")
        mod.add_arguments(p)
        p.set_defaults(handler=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except ArchcError as err:
        print(f"archc {args.command}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
