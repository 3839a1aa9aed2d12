"""Write one self-contained HTML page of a compile: the spec and its derived numbers, the graph
of a block before and after the pass pipeline stepped through pass by pass (with each pass's
diff and what it changed or refused), every kernel's source beside the nodes it implements, the
roofline of each kernel and, with --validate, each kernel's error against eager. The page
needs no network; --json prints the data it is a view of."""

from __future__ import annotations

import argparse
import re
import sys
import webbrowser
from pathlib import Path
from typing import Any

from archc.commands.common import Run, check_output, quant_of
from archc.commands.defaults import fit_lengths
from archc.commands.passes import add_quant_arguments
from archc.commands.roofline import NEW_TOKENS, PROMPT_LEN
from archc.commands.validate import BATCH as VALIDATE_BATCH
from archc.commands.validate import prompt_len as validate_prompt_len
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.gpus import gpu
from archc.ui import console


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add(p, "output", detail="the HTML file (default: MODEL-report.html here)")
    p.add_argument("--open", action="store_true", help="open the page in a web browser")
    add(p, "json", detail="the data the page embeds (the page is written too with -o or --open)")
    p.add_argument("--validate", action="store_true",
                   help="run the kernels against eager and show each kernel's error (weights "
                        "are read; a spec gets random ones)")
    add(p, "target", detail="shown beside each kernel")
    add(p, "jobs", default=2)
    add(p, "gpu", default="h200", detail="the roofline's")
    add(p, "prompt_len", detail=f"the roofline's prefill (default {PROMPT_LEN}, less where "
        "max_seq_len is shorter)")
    add(p, "new_tokens", detail=f"the roofline's decode step is the last (default "
        f"{NEW_TOKENS}, less where max_seq_len is shorter; an encoder does not decode)")
    add(p, "dtype")
    add_quant_arguments(p)
    add(p, "device", detail="with --validate")
    add(p, "seed", default=0, detail="with --validate")
    add(p, "cache_dir")


def default_output(model: str) -> Path:
    return Path(f"{re.sub(r'[^A-Za-z0-9_.-]', '_', model)}-report.html")


def _check(args: argparse.Namespace) -> None:
    """Refuse what would fail after the work, before it."""
    check_output(args.output, "file")
    check_output(args.cache_dir, "dir", "--cache-dir")
    for flag, value in (("--device", args.device), ("--seed", args.seed != 0 or None)):
        if value is not None and not args.validate:
            raise ArchcError(f"{flag} goes with --validate")


def run(args: argparse.Namespace) -> int:
    from archc.report import data as report_data
    from archc.report.page import render
    spec, quant = quant_of(args)
    _check(args)
    g = gpu(args.gpu)
    prompt_len, new_tokens = fit_lengths(spec, args.prompt_len, args.new_tokens,
                                         (PROMPT_LEN, NEW_TOKENS))
    options = report_data.Options(args.source, dtype=args.dtype, gpu=g,
                                  prompt_len=prompt_len, new_tokens=new_tokens,
                                  target=args.target, jobs=args.jobs)
    validate = None
    if args.validate:
        # as `archc validate` runs by default
        tokens = validate_prompt_len(spec, "--validate's prompt", quiet=False)
        run_ = Run(args, lengths=(tokens, 1))   # checked before any work

        def validate() -> Any:
            from archc.runtime.validation import validate as check
            return check(run_.load(), dtype=run_.dtype, batch=VALIDATE_BATCH,
                         tokens=tokens, seed=args.seed, device=str(run_.device),
                         cache_dir=args.cache_dir, kv_cache=None)
    data = report_data.build(spec, quant, options, validate=validate, cache_dir=args.cache_dir)
    if args.json:
        sys.stdout.write(report_data.to_json(data) + "\n")
        if args.output is None and not args.open:
            return 0
    path = args.output or default_output(spec.name)
    try:
        path.write_text(render(data), encoding="utf-8")
    except OSError as err:
        raise ArchcError(f"cannot write {path}: {err.strerror}") from None
    if not args.json:
        console.print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB): {spec.name}, "
                      f"{len(data['pipeline']['rows']) - 1} passes, {len(data['kernels'])} "
                      f"kernels, {data['launches']} launches")
    if args.open:
        webbrowser.open(path.resolve().as_uri())
    return 0
