"""`archc bench SPEC --host-time`: archc's own host time per decode step, measured on any machine.

On a GPU a decode step of a large model takes a few milliseconds of device time; the Python
around the kernels must stay far below that, or the GPU waits on the host. This measures that
Python alone, on the CPU, with nothing real-size allocated: the session users run, built for
the GPU target (its block sizes, grids and attention splits), every kernel launch a no-op that
counts its calls, the weights and the KV cache zero-stride views of one element.

Each decode step (`session.step` on B × 1 token) is timed on the host clock, the median over
many steps after a warm-up, with plain launches and through the CUDA-graph path (its replay a
no-op). Torch's CPU ops (the input copies, reading the logits) stand in for device ops here and
run on one thread: waking a thread pool for a 256 KB copy measures the machine's load (8 ms on a
busy 2-core machine, 4 µs on one thread), not archc.
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from archc.dtypes import TORCH_DTYPES
from archc.errors import ArchcError
from archc.ir.graph import Graph, Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.shapes import concrete
from archc.quant import QTensor, is_quantized
from archc.runtime.launch import LaunchPlan
from archc.runtime.triton_backend import TritonOptions, TritonSession
from archc.spec.schema import Spec

WARMUP_STEPS = 50


def _zero_stride(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` that holds one element."""
    return torch.zeros((), dtype=dtype).expand(shape)


class HostSession(TritonSession):
    """The session of the module docstring: each bound kernel counts its calls in `launches`."""

    def __init__(self, program: Program, *, max_seq_len: int, dtype: str,
                 cache_dir: Path | None = None) -> None:
        super().__init__(program, {}, max_seq_len=max_seq_len, dtype=dtype, device="cpu",
                         options=TritonOptions(cache_dir=cache_dir))
        self.launches = 0
        self.ctx.bind = lambda kernel, grid: self._launch
        self.cache.zeros = _zero_stride  # type: ignore[method-assign]

    def _launch(self, *args: Any, **meta: Any) -> None:
        self.launches += 1

    def _target(self, device: torch.device) -> str:
        return "gpu"

    def _parameters(self, graph: Graph, checkpoint: Mapping[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
        return {n.name: QTensor.zeros(n.dtype, concrete(n.shape, {}), _zero_stride)
                if is_quantized(n.dtype) else
                _zero_stride(concrete(n.shape, {}), TORCH_DTYPES[n.dtype])
                for n in graph.nodes if n.op == Op.PARAM}

    def _capture(self, plan: LaunchPlan) -> Any:
        return SimpleNamespace(replay=lambda: None)


@dataclass
class HostReport:
    spec: str
    dtype: str
    batch: int
    launches: int                   # kernel launches per decode step
    host_steps: int                 # other plan entries per step (host work between launches)
    unique_kernels: int
    plain_seconds: float            # median per step, plain launches
    graph_seconds: float            # median per step, the CUDA-graph path with a no-op replay
    steps: int
    warmup: int


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


def _median_step(session: HostSession, tokens: torch.Tensor, steps: int, warmup: int
                 ) -> tuple[float, int]:
    """The median seconds of a decode step after `warmup` steps, and the last one's launches."""
    times = []
    session.reset()
    for _ in range(warmup + steps):
        if session.past in (0, session.max_seq_len):    # a sequence starts: its first token
            session.reset()                             # is not a decode step
            session.step(tokens)
        before, start = session.launches, time.perf_counter()
        session.step(tokens)
        times.append(time.perf_counter() - start)
    return statistics.median(times[warmup:]), session.launches - before


def check_host(spec: Spec) -> None:
    if spec.family != "decoder":
        raise ArchcError(f"archc bench --host-time times decode steps of decoder-only models; "
                         f"{spec.name} is an {spec.family}")
    if spec.max_seq_len < 2:
        raise ArchcError(f"{spec.name}: max_seq_len {spec.max_seq_len} leaves no decode step")


def measure_host(spec: Spec, *, dtype: str = "bf16", batch: int = 1, steps: int = 1000,
                 warmup: int = WARMUP_STEPS, cache_dir: Path | None = None,
                 quant: Mapping[str, str] | None = None) -> HostReport:
    """archc's host time per decode step of `spec` (see the module docstring), the weights
    `quant` names (tensor → scheme) quantized."""
    check_host(spec)
    session = HostSession(lower(spec, dtype, quant), max_seq_len=spec.max_seq_len, dtype=dtype,
                          cache_dir=cache_dir)
    tokens = torch.zeros(batch, 1, dtype=torch.long)
    medians: dict[bool, float] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for graphs in (True, False):    # plain launches last: they count the step's kernels
            session.cuda_graphs = graphs
            medians[graphs], launches = _median_step(session, tokens, steps, warmup)
    finally:
        torch.set_num_threads(threads)
    entries = len(session.runners["decoder"].last.launches)
    return HostReport(spec.name, dtype, batch, launches, entries - launches,
                      session.generated.program_units, medians[False], medians[True], steps,
                      warmup)


def format_host(r: HostReport) -> list[str]:
    """The report, one line each; the last is `host overhead: N us/step` (plain launches)."""
    per_launch = r.plain_seconds / r.launches * 1e6 if r.launches else 0.0
    other = f" and {r.host_steps} host steps" if r.host_steps else ""
    return [
        f"{r.spec} ({r.dtype}, batch {r.batch}): archc's host work per decode step, every "
        f"kernel launch a no-op",
        f"  gpu-target module: {r.unique_kernels} unique kernels, {r.launches} launches per "
        f"step{other}",
        f"  plain launches:  {r.plain_seconds * 1e6:8.1f} us/step ({per_launch:.2f} us per launch)",
        f"  CUDA-graph path: {r.graph_seconds * 1e6:8.1f} us/step (inputs in, P to the device, "
        f"replay, logits out)",
        f"method: median of {r.steps} steps after {r.warmup} warm-up steps, host clock around "
        f"session.step(tokens) of batch {r.batch} × 1 token",
        f"        weights and KV cache as zero-stride views; {cpu_name()}, torch "
        f"{torch.__version__}, Python {platform.python_version()}",
        f"host overhead: {r.plain_seconds * 1e6:.1f} us/step",
    ]
