"""What commands share beyond their flags (``vocabulary``): reading a source's spec without its
weights, the checks every run makes before loading anything, loading with a progress bar, and
writing an output."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from archc.devices import resolve_device
from archc.dtypes import default_dtype
from archc.errors import ArchcError, cli_option
from archc.sources import Source, describe
from archc.spec.schema import Spec
from archc.timings import Timings
from archc.ui import err_console, progress


def source_of(args: argparse.Namespace, attr: str = "source") -> Source:
    """The source named on the command line, read without its weights."""
    return describe(getattr(args, attr))


def spec_of(args: argparse.Namespace, attr: str = "source") -> Spec:
    return source_of(args, attr).spec


def inspection_dtype(args: argparse.Namespace, spec: Spec) -> str:
    """--dtype, or the model's own dtype (nothing runs)."""
    return str(args.dtype or default_dtype(spec.dtype, None))


def check_output(path: Path | None, kind: str, flag: str = "-o") -> None:
    """Refuse, before any work, an output path that cannot be written as `kind` ("file" or
    "dir")."""
    if path is None:
        return
    if kind == "file":
        if path.is_dir():
            raise ArchcError(f"{flag} {path}: is a directory; give a file name")
        if not path.parent.is_dir():
            raise ArchcError(f"{flag} {path}: directory {path.parent} does not exist")
    elif path.exists() and not path.is_dir():
        raise ArchcError(f"{flag} {path}: exists and is not a directory")


def write_text(path: Path, text: str) -> None:
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ArchcError(f"cannot write {path}: {err.strerror}") from None


class Run:
    """A model about to run: where, in which dtype, from which source — all checked before a
    weight is read. `backend` None: the command runs both backends (validate)."""

    def __init__(self, args: argparse.Namespace, *, backend: str | None = "eager",
                 lengths: tuple[int, int] | None = None) -> None:
        self.args = args
        self.source = source_of(args)
        self.spec = self.source.spec
        self.device = resolve_device(getattr(args, "device", None), spell=cli_option)
        self.dtype = args.dtype or default_dtype(self.spec.dtype, self.device)
        self.quiet = bool(getattr(args, "quiet", False))
        if backend in ("triton", None) and self.dtype == "bf16" and self.device.type == "cpu":
            raise ArchcError("--dtype bf16 on the CPU: Triton's interpreter computes bfloat16 "
                             "wrongly; use --dtype f32 or f16, or --device cuda")
        if lengths is not None:
            prompt, new = lengths
            if prompt + new > self.spec.max_seq_len:
                raise ArchcError(f"{prompt} prompt tokens + {new} new exceed {self.spec.name}'s "
                                 f"max_seq_len = {self.spec.max_seq_len}")
        self._check_memory(backend)
        if getattr(args, "threads", None) is not None:
            torch.set_num_threads(args.threads)
        self.timings = Timings()      # load and compile, as they happen

    def _check_memory(self, backend: str | None) -> None:
        """The weights are read straight into the compute dtype, so the eager backend runs them
        as they are; the triton backend's passes evaluate a second copy (merged and folded
        weights), and validation runs both; on a GPU every copy is made there."""
        from archc.ir.lower import lower
        from archc.memory import check_fits, checkpoint_elements
        elements = checkpoint_elements(lower(self.spec))
        extra = {"eager": 0, "triton": 1}.get(backend or "", 2)
        checks = [(self.device, 1 + extra)]
        if self.device.type == "cuda":            # read on the host, then copied over
            checks.insert(0, (torch.device("cpu"), 1))
        for device, copies in checks:
            what = "its weights" if copies == 1 else f"its weights and {copies - 1} compiled " \
                f"cop{'y' if copies == 2 else 'ies'}"
            check_fits(self.spec.name, what, elements * copies, self.dtype, self.spec.family,
                       device, spell=cli_option, random=self.source.random_weights)

    def load(self) -> Any:
        """The model, its weights in the compute dtype; notes on stderr unless --quiet."""
        import archc
        seed = getattr(self.args, "seed", None) or 0
        with self.timings.phase("load"):
            if self.quiet or not err_console.is_terminal:   # no bar in logs and pipes
                model = archc.load(self.args.source, seed=seed, dtype=self.dtype)
            else:
                with progress() as bar:
                    task = bar.add_task("loading weights", total=None)

                    def report(done: int, total: int) -> None:
                        bar.update(task, completed=done, total=total)

                    model = archc.load(self.args.source, seed=seed, dtype=self.dtype,
                                       progress=report)
        if not self.quiet:
            for note in model.notes:
                err_console.print(f"[dim]note: {note}[/]", soft_wrap=True)
        return model

    def compile(self, model: Any, backend: str, **options: Any) -> Any:
        cache_dir = getattr(self.args, "cache_dir", None)
        if backend == "triton" and cache_dir is not None:
            options["cache_dir"] = cache_dir
        with self.timings.phase("compile"):
            return model.compile(backend, dtype=self.dtype, device=self.device, **options)
