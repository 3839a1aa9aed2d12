"""Roofline time per kernel, on a modelled GPU, for prefill and one decode step, and the decode
floor."""

from __future__ import annotations

import argparse
from collections import Counter

from rich.markup import escape

from archc.commands.common import quant_of
from archc.commands.defaults import fit_lengths
from archc.commands.passes import add_pipeline_arguments
from archc.commands.vocabulary import add
from archc.gpus import GPU, gpu
from archc.ir import cost
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.passes import optimize
from archc.passes.shard import shard_program
from archc.perf.roofline import decode_floor, grouped, kernels, per_step
from archc.perf.summary import fmt_seconds
from archc.report.facts import expanded_kv_bytes_per_token
from archc.spec.schema import Spec
from archc.ui import console, nbytes, si, table

# a real model's prefill and decode; a shorter max_seq_len fits them (`fit_lengths`)
PROMPT_LEN, NEW_TOKENS = 512, 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add(p, "gpu", default="h200")
    add(p, "batch", default=1)
    add(p, "prompt_len", detail=f"default {PROMPT_LEN}, less where max_seq_len is shorter")
    add(p, "new_tokens", detail=f"the decode step priced is the last (default {NEW_TOKENS}, less "
        "where max_seq_len is shorter; an encoder does not decode)")
    add(p, "kv_cache")
    add(p, "tp", default=1, detail="costs, weights and the floor are one GPU's, its "
        "collectives priced at the link's bandwidth")
    add_pipeline_arguments(p)


def _priced(title: str, program: Program, dims: dict[str, int],
            g: GPU) -> tuple[float, float, str]:
    """Print the kernels of `program` at `dims` as a table; return their roofline time, FLOPs
    and totals in words."""
    rows = grouped(kernels(program, dims), g)
    console.print(table(
        title, ("kernel", "reads", "launches", "FLOPs", "bytes", "FLOP/B", "bound", "time"),
        [(r.op, escape(r.label), str(r.launches), si(r.flops), nbytes(r.bytes),
          f"{r.intensity:.1f}", r.bound, f"{r.time * 1e6:.1f} µs") for r in rows],
        text=("kernel", "reads", "bound")))
    seconds, flops = sum(r.time for r in rows), sum(r.flops for r in rows)
    link = sum(r.bytes for r in rows if r.bound == "link")    # sent to other GPUs, not HBM
    hbm = sum(r.bytes for r in rows) - link
    return seconds, flops, f"{si(flops, 'FLOP')}, {nbytes(hbm)}" + (
        f" + {nbytes(link)} over the link" if link else "") + f", roofline {fmt_seconds(seconds)}"


def run(args: argparse.Namespace) -> int:
    g = gpu(args.gpu)
    spec, quant = quant_of(args)
    b = args.batch
    n, m = fit_lengths(spec, args.prompt_len, args.new_tokens, (PROMPT_LEN, NEW_TOKENS))
    dtype = args.dtype or spec.dtype
    kind = {"none": "unfused", "default": "kernel-level (default passes)"}.get(
        args.passes, f"after {args.passes}")
    tp = args.tp
    program = _program(spec, dtype, quant, args.passes, getattr(args, "kv_cache", None), tp)
    on = f"{tp} × {g.name}, tensor parallel (each GPU's share; link {si(g.link, 'B/s')} each " \
         f"way)" if tp > 1 else g.name
    console.print(f"[bold]{spec.name}[/] on {on} ({si(g.peak_flops, 'FLOP/s')} {dtype}, "
                  f"{si(g.bandwidth, 'B/s')}; ridge {g.ridge:.0f} FLOP/B), {kind} graph, batch {b}")
    seconds, flops, totals = _priced(f"prefill: {n} tokens", program,
                                     {"B": b, "T": n, "P": 0, "S": n}, g)
    console.print(f"prefill: {totals} = {flops / seconds / 1e12:.0f} TFLOP/s, "
                  f"{b * n / seconds:,.0f} tokens/s")
    if m == 0:
        return 0
    past = n + m - 1  # the last (slowest) step
    # a step runs the decoder alone: the encoder and cross-KV graphs ran once, in the prefill
    seconds, _, totals = _priced(f"one decode step at context {past + 1}", per_step(program),
                                 {"B": b, "T": 1, "P": past, "S": n}, g)
    floor = decode_floor(program, g, b, past)
    parts = [f"weights {nbytes(floor.weight_bytes)}"]
    if floor.kv_bytes or not floor.state_bytes:
        parts.append(f"KV cache {nbytes(floor.kv_bytes)}")
    if floor.state_bytes:
        parts.append(f"recurrent state {nbytes(floor.state_bytes)} (read and written)")
    link = f" + collectives {nbytes(floor.link_bytes)} sent at {si(g.link, 'B/s')} " \
           f"({fmt_seconds(floor.link_seconds)})" if floor.link_bytes else ""
    console.print(f"decode step: {totals} ({b / seconds:,.0f} tokens/s); floor "
                  f"{fmt_seconds(floor.seconds)} = {' + '.join(parts)} at "
                  f"{si(g.bandwidth, 'B/s')}{link} → {floor.tokens_per_second:,.0f} tokens/s")
    if (mha := expanded_kv_bytes_per_token(spec, dtype, getattr(args, "kv_cache", None))):
        latent = cost.kv_cache_bytes_per_token(program) * b * (past + 1)
        mha *= b * (past + 1) // tp
        console.print(f"latent KV cache at context {past + 1}: {nbytes(latent)} (the latents "
                      f"and RoPE keys) against {nbytes(mha)} of per-head keys and values "
                      f"({mha / latent:.1f}× more)")
    if tp > 1:
        console.print(f"per GPU: weights {nbytes(floor.weight_bytes)} read per step, "
                      f"collectives {fmt_seconds(floor.link_seconds)} of the "
                      f"{fmt_seconds(floor.seconds)} floor")
    if quant:
        dense = decode_floor(_program(spec, dtype, {}, args.passes, tp=tp), g, b, past)
        schemes = ", ".join(f"{s} ×{k}" for s, k in Counter(quant.values()).most_common())
        console.print(f"quantized weights ({schemes}): decode floor {fmt_seconds(floor.seconds)}"
                      f" against {fmt_seconds(dense.seconds)} with {dtype} weights (weights "
                      f"{nbytes(dense.weight_bytes)}) → {dense.seconds / floor.seconds:.2f}× "
                      "faster")
    return 0


def _program(spec: Spec, dtype: str, quant: dict[str, str], passes: str,
             kv_cache: str | None = None, tp: int = 1) -> Program:
    """The program priced: lowered with `quant`'s weights quantized and the KV cache in
    `kv_cache` (None: the compute dtype), split over `tp` ranks (one rank's), after `passes`."""
    program = shard_program(lower(spec, dtype, quant, kv_cache=kv_cache), tp)
    return program if passes == "none" else optimize(program, passes)
