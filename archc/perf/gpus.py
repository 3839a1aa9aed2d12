"""Peak dense 16-bit tensor throughput, HBM bandwidth and SM count of the GPUs archc models: the
vendor's datasheet figures for dense (not 2:4 sparse) bf16/fp16 tensor-core math, peak bandwidth
and streaming multiprocessors. What one SM of each architecture holds is its compile target's
(``archc.codegen.targets``)."""

from __future__ import annotations

from dataclasses import dataclass

from archc.errors import ArchcError


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float       # dense bf16/fp16 tensor-core FLOP/s
    bandwidth: float        # HBM bytes/s
    sms: int                # streaming multiprocessors
    arch: str               # the compile target of its SMs (a key of ``GPU_TARGETS``)
    # GPU-to-GPU link (NVLink) bytes/s one GPU sends, and receives, at once: half the datasheet's
    # total, which counts both directions. A ring collective's bytes are those one rank sends.
    link: float = 0.0

    @property
    def ridge(self) -> float:
        """Arithmetic intensity (FLOP/byte) above which a kernel is compute-bound."""
        return self.peak_flops / self.bandwidth


# Links: the datasheets' NVLink bandwidth per GPU counts both directions — A100 SXM 600 GB/s
# (NVLink 3), H100 and H200 SXM 900 GB/s (NVLink 4), B200 1.8 TB/s (NVLink 5) — so each way
# is half of it: 300, 450 and 900 GB/s.
GPUS: dict[str, GPU] = {
    "a100": GPU("A100-80GB SXM", 312e12, 2.039e12, 108, "sm_80",   # A100 datasheet (2021), HBM2e
                link=600e9 / 2),
    "h100": GPU("H100 SXM", 989.4e12, 3.35e12, 132, "sm_90a",      # H100 datasheet (2023), HBM3
                link=900e9 / 2),
    "h200": GPU("H200 SXM", 989e12, 4.8e12, 132, "sm_90a",         # H200 datasheet (2024), HBM3e
                link=900e9 / 2),
    # HGX B200 datasheet (2024), per GPU at 1000 W: 2.25 PFLOP/s dense BF16 (4.5 with 2:4
    # sparsity), 8 TB/s HBM3e; the datasheet gives no SM count: 148 (74 enabled of each die's
    # 80) is Chips and Cheese's "Nvidia's B200: Keeping the CUDA Juggernaut Rolling" (2025)
    "b200": GPU("B200 SXM", 2.25e15, 8e12, 148, "sm_100a", link=1.8e12 / 2),
}


def gpu(name: str) -> GPU:
    key = name.lower().replace("-", "").replace("_", "")
    for k, g in GPUS.items():
        if key.startswith(k):
            return g
    raise ArchcError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
