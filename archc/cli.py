"""The `archc` command line: a subcommand per module of ``archc.commands``. Bad input prints one
line (``archc.errors``); every argument is checked before a model is read."""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import sys
from typing import NoReturn

from archc.errors import ArchcError
from archc.versions import ARCHC

COMMAND_MODULES = ("specs", "show", "ir", "passes", "explain", "diff", "compile", "roofline",
                   "export_spec", "modernize", "quantize", "run", "chat", "serve", "validate",
                   "report", "bench", "cache")

# Flags of earlier versions, and what to write instead
RENAMED = {
    "--max-new-tokens": "--new-tokens",
    "--decode": "--new-tokens (tokens generated after the prompt)",
    "--tokens": "--prompt-len (a prompt's length) or --new-tokens (tokens to generate)",
    "--unfused": "--passes none",
}


class UsageError(ArchcError):
    def __init__(self, prog: str, message: str) -> None:
        super().__init__(f"{message} (see `{prog} --help`)")
        self.prog = prog


class Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as one line (`archc run: error: …`) instead of a usage
    block, so that a bad argument reads like any other bad input. Built without abbreviations:
    `--prompt` must never be read as `--prompt-len`."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(self.prog, message)


def build_parser() -> Parser:
    parser = Parser(
        prog="archc", allow_abbrev=False,
        description="A compiler for transformer architectures: spec → IR → passes → Triton "
                    "kernels, validated against an eager PyTorch interpreter.",
        epilog="SOURCE, wherever a command takes a model, is a zoo name (`archc specs`), a spec "
               "YAML, a Hugging Face directory, a .gguf file, an archc checkpoint directory or a "
               "quantized .safetensors file (`archc quantize`). "
               "Run `archc COMMAND --help` for a command's options; the flags commands share "
               "mean the same everywhere (README: 'One vocabulary').")
    parser.add_argument("--version", action="version", version=f"archc {ARCHC}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMAND_MODULES:
        mod = importlib.import_module(f"archc.commands.{name}")
        doc = inspect.cleandoc(mod.__doc__)     # its first paragraph says what the command does
        p = sub.add_parser(name.replace("_", "-"), help=" ".join(doc.split("\n\n")[0].split()),
                           description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                           allow_abbrev=False)
        mod.add_arguments(p)
        p.set_defaults(handler=mod.run)
    return parser


def _unknown(parser: Parser, command: str | None, extra: list[str]) -> UsageError:
    """An unknown argument, with what the user probably meant."""
    from archc.commands.vocabulary import FLAGS, commands_by_flag, subcommands
    sub = subcommands(parser).get(command or "")
    prog = sub.prog if sub is not None else parser.prog
    flag = next((e.split("=")[0] for e in extra if e.startswith("-")), None)
    if flag is None:
        return UsageError(prog, f"unexpected argument {extra[0]!r}")
    if flag in RENAMED:
        return UsageError(prog, f"unknown option {flag}: it is {RENAMED[flag]} now")
    message = f"unknown option {flag}"
    shared = next((name for name, f in FLAGS.items() if flag in f.names), None)
    if shared is not None:
        takers = ", ".join(commands_by_flag(parser)[shared])
        message += f" ({FLAGS[shared].meaning}: taken by {takers})"
    options = [o for a in (sub._actions if sub else []) for o in a.option_strings]
    close = difflib.get_close_matches(flag, options, n=1, cutoff=0.6)
    return UsageError(prog, message + (f"; did you mean {close[0]}?" if close else ""))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    prog = "archc"
    rank = 0            # of a --tp/--cp run: rank 0 alone reports bad input, as every rank meets it
    try:
        args, extra = parser.parse_known_args(argv)
        prog = f"archc {args.command}"
        if extra:
            raise _unknown(parser, args.command, extra)
        # the commands that run a model as ranks take --timeout; the others price one rank
        world = args.tp * args.cp if hasattr(args, "timeout") else 1
        if world > 1:   # one rank of several: started here, or by torchrun
            from archc import dist
            from archc.commands import launch
            if not dist.under_launcher():
                launch.check_before_launch(args)
                return launch.launch(sys.argv[1:] if argv is None else argv, world,
                                     args.timeout, main)
            rank = dist.init_from_env(world, args.timeout, getattr(args, "device", "cpu"))
            if rank != 0 and hasattr(args, "quiet"):
                args.quiet = True   # rank 0 speaks for the run
            try:
                return int(args.handler(args) or 0)
            finally:
                dist.leave()
        return int(args.handler(args) or 0)
    except ArchcError as err:
        if rank == 0:
            print(f"{getattr(err, 'prog', prog)}: error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
