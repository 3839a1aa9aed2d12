"""Will it fit? The bytes a model's weights take, priced from the IR before anything is
allocated: a real-size spec's random weights take 30 GiB in f32 for Llama 3 8B, and an operating
system that runs out kills the process without a word. A load or compile that cannot fit is
refused, naming the size, the memory available and what would fit."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from archc.errors import ArchcError, Spell, python_option
from archc.ir.graph import Program
from archc.ir.shapes import DTYPE_BYTES, FLOAT_DTYPES
from archc.runtime.weights import checkpoint_shapes
from archc.ui import nbytes

# A tiny spec to suggest, per family
TINY = {"decoder": "tiny-llama3", "encoder": "tiny-bert", "encoder-decoder": "tiny-t5"}


def checkpoint_elements(program: Program) -> int:
    """Elements of every checkpoint tensor the program reads."""
    return sum(math.prod(dims) for dims in checkpoint_shapes(program).values())


def host_available() -> int | None:
    """Bytes of host memory a new allocation can take without swapping: the kernel's
    MemAvailable (or free pages), within a cgroup v2 limit. None when it cannot be told."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
        found = int(meminfo.split("MemAvailable:")[1].split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        try:
            found = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    cgroup = Path("/sys/fs/cgroup")
    try:
        limit = int((cgroup / "memory.max").read_text())     # "max": no limit, a ValueError
        return min(found, limit - int((cgroup / "memory.current").read_text()))
    except (OSError, ValueError):
        return found


def check_fits(model: str, what: str, elements: int, dtype: str, family: str,
               device: torch.device | None = None, *, spell: Spell = python_option,
               random: bool = False) -> None:
    """Refuse to allocate `elements` values of `dtype` for `what` ("its weights") when the
    memory free on `device` (default: the host) cannot hold them."""
    device = device or torch.device("cpu")
    need = elements * DTYPE_BYTES[dtype]
    free = int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else \
        host_available()
    if free is None or need <= free:
        return
    smaller = [d for d in sorted(FLOAT_DTYPES, key=lambda d: (DTYPE_BYTES[d], d))
               if DTYPE_BYTES[d] < DTYPE_BYTES[dtype] and elements * DTYPE_BYTES[d] <= free]
    options = [" or ".join(spell("dtype", d) for d in smaller) +
               f" ({nbytes(elements * DTYPE_BYTES[smaller[0]])})"] if smaller else []
    if random:
        options.append(f"a tiny spec of the same structure, such as {TINY[family]}")
    options.append("a machine with more memory")
    raise ArchcError(f"{model}: {what} need {nbytes(need)} ({elements:,} "
                     f"{'random weights' if random else 'weights'} in {dtype}) and "
                     f"{nbytes(free)} of {'GPU memory' if device.type == 'cuda' else 'memory'} "
                     "is available. Options: " + "; ".join(options))
