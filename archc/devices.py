"""Where a model runs and the dtype it computes in, checked before anything is loaded.

Dtypes are named as the IR prints them (f32, f16, bf16); the Python API also takes torch dtypes
and torch's names ("float16", "bfloat16"…). Without one given, a model runs on the CUDA GPU when
torch sees one, else on the CPU, and computes in **its own dtype** (`dtype` in its spec; a
checkpoint's from its config or file) — **except on a CPU, where it computes in f32** (CPUs are
slow in f16 and bf16 matmuls, and Triton's interpreter computes bf16 wrongly).
"""

from __future__ import annotations

from typing import Any

import torch

from archc.errors import ArchcError, Spell, python_option
from archc.ir.shapes import FLOAT_DTYPES as DTYPES
from archc.runtime.weights import TORCH_DTYPES

# every spelling of the three: archc's, torch's and the usual short ones
_NAMES = {"float32": "f32", "float": "f32", "fp32": "f32", "float16": "f16", "half": "f16",
          "fp16": "f16", "bfloat16": "bf16", **{name: name for name in DTYPES},
          **{TORCH_DTYPES[name]: name for name in DTYPES}}


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
    if device is not None and torch.device(device).type == "cpu":
        return "f32"
    return model_dtype


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
