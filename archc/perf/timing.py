"""Timing on the device: one clock for every measurement of a benchmark run.

On a GPU a callable is timed with ``triton.testing.do_bench``: warm-up runs first (compiles,
autotuning, allocator growth stay out of the number), then repeats between CUDA events, the L2
flushed before each, the median kept. A loop that carries state from call to call (decode
steps) is timed whole on the host clock between two device synchronizations. On a CPU
(``archc bench --dry-run``) there are no device events: one untimed call, then the median of a
few host-clock repeats; the numbers mean nothing, the code paths are the same. The ceilings (a
large copy and a large matmul) are measured in the same run, so fractions can be read against
what this card really does as well as against its datasheet.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timer:
    """Seconds per call of a callable on `device` (median)."""

    device: torch.device
    warmup_ms: float = 25.0        # do_bench's warm-up budget (GPU)
    rep_ms: float = 100.0          # do_bench's measurement budget (GPU)
    cpu_repeats: int = 3           # host-clock repeats after one untimed call (CPU)

    @property
    def method(self) -> str:
        if self.device.type == "cuda":
            return (f"triton.testing.do_bench, median, warm-up {self.warmup_ms:g} ms, "
                    f"repeats for {self.rep_ms:g} ms, L2 flushed before each")
        return f"host clock, median of {self.cpu_repeats} after one untimed call (CPU dry run)"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench
            return float(do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                  return_mode="median")) / 1e3
        fn()
        return statistics.median(self.loop(fn, 1) for _ in range(self.cpu_repeats))

    def loop(self, step: Callable[[], object], n: int) -> float:
        """Seconds for `n` calls of `step` in a row, between two device synchronizations."""
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        synchronize(self.device)
        return time.perf_counter() - t0


def measure_ceilings(timer: Timer, dtype: torch.dtype, *, copy_mib: int,
                     matmul_size: int) -> dict[str, Any]:
    """A device-to-device copy of `copy_mib` MiB (bytes read plus bytes written) and a square
    `matmul_size`³ product in `dtype` on random data, timed."""
    gen = torch.Generator(timer.device).manual_seed(0)
    src = torch.randn(copy_mib * 2**20 // 4, generator=gen, device=timer.device)
    dst = torch.empty_like(src)
    copy_s, copied = timer(lambda: dst.copy_(src)), 2 * src.numel() * src.element_size()
    n = matmul_size
    a, b = (torch.randn(n, n, generator=gen, device=timer.device).to(dtype) for _ in range(2))
    mm_s = timer(lambda: torch.matmul(a, b))
    return {"copy_bytes": copied, "copy_seconds": copy_s, "copy_bandwidth": copied / copy_s,
            "matmul_shape": (n, n, n), "matmul_seconds": mm_s, "matmul_flops": 2 * n**3 / mm_s}
