"""Terminal output: one console for results, one for notes on stderr, tables and numbers."""

from __future__ import annotations

import sys
from collections.abc import Container, Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

# Piped output gets a fixed, generous width so tables do not wrap differently per terminal.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, highlight=False)


def si(value: float, unit: str = "", *, base: int = 1000) -> str:
    """12_345_678 → '12.35 M' (base 1000), or in bytes with base 1024 → '11.77 Mi'."""
    v, i = float(value), 0
    while abs(v) >= base and i < 5:
        v /= base
        i += 1
    prefix = ["", "K", "M", "G", "T", "P"][i] + ("i" if base == 1024 and i else "")
    return f"{v:.0f} {prefix}{unit}".rstrip() if i == 0 else f"{v:.2f} {prefix}{unit}"


def nbytes(value: float) -> str:
    return si(value, "B", base=1024)


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], *,
          text: Container[str] = (), **options: Any) -> Table:
    """A table whose columns named in `text` are left-aligned and the others (numbers)
    right-aligned; `options` apply to every column."""
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col, justify="left" if col in text else "right", **options)
    for row in rows:
        t.add_row(*row)
    return t
