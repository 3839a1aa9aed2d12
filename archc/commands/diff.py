"""`archc diff SOURCE_A SOURCE_B`: two models side by side, every number from their IR."""

from __future__ import annotations

import argparse

from rich.table import Table

from archc.commands.common import inspection_dtype, spec_of
from archc.commands.passes import add_dims_arguments, add_pipeline_arguments
from archc.commands.vocabulary import add
from archc.ir.lower import lower
from archc.passes import optimize
from archc.passes.measure import dims, kernels_per_layer, stats
from archc.ui import console, nbytes, si

NAME = "diff"
HELP = "compare two models side by side after the pass pipeline: nodes, kernels, parameters, " \
       "FLOPs, bytes moved and KV-cache bytes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source", dest="source_a", metavar="SOURCE_A")
    add(p, "source", dest="source_b", metavar="SOURCE_B")
    add_pipeline_arguments(p)
    add_dims_arguments(p)


def _ratio(a: float, b: float) -> str:
    if a == b:
        return "="
    if a == 0:
        return "new"
    return f"×{b / a:.3g}"


def run(args: argparse.Namespace) -> int:
    specs = [spec_of(args, "source_a"), spec_of(args, "source_b")]
    at = dims(args.batch, args.prompt_len, args.past, args.encoder_len)
    rows: list[tuple[str, list[float], str]] = []
    facts = []
    for s in specs:
        dtype = inspection_dtype(args, s)
        program = optimize(lower(s, dtype), args.passes)
        facts.append((stats(program, at), kernels_per_layer(s, args.passes, dtype)[1]))
    (a, a_layer), (b, b_layer) = facts
    rows = [
        ("nodes", [a.nodes, b.nodes], "n"),
        ("kernels", [a.kernels, b.kernels], "n"),
        ("kernels per block", [a_layer, b_layer], "n"),
        ("parameters", [a.params, b.params], "si"),
        ("weight bytes", [a.weight_bytes, b.weight_bytes], "bytes"),
        ("FLOPs per token", [a.flops_per_token, b.flops_per_token], "flop"),
        ("bytes moved per token", [a.bytes_per_token, b.bytes_per_token], "bytes"),
        ("KV cache per token", [a.kv_bytes_per_token, b.kv_bytes_per_token], "bytes"),
    ]
    where = f"B={at['B']}, T={at['T']}, P={at['P']}"
    table = Table(title=f"{specs[0].name} vs {specs[1].name} (passes: {args.passes}; per new "
                        f"token at {where})", title_justify="left")
    table.add_column("")
    for col in (specs[0].name, specs[1].name, "B / A"):
        table.add_column(col, justify="right")
    fmt = {"n": lambda v: f"{v:g}", "si": si, "bytes": nbytes,
           "flop": lambda v: si(v, "FLOP")}
    for label, (x, y), kind in rows:
        table.add_row(label, fmt[kind](x), fmt[kind](y), _ratio(x, y))
    console.print(table)
    return 0
