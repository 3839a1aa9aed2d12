"""`archc run SOURCE`: run a model. With --prompt or --chat it generates text, streamed to the
terminal as tokens come, and reports tokens/s; without, it summarizes the next-token logits of a
random prompt."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from rich.table import Table

import archc
from archc.commands.common import positive_int
from archc.ui import console, err_console, progress

NAME = "run"
HELP = "run a model: generate text from a prompt, or summarize its next-token logits"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE", help="a Hugging Face model directory, a .gguf "
                   "file, a spec YAML path or zoo name (specs get random weights)")
    p.add_argument("--backend", default="eager", help="eager (default)")
    p.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f32",
                   help="compute dtype (default f32)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of random weights, random prompt and sampling (default 0)")
    p.add_argument("--threads", type=positive_int, metavar="N",
                   help="CPU threads for torch (default: torch's choice; 1 is often fastest "
                   "for decoding small models on a busy machine)")
    text = p.add_argument_group("text generation (needs a tokenizer)")
    what = text.add_mutually_exclusive_group()
    what.add_argument("--prompt", metavar="TEXT", help="continue this text")
    what.add_argument("--chat", metavar="TEXT",
                      help="answer this user message through the model's chat template")
    text.add_argument("--system", metavar="TEXT", help="with --chat: a system message")
    text.add_argument("--max-new-tokens", type=positive_int, default=128, metavar="N",
                      help="stop after N new tokens (default 128)")
    text.add_argument("--temperature", type=float, default=0.0,
                      help="sampling temperature; 0 picks the likeliest token (default 0)")
    text.add_argument("--top-k", type=positive_int, metavar="K",
                      help="sample among the K likeliest tokens")
    text.add_argument("--top-p", type=float, metavar="P",
                      help="sample among the likeliest tokens holding P of the probability")
    logits = p.add_argument_group("logits summary (without --prompt/--chat)")
    logits.add_argument("--tokens", type=positive_int, default=8,
                        help="length of the random prompt (default 8)")
    logits.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    logits.add_argument("--decode", type=int, default=4,
                        help="greedy decode steps after the prompt (default 4)")


def _load(args: argparse.Namespace) -> archc.Model:
    if not err_console.is_terminal:  # no bar in logs and pipes
        model = archc.load(args.source, seed=args.seed)
    else:
        with progress() as bar:
            task = bar.add_task("loading weights", total=None)

            def report(done: int, total: int) -> None:
                bar.update(task, completed=done, total=total)

            model = archc.load(args.source, seed=args.seed, progress=report)
    for note in model.notes:
        err_console.print(f"[dim]note: {note}[/]")
    return model


def run(args: argparse.Namespace) -> int:
    if args.system is not None and args.chat is None:
        raise archc.ArchcError("--system goes with --chat")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = _load(args)
    if args.prompt is not None or args.chat is not None:
        return _generate_text(args, model)
    return _summarize(args, model)


# ---- text generation ---------------------------------------------------------------------------

def _generate_text(args: argparse.Namespace, model: archc.Model) -> int:
    spec, tok = model.spec, model.tokenizer
    if spec.family == "encoder":
        raise archc.ArchcError(f"{spec.name} is an encoder: it has no output head to generate "
                               "text with")
    if tok is None:
        raise archc.ArchcError(f"{args.source} has no tokenizer (tokenizer.json in a Hugging "
                               "Face directory, tokenizer.ggml.* in a GGUF file); --prompt and "
                               "--chat need one")
    if args.chat is not None:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.chat}]
        ids = tok.encode_chat(messages)
    else:
        ids = tok.encode(args.prompt)
    if not ids:
        raise archc.ArchcError("the prompt encodes to no tokens")
    room = spec.max_seq_len - (1 if spec.family == "encoder-decoder" else len(ids))
    if room < 1:
        raise archc.ArchcError(f"the prompt is {len(ids)} tokens; {spec.name} takes at most "
                               f"{spec.max_seq_len}")
    new = min(args.max_new_tokens, room)
    if new < args.max_new_tokens:
        err_console.print(f"[dim]note: {new} new tokens fit in max_seq_len = "
                          f"{spec.max_seq_len}[/]")
    compiled = model.compile(args.backend, dtype=args.dtype)
    stream = tok.stream()
    eos = set(model.eos_token_ids)
    times: list[float] = []

    def on_token(column: torch.Tensor) -> None:
        times.append(time.perf_counter())
        token = int(column[0])
        if token in eos:
            return
        sys.stdout.write(stream.push([token]))
        sys.stdout.flush()

    if args.prompt is not None and spec.family == "decoder":
        sys.stdout.write(args.prompt)
        sys.stdout.flush()
    start = time.perf_counter()
    compiled.generate(torch.tensor([ids]), new, temperature=args.temperature, top_k=args.top_k,
                      top_p=args.top_p, seed=args.seed, eos_token_id=sorted(eos) or None,
                      on_token=on_token)
    sys.stdout.write(stream.flush() + "\n")
    sys.stdout.flush()
    _report_speed(len(ids), start, times)
    return 0


def _report_speed(prompt_tokens: int, start: float, times: list[float]) -> None:
    if not times:
        return
    prefill = times[0] - start
    decoded = len(times) - 1
    line = f"prompt: {prompt_tokens} tokens in {prefill:.2f} s"
    if decoded:
        decode = times[-1] - times[0]
        line += (f"; generated {len(times)} tokens, {decoded / decode:.1f} tokens/s after the "
                 f"first ({decode:.2f} s)")
    err_console.print(f"[dim]{line}[/]")


# ---- logits summary ----------------------------------------------------------------------------

def _summarize(args: argparse.Namespace, model: archc.Model) -> int:
    spec = model.spec
    if args.tokens + max(args.decode, 0) > spec.max_seq_len:
        raise archc.ArchcError(f"--tokens {args.tokens} + --decode {args.decode} exceed "
                               f"max_seq_len = {spec.max_seq_len}")
    compiled = model.compile(args.backend, dtype=args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.tokens), generator=gen)
    t0 = time.perf_counter()
    out: Any
    if spec.family == "encoder-decoder":
        out = compiled(ids, decoder_input_ids=ids[:, :1])
    else:
        out = compiled(ids)
    elapsed = time.perf_counter() - t0
    weights = f"random weights (seed {args.seed})" if model.source == spec.name else \
        f"weights from {model.source}"
    console.print(f"[bold]{spec.name}[/] on {args.backend} ({args.dtype}), {weights}, "
                  f"prompt of {args.tokens} random tokens: {elapsed * 1e3:.1f} ms")
    last = out[0, -1].float()
    console.print(f"output [B, T, {'d' if spec.family == 'encoder' else 'vocab'}] = "
                  f"{list(out.shape)}; last position: mean {last.mean():.4f}, "
                  f"std {last.std():.4f}, min {last.min():.4f}, max {last.max():.4f}")
    if spec.family == "encoder":
        return 0
    top = last.softmax(-1).topk(5)
    table = Table(title="next token (top 5)", title_justify="left")
    for col in ("token id", "logit", "probability"):
        table.add_column(col, justify="right")
    for p, i in zip(top.values.tolist(), top.indices.tolist()):
        table.add_row(str(i), f"{last[i]:.4f}", f"{p:.4f}")
    console.print(table)
    if args.decode > 0 and spec.family == "decoder":
        t0 = time.perf_counter()
        seq = compiled.generate(ids, args.decode)
        elapsed = time.perf_counter() - t0
        mixers = set(spec.all_mixers)
        carried = " and ".join(([] if not spec.softmax_attends else ["the KV cache"]) +
                               ([] if mixers <= {"attention"} else ["the recurrent state"]))
        console.print(f"greedy continuation: {seq[0, args.tokens:].tolist()} "
                      f"({args.decode} tokens in {elapsed:.2f} s, prefill + "
                      f"{args.decode - 1} decode steps with {carried})")
    return 0
