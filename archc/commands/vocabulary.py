"""The command line's shared vocabulary: every flag more than one command takes, declared once.

A command adds a shared flag with ``add(parser, name)``, never with ``add_argument``, so that it
means the same thing, takes the same values and is checked the same way — as the command line is
parsed, before any model is read — wherever it appears (a test walks the parser to hold every
command to it)."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archc.devices import DTYPES
from archc.gpus import GPU_TARGETS, GPUS


def number(kind: type, lo: float, hi: float | None = None) -> Callable[[str], Any]:
    """An argparse type: a whole number (`kind` int) or a finite number (float) that is at least
    `lo`, or with `hi`, in (lo, hi]."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {'whole' if kind is int else 'finite'} number")
        if hi is None and value < lo:
            raise argparse.ArgumentTypeError(f"{text} must be ≥ {lo:g}")
        if hi is not None and not lo < value <= hi:
            raise argparse.ArgumentTypeError(f"{text} must be in ({lo:g}, {hi:g}]")
        return value
    return parse


positive_int, nonnegative_int = number(int, 1), number(int, 0)


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


# keyed as argparse names the attribute: --prompt-len is prompt_len
FLAGS: dict[str, Flag] = {f.names[-1].lstrip("-").replace("-", "_"): f for f in (
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
    Flag(("--context",), "context length in tokens: the keys a decode step attends over", "N",
         {"type": positive_int}),
    Flag(("--dtype",), "the dtype weights and activations are computed in; default: the "
         "model's own (its spec's `dtype`, a checkpoint's), f32 when it runs on a CPU", None,
         {"choices": DTYPES}),
    Flag(("--device",), "where the model runs: cpu (kernels under Triton's interpreter), cuda "
         "or cuda:N; default: cuda when torch sees a GPU, else cpu", "DEVICE",
         {"type": device_name}),
    Flag(("--backend",), "what runs the model: eager (PyTorch ops, the reference) or triton "
         "(the generated kernels)", None, {"choices": ("eager", "triton")}),
    Flag(("--passes",), "the pass pipeline: default, none, or pass names separated by commas, "
         "one given options as NAME:OPTION=N (`shard:tp=2`; `archc passes --list`)", "PIPELINE"),
    Flag(("--tp",), "tensor-parallel GPUs: the model split over N ranks (heads, FFN columns, "
         "vocabulary): run and chat start N processes (or join torchrun's), the others price "
         "each rank's program", "N", {"type": positive_int}),
    Flag(("--gpu",), "the GPU the roofline models: " + ", ".join(GPUS), "MODEL"),
    Flag(("--seed",), "seed of random weights, random prompts and sampling", "N",
         {"type": nonnegative_int}),
    Flag(("--threads",), "CPU threads torch may use", "N", {"type": positive_int}),
    Flag(("--cp",), "context-parallel ranks: the sequence split over M processes (ring "
         "attention), each also --tp wide", "M", {"type": positive_int, "default": 1}),
    Flag(("--timeout",), "seconds a rank of a --tp/--cp run waits for the others (to start, or "
         "in a collective) before the run stops with an error", "SECONDS",
         {"type": number(float, 0, 86400), "default": 120.0}),
    Flag(("--temperature",), "sampling temperature; 0 picks the likeliest token", "T",
         {"type": number(float, 0)}),
    Flag(("--top-k",), "sample among the K likeliest tokens", "K", {"type": positive_int}),
    Flag(("--top-p",), "sample among the likeliest tokens holding P of the probability", "P",
         {"type": number(float, 0, 1)}),
    Flag(("--ignore-eos",), "keep generating past the checkpoint's end-of-sequence tokens",
         None, {"action": "store_true"}),
    Flag(("-o", "--output"), "where to write: a path; each command says whether a file or a "
         "directory, and what goes there", "PATH", {"type": Path}),
    Flag(("--json",), "print the results as JSON on standard output, in place of tables and "
         "text", None, {"action": "store_true"}),
    Flag(("--quiet",), "print no notes, progress or timings on standard error", None,
         {"action": "store_true"}),
    Flag(("--no-autotune",), "launch every kernel at its heuristic block sizes: no tuning on "
         "a GPU (by default the first run tunes the matmuls and prefill attention and caches the "
         "choices on disk)",
         None, {"action": "store_true"}),
    Flag(("--quantize",), "quantize the weights of linear layers and experts as they load: "
         "weight-only, round-to-nearest, int8 per output channel or int4 in groups of --group",
         None, {"choices": ("int8", "int4")}),
    Flag(("--group",), "elements per int4 scale with --quantize int4", None,
         {"type": int, "choices": (32, 64, 128)}),
    Flag(("--dequantize",), "read a GGUF file's quantized tensors as floats, dequantized at "
         "load (by default they stay quantized and the kernels dequantize them)", None,
         {"action": "store_true"}),
    Flag(("--kv-cache",), "hold the KV cache in int8 (a scale per token and head) or fp8 e4m3 "
         "(GPUs from sm_89) instead of the compute dtype", None,
         {"choices": ("int8", "fp8")}),
    Flag(("--cache-dir",), "where generated kernel modules are written (default: the kernel "
         "cache, `archc cache`)", "DIR", {"type": Path}),
    Flag(("--target",), "compile every unique kernel ahead of time for this GPU, without one: "
         "registers, spills, shared memory, tensor-core instructions (sm_80 A100, sm_90a Hopper, "
         "sm_100a Blackwell)", None, {"choices": tuple(GPU_TARGETS)}),
    Flag(("--jobs",), "ahead-of-time compiles run in parallel with --target", "N",
         {"type": positive_int}),
)}


def add(p: Any, *names: str, default: Any = None, detail: str | None = None,
        dest: str | None = None, **options: Any) -> None:
    """Add shared flags `names` to parser (or argument group) `p`. `detail`: what a flag means
    for this command besides (what `-o` writes); a `default` is said in the help text. `dest`
    names a second positional SOURCE (`archc diff SOURCE_A SOURCE_B`); `options` go to argparse."""
    for name in names:
        flag = FLAGS[name]
        kwargs: dict[str, Any] = {**flag.argparse, **options,
                                  "help": flag.meaning + (f"; {detail}" if detail else "")}
        if default is not None:
            kwargs["default"] = default
            kwargs["help"] += f" (default {default})"
        if flag.metavar is not None and "choices" not in kwargs:
            kwargs["metavar"] = dest.upper() if dest else flag.metavar
        positional = not flag.names[0].startswith("-")
        action = p.add_argument(*((dest or name,) if positional else flag.names), **kwargs)
        action.vocabulary = name  # read back by the README table and the tests
        action.vocabulary_detail = detail


def commands_by_flag(parser: argparse.ArgumentParser) -> dict[str, dict[str, str | None]]:
    """Shared flag → the commands that take it → what it means there besides."""
    out: dict[str, dict[str, str | None]] = {name: {} for name in FLAGS}
    for command, sub in subcommands(parser).items():
        for action in sub._actions:
            if hasattr(action, "vocabulary"):
                out[action.vocabulary].setdefault(command, action.vocabulary_detail)
    return out


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(dict(a.choices) for a in parser._actions
                if isinstance(a, argparse._SubParsersAction))


def markdown(parser: argparse.ArgumentParser) -> str:
    """The vocabulary as the README's table."""
    users = commands_by_flag(parser)
    lines = ["| flag | means, in every command | taken by |", "|---|---|---|"]
    for name, flag in FLAGS.items():
        spelled = ", ".join(f"`{n}`" for n in flag.names) if flag.names[0].startswith("-") \
            else f"`{flag.metavar}`"
        if "choices" in flag.argparse:
            spelled += " " + "\\|".join(map(str, flag.argparse["choices"]))
        elif flag.names[0].startswith("-") and flag.metavar:
            spelled += f" {flag.metavar}"
        lines.append(f"| {spelled} | {flag.meaning} | {', '.join(users[name]) or '—'} |")
    lines += ["", "What `-o` writes:", ""]
    lines += [f"- `archc {command}`: {detail}" for command, detail in users["output"].items()]
    return "\n".join(lines) + "\n"
