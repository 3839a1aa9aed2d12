"""Walk a model to the modern block one architecture step at a time (post→pre norm, RMSNorm,
SwiGLU, RoPE, GQA…) and report what each step buys."""

from __future__ import annotations

import argparse
from pathlib import Path

from archc.commands.common import check_output, emit
from archc.commands.defaults import fitted, note
from archc.commands.vocabulary import add
from archc.errors import ArchcError
from archc.modernize import Row, convert, walk
from archc.sources import describe
from archc.spec.steps import DEFAULT_STEPS, STEPS, StepError, parse_steps
from archc.ui import console, nbytes, si, table


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source", detail="a spec is walked as a spec; a checkpoint's weights are converted")
    steps = "; ".join(f"{s.name}: {s.doc}" for s in STEPS.values())
    p.add_argument("--steps", help=f"comma-separated steps (default: those of "
                   f"{','.join(DEFAULT_STEPS)} that apply; on a checkpoint, those that convert "
                   f"its weights). {steps}")
    add(p, "batch", default=1)
    add(p, "context", detail="for KV bytes and intensity (default: max_seq_len)")
    add(p, "output", detail="for a spec, a file: the final spec as YAML; for a checkpoint, a "
        "directory: the converted checkpoint (spec.yaml and model.safetensors)")
    p.add_argument("--plot", type=Path, metavar="FILE.png", help="draw the columns per step")


def _plot(rows: list[Row], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ArchcError("--plot needs matplotlib (pip install 'archc[plot]')") from None
    series = [("parameters", [r.params for r in rows]),
              ("FLOPs / token", [r.flops_per_token for r in rows]),
              ("KV bytes / token", [r.kv_bytes_per_token for r in rows]),
              ("decode arithmetic intensity", [r.intensity for r in rows]),
              ("kernels / layer", [r.kernels_per_layer for r in rows]),
              ("bytes moved / decode token", [r.decode_bytes_per_token for r in rows])]
    fig, axes = plt.subplots(len(series), 1, figsize=(8, 2.2 * len(series)), sharex=True)
    for ax, (title, values) in zip(axes, series):
        ax.bar(range(len(values)), values, color="#4c72b0")
        ax.set_title(title, fontsize=9, loc="left")
        ax.tick_params(labelsize=8)
    axes[-1].set_xticks(range(len(rows)), [r.step for r in rows], rotation=30, ha="right")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as err:
        raise ArchcError(f"cannot write {path}: {err.strerror}") from None
    console.print(f"wrote {path}")


def run(args: argparse.Namespace) -> int:
    import archc
    from archc.spec.load import dump_yaml
    calls = parse_steps(args.steps or ",".join(DEFAULT_STEPS))
    source = describe(args.source)
    spec, checkpoint = source.spec, not source.random_weights
    check_output(args.output, "dir" if checkpoint else "file")
    check_output(args.plot, "file", "--plot")
    if checkpoint and args.steps is None:   # the default walk: the steps weights go through
        calls = [call for call in calls if call.step.converts_weights]
        if source.quant:
            note(f"{', '.join(c.text for c in calls)} left out of the default steps: they "
                 f"convert float weights, and {spec.name}'s are quantized")
            calls = []
    if checkpoint:  # refuse before any work what a checkpoint cannot go through
        for call in calls:
            if not call.step.converts_weights:
                raise StepError(f"{call.text} changes what the weights compute and needs "
                                "training; on a checkpoint only gqa:N, mqa and no-bias apply")
    context = fitted("--context", args.context, spec.max_seq_len, spec.max_seq_len,
                     f"max_seq_len = {spec.max_seq_len}")
    model = archc.load(args.source) if checkpoint else None
    # the default walk leaves out, and says, the steps that do not apply to this model
    rows = walk(spec, calls, args.batch, context, skipped=None if args.steps else (
        lambda call, err: note(f"{call.text} left out of the default steps: {err}")))
    calls = [r.call for r in rows[1:] if r.call is not None]
    console.print(table(
        f"architecture steps (batch {args.batch}, context {context})",
        ("step", "params", "FLOPs/token", "KV/token", f"KV @ {context}", "decode AI",
         "kernels/layer", "bytes/token"),
        [(r.step, si(r.params), si(r.flops_per_token), nbytes(r.kv_bytes_per_token),
          nbytes(r.kv_bytes_at_context), f"{r.intensity:.1f}", f"{r.kernels_per_layer:g}",
          nbytes(r.decode_bytes_per_token)) for r in rows], text=("step",)))
    if model is not None:
        from archc.sources import native
        weights = dict(model.weights or {})
        for call, before, row in zip(calls, rows, rows[1:]):
            weights, report = convert(call, before.spec, row.spec, weights)
            for line in report.lines():
                console.print(f"{call.text}: {line}")
        if args.output:
            native.save(args.output, rows[-1].spec, weights)
            console.print(f"wrote {args.output}/ ({native.SPEC_FILE}, {native.WEIGHTS_FILE})")
    elif args.output:
        emit(dump_yaml(rows[-1].spec), args.output)
    if args.plot:
        _plot(rows, args.plot)
    return 0
