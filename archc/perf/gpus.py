"""Peak dense 16-bit tensor throughput and HBM bandwidth of the GPUs archc models: the vendor's
datasheet figures for dense (not 2:4 sparse) bf16/fp16 tensor-core math and peak bandwidth."""

from __future__ import annotations

from dataclasses import dataclass

from archc.errors import ArchcError


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float       # dense bf16/fp16 tensor-core FLOP/s
    bandwidth: float        # HBM bytes/s

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound."""
        return self.peak_flops / self.bandwidth


GPUS: dict[str, GPU] = {
    "a100": GPU("A100-80GB SXM", 312e12, 2.039e12),     # A100 datasheet (2021), HBM2e
    "h100": GPU("H100 SXM", 989.4e12, 3.35e12),         # H100 datasheet (2023), HBM3
    "h200": GPU("H200 SXM", 989e12, 4.8e12),            # H200 datasheet (2024), HBM3e
}


def gpu(name: str) -> GPU:
    key = name.lower().replace("-", "").replace("_", "")
    for k, g in GPUS.items():
        if key.startswith(k):
            return g
    raise ArchcError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
