"""`archc validate SOURCE`: the generated kernels against the eager interpreter, kernel by
kernel."""

from __future__ import annotations

import argparse

from rich.markup import escape
from rich.table import Table

import archc
from archc.commands.common import positive_int
from archc.ui import console

NAME = "validate"
HELP = "run eager (unfused graph) and triton (kernel-level graph) on the same weights and " \
       "inputs; print each kernel's max error and name the first kernel that diverges"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", metavar="SOURCE",
                   help="a spec YAML path or zoo name, an HF directory or a .gguf file")
    p.add_argument("--dtype", choices=("f32", "f16", "bf16"), default="f32",
                   help="compute dtype (default f32; bf16 needs a GPU)")
    p.add_argument("--tokens", type=positive_int, default=7, help="prompt length (default 7)")
    p.add_argument("--batch", type=positive_int, default=2, help="batch size (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and inputs (default 0)")
    p.add_argument("--device", default="cpu", help="cpu (Triton's interpreter) or cuda")
    p.add_argument("--all", action="store_true", help="list every kernel, not only the worst "
                   "per phase and the divergent ones")


def run(args: argparse.Namespace) -> int:
    from archc.runtime.validation import validate
    model = archc.load(args.source, seed=args.seed)
    report = validate(model, dtype=args.dtype, batch=args.batch, tokens=args.tokens,
                      seed=args.seed, device=args.device)
    table = Table(title=f"{report.model} ({report.dtype}): triton vs eager, per kernel "
                        f"(tolerance {report.tolerance:g} of each output's scale)",
                  title_justify="left")
    for col in ("phase", "node", "kernel", "checks", "max error", "relative", ""):
        table.add_column(col, justify="right" if col in ("max error", "relative") else "left")
    worst = {}
    for k in report.kernels:
        if k.phase not in worst or k.relative > worst[k.phase].relative:
            worst[k.phase] = k
    for k in report.kernels:
        bad = k.relative > report.tolerance
        if not (args.all or bad or worst.get(k.phase) is k):
            continue
        table.add_row(k.phase, f"{k.graph} %{k.node}", escape(k.kernel), escape(k.what),
                      f"{k.max_error:.3g}", f"{k.relative:.2e}", "[red]diverges[/]" if bad else
                      ("worst" if worst.get(k.phase) is k else "ok"))
    console.print(table)
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
        return 1
    if not report.ok:
        return 1
    console.print("[green]all kernels agree with eager[/]")
    return 0
