"""Peak dense 16-bit tensor throughput and HBM bandwidth of the GPUs archc models.

Figures are the vendor's datasheet numbers for dense (not 2:4 sparse) bf16/fp16 tensor-core
math and peak memory bandwidth:
- A100-80GB SXM: 312 TFLOP/s bf16 dense, 2,039 GB/s HBM2e (NVIDIA A100 datasheet, 2021).
- H100 SXM5: 989.4 TFLOP/s bf16 dense (1,979 with sparsity), 3.35 TB/s HBM3 (NVIDIA H100
  datasheet, 2023).
- H200 SXM: 989 TFLOP/s bf16 dense (1,979 with sparsity), 4.8 TB/s HBM3e (NVIDIA H200
  datasheet, 2024).
"""

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
    "a100": GPU("A100-80GB SXM", 312e12, 2.039e12),
    "h100": GPU("H100 SXM", 989.4e12, 3.35e12),
    "h200": GPU("H200 SXM", 989e12, 4.8e12),
}


def gpu(name: str) -> GPU:
    key = name.lower().replace("-", "").replace("_", "")
    for k, g in GPUS.items():
        if key.startswith(k):
            return g
    raise ArchcError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
