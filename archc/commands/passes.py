"""Run the pass pipeline on a model and show, per pass, nodes, kernels, parameters, FLOPs and
bytes per token, and what changed."""

from __future__ import annotations

import argparse
from collections import Counter

from rich.markup import escape

from archc.commands.common import quant_of
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.ir.cost import node_cost
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.ir.ops.base import COLLECTIVE
from archc.ir.shapes import evaluate
from archc.passes import DEFAULT_PIPELINE, PASSES, run_pipeline
from archc.passes.decisions import changed
from archc.passes.manager import known
from archc.passes.measure import dims, kernels_per_layer, stats
from archc.ui import console, nbytes, si, table


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "passes", default="default", detail="Passes: " + known(pipelines=False))
    add(p, "dtype")
    add_quant_arguments(p)


def add_quant_arguments(p: argparse.ArgumentParser) -> None:
    """--quantize and --group: lower the program with the weights `archc.load(quantize=...)`
    would quantize held in their scheme (a quantized source's own schemes without them)."""
    add(p, "quantize", detail="here: price the weights as they would be quantized")
    add(p, "group", detail="default 128")


def add_dims_arguments(p: argparse.ArgumentParser) -> None:
    """Where costs are evaluated: a call on T new tokens after P cached, B sequences."""
    add(p, "batch", default=1)
    add(p, "prompt_len", default=1, detail="costs are of one call on N new tokens, T = N "
        "(1: a decode step)")
    add(p, "past", default=0)
    add(p, "encoder_len", detail="default: --prompt-len")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source", nargs="?")
    p.add_argument("--list", action="store_true",
                   help="list the registered passes and the default pipeline, then exit")
    add_pipeline_arguments(p)
    add(p, "tp", default=1, detail="the shard pass runs first; costs are one rank's")
    add_dims_arguments(p)


def _weights(quant: dict[str, str]) -> str:
    """`, weights int4_g128 ×225` when weights are quantized."""
    counts = Counter(quant.values()).most_common()
    return ", weights " + ", ".join(f"{s} ×{n}" for s, n in counts) if counts else ""


def run(args: argparse.Namespace) -> int:
    if args.list:
        columns = ("pass", "kind", "in default", "what it does")
        console.print(table("passes (the default pipeline runs them in this order)", columns, [
            (PASSES[name].usage(), PASSES[name].kind, "yes" if name in DEFAULT_PIPELINE else "",
             escape(PASSES[name].summary))
            for name in [*DEFAULT_PIPELINE, *sorted(set(PASSES) - set(DEFAULT_PIPELINE))]],
            text=columns, overflow="fold"))
        return 0
    if args.source is None:
        raise ArchcError("give a SOURCE (a zoo name, spec YAML, HF directory or .gguf file), "
                         "or --list")
    spec, quant = quant_of(args)
    dtype = args.dtype or spec.dtype
    at = dims(args.batch, args.prompt_len, args.past, args.encoder_len)
    lowered = lower(spec, dtype, quant)
    result = run_pipeline(lowered, f"shard:tp={args.tp},{args.passes}" if args.tp > 1 else
                          args.passes)
    where = f"B={at['B']}, T={at['T']}, P={at['P']}" + (
        f", S={at['S']}" if spec.family == "encoder-decoder" else "")
    rows = [("", "lowered", "", stats(lowered, at), "unfused")]
    for k, step in enumerate(result.steps, 1):
        rows.append((str(k), step.name, step.kind, stats(step.after, at), changed(step)))
    console.print(table(
        f"{spec.name}: pass pipeline ({dtype}{_weights(quant)}; costs per new token at "
        f"{where})",
        ("#", "pass", "kind", "nodes", "kernels", "params", "FLOPs/token", "bytes/token",
         "changed"),
        [(num, name, kind, str(st.nodes), str(st.kernels), si(st.params),
          si(st.flops_per_token, "FLOP"), nbytes(st.bytes_per_token), escape(what))
         for num, name, kind, st, what in rows],
        text=("pass", "kind", "changed"), overflow="fold"))
    before, after = kernels_per_layer(spec, args.passes, dtype)
    console.print(f"kernels per block (embedding and head aside): {before:g} unfused → "
                  f"{after:g} after the pipeline")
    if args.tp > 1:
        _communicated(result.program, at, args.tp)
    return 0


def _communicated(program: Program, at: dict[str, int], tp: int) -> None:
    """What one rank of a tensor-parallel program sends to the others per new token (counted
    in the bytes/token column too), by collective."""
    tokens = at["B"] * at["T"]
    sent: Counter[str] = Counter()
    for g in program:
        for i in g.compute_ids():
            if g.nodes[i].op in COLLECTIVE:
                sent[g.nodes[i].op.value] += int(evaluate(node_cost(g, i).bytes, at))
    by_op = ", ".join(f"{op} {nbytes(n / tokens)}" for op, n in sent.items())
    console.print(f"tensor parallel over {tp} ranks: each rank sends "
                  f"{nbytes(sum(sent.values()) / tokens)} per token over the link ({by_op})")
