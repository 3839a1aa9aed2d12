"""Write a model as one quantized safetensors file: its spec, its quantized weights in their
stored parts, its other tensors as they are (docs/quantized-format.md); every command reads the
file back as a SOURCE.

With --quantize, the weights of linear layers and experts are quantized round-to-nearest (int8
per output channel, int4 in groups of --group). Without it, the source's own quantized tensors
(a GGUF file's blocks, repacked exactly) are written as they load; a GGUF file given --quantize
is read dequantized first, then quantized."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from archc.commands.common import check_output
from archc.commands.vocabulary import add
from archc.devices import dtype_name
from archc.errors import ArchcError
from archc.quant.tensor import QTensor, tensor_bytes
from archc.sources import describe, is_gguf
from archc.sources.quantized import SUFFIX, save
from archc.ui import console, err_console, nbytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    add(p, "source")
    add(p, "output", required=True,
        detail=f"a file ({SUFFIX}): the spec and weights, quantized ones in their parts")
    add(p, "quantize")
    add(p, "group", detail="default 128")
    add(p, "dtype", detail="here: the dtype the float tensors are written in (default: as "
        "they load)")
    add(p, "seed", default=0, detail="of a spec's random weights")
    add(p, "quiet")


def _check(args: argparse.Namespace) -> None:
    """Refuse, before a weight is read, an output or flags that cannot work."""
    out: Path = args.output
    check_output(out, "file")
    if out.suffix.lower() != SUFFIX:
        raise ArchcError(f"-o {out}: name the file *{SUFFIX} (archc reads a quantized file back "
                         "by its suffix)")
    if args.group is not None and args.quantize != "int4":
        raise ArchcError("--group sets int4 groups: give it with --quantize int4")


def run(args: argparse.Namespace) -> int:
    import archc
    _check(args)
    source = describe(args.source)       # a source that cannot be read is refused here
    dequantize = args.quantize is not None and is_gguf(Path(args.source))
    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=err_console, transient=True,
                  disable=args.quiet or not err_console.is_terminal) as bar:
        task = bar.add_task("loading weights", total=None)
        model = archc.load(args.source, seed=args.seed, dtype=args.dtype,
                           progress=lambda done, total: bar.update(task, completed=done,
                                                                   total=total),
                           **({"dequantize": True} if dequantize else {}))
    before = sum(tensor_bytes(w) for w in (model.weights or {}).values())
    if args.quantize is not None:
        model = model.quantized(args.quantize, args.group or 128)
    weights = dict(model.weights or {})
    if not args.quiet:
        for note in model.notes:
            err_console.print(f"[dim]note: {note}[/]", soft_wrap=True)
    after = save(args.output, model.spec, weights, source=str(args.source))
    schemes: dict[str, int] = {}
    for w in weights.values():
        key = w.dtype if isinstance(w, QTensor) else dtype_name(w.dtype)
        schemes[key] = schemes.get(key, 0) + 1
    kinds = ", ".join(f"{k} ×{n}" for k, n in sorted(schemes.items(), key=lambda kv: -kv[1]))
    console.print(f"wrote {args.output}: {source.spec.name}, {len(weights)} tensors ({kinds}), "
                  f"{nbytes(before)} → {nbytes(after)} ({before / max(after, 1):.2f}× smaller)",
                  soft_wrap=True)
    return 0
