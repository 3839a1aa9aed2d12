"""Peak dense 16-bit tensor throughput, HBM bandwidth and SM count of the GPUs archc models: the
vendor's datasheet figures for dense (not 2:4 sparse) bf16/fp16 tensor-core math, peak bandwidth
and streaming multiprocessors; and what one SM of each architecture holds (CUDA programming
guide, compute capabilities 8.0, 9.0 and 10.0), which bounds the programs resident on it."""

from __future__ import annotations

from dataclasses import dataclass

from archc.errors import ArchcError


@dataclass(frozen=True)
class SM:
    """What one streaming multiprocessor of an architecture holds at once."""

    registers: int          # 32-bit registers
    shared_bytes: int       # shared memory, of which the runtime reserves 1 KB per program
    warps: int              # resident warps
    programs: int           # resident thread blocks

    def resident(self, registers: int, warps: int, shared_bytes: int) -> int:
        """Programs of a kernel that fit on one SM at once: registers are allocated per warp
        in units of 256 (8 per thread)."""
        per_warp = -(-max(registers, 1) * 32 // 256) * 256
        return max(0, min(self.programs, self.warps // warps,
                          self.registers // (per_warp * warps),
                          self.shared_bytes // (shared_bytes + 1024)))


# compute capability 10.0 (B200), 9.0 (H100/H200) and 8.0 (A100); 10.0 keeps 9.0's register
# file, shared memory, warps and blocks per SM (its tensor memory holds tcgen05 accumulators,
# not registers)
SMS: dict[str, SM] = {
    "sm_100a": SM(65536, 228 * 1024, 64, 32),
    "sm_90a": SM(65536, 228 * 1024, 64, 32),
    "sm_80": SM(65536, 164 * 1024, 64, 32),
}


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float       # dense bf16/fp16 tensor-core FLOP/s
    bandwidth: float        # HBM bytes/s
    sms: int                # streaming multiprocessors
    arch: str               # the compile target of its SMs (a key of ``SMS``)
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
# the GPU a compile target's report models unless --gpu names another of its architecture
TARGET_GPU = {"sm_100a": "b200", "sm_90a": "h200", "sm_80": "a100"}


def gpu(name: str) -> GPU:
    key = name.lower().replace("-", "").replace("_", "")
    for k, g in GPUS.items():
        if key.startswith(k):
            return g
    raise ArchcError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
