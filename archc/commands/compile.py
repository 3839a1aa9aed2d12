"""Render a model's kernels into one Triton module (after the default passes) and, with
--target, compile every unique kernel ahead of time for a GPU: registers, spills, shared memory,
tensor-core instructions."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from rich.markup import escape

from archc.commands.common import check_output, spec_of
from archc.commands.passes import add_pipeline_arguments
from archc.commands.vocabulary import add, positive_int
from archc.errors import ArchcError
from archc.ui import console, nbytes, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add(p, "output", detail="a directory: the module is also written there, as MODEL.py")
    p.add_argument("--target", choices=("sm_80", "sm_90a"),
                   help="compile every unique kernel for this GPU (no GPU needed)")
    add_pipeline_arguments(p)
    p.add_argument("--jobs", type=positive_int, default=2,
                   help="parallel compiles with --target (default 2)")
    p.add_argument("--kernel", metavar="NAME",
                   help="print only this kernel's source (e.g. fused_linear_0), as in the module")
    add(p, "cache_dir")


def run(args: argparse.Namespace) -> int:
    from archc.codegen.build import CodegenOptions
    from archc.codegen.render import generate, write_module
    from archc.ir.lower import lower
    from archc.kernel_cache import default_cache_dir, used
    from archc.passes import optimize

    check_output(args.output, "dir")
    spec = spec_of(args)
    dtype = args.dtype or spec.dtype
    gen = generate(optimize(lower(spec, dtype), args.passes),
                   CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
    path = write_module(gen, (args.cache_dir or default_cache_dir()) / gen.digest[:24])
    used(path)
    if args.kernel is not None:
        names = [u.name for u in gen.units]
        if args.kernel not in names:
            raise ArchcError(f"no kernel {args.kernel!r} in {spec.name} (kernels: "
                             f"{', '.join(names)})")
        sys.stdout.write(gen.unit_text(args.kernel))
        return 0
    if args.output is not None:
        try:
            args.output.mkdir(parents=True, exist_ok=True)
            path = shutil.copyfile(path, args.output / path.name)
        except OSError as err:
            raise ArchcError(f"cannot write {args.output}: {err.strerror}") from None
    rows = []
    for u in gen.units:
        graph, _, text = u.uses[0]
        rows.append((u.name, u.family, str(len(u.uses)),
                     escape(f"{graph} {text if len(text) <= 90 else text[:89] + '…'}")))
    console.print(table(f"{spec.name}: {len(gen.units)} unique kernels, {gen.launches} launches "
                        f"({dtype})", ("kernel", "family", "launches", "implements (first use)"),
                        rows, text=("kernel", "family", "implements (first use)")))
    console.print(f"generated module: {path}")
    return 0 if args.target is None else _aot(path, args.target, args.jobs)


def _aot(path: Path, target: str, jobs: int) -> int:
    from archc.codegen.aot import TARGETS, compile_module
    from archc.codegen.aot_worker import TENSOR_CORE_OP
    op = TENSOR_CORE_OP[TARGETS[target]].split(".")[0]
    results = compile_module(path, target, jobs=jobs)
    console.print(table(
        f"ahead-of-time compile for {target} (bf16 buffers as generated, default block sizes "
        "at a full-size prefill)",
        ("kernel", "family", "registers", "spill bytes", "shared mem", op, "config"),
        [(r.kernel, r.family, str(r.registers), str(r.spill_bytes), nbytes(r.shared_bytes),
          str(r.tensor_core_ops), r.config) if r.ok else
         (r.kernel, r.family, "-", "-", "-", "-", f"[red]{escape(r.error)}[/]")
         for r in results], text=("kernel", "family", "config")))
    failed = [r for r in results if not r.ok]
    spilled = [r.kernel for r in results if r.ok and r.spill_bytes]
    console.print(f"{len(results) - len(failed)}/{len(results)} kernels compile for {target}; "
                  f"{sum(1 for r in results if r.ok and r.tensor_core_ops)} use {op}; "
                  + (f"{len(spilled)} spill registers ({', '.join(spilled)})" if spilled
                     else "none spill registers"))
    for r in failed:
        console.print(f"[red]{escape(f'{r.kernel}: {r.error}')}[/]")
    return 1 if failed else 0
