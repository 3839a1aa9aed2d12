"""The GPU architectures archc compiles for ahead of time, declared once: the compute capability
Triton compiles at, the tensor-core instruction the PTX counts, what one streaming
multiprocessor holds (CUDA programming guide, compute capabilities 8.0, 9.0 and 10.0), which
bounds the programs resident on it, and the GPU (``archc.perf.gpus``) a report models unless
told another. The ahead-of-time compile, the autotuner's pre-filter, the occupancy report and
`archc compile --target` read this table."""

from __future__ import annotations

from dataclasses import dataclass

TMA_ALIGN = 16   # bytes: a tensor descriptor's base address and row strides are multiples of it


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


@dataclass(frozen=True)
class GPUTarget:
    name: str               # as --target takes it: sm_90a
    capability: int         # Triton's GPUTarget("cuda", capability, 32): 90
    tensor_core_op: str     # the PTX instruction of its tensor-core math: wgmma.mma_async
    sm: SM
    gpu: str                # the GPU its reports model by default (a key of perf.gpus.GPUS)

    @property
    def mma(self) -> str:
        """The tensor-core instruction family, as tables head it: `mma`, `wgmma`, `tcgen05`."""
        return self.tensor_core_op.split(".")[0]

    @property
    def pdl(self) -> bool:
        """Programmatic dependent launch (sm_90 and later): launches are made with it."""
        return self.capability >= 90


# 10.0 keeps 9.0's register file, shared memory, warps and blocks per SM (its tensor memory
# holds tcgen05 accumulators, not registers)
GPU_TARGETS: dict[str, GPUTarget] = {t.name: t for t in (
    GPUTarget("sm_80", 80, "mma.sync", SM(65536, 164 * 1024, 64, 32), "a100"),
    GPUTarget("sm_90a", 90, "wgmma.mma_async", SM(65536, 228 * 1024, 64, 32), "h200"),
    GPUTarget("sm_100a", 100, "tcgen05.mma", SM(65536, 228 * 1024, 64, 32), "b200"),
)}


def target_of(capability: tuple[int, int]) -> str | None:
    """The ahead-of-time target that stands for a device's compute capability (its major
    version: sm_86 compiles as sm_80), or None where there is none."""
    return next((t.name for t in GPU_TARGETS.values() if t.capability // 10 == capability[0]),
                None)
