"""Render a model's kernels into one Triton module (after the default passes) and, with
--target, compile every unique kernel ahead of time for a GPU: registers, spills, shared memory,
tensor-core instructions. With --occupancy, every launch of a prefill and a decode step as the
runtime makes it for that GPU instead: programs with work, waves, the compile of each launch's
own configuration and its roofline time, with verdicts (``archc.perf.occupancy``)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import textwrap
from pathlib import Path

from rich.markup import escape

from archc.commands.common import check_output, quant_of
from archc.commands.defaults import fitted_all
from archc.commands.passes import add_pipeline_arguments
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.gpus import GPU_TARGETS, GPUS, default_gpu, gpu
from archc.spec.schema import Spec
from archc.ui import console, err_console, nbytes, table
from archc.versions import software_text


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add(p, "output", detail="a directory: the module is also written there, as MODEL.py")
    add(p, "target")
    add_pipeline_arguments(p)
    add(p, "jobs", default=2)
    p.add_argument("--kernel", metavar="NAME",
                   help="print only this kernel's source (e.g. fused_linear_0), as in the module")
    add(p, "cache_dir")
    add(p, "kv_cache")
    # the parser keeps descriptions as written (RawDescriptionHelpFormatter): wrapped here
    occupancy = p.add_argument_group("occupancy report (with --target)", textwrap.fill(
        "every launch of a prefill of N tokens and of the decode step at context N, as the "
        "runtime makes it on the GPU: programs with work, waves on the GPU's SMs, registers, "
        "spills, shared memory, tensor-core shapes (wgmma on sm_90a, tcgen05 on sm_100a) and TMA "
        "use of each launch's own configuration, "
        "bytes moved and roofline time; then pass/FAIL verdict lines for the decode step. The "
        "exit status is 0 whatever the verdicts, 1 when a kernel fails to compile.", 76))
    occupancy.add_argument("--occupancy", action="store_true",
                           help="report occupancy instead of the per-kernel compile table")
    add(occupancy, "context", nargs="+", detail="one or more: a prefill of N tokens and the "
        "decode step at context N each (default 512 2048 8192, those within max_seq_len)")
    add(occupancy, "batch", detail="default 1")
    add(occupancy, "gpu", detail="default: " + ", ".join(f"{default_gpu(t)} for {t}" for t in
                                                         reversed(GPU_TARGETS)))
    add(occupancy, "json", detail="the occupancy report")


def _check_occupancy_flags(args: argparse.Namespace) -> None:
    given = [flag for flag, value in (("--context", args.context), ("--batch", args.batch),
                                      ("--gpu", args.gpu), ("--json", args.json)) if value]
    if not args.occupancy and given:
        raise ArchcError(f"{', '.join(given)} go{'es' if len(given) == 1 else ''} with "
                         "--occupancy")
    if not args.occupancy:
        return
    if args.target is None:
        others = " or ".join(t for t in GPU_TARGETS if t != "sm_90a")
        raise ArchcError(f"--occupancy needs a GPU to report on: add --target sm_90a ({others})")
    if args.passes != "default":
        raise ArchcError("--occupancy reports the kernels the runtime runs, after the default "
                         "passes: leave out --passes")
    for flag, value in (("--kernel", args.kernel), ("-o", args.output)):
        if value is not None:
            raise ArchcError(f"{flag} does not go with --occupancy")


def run(args: argparse.Namespace) -> int:
    from archc.codegen.build import CodegenOptions
    from archc.codegen.render import generate, write_module
    from archc.ir.lower import lower
    from archc.kernel_cache import default_cache_dir, used
    from archc.passes import optimize
    from archc.runtime.triton_backend import check_cache_writes, check_kernels_exist

    _check_occupancy_flags(args)
    check_output(args.output, "dir")
    spec, quant = quant_of(args)
    dtype = args.dtype or spec.dtype
    program = lower(spec, dtype, quant, kv_cache=args.kv_cache)
    check_kernels_exist(program)   # an op no kernel runs yet: refused in one line
    program = optimize(program, args.passes)
    check_cache_writes(program)   # a cache write no kernel makes: refused in one line
    if args.occupancy:
        return _occupancy(args, spec, dtype, quant)
    gen = generate(program, CodegenOptions(target="gpu", max_seq_len=spec.max_seq_len))
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
    from archc.codegen.aot import compile_module
    op = GPU_TARGETS[target].mma
    results = compile_module(path, target, jobs=jobs)
    # Blackwell: the MMA shapes (the PTX names none on the instruction) and whether Triton
    # split the K loop into warp-specialized partitions, which it does there
    blackwell = GPU_TARGETS[target].capability >= 100
    extra = ("shapes", "warp spec.") if blackwell else ()
    console.print(table(
        f"ahead-of-time compile for {target} (bf16 buffers as generated, default block sizes "
        "at a full-size prefill)",
        ("kernel", "family", "registers", "spill bytes", "shared mem", op, *extra, "config"),
        [(r.kernel, r.family, str(r.registers), str(r.spill_bytes), nbytes(r.shared_bytes),
          str(r.tensor_core_ops),
          *((" ".join(r.mma) or "—", "yes" if r.warp_specialized else "no") if blackwell
            else ()), r.config) if r.ok else
         (r.kernel, r.family, "-", "-", "-", "-", *("-" for _ in extra),
          f"[red]{escape(r.error)}[/]")
         for r in results], text=("kernel", "family", *extra, "config")))
    failed = [r for r in results if not r.ok]
    spilled = [r.kernel for r in results if r.ok and r.spill_bytes]
    specialized = sum(1 for r in results if r.ok and r.warp_specialized)
    # a kernel shared by projections of different sizes compiles once per size (its `static`)
    console.print(f"{len(results) - len(failed)}/{len(results)} kernel configurations compile "
                  f"for {target}; "
                  f"{sum(1 for r in results if r.ok and r.tensor_core_ops)} use {op}; "
                  + (f"{specialized} warp-specialized; " if blackwell else "")
                  + (f"{len(spilled)} spill registers ({', '.join(spilled)})" if spilled
                     else "none spill registers"))
    console.print(software_text())
    for r in failed:
        console.print(f"[red]{escape(f'{r.kernel}: {r.error}')}[/]")
    return 1 if failed else 0


def _occupancy(args: argparse.Namespace, spec: Spec, dtype: str,
               quant: dict[str, str]) -> int:
    """The occupancy report (``archc.perf.occupancy``): tables and verdicts, or JSON."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    from archc.codegen.aot import compile_configs
    from archc.ir.lower import lower
    from archc.perf import occupancy as occ
    g = gpu(args.gpu or default_gpu(args.target))
    if g.target.name != args.target:
        those = ", ".join(k for k, v in GPUS.items() if v.target.name == args.target)
        raise ArchcError(f"--gpu {args.gpu} is not an {args.target} GPU (those: {those})")
    occ.check_occupancy(spec, args.context or [])    # before a default is fitted and said
    contexts = sorted(set(fitted_all("--context", args.context, occ.DEFAULT_CONTEXTS,
                                     spec.max_seq_len, f"{spec.name}'s max_seq_len = "
                                     f"{spec.max_seq_len}")))
    batch = args.batch or 1
    program = lower(spec, dtype, quant, kv_cache=args.kv_cache)
    recorder, plans = occ.record(program, spec, dtype=dtype, batch=batch,
                                 contexts=contexts, gpu=g, cache_dir=args.cache_dir)
    jobs = occ.compile_jobs(plans)
    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeRemainingColumn(), console=err_console, transient=True,
                  disable=not err_console.is_terminal) as bar:
        task = bar.add_task(f"compiling for {args.target}", total=len(jobs))
        results = compile_configs(recorder.module_path, args.target, jobs, jobs=args.jobs,
                                  cache_dir=recorder.module_path.parent / "aot",
                                  progress=lambda r: bar.advance(task))
    occ.attach(plans, results)
    rep = occ.Occupancy(spec.name, dtype, args.target, g, batch, contexts, plans,
                        recorder.module_path, results)
    if args.json:
        sys.stdout.write(json.dumps(occ.to_json(rep), indent=1) + "\n")
    else:
        for item in occ.format_report(rep):
            console.print(item)
    return 1 if rep.failed else 0
