"""Text generation as `archc run --prompt/--chat` and `archc chat` do it: flags, checks made before
the model loads, and one answer streamed to standard output as its tokens come, timed per phase.

Ctrl-C stops an answer where it is: the text so far is kept, the line is ended, and the timings
say "interrupted".
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.sources import Source
from archc.timings import Timings
from archc.ui import err_console


def add_sampling_arguments(p: Any) -> None:
    add(p, "temperature", default=0.0)
    add(p, "top_k")
    add(p, "top_p")
    add(p, "ignore_eos")


def check_text_source(source: Source, what: str) -> None:
    """Before loading: can this source take text at all?"""
    spec = source.spec
    if spec.family == "encoder":
        raise ArchcError(f"{spec.name} is an encoder: it has no output head to generate "
                         f"text with, so {what} does not apply")
    if source.random_weights:
        raise ArchcError(f"{spec.name} is a spec, not a checkpoint: its weights would be random "
                         f"and it has no tokenizer, so {what} cannot be used. Give a checkpoint "
                         "(a Hugging Face directory or a .gguf file); `archc run "
                         f"{spec.name}` alone summarizes its logits on a random prompt")
    if not source.tokenizer:
        raise ArchcError(f"{spec.name} carries no tokenizer (tokenizer.json in a Hugging Face "
                         f"directory, tokenizer.ggml.* in a GGUF file), so {what} cannot be used")


@dataclass
class Answer:
    text: str
    ids: list[int]          # the new tokens, without an end-of-sequence token
    timings: Timings


def answer(compiled: Any, prompt_ids: Sequence[int], args: argparse.Namespace, *,
           out: TextIO | None, timings: Timings | None = None) -> Answer:
    """Generate after `prompt_ids`, writing text to `out` as it becomes final. Stops at the
    model's end-of-sequence ids unless --ignore-eos, at --new-tokens, at max_seq_len, or at
    Ctrl-C."""
    model, spec, tok = compiled.model, compiled.spec, compiled.model.tokenizer
    timings = timings or Timings()
    timings.prompt_tokens = len(prompt_ids)
    room = spec.max_seq_len - (1 if spec.family == "encoder-decoder" else len(prompt_ids))
    if room < 1:
        raise ArchcError(f"the prompt is {len(prompt_ids)} tokens; {spec.name} takes at most "
                         f"{spec.max_seq_len}")
    new = min(args.new_tokens, room)
    if new < args.new_tokens and not getattr(args, "quiet", False):
        err_console.print(f"[dim]note: {new} new tokens fit in max_seq_len = "
                          f"{spec.max_seq_len}[/]", soft_wrap=True)
    eos = () if args.ignore_eos else tuple(model.eos_token_ids)
    stream = tok.stream()
    ids: list[int] = []
    seen: list[float] = []

    def write(text: str) -> None:
        if out is not None and text:
            out.write(text)
            out.flush()

    def on_token(column: torch.Tensor) -> None:
        seen.append(time.perf_counter())
        token = int(column[0])
        if token in eos:
            timings.stop_token = tok.decode([token], skip_special_tokens=False)
            return
        ids.append(token)
        write(stream.push([token]))

    start = time.perf_counter()
    stop = "interrupted"
    try:
        compiled.generate(torch.tensor([list(prompt_ids)]), new, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          eos_token_id=eos, on_token=on_token)
        stop = "eos" if timings.stop_token is not None else "length"
    except KeyboardInterrupt:
        pass
    finally:
        write(stream.flush())
        end = seen[0] if seen else time.perf_counter()
        timings.seconds["prefill"] = end - start
        if len(seen) > 1:
            timings.seconds["decode"] = seen[-1] - seen[0]
        timings.generated = len(seen)
        timings.stop = stop
    return Answer(tok.decode(ids), ids, timings)


def report(timings: Timings, quiet: bool) -> None:
    """The timings line on stderr: whole, however narrow the terminal or pipe."""
    if not quiet:
        err_console.print(f"[dim]{timings.line()}[/]", soft_wrap=True, highlight=False)


def ends_line(out: TextIO) -> None:
    out.write("\n")
    out.flush()


def interrupted_exit(timings: Timings) -> int:
    return 130 if timings.stop == "interrupted" else 0

