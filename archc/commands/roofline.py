"""`archc roofline SOURCE`: roofline time of every kernel, prefill and decode, on a modelled
GPU."""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table

from archc.commands.common import inspection_dtype, spec_of
from archc.commands.passes import add_pipeline_arguments
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.passes import optimize
from archc.perf.gpus import gpu
from archc.perf.roofline import KernelGroup, decode_floor, grouped, kernels, per_step
from archc.spec.schema import Spec
from archc.ui import console, nbytes, si

NAME = "roofline"
HELP = "roofline time per kernel for prefill and one decode step, and the decode floor"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add(p, "gpu", default="h200")
    add(p, "batch", default=1)
    add(p, "prompt_len", default=512)
    add(p, "new_tokens", default=128, detail="the decode step priced is the last")
    add(p, "dtype")
    add_pipeline_arguments(p)


def _table(title: str, rows: list[KernelGroup]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("kernel", "reads", "launches", "FLOPs", "bytes", "FLOP/B", "bound", "time"):
        t.add_column(col, justify="left" if col in ("kernel", "reads", "bound") else "right")
    for r in rows:
        t.add_row(r.op, escape(r.label), str(r.launches), si(r.flops), nbytes(r.bytes),
                  f"{r.intensity:.1f}", r.bound, f"{r.time * 1e6:.1f} µs")
    return t


def duration(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.2f} µs"


def program_for(spec: Spec, dtype: str, passes: str) -> tuple[Program, str]:
    program = lower(spec, dtype)
    if passes == "none":
        return program, "unfused"
    kind = "kernel-level (default passes)" if passes == "default" else f"after {passes}"
    return optimize(program, passes), kind


def run(args: argparse.Namespace) -> int:
    g = gpu(args.gpu)
    spec = spec_of(args)
    if spec.family == "encoder" and args.new_tokens:
        raise ArchcError(f"{spec.name} is an encoder: it does not decode (use --new-tokens 0)")
    if args.prompt_len + args.new_tokens > spec.max_seq_len:
        raise ArchcError(f"--prompt-len {args.prompt_len} + --new-tokens {args.new_tokens} "
                         f"exceed max_seq_len = {spec.max_seq_len}")
    dtype = inspection_dtype(args, spec)
    program, kind = program_for(spec, dtype, args.passes)
    b, n, m = args.batch, args.prompt_len, args.new_tokens
    console.print(f"[bold]{spec.name}[/] on {g.name} ({si(g.peak_flops, 'FLOP/s')} "
                  f"{dtype}, {si(g.bandwidth, 'B/s')}; ridge {g.ridge:.0f} FLOP/B), "
                  f"{kind} graph, batch {b}")
    prefill = kernels(program, {"B": b, "T": n, "P": 0, "S": n})
    rows = grouped(prefill, g)
    t_prefill = sum(r.time for r in rows)
    console.print(_table(f"prefill: {n} tokens", rows))
    flops = sum(r.flops for r in rows)
    console.print(f"prefill: {si(flops, 'FLOP')}, {nbytes(sum(r.bytes for r in rows))}, "
                  f"roofline {duration(t_prefill)} = {flops / t_prefill / 1e12:.0f} TFLOP/s, "
                  f"{b * n / t_prefill:,.0f} tokens/s")
    if m == 0 or spec.family == "encoder":
        return 0
    past = n + m - 1  # the last (slowest) step
    # a step runs the decoder alone: the encoder and cross-KV graphs ran once, in the prefill
    step = grouped(kernels(per_step(program), {"B": b, "T": 1, "P": past, "S": n}), g)
    t_step = sum(r.time for r in step)
    console.print(_table(f"one decode step at context {past + 1}", step))
    floor = decode_floor(program, g, b, past)
    parts = [f"weights {nbytes(floor.weight_bytes)}"]
    if floor.kv_bytes or not floor.state_bytes:
        parts.append(f"KV cache {nbytes(floor.kv_bytes)}")
    if floor.state_bytes:
        parts.append(f"recurrent state {nbytes(floor.state_bytes)} (read and written)")
    console.print(f"decode step: {si(sum(r.flops for r in step), 'FLOP')}, "
                  f"{nbytes(sum(r.bytes for r in step))}, "
                  f"roofline {duration(t_step)} ({b / t_step:,.0f} tokens/s); "
                  f"floor {duration(floor.seconds)} = {' + '.join(parts)} at "
                  f"{si(g.bandwidth, 'B/s')} → {floor.tokens_per_second:,.0f} tokens/s")
    return 0
