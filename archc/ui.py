"""Terminal output: one console, number formatting, progress bars."""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

# Piped output gets a fixed, generous width so tables do not wrap differently per terminal.
console = Console(highlight=False, width=None if sys.stdout.isatty() else 120)
err_console = Console(stderr=True, highlight=False)


def si(value: float, unit: str = "", *, base: int = 1000) -> str:
    """12_345_678 → '12.35 M' (base 1000) or bytes with base 1024 → '11.77 Mi'."""
    prefixes = ["", "K", "M", "G", "T", "P"]
    v = float(value)
    i = 0
    while abs(v) >= base and i < len(prefixes) - 1:
        v /= base
        i += 1
    suffix = prefixes[i] + ("i" if base == 1024 and i else "")
    text = f"{v:.0f}" if i == 0 else f"{v:.2f}"
    return f"{text} {suffix}{unit}".rstrip()


def nbytes(value: float) -> str:
    return si(value, "B", base=1024)


def progress() -> Progress:
    """A progress bar on stderr for long work (loading weights, compiling kernels)."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=err_console, transient=True)
