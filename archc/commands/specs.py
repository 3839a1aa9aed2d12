"""List the bundled specs with their sizes and parameter counts."""

from __future__ import annotations

import argparse

from rich.table import Table

from archc.ir.cost import parameter_count
from archc.ir.lower import lower
from archc.spec import load_spec, zoo_names
from archc.ui import console, si


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="also list the tiny-* test specs")


def run(args: argparse.Namespace) -> int:
    table = Table(title="archc spec zoo", title_justify="left")
    for col in ("name", "family", "layers", "d_model", "heads (kv)", "ffn", "positions",
                "params"):
        table.add_column(col, justify="right" if col in ("layers", "d_model", "params")
                         else "left")
    for name in zoo_names():
        if name.startswith("tiny-") and not args.tiny:
            continue
        s = load_spec(name)
        att = s.attention
        layers = str(s.layers) if s.decoder_layers is None else f"{s.layers}+{s.decoder_layers}"
        ffn = s.ffn.kind if s.ffn.kind != "mlp" else f"mlp/{s.ffn.activation}"
        if s.ffn.moe:
            ffn = f"moe {s.ffn.moe.experts}×{s.ffn.moe.expert} top-{s.ffn.moe.top_k}"
        heads = f"{att.heads} ({att.kv_heads})" if s.attends else "— (mamba)"
        if s.ffn.d_ff is not None:
            ffn = f"{ffn} {s.ffn.d_ff}"
        table.add_row(name, s.family, layers, str(s.d_model), heads, ffn, s.position.kind,
                      si(parameter_count(lower(s))))
    console.print(table)
    return 0
