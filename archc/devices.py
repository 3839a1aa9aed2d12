"""The device a model runs on: a name checked before anything is loaded onto it.

Without one given, a model runs on the CUDA GPU when torch sees one, else on the CPU.
"""

from __future__ import annotations

from typing import Any

import torch

from archc.errors import ArchcError, Spell, python_option

DEVICES = ("cpu", "cuda")


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(value: Any, *, spell: Spell = python_option) -> torch.device:
    """A torch device archc can run on (cpu, cuda, cuda:N), or an ArchcError that says why not
    and what to pass instead. None or "auto": ``default_device()``."""
    if value is None or value == "auto":
        return default_device()
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ArchcError(f"{spell('device', value)} is not a device (use 'cpu' or 'cuda')") \
            from None
    if device.type not in DEVICES:
        raise ArchcError(f"{spell('device', value)}: archc runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else \
                f"built for CUDA {torch.version.cuda}"
            raise ArchcError(f"{spell('device', value)}, but torch sees no CUDA GPU here "
                             f"(torch {torch.__version__}, {build}); run on "
                             f"{spell('device', 'cpu')} — the triton backend then runs its "
                             "kernels under Triton's interpreter")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ArchcError(f"{spell('device', value)}: torch sees "
                             f"{torch.cuda.device_count()} GPU(s), numbered from 0")
    return device
