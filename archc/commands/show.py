"""Sizes, parameters, FLOPs per token, KV-cache and recurrent-state size of a model, computed
from its IR in the model's own dtype."""

from __future__ import annotations

import argparse

from rich.table import Table

from archc.commands.common import quant_of
from archc.commands.passes import add_quant_arguments
from archc.commands.vocabulary import add
from archc.report.facts import facts
from archc.ui import console


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add_quant_arguments(p)
    add(p, "kv_cache")
    add(p, "tp", default=1, detail="adds what one rank holds and sends")


def run(args: argparse.Namespace) -> int:
    s, quant = quant_of(args)
    rows = facts(s, quant, getattr(args, "kv_cache", None), args.tp)
    t = Table(show_header=False, box=None, title=s.name, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    for row in rows:
        if row[1] is not None:
            t.add_row(*row)
    console.print(t)
    return 0
