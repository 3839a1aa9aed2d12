"""List the kernel cache (generated modules on disk), clear it, or set its size cap."""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from archc import kernel_cache
from archc.commands.vocabulary import add
from archc.ui import console, nbytes, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clear", action="store_true", help="delete every entry")
    p.add_argument("--max-size", metavar="SIZE",
                   help="keep the cache within SIZE (e.g. 500M, 2G; 0 keeps nothing), deleting "
                        "the entries used longest ago; remembered for later runs (default "
                        f"{nbytes(kernel_cache.DEFAULT_MAX_BYTES)})")
    add(p, "cache_dir", detail="the directory to list or clear")
    add(p, "json")


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def run(args: argparse.Namespace) -> int:
    directory = args.cache_dir or kernel_cache.default_cache_dir()
    if args.max_size is not None:
        kernel_cache.set_max_bytes(kernel_cache.parse_size(args.max_size))
    removed = kernel_cache.trim(directory, 0) if args.clear else \
        kernel_cache.trim(directory) if args.max_size is not None else []
    found = kernel_cache.entries(directory)
    limit, total = kernel_cache.max_bytes(), sum(e.bytes for e in found)
    if args.json:
        sys.stdout.write(json.dumps({
            "directory": str(directory), "max_bytes": limit, "bytes": total,
            "removed": [str(e.path) for e in removed],
            "entries": [{"path": str(e.path), "models": list(e.models), "bytes": e.bytes,
                         "used": e.used} for e in found]}, indent=2) + "\n")
        return 0
    if removed:
        console.print(f"removed {_entries(len(removed))} "
                      f"({nbytes(sum(e.bytes for e in removed))})")
    if found:
        console.print(table(str(directory), ("entry", "models", "size", "last used"), [
            (e.path.name, ", ".join(e.models), nbytes(e.bytes),
             datetime.datetime.fromtimestamp(e.used).strftime("%Y-%m-%d %H:%M"))
            for e in found], text=("entry", "models", "last used")))
    console.print(f"{_entries(len(found))}, {nbytes(total)} of a {nbytes(limit)} cap, in "
                  f"{directory}")
    return 0
