"""Memory: what a device has free for a new allocation, tensors whose pages are mapped only when
written, and the peak resident memory a process held (what `archc run` reports)."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

LAZY_ZEROS = 1 << 20     # bytes from which `zeros` maps memory of its own on the host


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on `device` can take: the GPU's free memory, or the host's
    (`host_available`); None when it cannot be told."""
    return int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else \
        host_available()


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


def mapped(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor in pages of its own (an anonymous private map): resident only once
    written, and given back to the system when the tensor is freed, whatever malloc's heap
    keeps — what a weight read at load and let go after (merged into another) needs."""
    size = math.prod(shape) * dtype.itemsize
    if size == 0:
        return torch.zeros(tuple(shape), dtype=dtype)
    pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)   # the tensor keeps the map alive
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(tuple(shape))


def zeros(shape: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
          ) -> torch.Tensor:
    """torch.zeros, but a large one on the host `mapped`: its pages are mapped, zeroed, on first
    write, not zero-filled up front, so a KV cache sized for max_seq_len holds resident only the
    rows written. (malloc's zeroed memory is no substitute: it fills reused heap memory with
    zeros, touching every page.)"""
    if torch.device(device).type != "cpu" or math.prod(shape) * dtype.itemsize < LAZY_ZEROS:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    return mapped(shape, dtype)


def peak_resident() -> int | None:
    """The most bytes of host memory this process has held resident (its high-water mark),
    None where it cannot be told. Linux's VmHWM, which starts afresh when a program starts;
    elsewhere getrusage's ru_maxrss (on Linux that one keeps the parent's mark across the
    fork and exec that started the process)."""
    status = Path("/proc/self/status")
    try:
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)   # macOS: bytes; else KiB


def release_freed() -> None:
    """Give the heap memory freed so far back to the system (glibc's malloc_trim): a load's or
    a compile's transients, freed, otherwise stay resident in the holes of the heap. A no-op
    where the C library has no malloc_trim."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
