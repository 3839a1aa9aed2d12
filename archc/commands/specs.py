"""List the bundled specs with their sizes and parameter counts."""

from __future__ import annotations

import argparse

from archc.ir.cost import parameter_count
from archc.ir.lower import lower
from archc.spec import load_spec, zoo_names
from archc.ui import console, si, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tiny", action="store_true", help="also list the tiny-* test specs")


def _row(name: str) -> tuple[str, ...]:
    s = load_spec(name)
    layers = str(s.layers) if s.decoder_layers is None else f"{s.layers}+{s.decoder_layers}"
    ffn = s.ffn.kind if s.ffn.kind != "mlp" else f"mlp/{s.ffn.activation}"
    if s.ffn.moe:
        ffn = f"moe {s.ffn.moe.experts}×{s.ffn.moe.expert} top-{s.ffn.moe.top_k}"
    if s.ffn.d_ff is not None:
        ffn = f"{ffn} {s.ffn.d_ff}"
    heads = f"{s.attention.heads} ({s.attention.kv_heads})" if s.attends else "— (mamba)"
    return (name, s.family, layers, str(s.d_model), heads, ffn, s.position.kind,
            si(parameter_count(lower(s))))


def run(args: argparse.Namespace) -> int:
    console.print(table(
        "archc spec zoo", ("name", "family", "layers", "d_model", "heads (kv)", "ffn",
                           "positions", "params"),
        [_row(name) for name in zoo_names() if args.tiny or not name.startswith("tiny-")],
        text=("name", "family", "heads (kv)", "ffn", "positions")))
    return 0
