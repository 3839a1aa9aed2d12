"""Text generation as `archc run --prompt/--chat` and `archc chat` do it: sampling flags, checks
made before the model loads, and one answer streamed to standard output as its tokens come,
timed per phase as llama.cpp reports it — one line on standard error, never wrapped, so that a
log keeps it whole. Prefill runs from the start of generation to the first new token; decode,
from the first new token to the last.

Ctrl-C stops an answer where it is: the text so far is kept, the line is ended, and the timings
say "interrupted".
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.sources import Source
from archc.ui import err_console

STOPS = {"eos": "stopped at end-of-sequence", "length": "stopped at the token limit",
         "interrupted": "interrupted"}


@dataclass
class Timings:
    seconds: dict[str, float] = field(default_factory=dict)   # load, compile, prefill, decode
    prompt_tokens: int = 0
    generated: int = 0              # new tokens, the first of them from the prefill
    stop: str | None = None         # a key of STOPS
    stop_token: str | None = None   # the end-of-sequence token's text

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def tokens(self, phase: str) -> int:
        return self.prompt_tokens if phase == "prefill" else max(self.generated - 1, 0)

    def tokens_per_second(self) -> dict[str, float]:
        return {p: self.tokens(p) / self.seconds[p] for p in ("prefill", "decode")
                if self.seconds.get(p) and self.tokens(p)}

    def line(self) -> str:
        """`load 0.41 s · compile 0.02 s · prefill 37 tokens in 0.80 s (46.3 tokens/s) · …`"""
        rates = self.tokens_per_second()
        parts = []
        for name, s in self.seconds.items():
            n = self.tokens(name)
            parts.append((f"{name} {s:.2f} s" if name in ("load", "compile") else
                          f"{name} {n} token{'' if n == 1 else 's'} in {s:.2f} s") +
                         (f" ({rates[name]:.3g} tokens/s)" if name in rates else ""))
        if self.stop is not None:
            parts.append(STOPS[self.stop] + (f" ({self.stop_token})" if self.stop_token else ""))
        return " · ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "prompt_tokens": self.prompt_tokens,
                "generated_tokens": self.generated,
                "tokens_per_second": self.tokens_per_second(), "stop": self.stop}


def report(timings: Timings, quiet: bool) -> None:
    """The timings line on stderr: whole, however narrow the terminal or pipe."""
    if not quiet:
        err_console.print(f"[dim]{timings.line()}[/]", soft_wrap=True, highlight=False)


def add_sampling_arguments(p: Any) -> None:
    add(p, "temperature", default=0.0)
    add(p, "top_k", "top_p", "ignore_eos")


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


def answer(compiled: Any, prompt_ids: Sequence[int], args: argparse.Namespace,
           timings: Timings, *, out: TextIO | None) -> Answer:
    """Generate after `prompt_ids`, writing text to `out` as it becomes final. Stops at the
    model's end-of-sequence ids unless --ignore-eos, at --new-tokens, at max_seq_len, or at
    Ctrl-C."""
    spec, tok = compiled.spec, compiled.model.tokenizer
    timings.prompt_tokens = len(prompt_ids)
    room = spec.max_seq_len - (1 if spec.family == "encoder-decoder" else len(prompt_ids))
    if room < 1:
        raise ArchcError(f"the prompt is {len(prompt_ids)} tokens; {spec.name} takes at most "
                         f"{spec.max_seq_len}")
    if room < args.new_tokens and not args.quiet:
        err_console.print(f"[dim]note: {room} new tokens fit in max_seq_len = "
                          f"{spec.max_seq_len}[/]", soft_wrap=True)
    eos = () if args.ignore_eos else tuple(compiled.model.eos_token_ids)
    stream = tok.stream()
    ids: list[int] = []
    seen: list[float] = []

    def write(text: str) -> None:
        if out is not None and text:
            out.write(text)
            out.flush()

    def on_token(column: torch.Tensor) -> None:
        seen.append(time.perf_counter())
        if int(column[0]) in eos:
            timings.stop_token = tok.decode([int(column[0])], skip_special_tokens=False)
        else:
            ids.append(int(column[0]))
            write(stream.push(ids[-1:]))

    start = time.perf_counter()
    timings.stop = "interrupted"
    try:
        compiled.generate(torch.tensor([list(prompt_ids)]), min(args.new_tokens, room),
                          temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          seed=args.seed, eos_token_id=eos, on_token=on_token)
        timings.stop = "eos" if timings.stop_token is not None else "length"
    except KeyboardInterrupt:
        pass
    finally:
        write(stream.flush())
        timings.seconds["prefill"] = (seen[0] if seen else time.perf_counter()) - start
        if len(seen) > 1:
            timings.seconds["decode"] = seen[-1] - seen[0]
        timings.generated = len(seen)
    return Answer(tok.decode(ids), ids)
