"""Compute dtypes by name, and the one rule for the dtype a model computes in when none is given.

archc names dtypes as its IR prints them (f32, f16, bf16). The Python API also takes torch dtypes
and torch's names for them ("float16", "bfloat16"...); the command line takes the short names.

The default rule, everywhere: **the model's own dtype** (`dtype` in its spec; a checkpoint's
from its config or file) — **except that a model run on a CPU computes in f32** (CPUs are slow
in f16 and bf16 matmuls, and Triton's interpreter computes bf16 wrongly).
"""

from __future__ import annotations

from typing import Any

import torch

from archc.errors import ArchcError
from archc.runtime.weights import TORCH_DTYPES

DTYPES = ("f32", "f16", "bf16")
# torch's spellings (and the usual short ones) of the three
_NAMES = {"float32": "f32", "float": "f32", "fp32": "f32", "float16": "f16", "half": "f16",
          "fp16": "f16", "bfloat16": "bf16"}


def dtype_name(value: Any, *, argument: str = "dtype") -> str:
    """'f32', 'f16' or 'bf16' for a name or a torch dtype; an ArchcError naming `argument`
    otherwise."""
    if isinstance(value, torch.dtype):
        for name in DTYPES:
            if TORCH_DTYPES[name] == value:
                return name
        raise ArchcError(f"{argument}={value} is not a dtype archc computes in (torch.float32, "
                         "torch.float16, torch.bfloat16, or 'f32', 'f16', 'bf16')")
    if isinstance(value, str):
        text = value.lower().removeprefix("torch.")
        if text in DTYPES:
            return text
        if text in _NAMES:
            return _NAMES[text]
    raise ArchcError(f"{argument}={value!r} is not a dtype archc computes in ('f32', 'f16', "
                     "'bf16', or torch.float32, torch.float16, torch.bfloat16)")


def itemsize(name: str) -> int:
    return TORCH_DTYPES[name].itemsize


def default_dtype(model_dtype: str, device: torch.device | str | None) -> str:
    """The dtype a model computes in when none is given: its own, or f32 on a CPU. `device`
    None: nothing runs (the IR and the costs of a model are shown in its own dtype)."""
    if device is not None and torch.device(device).type == "cpu":
        return "f32"
    return model_dtype
