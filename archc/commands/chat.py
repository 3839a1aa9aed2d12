"""Talk with a model through its chat template, from a terminal or a pipe (/reset, /exit).

Each line read is a user message; the answer streams to standard output, followed by its
timings on standard error. The conversation is kept, so every answer sees the turns before it
(the oldest turns are dropped when it outgrows max_seq_len). Lines come from the terminal, with a
`> ` prompt, or from a pipe: `printf 'Hi\\n/reset\\nWho are you?\\n' | archc chat model.gguf`.
Ctrl-C stops an answer where it is: the text so far is kept, the line is ended, and the timings
say "interrupted"."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from archc.commands.common import Run, Timings
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.tokenizer import TextStream
from archc.ui import err_console

COMMANDS = {"/reset": "start a new conversation", "/exit": "end the chat, as end of input does"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source", detail="a checkpoint with a tokenizer and a chat template")
    add(p, "system", detail="the conversation's first message")
    add(p, "new_tokens", default=256, detail="at most, per answer")
    add_sampling_arguments(p)
    add(p, "seed", default=0)
    add(p, "backend", default="eager")
    add(p, "device", "dtype", "threads", "cache_dir", "quiet")
    add(p, "tp", default=1, detail="see docs/distributed.md")
    add(p, "cp", "timeout", detail="see docs/distributed.md")
    add(p, "quantize", "group", "dequantize", "kv_cache")
    add(p, "no_autotune", detail="with --backend triton")
    add(p, "json", detail="one line per turn: the message, the answer and its timings")


def add_sampling_arguments(p: Any) -> None:
    add(p, "temperature", default=0.0)
    add(p, "top_k", "top_p", "ignore_eos")


def load_for_text(args: argparse.Namespace, what: str, *, chat: bool,
                  encoder: bool = False) -> tuple[Run, Any]:
    """The model, loaded once the source is known to take text (and, for `chat`, to have a
    chat template); `what` names the flag or command that needs it; an encoder is refused
    unless `encoder` (it embeds text, and generates none)."""
    run_ = Run(args)
    spec, source = run_.spec, run_.source
    if spec.family == "encoder" and not encoder:
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
    model = run_.load()
    if chat and not model.tokenizer.chat_template:
        raise ArchcError(f"{spec.name} has no chat template, so {what} cannot be used; "
                         "`archc run SOURCE --prompt TEXT` continues plain text")
    return run_, model


def answer(compiled: Any, prompt_ids: Sequence[int], args: argparse.Namespace,
           timings: Timings, *, keep_cache: bool = False) -> list[int]:
    """The new tokens after `prompt_ids` (an end-of-sequence token left out), their text on
    standard output (unless --json) as it becomes final. Stops at the model's end-of-sequence ids
    unless --ignore-eos, at --new-tokens, at max_seq_len, or at Ctrl-C."""
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
    stream = TextStream(tok)
    ids: list[int] = []
    seen: list[float] = []

    def write(text: str) -> None:
        if text and not args.json:
            print(text, end="", flush=True)

    def on_token(column: torch.Tensor) -> None:
        seen.append(time.perf_counter())
        if int(column[0]) in eos:
            timings.stop_token = tok.decode([int(column[0])], skip_special_tokens=False)
        else:
            ids.append(int(column[0]))
            write(stream.push(ids[-1:]))

    prompt = torch.tensor([list(prompt_ids)])
    if keep_cache:      # the conversation so far is in the cache: prefill only what is new
        timings.cached_tokens = compiled.reusable(prompt, None)
    start = time.perf_counter()
    timings.stop = "interrupted"
    try:
        compiled.generate(prompt, min(args.new_tokens, room), temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                          eos_token_id=eos, on_token=on_token, keep_cache=keep_cache)
        timings.stop = "eos" if timings.stop_token is not None else "length"
    except KeyboardInterrupt:
        pass
    finally:
        write(stream.flush())
        timings.seconds["prefill"] = (seen[0] if seen else time.perf_counter()) - start
        if len(seen) > 1:
            timings.seconds["decode"] = seen[-1] - seen[0]
        timings.generated = len(seen)
    return ids


@dataclass
class Conversation:
    """The messages so far, rendered through the chat template to fit the context."""

    tok: Any
    max_tokens: int
    system: str | None
    turns: list[tuple[str, str]] = field(default_factory=list)    # (user, assistant)

    def prompt(self, user: str, room: int) -> tuple[list[int], int]:
        """Token ids of the conversation with `user` appended, leaving `room` tokens to answer
        in, after dropping the oldest turns until it fits; and how many turns were dropped."""
        dropped = 0
        while True:
            messages = [{"role": "system", "content": self.system}] if self.system else []
            for question, reply in self.turns:
                messages += [{"role": "user", "content": question},
                             {"role": "assistant", "content": reply}]
            ids = self.tok.encode_chat([*messages, {"role": "user", "content": user}])
            if len(ids) + room <= self.max_tokens or not self.turns:
                break
            self.turns.pop(0)
            dropped += 1
        if len(ids) >= self.max_tokens:
            raise ArchcError(f"the message is {len(ids)} tokens with the template; the model "
                             f"takes at most {self.max_tokens}")
        return ids, dropped


def _lines(interactive: bool) -> Iterator[str]:
    """User lines until end of input; Ctrl-C at the prompt ends the chat too."""
    while True:
        try:
            line = input("> ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            if interactive:
                print()
            return
        if not interactive and line == "":
            return
        yield line.strip()


def run(args: argparse.Namespace) -> int:
    run_, model = load_for_text(args, "archc chat", chat=True)
    compiled = run_.compile(model)
    interactive = sys.stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (line editing and history for input())

    def note(text: str) -> None:
        if not args.quiet:
            err_console.print(f"[dim]{text}[/]", soft_wrap=True)

    run_.timings.report(args.quiet)
    if interactive:
        note(f"chatting with {model.spec.name}: "
             + "; ".join(f"{c} to {what}" for c, what in COMMANDS.items()))
    talk = Conversation(model.tokenizer, model.spec.max_seq_len, args.system)
    for line in _lines(interactive):
        if line == "/exit":
            break
        if line == "/reset":
            talk.turns.clear()
            note("a new conversation")
        elif line.startswith("/") and " " not in line:
            err_console.print(f"unknown command {line}: "
                              + ", ".join(f"{c} ({what})" for c, what in COMMANDS.items()),
                              soft_wrap=True, highlight=False, markup=False)
        elif line:
            # room for an answer: --new-tokens, or a quarter of the context if less
            ids, dropped = talk.prompt(line, min(args.new_tokens, model.spec.max_seq_len // 4))
            if dropped:
                note(f"note: the {dropped} oldest turn(s) no longer fit in max_seq_len = "
                     f"{model.spec.max_seq_len} and were dropped")
            timings = Timings()
            reply = model.tokenizer.decode(answer(compiled, ids, args, timings,
                                                  keep_cache=True))
            talk.turns.append((line, reply))
            print(json.dumps({"user": line, "assistant": reply,
                              "timings": timings.as_dict()}) if args.json else "", flush=True)
            timings.report(args.quiet or args.json)
            if timings.stop == "interrupted" and not interactive:
                return 130
    return 0
