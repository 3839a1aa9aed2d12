"""What commands share beyond their flags (``vocabulary``): reading a source's spec without its
weights, checking and writing an output, and a model about to run (``Run``), each phase timed
as llama.cpp reports it: one line on standard error, never wrapped, so that a log keeps it
whole. Prefill runs from the start of generation to the first new token; decode, on to the last."""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

from archc.devices import (
    check_compilable,
    check_fits,
    default_dtype,
    dtype_name,
    resolve_device,
)
from archc.errors import ArchcError, cli_option
from archc.ir.lower import lower
from archc.memory import peak_resident
from archc.quant import QTensor, tensor_bytes
from archc.sources import describe
from archc.spec.schema import Spec
from archc.ui import console, err_console, nbytes

STOPS = {"eos": "stopped at end-of-sequence", "length": "stopped at the token limit",
         "interrupted": "interrupted"}


@dataclass
class Timings:
    seconds: dict[str, float] = field(default_factory=dict)   # load, compile, prefill, decode
    prompt_tokens: int = 0
    cached_tokens: int = 0          # of the prompt, already in the KV cache: not prefilled
    generated: int = 0              # new tokens, the first of them from the prefill
    stop: str | None = None         # a key of STOPS
    stop_token: str | None = None   # the end-of-sequence token's text
    weight_bytes: int | None = None         # what the loaded weights hold in memory
    weight_kinds: dict[str, int] = field(default_factory=dict)   # dtype or scheme → tensors

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def tokens(self, phase: str) -> int:
        return self.prompt_tokens - self.cached_tokens if phase == "prefill" else \
            max(self.generated - 1, 0)

    def tokens_per_second(self) -> dict[str, float]:
        return {p: self.tokens(p) / self.seconds[p] for p in ("prefill", "decode")
                if self.seconds.get(p) and self.tokens(p)}

    def line(self) -> str:
        """`load 0.41 s · compile 0.02 s · prefill 37 tokens in 0.80 s (46.3 tokens/s) · …`, and
        the most memory the process has held resident so far."""
        rates = self.tokens_per_second()
        parts = []
        for name, s in self.seconds.items():
            n = self.tokens(name)
            cached = f" ({self.cached_tokens} cached)" if name == "prefill" and \
                self.cached_tokens else ""
            if name == "load" and self.weight_bytes is not None:
                kinds = ", ".join(f"{k} ×{c}" for k, c in self.weight_kinds.items())
                parts.append(f"load {s:.2f} s, {nbytes(self.weight_bytes)} of weights ({kinds})")
                continue
            parts.append((f"{name} {s:.2f} s" if name in ("load", "compile") else
                          f"{name} {n} token{'' if n == 1 else 's'}{cached} in {s:.2f} s") +
                         (f" ({rates[name]:.3g} tokens/s)" if name in rates else ""))
        peak = peak_resident()
        if peak is not None:
            parts.append(f"peak memory {nbytes(peak)}")
        if self.stop is not None:
            parts.append(STOPS[self.stop] + (f" ({self.stop_token})" if self.stop_token else ""))
        return " · ".join(parts)

    def report(self, quiet: bool) -> None:
        if not quiet:
            err_console.print(f"[dim]{self.line()}[/]", soft_wrap=True, highlight=False)

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "weight_bytes": self.weight_bytes,
                "weight_tensors": self.weight_kinds, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens,
                "generated_tokens": self.generated,
                "tokens_per_second": self.tokens_per_second(), "stop": self.stop,
                "peak_memory_bytes": peak_resident()}


def spec_of(args: argparse.Namespace, attr: str = "source") -> Spec:
    """The spec of the source named on the command line, read without its weights."""
    return describe(getattr(args, attr)).spec


def quantize_flags(args: argparse.Namespace) -> tuple[str | None, int | None]:
    """--quantize and --group as given, refusing a --group without --quantize int4."""
    kind, group = getattr(args, "quantize", None), getattr(args, "group", None)
    if group is not None and kind != "int4":
        raise ArchcError("--group sets int4 groups: give it with --quantize int4")
    return kind, group


def quant_scheme(args: argparse.Namespace) -> str | None:
    """The scheme --quantize and --group name (None without --quantize)."""
    from archc.quant.pack import scheme_name
    kind, group = quantize_flags(args)
    return None if kind is None else scheme_name(kind, group or 128)


def quant_of(args: argparse.Namespace, attr: str = "source") -> tuple[Spec, dict[str, str]]:
    """The spec of the source named on the command line and the map of its quantized weights
    (checkpoint tensor → scheme), read without its weights: the source's own quantized tensors,
    or with --quantize, those `archc.load(quantize=...)` would quantize."""
    from archc.runtime.weights import quantizable
    source = describe(getattr(args, attr))
    quant = dict(source.quant)
    name = quant_scheme(args)
    if name is not None:
        if quant:
            raise ArchcError(f"{getattr(args, attr)} is already quantized "
                             f"({', '.join(sorted(set(quant.values())))}); --quantize is for "
                             "float checkpoints")
        quant = {t: name for t in quantizable(lower(source.spec))}
    return source.spec, quant


def check_output(path: Path | None, kind: str, flag: str = "-o") -> None:
    """Refuse, before any work, an output path that cannot be written as a `kind` (file, dir)."""
    if path is None:
        return
    if kind == "file" and path.is_dir():
        raise ArchcError(f"{flag} {path}: is a directory; give a file name")
    if kind == "file" and not path.parent.is_dir():
        raise ArchcError(f"{flag} {path}: directory {path.parent} does not exist")
    if kind == "dir" and path.exists() and not path.is_dir():
        raise ArchcError(f"{flag} {path}: exists and is not a directory")


def emit(text: str, path: Path | None) -> None:
    """`text` on standard output, or written to `path` and said so."""
    if path is None:
        sys.stdout.write(text)
        return
    try:
        path.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ArchcError(f"cannot write {path}: {err.strerror}") from None
    console.print(f"wrote {path}")


class Run:
    """A model about to run: its source, device and dtype, checked before a weight is read.
    A command without --backend runs both backends (validate)."""

    def __init__(self, args: argparse.Namespace, lengths: tuple[int, int] | None = None) -> None:
        self.args = args
        backend = getattr(args, "backend", None)
        self.source = describe(args.source)
        self.spec = self.source.spec
        self.device = resolve_device(args.device, spell=cli_option)
        self.dtype = args.dtype or default_dtype(self.spec.dtype, self.device)
        self.quiet = bool(getattr(args, "quiet", False))
        self.quantize, self.group = quantize_flags(args)
        if getattr(args, "dequantize", False) and self.source.kind != "gguf":
            raise ArchcError(f"--dequantize reads a GGUF file's quantized tensors as floats; "
                             f"{args.source} is not a GGUF file")
        # before any weight is read
        check_compilable(backend, self.dtype, self.device, getattr(args, "kv_cache", None),
                         spell=cli_option)
        self.timings = Timings()      # load and compile, as they happen
        if lengths is not None:
            self.check_lengths(*lengths)
        # The weights are read straight into the compute dtype, so the eager backend runs them
        # as they are (quantized ones too: it dequantizes them as it reads them); the triton
        # backend's passes evaluate merged and folded weights, each taking the place of the
        # tensors it is made of (the command compiles once: `Run.compile`); validation keeps
        # the checkpoint beside the eager and the kernels' copies. A GPU's copies are read on
        # the host first.
        program = lower(self.spec)   # tensors a source keeps quantized priced at their bytes
        quant = {} if getattr(args, "dequantize", False) else self.source.quant
        tp = getattr(args, "tp", 1)  # a rank of a --tp run holds its slices only
        copies = {"eager": 1, "triton": 1, None: 3}[backend]
        host = [(torch.device("cpu"), 1)] if self.device.type == "cuda" else []
        for device, n in [*host, (self.device, copies)]:
            check_fits(self.spec, program, self.dtype, device, quant=quant, tp=tp, copies=n,
                       spell=cli_option, random=self.source.random_weights)
        if getattr(args, "threads", None) is not None:
            torch.set_num_threads(args.threads)

    def check_lengths(self, prompt: int, new: int) -> None:
        """Refuse a prompt and new tokens that exceed the model's max_seq_len."""
        if prompt + new > self.spec.max_seq_len:
            raise ArchcError(f"{prompt} prompt tokens + {new} new exceed "
                             f"{self.spec.name}'s max_seq_len = {self.spec.max_seq_len}")

    def load(self) -> Any:
        """The model, its weights in the compute dtype, with a progress bar on a terminal and
        notes on stderr unless --quiet."""
        import archc
        tp = getattr(self.args, "tp", 1)
        # a rank reads its tensor-parallel slices only (tp-major: its tp rank is g mod tp)
        if tp > 1:
            import torch.distributed as dist
        rank = 0 if tp == 1 else dist.get_rank() % tp
        with self.timings.phase("load"), Progress(
                "{task.description}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                console=err_console, transient=True,
                disable=self.quiet or not err_console.is_terminal) as bar:
            task = bar.add_task("loading weights", total=None)
            model = archc.load(self.args.source, seed=self.args.seed, dtype=self.dtype,
                               progress=lambda done, total: bar.update(task, completed=done,
                                                                       total=total),
                               quantize=self.quantize, group=self.group or 128,
                               dequantize=bool(getattr(self.args, "dequantize", False)),
                               tp=tp, rank=rank)
        if not self.quiet:
            for note in model.notes:
                err_console.print(f"[dim]note: {note}[/]", soft_wrap=True)
        weights = list((model.weights or {}).values())
        self.timings.weight_bytes = sum(map(tensor_bytes, weights))
        kinds = Counter(w.dtype if isinstance(w, QTensor) else dtype_name(w.dtype)
                        for w in weights)
        self.timings.weight_kinds = dict(kinds.most_common())
        return model

    def compile(self, model: Any) -> Any:
        """The model compiled for --backend, kernels written to --cache-dir when given, not
        tuned with --no-autotune."""
        backend, cache_dir = self.args.backend, self.args.cache_dir
        options: dict[str, Any] = {}
        if backend == "triton" and cache_dir is not None:
            options["cache_dir"] = cache_dir
        if backend == "triton" and getattr(self.args, "no_autotune", False):
            options["autotune"] = False
        if getattr(self.args, "kv_cache", None) is not None:
            options["kv_cache"] = self.args.kv_cache
        tp, cp = getattr(self.args, "tp", 1), getattr(self.args, "cp", 1)
        # the command compiles once: the weights are handed to the session (a rank's slices,
        # a merged copy), never held twice
        with self.timings.phase("compile"):
            return model.compile(backend, dtype=self.dtype, device=self.device, tp=tp, cp=cp,
                                 keep_weights=False, **options)
