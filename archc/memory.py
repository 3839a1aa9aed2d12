"""Will it fit? Weight bytes estimated before anything is allocated, against the memory free.

A real-size spec's random weights in f32 take four bytes per parameter — 30 GiB for Llama 3 8B —
and an operating system that runs out kills the process without a word. So loading weights
and compiling a model first price what they will allocate (parameter count × bytes per element,
from the IR) and refuse, naming the size, the memory available and what would fit, when it
cannot.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from archc.errors import ArchcError, Spell, python_option
from archc.ir.graph import Program
from archc.runtime.weights import checkpoint_shapes
from archc.ui import nbytes

# A tiny spec to suggest, per family
TINY = {"decoder": "tiny-llama3", "encoder": "tiny-bert", "encoder-decoder": "tiny-t5"}


def checkpoint_elements(program: Program) -> int:
    """Elements of every checkpoint tensor the program reads."""
    total = 0
    for dims in checkpoint_shapes(program).values():
        n = 1
        for d in dims:
            n *= d
        total += n
    return total


def _cgroup_free() -> int | None:
    """Room left under a cgroup (v2) memory limit, if there is one."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def host_available() -> int | None:
    """Bytes of host memory a new allocation can take without swapping: the kernel's
    MemAvailable, within a cgroup's limit. None when it cannot be told."""
    found: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        found = None
    if found is None:
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    room = _cgroup_free()
    return found if room is None else min(found, room)


def available(device: torch.device) -> int | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available()


def check_fits(model: str, what: str, elements: int, dtype: str, family: str,
               device: torch.device | None = None, *, spell: Spell = python_option,
               random: bool = False) -> None:
    """Refuse to allocate `elements` values of `dtype` for `what` (\"its weights\") when the
    memory free on `device` cannot hold them."""
    from archc.dtypes import DTYPES, itemsize
    device = device or torch.device("cpu")
    need = elements * itemsize(dtype)
    free = available(device)
    if free is None or need <= free:
        return
    where = "GPU memory" if device.type == "cuda" else "memory"
    smaller = [d for d in sorted(DTYPES, key=lambda d: (itemsize(d), d))
               if itemsize(d) < itemsize(dtype) and elements * itemsize(d) <= free]
    options = [" or ".join(spell("dtype", d) for d in smaller) +
               f" ({nbytes(elements * itemsize(smaller[0]))})"] if smaller else []
    if random:
        options.append(f"a tiny spec of the same structure, such as {TINY[family]}")
    options.append("a machine with more memory")
    state = "random weights" if random else "weights"
    raise ArchcError(f"{model}: {what} need {nbytes(need)} ({elements:,} {state} in {dtype}) "
                     f"and {nbytes(free)} of {where} is available. Options: "
                     + "; ".join(options))
