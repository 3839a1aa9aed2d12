"""The command line's shared vocabulary: every flag more than one command takes, declared once.

A command adds a shared flag with ``add(parser, name)``, never with ``add_argument``, so a flag
means the same thing, takes the same values and is checked the same way wherever it appears (a
test walks the parser to hold every command to it). A command may give its own default and a
line of its own (what `-o` writes, what is generated); the meaning stays. ``markdown()`` renders
the table the README shows, with the commands that take each flag read off the parser.

Every value is checked as the command line is parsed — before any model is read.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archc.dtypes import DTYPES
from archc.perf.gpus import GPUS

Parse = Callable[[str], Any]


def _number(text: str, kind: type, what: str) -> Any:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def int_at_least(lo: int) -> Parse:
    def parse(text: str) -> int:
        value = _number(text, int, "a whole number")
        if value < lo:
            raise argparse.ArgumentTypeError(f"{value} must be ≥ {lo}")
        return value
    parse.__name__ = "whole number"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def temperature(text: str) -> float:
    value = _number(text, float, "a number")
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be ≥ 0 (0 picks the likeliest token)")
    return value


def probability_mass(text: str) -> float:
    value = _number(text, float, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} must be in (0, 1]")
    return value


def device_name(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:\d+)?|auto", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda, cuda:N or auto")
    return text


@dataclass(frozen=True)
class Flag:
    """One shared flag: its spellings, what it means everywhere, and how argparse reads it."""

    names: tuple[str, ...]
    meaning: str                       # one sentence: the README table's text
    metavar: str | None = None
    argparse: dict[str, Any] = field(default_factory=dict)   # type, choices, action…

    @property
    def dest(self) -> str:
        return self.names[-1].lstrip("-").replace("-", "_")


FLAGS: dict[str, Flag] = {f.dest: f for f in (
    Flag(("source",), "the model: a zoo name (`archc specs`), a spec YAML, a Hugging Face "
         "directory, a .gguf file, or an archc checkpoint directory", "SOURCE"),
    Flag(("--prompt",), "text to continue", "TEXT"),
    Flag(("--chat",), "one user message, answered through the model's chat template", "TEXT"),
    Flag(("--system",), "a system message for the chat template", "TEXT"),
    Flag(("--prompt-len",), "prompt length in tokens (a prefill of N tokens)", "N",
         {"type": positive_int}),
    Flag(("--new-tokens",), "tokens to generate after the prompt (decode steps)", "N",
         {"type": nonnegative_int}),
    Flag(("--past",), "tokens already in the KV cache when the costed call runs", "N",
         {"type": nonnegative_int}),
    Flag(("--encoder-len",), "encoder length S of an encoder-decoder", "S",
         {"type": positive_int}),
    Flag(("--batch",), "sequences per batch", "N", {"type": positive_int}),
    Flag(("--dtype",), "the dtype weights and activations are computed in; default: the "
         "model's own (its spec's `dtype`, a checkpoint's), f32 when it runs on a CPU", None,
         {"choices": DTYPES}),
    Flag(("--device",), "where the model runs: cpu (kernels under Triton's interpreter), cuda "
         "or cuda:N; default: cuda when torch sees a GPU, else cpu", "DEVICE",
         {"type": device_name}),
    Flag(("--backend",), "what runs the model: eager (PyTorch ops, the reference) or triton "
         "(the generated kernels)", None, {"choices": ("eager", "triton")}),
    Flag(("--passes",), "the pass pipeline: default, none, or pass names separated by commas "
         "(`archc passes --list`)", "PIPELINE"),
    Flag(("--gpu",), "the GPU the roofline models: " + ", ".join(GPUS), "MODEL"),
    Flag(("--seed",), "seed of random weights, random prompts and sampling", "N",
         {"type": nonnegative_int}),
    Flag(("--threads",), "CPU threads torch may use", "N", {"type": positive_int}),
    Flag(("--temperature",), "sampling temperature; 0 picks the likeliest token", "T",
         {"type": temperature}),
    Flag(("--top-k",), "sample among the K likeliest tokens", "K", {"type": positive_int}),
    Flag(("--top-p",), "sample among the likeliest tokens holding P of the probability", "P",
         {"type": probability_mass}),
    Flag(("--ignore-eos",), "keep generating past the checkpoint's end-of-sequence tokens",
         None, {"action": "store_true"}),
    Flag(("-o", "--output"), "where to write: a path; each command says whether a file or a "
         "directory, and what goes there", "PATH", {"type": Path}),
    Flag(("--json",), "print the results as JSON on standard output, in place of tables and "
         "text", None,
         {"action": "store_true"}),
    Flag(("--quiet",), "print no notes, progress or timings on standard error", None,
         {"action": "store_true"}),
    Flag(("--cache-dir",), "where generated kernel modules are written (default: the kernel "
         "cache, `archc cache`)", "DIR", {"type": Path}),
)}


def add(p: argparse.ArgumentParser | Any, name: str, *, default: Any = None,
        detail: str | None = None, metavar: str | None = None, dest: str | None = None,
        nargs: str | None = None) -> argparse.Action:
    """Add shared flag `name` to parser (or argument group) `p`. `detail`: what it means for
    this command (what `-o` writes); a `default` is said in the help text. `dest` and `metavar`
    name a second positional SOURCE (`archc diff SOURCE_A SOURCE_B`)."""
    flag = FLAGS[name]
    help_text = flag.meaning + (f"; {detail}" if detail else "")
    kwargs: dict[str, Any] = dict(flag.argparse)
    positional = not flag.names[0].startswith("-")
    names = (dest or flag.names[0],) if positional else flag.names
    if default is not None:
        kwargs["default"] = default
        if not isinstance(default, bool):
            help_text += f" (default {default})"
    if dest is not None and not positional:
        kwargs["dest"] = dest
    if flag.metavar is not None and "choices" not in kwargs and "action" not in kwargs:
        kwargs["metavar"] = metavar or flag.metavar
    if nargs is not None:
        kwargs["nargs"] = nargs
    action = p.add_argument(*names, help=help_text, **kwargs)
    action.vocabulary = name  # type: ignore[attr-defined]  # read back by the README table
    action.vocabulary_detail = detail  # type: ignore[attr-defined]
    return action


def commands_by_flag(parser: argparse.ArgumentParser) -> dict[str, dict[str, str | None]]:
    """Shared flag → the commands that take it → what it means there besides, read off the
    built parser."""
    out: dict[str, dict[str, str | None]] = {name: {} for name in FLAGS}
    for command, sub in subcommands(parser).items():
        for action in sub._actions:
            name = getattr(action, "vocabulary", None)
            if name is not None and command not in out[name]:
                out[name][command] = getattr(action, "vocabulary_detail", None)
    return out


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def markdown(parser: argparse.ArgumentParser) -> str:
    """The vocabulary as the README's table."""
    users = commands_by_flag(parser)
    lines = ["| flag | means, in every command | taken by |", "|---|---|---|"]
    for name, flag in FLAGS.items():
        spelled = ", ".join(f"`{n}`" for n in flag.names) if flag.names[0].startswith("-") \
            else f"`{flag.metavar}`"
        if flag.names[0].startswith("-") and flag.metavar and "choices" not in flag.argparse:
            spelled += f" {flag.metavar}"
        elif "choices" in flag.argparse:
            spelled += " " + "\\|".join(flag.argparse["choices"])
        lines.append(f"| {spelled} | {flag.meaning} | {', '.join(users[name]) or '—'} |")
    lines += ["", "What `-o` writes:", ""]
    lines += [f"- `archc {command}`: {detail}" for command, detail in users["output"].items()]
    return "\n".join(lines) + "\n"
