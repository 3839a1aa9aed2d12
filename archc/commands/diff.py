"""Compare two models side by side after the pass pipeline: nodes, kernels, parameters, FLOPs,
bytes moved and KV-cache bytes, every number from their IR."""

from __future__ import annotations

import argparse

from archc.commands.common import quant_of
from archc.commands.passes import add_dims_arguments, add_pipeline_arguments
from archc.commands.vocabulary import add
from archc.ir.lower import lower
from archc.passes import optimize
from archc.passes.measure import dims, kernels_per_layer, stats
from archc.ui import console, nbytes, si, table

ROWS = (("nodes", "nodes", "{:g}".format), ("kernels", "kernels", "{:g}".format),
        ("kernels per block", "per_block", "{:g}".format), ("parameters", "params", si),
        ("weight bytes", "weight_bytes", nbytes),
        ("FLOPs per token", "flops_per_token", lambda v: si(v, "FLOP")),
        ("bytes moved per token", "bytes_per_token", nbytes),
        ("KV cache per token", "kv_bytes_per_token", nbytes))


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source", dest="source_a")
    add(p, "source", dest="source_b")
    add_pipeline_arguments(p)
    add_dims_arguments(p)


def run(args: argparse.Namespace) -> int:
    sources = [quant_of(args, "source_a"), quant_of(args, "source_b")]
    specs = [s for s, _ in sources]
    at = dims(args.batch, args.prompt_len, args.past, args.encoder_len)
    facts = []
    for s, quant in sources:
        dtype = args.dtype or s.dtype
        facts.append({**vars(stats(optimize(lower(s, dtype, quant), args.passes), at)),
                      "per_block": kernels_per_layer(s, args.passes, dtype)[1]})
    rows = []
    for label, key, fmt in ROWS:
        a, b = facts[0][key], facts[1][key]
        rows.append((label, fmt(a), fmt(b),
                     "=" if a == b else "new" if a == 0 else f"×{b / a:.3g}"))
    console.print(table(f"{specs[0].name} vs {specs[1].name} (passes: {args.passes}; per new "
                        f"token at B={at['B']}, T={at['T']}, P={at['P']})",
                        ("", specs[0].name, specs[1].name, "B / A"), rows, text=("",)))
    return 0
