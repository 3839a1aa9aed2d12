"""Where a model runs, the dtype it computes in, and whether its weights fit there — all checked
before anything is loaded.

Dtypes are named as the IR prints them (f32, f16, bf16); the Python API also takes torch dtypes
and torch's names ("float16", "bfloat16"…). Without one given, a model runs on the CUDA GPU when
torch sees one, else on the CPU, and computes in **its own dtype** (`dtype` in its spec; a
checkpoint's from its config or file) — **except on a CPU, where it computes in f32** (CPUs are
slow in f16 and bf16 matmuls, and Triton's interpreter computes bf16 wrongly).

Weights are priced from the IR before they are allocated: a real-size spec's random weights take
30 GiB in f32 for Llama 3 8B, and a process that exhausts memory is killed without a word."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from archc import dtypes
from archc.dtypes import FLOAT_DTYPES as DTYPES
from archc.dtypes import KV_CODES
from archc.errors import ArchcError, Spell, python_option
from archc.ir.graph import Program
from archc.ir.shapes import DTYPE_BYTES
from archc.memory import free_bytes
from archc.passes.slices import rank_slices
from archc.runtime.weights import checkpoint_shapes
from archc.ui import nbytes

if TYPE_CHECKING:
    from archc.spec.schema import Spec

# every spelling of the three: archc's, torch's and the usual short ones
_NAMES = {spelling: name for name in DTYPES
          for spelling in (name, dtypes.DTYPES[name].torch, *dtypes.DTYPES[name].aliases)}


def dtype_name(value: Any) -> str:
    """'f32', 'f16' or 'bf16' for a name or a torch dtype."""
    key = value.lower().removeprefix("torch.") if isinstance(value, str) else value
    if not isinstance(key, (str, torch.dtype)) or key not in _NAMES:
        raise ArchcError(f"dtype={value!r} is not a dtype archc computes in ('f32', 'f16', "
                         "'bf16', or torch.float32, torch.float16, torch.bfloat16)")
    return _NAMES[key]


def default_dtype(model_dtype: str, device: torch.device | str | None) -> str:
    """The dtype a model computes in when none is given. `device` None: nothing runs (the IR
    and the costs of a model are shown in its own dtype)."""
    return "f32" if device is not None and torch.device(device).type == "cpu" else model_dtype


def resolve_device(value: Any, *, spell: Spell = python_option) -> torch.device:
    """A torch device archc can run on (cpu, cuda, cuda:N; None or "auto": the default), or an
    ArchcError that says why not and what to pass instead."""
    if value is None or value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ArchcError(f"{spell('device', value)} is not a device (use 'cpu' or 'cuda')") \
            from None
    if device.type not in ("cpu", "cuda"):
        raise ArchcError(f"{spell('device', value)}: archc runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else \
            f"built for CUDA {torch.version.cuda}"
        raise ArchcError(f"{spell('device', value)}, but torch sees no CUDA GPU here (torch "
                         f"{torch.__version__}, {build}); run on {spell('device', 'cpu')} — the "
                         "triton backend then runs its kernels under Triton's interpreter")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ArchcError(f"{spell('device', value)}: torch sees {torch.cuda.device_count()} "
                         "GPU(s), numbered from 0")
    return device


def check_compilable(backend: str | None, dtype: str, device: torch.device,
                     kv_cache: Any = None, *, spell: Spell = python_option) -> None:
    """Refuse what `backend` ("eager", "triton"; None: both, as validation runs them) cannot
    compute on `device` before anything is loaded or compiled: bf16 in Triton's interpreter,
    which computes bfloat16 wrongly; a KV-cache format that is not one; fp8 e4m3, which needs
    torch's float8_e4m3fn, and in Triton kernels a GPU of compute capability 8.9 or later (Ada,
    Hopper), whose cvt instructions convert to and from e4m3."""
    triton = backend in ("triton", None)
    if triton and dtype == "bf16" and device.type == "cpu":
        raise ArchcError(f"{spell('dtype', 'bf16')} with the triton backend on the CPU: Triton's "
                         f"interpreter computes bfloat16 wrongly; use {spell('dtype', 'f32')} or "
                         f"{spell('dtype', 'f16')}, or {spell('device', 'cuda')}")
    if kv_cache is None:
        return
    if kv_cache not in KV_CODES:
        raise ArchcError(f"{spell('kv_cache', kv_cache)} is not a KV-cache format (known: "
                         f"{', '.join(map(repr, KV_CODES))}, or None for the model dtype)")
    if kv_cache != "fp8":
        return
    if KV_CODES["fp8"].torch is None:
        raise ArchcError(f"{spell('kv_cache', 'fp8')}: this torch ({torch.__version__}) has no "
                         f"float8_e4m3fn; use {spell('kv_cache', 'int8')}")
    if triton:
        cc = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        if cc is None or cc < (8, 9):
            where = "the CPU (Triton's interpreter)" if cc is None else \
                f"{torch.cuda.get_device_name(device)} (sm_{cc[0]}{cc[1]})"
            raise ArchcError(f"{spell('kv_cache', 'fp8')} with the triton backend needs a GPU "
                             f"of compute capability 8.9 or later; {where} has no e4m3 "
                             f"conversions. Use {spell('kv_cache', 'int8')} there, or the eager "
                             "backend for fp8")


TINY = {"decoder": "tiny-llama3", "encoder": "tiny-bert", "encoder-decoder": "tiny-t5"}


def weight_sizes(program: Program, quant: Mapping[str, str] | None = None,
                 tp: int = 1) -> tuple[int, int]:
    """(elements held as floats, bytes kept quantized) of the checkpoint tensors `program` reads,
    as one of `tp` tensor-parallel ranks holds them (its slices, or the whole tensor where the
    shard pass replicates it): those `quant` (tensor → scheme) keeps quantized at their
    scheme's bytes, scales included, whatever the compute dtype."""
    shapes = checkpoint_shapes(program)
    for name, (dim, parts, _) in rank_slices(program, tp).items():
        shapes[name] = tuple(d // parts if k == dim else d for k, d in enumerate(shapes[name]))
    quant = quant or {}
    return (sum(math.prod(dims) for name, dims in shapes.items() if name not in quant),
            sum(math.ceil(math.prod(dims) * DTYPE_BYTES[quant[name]])
                for name, dims in shapes.items() if name in quant))


def check_fits(spec: Spec, program: Program, dtype: str, device: torch.device | None = None,
               *, quant: Mapping[str, str] | None = None, tp: int = 1, copies: int = 1,
               what: str | None = None, spell: Spell = python_option,
               random: bool = False) -> None:
    """Refuse to allocate the checkpoint tensors `program` (of `spec`) reads, in `dtype` (those
    `quant` keeps quantized at their bytes), `copies` times over, on one of `tp` ranks, when the
    memory free on `device` (default: the host) cannot hold them, saying what would fit. `what`
    names them (default: its weights, or a rank's slices of them, and the compiled copies)."""
    device = device or torch.device("cpu")
    elements, quantized = (copies * n for n in weight_sizes(program, quant, tp))
    need = elements * DTYPE_BYTES[dtype] + quantized
    free = free_bytes(device)
    if free is None or need <= free:
        return
    if what is None:
        what = ("its weights" if tp == 1 else f"its weights' slices for 1 of {tp} ranks") + (
            f" and {copies - 1} compiled cop{'y' if copies == 2 else 'ies'}" if copies > 1
            else "")
    smaller = [d for d in sorted(DTYPES, key=lambda d: (DTYPE_BYTES[d], d))
               if DTYPE_BYTES[d] < DTYPE_BYTES[dtype]
               and elements * DTYPE_BYTES[d] + quantized <= free]
    options = [" or ".join(spell("dtype", d) for d in smaller) +
               f" ({nbytes(elements * DTYPE_BYTES[smaller[0]] + quantized)})"] if smaller else []
    if random:
        options.append(f"a tiny spec of the same structure, such as {TINY[spec.family]}")
    options.append("a machine with more memory")
    raise ArchcError(f"{spec.name}: {what} need {nbytes(need)} ({elements:,} "
                     f"{'random weights' if random else 'weights'} in {dtype}"
                     + (f" and {nbytes(quantized)} quantized" if quantized else "") + ") and "
                     f"{nbytes(free)} of {'GPU memory' if device.type == 'cuda' else 'memory'} "
                     "is available. Options: " + "; ".join(options))
