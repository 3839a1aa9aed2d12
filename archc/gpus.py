"""The GPUs archc compiles for and models, declared once.

An architecture (``GPUTarget``, by the name `archc compile --target` takes: sm_90a) is what
Triton compiles at — its compute capability and the tensor-core instruction the PTX counts — and
what one streaming multiprocessor holds (CUDA programming guide, compute capabilities 8.0, 9.0
and 10.0), which bounds the programs resident on it. A GPU (``GPU``, by the name `--gpu` takes:
h200) is one part of an architecture with its vendor's datasheet figures: dense (not 2:4 sparse)
bf16/fp16 tensor-core math, peak HBM bandwidth, streaming multiprocessors and link bandwidth. A
target's reports model its newest GPU, the last listed, unless told another. The ahead-of-time
compile, the autotuner's pre-filter, the roofline, the occupancy report, `archc bench` and the
commands' flags read these two tables."""

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


@dataclass(frozen=True)
class GPUTarget:
    name: str               # as --target takes it: sm_90a
    capability: int         # Triton's GPUTarget("cuda", capability, 32): 90
    tensor_core_op: str     # the PTX instruction of its tensor-core math: wgmma.mma_async
    sm: SM

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
    GPUTarget("sm_80", 80, "mma.sync", SM(65536, 164 * 1024, 64, 32)),
    GPUTarget("sm_90a", 90, "wgmma.mma_async", SM(65536, 228 * 1024, 64, 32)),
    GPUTarget("sm_100a", 100, "tcgen05.mma", SM(65536, 228 * 1024, 64, 32)),
)}


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: float       # dense bf16/fp16 tensor-core FLOP/s
    bandwidth: float        # HBM bytes/s
    sms: int                # streaming multiprocessors
    target: GPUTarget       # the architecture of its SMs
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
_SM80, _SM90A, _SM100A = GPU_TARGETS.values()
GPUS: dict[str, GPU] = {
    "a100": GPU("A100-80GB SXM", 312e12, 2.039e12, 108, _SM80,    # A100 datasheet (2021), HBM2e
                link=600e9 / 2),
    "h100": GPU("H100 SXM", 989.4e12, 3.35e12, 132, _SM90A,       # H100 datasheet (2023), HBM3
                link=900e9 / 2),
    "h200": GPU("H200 SXM", 989e12, 4.8e12, 132, _SM90A,          # H200 datasheet (2024), HBM3e
                link=900e9 / 2),
    # HGX B200 datasheet (2024), per GPU at 1000 W: 2.25 PFLOP/s dense BF16 (4.5 with 2:4
    # sparsity), 8 TB/s HBM3e; the datasheet gives no SM count: 148 (74 enabled of each die's
    # 80) is Chips and Cheese's "Nvidia's B200: Keeping the CUDA Juggernaut Rolling" (2025)
    "b200": GPU("B200 SXM", 2.25e15, 8e12, 148, _SM100A, link=1.8e12 / 2),
}


def default_gpu(target: str) -> str:
    """The GPU a report for `target` models unless told another: its newest, the last listed."""
    return [k for k, g in GPUS.items() if g.target.name == target][-1]


def find_gpu(name: str) -> GPU | None:
    """The GPU a name (`h200`, `H200-SXM`, a device's `NVIDIA H200`) names, if any."""
    key = name.lower().replace("-", "").replace("_", "").replace(" ", "")
    return next((g for k, g in GPUS.items() if k in key), None)


def gpu(name: str) -> GPU:
    found = find_gpu(name)
    if found is None:
        raise ArchcError(f"unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return found


def target_of(capability: tuple[int, int]) -> str | None:
    """The ahead-of-time target that stands for a device's compute capability (its major
    version: sm_86 compiles as sm_80), or None where there is none."""
    return next((t.name for t in GPU_TARGETS.values() if t.capability // 10 == capability[0]),
                None)
