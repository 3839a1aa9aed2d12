"""Time each generated kernel beside torch.matmul, scaled_dot_product_attention and the unfused
torch ops it replaces, and whole-model prefill and decode beside PyTorch eager and torch.compile,
against the roofline (needs a CUDA GPU).

    archc bench llama3-8b --layers 4 --prompt-len 2048 --new-tokens 64 -o results.json
    archc bench llama3-8b --layers 4 --contexts 512 2048   # batch-1 decode at two contexts
    archc bench tiny-llama3 --dry-run        # the whole harness on the CPU, tiny shapes
    archc bench llama3-8b --host-time        # archc's host time per decode step, any machine"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

import torch
from rich.markup import escape
from rich.table import Table

from archc.commands.common import check_output, quant_of, quant_scheme, spec_of
from archc.commands.defaults import fit_lengths
from archc.commands.vocabulary import add, positive_int
from archc.devices import check_compilable, default_dtype, resolve_device
from archc.errors import ArchcError, cli_option
from archc.gpus import GPUS, find_gpu, gpu
from archc.perf.summary import fmt_percent as _pct
from archc.perf.summary import fmt_ratio as _x
from archc.perf.summary import fmt_seconds as _t
from archc.perf.summary import quant_line
from archc.ui import console, err_console, si, table

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
KNOWN_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DRY_RUN = {"batch": 1, "prompt": 8, "decode": 4, "dtype": "f32"}
GPU_RUN = {"batch": 1, "prompt": 512, "decode": 64, "dtype": "bf16"}
HOST_STEPS = 1000


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add(p, "gpu", detail="default: read off the device; h200 in a dry run")
    p.add_argument("--host-time", action="store_true",
                   help="time archc's own host work per decode step, on the CPU: the GPU "
                        "target's launch code with every kernel launch a no-op, plain and "
                        "through the CUDA-graph path; weights and KV cache are never allocated")
    p.add_argument("--dry-run", action="store_true",
                   help="run the whole harness on the CPU (Triton's interpreter, tiny shapes, "
                        "host-clock timing): checks the code, measures nothing meaningful")
    add(p, "device", detail="a CUDA GPU; cpu only with --dry-run")
    p.add_argument("--layers", type=positive_int, metavar="N",
                   help="keep the first N blocks (a real-size model in less time and memory)")
    add(p, "batch", detail=f"default {GPU_RUN['batch']}")
    add(p, "prompt_len", detail=f"default {GPU_RUN['prompt']}; {DRY_RUN['prompt']} in a dry run "
        "(less where max_seq_len is shorter)")
    add(p, "new_tokens", detail=f"the decode steps timed: default {GPU_RUN['decode']}; "
        f"{DRY_RUN['decode']} in a dry run (less where max_seq_len is shorter)")
    add(p, "dtype")
    add(p, "quantize", detail="here: archc runs the quantized model; PyTorch and the dense "
        "decode floor stay in --dtype")
    add(p, "group", detail="default 128")
    p.add_argument("--compile-modes", default=",".join(COMPILE_MODES), metavar="MODES",
                   help="torch.compile modes to measure, comma-separated, or none "
                        f"(default {','.join(COMPILE_MODES)})")
    p.add_argument("--contexts", type=positive_int, nargs="+", default=(), metavar="N",
                   help="also decode after a prefill of N tokens, for each N: every runner's "
                        "tokens/s against the decode floor at that context, and the decode "
                        "attention kernel alone at that past length beside a device-to-device "
                        "copy of the same KV bytes")
    p.add_argument("--no-kernels", action="store_true",
                   help="skip the per-kernel section (whole-model numbers only)")
    add(p, "no_autotune")
    add(p, "seed", default=0)
    add(p, "output", detail="a file: the results as JSON, saved after every section; an "
        "existing directory gets a file named by date, device, model and dtype")
    add(p, "json", detail="instead of the tables")
    add(p, "cache_dir")


def config_of(args: argparse.Namespace) -> Any:
    from archc.perf.bench import WARMUP_STEPS, BenchConfig, Timer, check_config, keep_layers
    dry = args.dry_run
    modes = tuple(m.strip() for m in args.compile_modes.split(",")
                  if m.strip() not in ("", "none"))
    unknown = [m for m in modes if m not in KNOWN_MODES]
    if unknown:
        raise ArchcError(f"--compile-modes: unknown torch.compile mode {unknown[0]!r} (known: "
                         f"{', '.join(KNOWN_MODES)}, or none)")
    base = DRY_RUN if dry else GPU_RUN
    if dry and args.device not in (None, "cpu"):
        raise ArchcError("--dry-run runs on the CPU (Triton's interpreter); drop --device or "
                         "--dry-run")
    # every argument is checked before the GPU is looked for: `no CUDA GPU here` on a CPU says
    # that the rest of the command is fine (bench/rehearse.sh relies on it)
    full = spec_of(args)
    spec = keep_layers(full, args.layers)
    # a decoder's defaults fitted to its max_seq_len, with room for the warm-up steps (said once
    # every argument is checked); the others are refused by check_config
    def lengths(quiet: bool) -> tuple[int, int]:
        if spec.family != "decoder":
            return args.prompt_len or base["prompt"], base["decode"]
        return fit_lengths(spec, args.prompt_len, args.new_tokens,
                           (base["prompt"], base["decode"]), reserve=WARMUP_STEPS, quiet=quiet)
    prompt, decode = lengths(quiet=True)
    contexts = tuple(args.contexts)
    check_config(spec, prompt, decode, contexts)
    dtype = args.dtype or default_dtype(spec.dtype, "cpu" if dry else "cuda")
    scheme = quant_scheme(args)
    auto = args.gpu in (None, "auto")
    model = gpu("h200" if auto else args.gpu)
    if not dry and (args.device == "cpu" or not torch.cuda.is_available()):
        raise ArchcError("no CUDA GPU here: archc bench times kernels on a GPU. `archc bench "
                         f"{args.source} --dry-run` runs the same harness on the CPU with tiny "
                         "shapes; `archc roofline` models any GPU without one")
    device = resolve_device(args.device or ("cpu" if dry else "cuda"), spell=cli_option)
    check_compilable("triton", dtype, device, spell=cli_option)
    detected = auto and device.type == "cuda"
    if detected:     # read the GPU model off the device
        name = torch.cuda.get_device_name(device)
        model = find_gpu(name)
        if model is None:
            raise ArchcError(f"cannot tell which GPU model {name!r} is for the roofline: pass "
                             f"--gpu {' | '.join(GPUS)}")
    lengths(quiet=False)
    return BenchConfig(
        spec=spec, dtype=dtype, device=device, gpu=model, gpu_detected=detected,
        batch=args.batch or base["batch"], prompt=prompt, decode=decode,
        timer=Timer(device, cpu_repeats=2) if dry else Timer(device), compile_modes=modes,
        # a dry run traces with dynamo but compiles nothing (inductor on a CPU takes minutes)
        compile_backend="eager" if dry else "inductor",
        copy_mib=4 if dry else 1024, matmul_size=128 if dry else 8192, dry_run=dry,
        autotune=not args.no_autotune, seed=args.seed,
        layers_of_spec=full.layers if spec.layers != full.layers else None,
        kernel_section=not args.no_kernels, cache_dir=args.cache_dir, contexts=contexts,
        quant=scheme)


def run_host(args: argparse.Namespace) -> int:
    from archc.perf.bench import keep_layers
    from archc.perf.host import check_host, format_host, measure_host
    # the flags that do not apply, as the parser leaves them when not given
    defaults = {"dry_run": False, "prompt_len": None, "gpu": None, "contexts": (),
                "compile_modes": ",".join(COMPILE_MODES), "no_kernels": False,
                "no_autotune": False, "seed": 0, "json": False}
    extra = [f"--{k.replace('_', '-')}" for k, v in defaults.items() if getattr(args, k) != v]
    if extra:
        raise ArchcError(f"--host-time times archc's host work per decode step with no-op kernels "
                         f"and no weights: {', '.join(extra)} "
                         f"do{'es' if len(extra) == 1 else ''} not apply (it takes --batch, "
                         "--new-tokens, --dtype, --layers, --cache-dir)")
    spec, quant = quant_of(args)
    spec = keep_layers(spec, args.layers)
    check_host(spec)
    report = measure_host(spec, dtype=args.dtype or GPU_RUN["dtype"],
                          batch=args.batch or GPU_RUN["batch"],
                          steps=args.new_tokens or HOST_STEPS, cache_dir=args.cache_dir,
                          quant=quant)
    for line in format_host(report):
        console.print(escape(line), soft_wrap=True)
    return 0


def run(args: argparse.Namespace) -> int:
    from archc.perf.bench import default_json_name, run_bench
    if args.host_time:
        return run_host(args)
    path = args.output
    if path is not None and not path.is_dir():
        check_output(path, "file")
    cfg = config_of(args)
    if path is not None and path.is_dir():
        path = path / default_json_name(cfg)
    report = run_bench(cfg, path, lambda line: err_console.print(f"[dim]bench:[/] {line}",
                                                                 highlight=False))
    if args.json:
        sys.stdout.write(json.dumps(report.data, indent=2) + "\n")
        return 1 if report.failed else 0
    print_report(report.data)
    if path is not None:
        console.print(f"JSON: {path}")
    if report.failed:
        console.print(f"[red]failed sections:[/] {', '.join(report.failed)}")
        for e in report.data["errors"]:
            console.print(f"  {e['section']}{' ' + e['kernel'] if 'kernel' in e else ''}: "
                          f"{e['error']}")
    return 1 if report.failed else 0


def print_report(data: dict[str, Any]) -> None:
    env, g, shapes = data["environment"], data["gpu_model"], data["shapes"]
    kept = f", first {data['layers']} of {data['spec_layers']} blocks" \
        if data["layers"] != data["spec_layers"] else ""
    console.print(f"[bold]{data['spec']}[/]{kept}, {data['dtype']}, batch {shapes['batch']}, "
                  f"prompt {shapes['prompt']}, decode {shapes['decode']} on "
                  f"{env.get('device_name')} (torch {env['torch']}, triton {env.get('triton')})")
    if data["dry_run"]:
        console.print("[yellow]dry run[/]: CPU, Triton's interpreter, host clock — the numbers "
                      "test the harness, they say nothing about speed")
    console.print(f"roofline: {g['name']} {'(read off the device)' if g['detected'] else ''}"
                  f"{si(g['peak_flops'], 'FLOP/s')}, {si(g['bandwidth'], 'B/s')}; "
                  f"timing: {data['timing']['method']}")
    if c := data.get("ceilings"):
        console.print(f"measured: copy {si(c['copy_bandwidth'], 'B/s')} "
                      f"({_pct(c['copy_bandwidth'] / g['bandwidth'])} of datasheet), "
                      f"{c['matmul_dtype']} matmul {c['matmul_shape'][0]}³ "
                      f"{si(c['matmul_flops'], 'FLOP/s')} "
                      f"({_pct(c['matmul_flops'] / g['peak_flops'])} of datasheet)")
    for phase in ("prefill", "decode"):
        rows = [r for r in data["kernels"] if r["phase"] == phase]
        if rows:
            console.print(_kernel_table(phase, rows, shapes))
    pre, dec = data["model"]["prefill"], data["model"]["decode"]
    if pre.get("runs"):
        console.print(_runs_table(
            f"prefill, {pre['tokens']} tokens: {si(pre['flops'], 'FLOP')}, "
            f"roofline {_t(pre['roofline_seconds'])}",
            ("time", "tokens/s", "FLOP/s", "of peak", "of roofline"), pre["runs"], "seconds",
            lambda r: [_t(r["seconds"]), f"{r['tokens_per_second']:,.0f}",
                       si(r["flops_per_second"], "FLOP/s"), _pct(r["peak_fraction"]),
                       _pct(r["roofline_fraction"])]))
    if dec.get("runs"):
        console.print(_runs_table(
            f"decode, {dec['steps']} steps from context {dec['past_first'] + 1}: "
            f"floor {_t(dec['floor_seconds'])}/step = "
            f"{dec['floor_tokens_per_second']:,.0f} tokens/s "
            f"({si(dec['bytes_per_step'], 'B')} per step)",
            ("ms/token", "tokens/s", "bandwidth", "of floor", "of copy"), dec["runs"],
            "step_seconds",
            lambda r: [f"{r['step_seconds'] * 1e3:.3f}", f"{r['tokens_per_second']:,.1f}",
                       si(r["bandwidth"], "B/s"), _pct(r["floor_fraction"]),
                       _pct(r.get("copy_fraction"))]))
    if dense := dec.get("dense_floor"):
        console.print(quant_line(data["quantize"], data["dtype"], dec, dense))
    for c in data["model"].get("contexts", []):
        _print_context(c)
    if goals := data.get("goals"):
        console.print(table("goals (recorded, not enforced)",
                            ("goal", "measured", "target", "met", "note"),
                            [_goal_row(goal) for goal in goals], text=("goal", "met", "note")))


def _print_context(c: dict[str, Any]) -> None:
    """One context: every runner's decode against the floor at that length, and the decode
    attention kernel beside a copy of its KV bytes."""
    if c["runs"]:
        console.print(_runs_table(
            f"decode at context {c['context']} ({c['steps']} steps after a prefill of "
            f"{c['context']} tokens): floor {_t(c['floor_seconds'])}/step = "
            f"{c['floor_tokens_per_second']:,.0f} tokens/s ({si(c['bytes_per_step'], 'B')} "
            "per step)", ("ms/token", "tokens/s", "bandwidth", "of floor"), c["runs"],
            "step_seconds",
            lambda r: [f"{r['step_seconds'] * 1e3:.3f}", f"{r['tokens_per_second']:,.1f}",
                       si(r["bandwidth"], "B/s"), _pct(r["floor_fraction"])]))
    if c["attention"]:
        console.print(table(
            f"decode attention at context {c['context']} beside a copy of the same KV bytes "
            "(bandwidth: bytes moved per second; a copy reads and writes)",
            ("kernel", "shape", "KV bytes", "archc", "bandwidth", "copy", "copy bandwidth",
             "× copy", "sdpa ×"),
            [(escape(r["kernel"]), r["shape"], _si(r.get("kv_bytes"), "B"),
              "[red]failed[/]" if r.get("error") else _t(r["archc_seconds"]),
              _si(r.get("achieved_bandwidth"), "B/s"), _t(r.get("copy_seconds")),
              _si(r.get("copy_bandwidth"), "B/s"), _x(r.get("copy_fraction")),
              _cell(r, "sdpa")[1]) for r in c["attention"]],
            text=("kernel", "shape"), no_wrap=True))


def _si(value: float | None, unit: str) -> str:
    """`value` with an SI prefix, or a dash when it was not measured."""
    return "—" if value is None else si(value, unit)


def _runs_table(title: str, columns: tuple[str, ...], runs: list[dict[str, Any]],
                measured: str, cells: Callable[[dict[str, Any]], list[str]]) -> Table:
    """A row per runner; one without its `measured` value failed."""
    return table(title, ("runner", *columns, "archc speed-up"), [
        [r["name"], *([*cells(r), _x(r.get("archc_speedup"))] if r.get(measured) is not None
                      else ["[red]failed[/]"])] for r in runs], text=("runner",), no_wrap=True)


def _goal_row(goal: dict[str, Any]) -> list[str]:
    fmt = _x if goal["unit"] == "×" else _pct
    met = ("n/a" if not goal["applies"] else "—" if goal["met"] is None else
           "[green]yes[/]" if goal["met"] else "[red]no[/]")
    target = f"{goal['target']:g}×" if goal["unit"] == "×" else \
        f"{_pct(goal['target'])} {goal['unit']}"
    return [goal["goal"], fmt(goal["measured"]), target, met, goal["note"]]


def _cell(row: dict[str, Any], *names: str) -> tuple[str, str, str]:
    """The time, speed-up and op count of the first of the baselines `names` the kernel has."""
    b = next((b for n in names for b in row["baselines"] if b["name"] == n), None)
    if b is None:
        return "", "", ""
    ops = str(b.get("ops") or "")
    if b.get("seconds") is None:
        return "n/a", "", ops
    return (("sdpa " if b["name"] == "sdpa" else "") + _t(b["seconds"]) +
            (" [red]✗[/]" if b.get("agrees") is False else ""), _x(b.get("archc_speedup")), ops)


def _kernel_table(phase: str, rows: list[dict[str, Any]], shapes: dict[str, int]) -> Table:
    where = (f"prompt {shapes['prompt']}" if phase == "prefill" else
             f"one step at context {shapes['kernel_decode_past'] + 1}")
    t = table(f"kernels, {phase} ({where}); shape M×N×K or T×L heads/kv×D; × = torch time / "
              "archc time; ✗: differs from the kernel",
              ("kernel", "reads", "shape", "n", "archc", "torch", "×", "unfused", "×", "ops",
               "roofline"),
              [(escape(r["kernel"]), escape(r["reads"]), r["shape"], str(r["launches"]),
                "[red]failed[/]" if r.get("error") else _t(r["archc_seconds"]),
                *_cell(r, "torch.matmul", "sdpa", "torch")[:2], *_cell(r, "unfused"),
                f"{_pct(r.get('roofline_fraction'))} {r['bound'][:3]}") for r in rows],
              text=("kernel", "reads", "shape"), no_wrap=True, overflow="ellipsis")
    t.columns[1].no_wrap, t.columns[1].max_width = False, 24      # reads
    return t
