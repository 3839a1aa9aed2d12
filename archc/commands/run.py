"""`archc run SOURCE`: run a model and show what it predicts."""

from __future__ import annotations

import argparse
import time

import torch
from rich.table import Table

import archc
from archc.commands.common import positive_int
from archc.ui import console

NAME = "run"
HELP = "run a model (random weights for a spec) and summarize its next-token logits"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE", help="a spec YAML path or zoo name")
    p.add_argument("--backend", default="eager", help="eager (default)")
    p.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f32",
                   help="compute dtype (default f32)")
    p.add_argument("--tokens", type=positive_int, default=8,
                   help="length of the random prompt (default 8)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--decode", type=int, default=4,
                   help="greedy decode steps after the prompt (default 4)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and prompt (default 0)")


def run(args: argparse.Namespace) -> int:
    model = archc.load(args.source, seed=args.seed)
    spec = model.spec
    if args.tokens + max(args.decode, 0) > spec.max_seq_len:
        raise archc.ArchcError(f"--tokens {args.tokens} + --decode {args.decode} exceed "
                               f"max_seq_len = {spec.max_seq_len}")
    compiled = model.compile(args.backend, dtype=args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, spec.vocab_size, (args.batch, args.tokens), generator=gen)
    t0 = time.perf_counter()
    if spec.family == "encoder-decoder":
        out = compiled(ids, decoder_input_ids=ids[:, :1])
    else:
        out = compiled(ids)
    elapsed = time.perf_counter() - t0
    console.print(f"[bold]{spec.name}[/] on {args.backend} ({args.dtype}), random weights "
                  f"(seed {args.seed}), prompt of {args.tokens} random tokens: "
                  f"{elapsed * 1e3:.1f} ms")
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
        console.print(f"greedy continuation: {seq[0, args.tokens:].tolist()} "
                      f"({args.decode} tokens in {elapsed:.2f} s, prefill + "
                      f"{args.decode - 1} decode steps with the KV cache)")
    return 0
