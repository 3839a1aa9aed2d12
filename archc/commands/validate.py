"""Run eager (unfused graph) and triton (kernel-level graph) on the same weights and inputs;
print each kernel's max error and name the first kernel that diverges."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape

from archc.commands.common import Run, check_output
from archc.commands.defaults import fitted
from archc.commands.vocabulary import add
from archc.spec.schema import Spec
from archc.ui import console, table

# sequences and prompt tokens checked (`archc report --validate` runs the same), then a step
BATCH, PROMPT_LEN = 2, 7


def prompt_len(spec: Spec, flag: str, *, quiet: bool) -> int:
    """The default prompt, within max_seq_len less the decode step that follows it."""
    return fitted(flag, None, PROMPT_LEN, spec.max_seq_len - 1,
                  f"{spec.name}'s max_seq_len = {spec.max_seq_len} less a decode step",
                  quiet=quiet)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source", detail="a spec gets random weights")
    add(p, "dtype", detail="bf16 needs a GPU")
    add(p, "device")
    add(p, "prompt_len", detail=f"default {PROMPT_LEN}, less where max_seq_len is shorter")
    add(p, "batch", default=BATCH)
    add(p, "seed", default=0)
    add(p, "cache_dir")
    add(p, "quantize", "group", "dequantize", "kv_cache")
    add(p, "no_autotune")
    p.add_argument("--all", action="store_true", help="list every kernel, not only the worst "
                   "per phase and the divergent ones")


def run(args: argparse.Namespace) -> int:
    from archc.kernel_cache import used
    from archc.runtime.validation import validate
    check_output(args.cache_dir, "dir", "--cache-dir")
    run_ = Run(args)
    if args.prompt_len is None:
        args.prompt_len = prompt_len(run_.spec, "--prompt-len", quiet=False)
    run_.check_lengths(args.prompt_len, 1)
    report = validate(run_.load(), dtype=run_.dtype, batch=args.batch, tokens=args.prompt_len,
                      seed=args.seed, device=str(run_.device), cache_dir=args.cache_dir,
                      autotune=False if args.no_autotune else None, kv_cache=args.kv_cache)
    used(Path(report.module_path))
    console.print(f"{report.model} ({report.dtype}): triton vs eager, per kernel (tolerance "
                  f"{report.tolerance:g} of each output's scale)", soft_wrap=True)
    worst = {k.phase: k for k in sorted(report.kernels, key=lambda k: k.relative)}
    rows = [(k.phase, f"{k.graph} %{k.node}", escape(k.kernel), escape(k.what),
             f"{k.max_error:.3g}", f"{k.relative:.2e}",
             "[red]diverges[/]" if k.relative > report.tolerance else
             "worst" if worst[k.phase] is k else "ok") for k in report.kernels]
    console.print(table("", ("phase", "node", "kernel", "checks", "max error", "relative", ""),
                        [r for r in rows if args.all or r[-1] != "ok"],
                        text=("phase", "node", "kernel", "checks", "")))
    for p in report.phases:
        status = "ok" if p.relative <= report.tolerance else "[red]differs[/]"
        console.print(f"{p.phase}: {p.output} vs eager on the unfused graph: max error "
                      f"{p.max_error:.3g} ({p.relative:.2e} of {p.scale:.3g}) {status}")
    console.print(f"{len(report.kernels)} kernel outputs checked; generated module: "
                  f"{report.module_path}")
    first = report.first_divergence
    if first is not None:
        console.print(f"[red]first divergence[/]: {first.phase}, kernel {first.kernel} "
                      f"({escape(first.what)}), implementing {first.graph} {escape(first.text)}")
    if first is not None or not report.ok:
        return 1
    console.print("[green]all kernels agree with eager[/]")
    return 0
