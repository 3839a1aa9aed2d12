"""Autotuning on a GPU: block sizes chosen by timing, over configs the ahead-of-time compile let
through, each choice kept on disk so that only a model's first run pays for it.

A kernel that ``blocks.autotune_configs`` gives candidates for is tuned at its first launch:
prefill matmuls and attention, and decode GEMVs (M ≤ 16) over narrow tiles at their split-K
counts — their scratch sized for the largest candidate, their first launch before the decode
step's CUDA graph is captured, which then replays the choice (decode attention keeps its
heuristic split count):

1. the cache: a choice made before for this kernel's source, shape bucket and GPU launches as it
   is, nothing timed;
2. the pre-filter: each candidate is compiled ahead of time for the device's capability
   (``archc.codegen.aot.compile_configs``, itself cached on disk); one that does not compile or
   spills registers is dropped. The set is never empty: the heuristic config
   (``blocks.launch_config``) stays when nothing else is left;
3. timing: each remaining candidate runs on the launch's own arguments — the tuned kernels,
   matmuls and prefill attention, compute their outputs from inputs they never alias
   (``archc.runtime.buffers``), a KV-cache write epilogue writing the same values again, so
   running one again changes nothing — and the fastest is kept in memory and in the cache.

The cache is one JSON file per generated module and GPU, beside the module in the kernel cache
(``<module dir>/tuning/<gpu>.json``: `archc cache` lists and clears it with the module):

    {"format": 1, "module": <digest>, "gpu": "NVIDIA H200", "triton": "3.x",
     "choices": {<kernel>: {"M=512,T=512": {"BLOCK_M": 128, …, "num_warps": 8, …}}}}

The shape bucket is the kernel's integer arguments (M, T, S…), each rounded up to a power of two —
one tuning serves every prompt length up to the next power of two — then its constexpr sizes as
they are (a matmul's N and K: `M=512,T=512,N=4096,K=14336`), one Triton specialization each.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from archc.codegen import aot, blocks

FORMAT = 1
TUNING_DIR = "tuning"          # beside the module, in its kernel-cache entry

Config = dict[str, Any]        # block sizes (constexprs) + num_warps + num_stages
Bucket = tuple[tuple[str, int], ...]
# (kernel, candidates) → the candidates that compile ahead of time without spilling
Prefilter = Callable[[str, list[Config]], list[Config]]
# (kernel, candidates, run(config)) → seconds per candidate (inf: it failed to run)
Benchmark = Callable[[str, list[Config], Callable[[Config], None]], list[float]]


def tuning_enabled(autotune: bool, target: str, device_type: str) -> bool:
    """Whether a session tunes: asked for (the default), generating for the GPU, and running on
    a CUDA device. The interpreter never tunes, nor a GPU-target session on the host (`archc
    bench --host-time`, the occupancy report), whose launches never run."""
    return bool(autotune) and target == "gpu" and device_type == "cuda"


def bucket(values: Mapping[str, int]) -> Bucket:
    """A launch's shape bucket: each integer argument rounded up to a power of two (0 stays 0),
    in argument order."""
    return tuple((name, 0 if v <= 0 else blocks.next_pow2(int(v))) for name, v in values.items())


def bucket_text(b: Bucket) -> str:
    """`M=512,T=512`: a bucket as the cache file keys it."""
    return ",".join(f"{name}={v}" for name, v in b)


def candidates(family: str, sizes: Mapping[str, int], target: str = "gpu") -> list[Config]:
    """The configs a launch at `sizes` is tuned over: the heuristic config first, then each of
    ``blocks.autotune_configs`` laid over it (so every constexpr the heuristic sets is set), no
    two alike. Empty when the launch is not tuned (decode attention, untuned families)."""
    tiles = blocks.autotune_configs(family, **sizes)
    if not tiles:
        return []
    base = blocks.launch_config(family, target, **sizes)
    out: list[Config] = [base]
    for tile in tiles:
        config = {**base, **tile}
        if config not in out:
            out.append(config)
    return out


def tuned_kernels(kernels: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """The kernels of a generated module's KERNELS table that are tuned at prefill sizes: those
    whose family has candidates (asked at 4096 rows, a full-size prefill)."""
    return {name for name, e in kernels.items()
            if blocks.autotune_configs(e["family"], **{"M": 4096, "T": 4096, **e["sizes"]})}


# ---- the disk cache ------------------------------------------------------------------------

def _triton_version() -> str:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version("triton")
    return ""


def gpu_slug(gpu: str) -> str:
    """A GPU name as a file name: `NVIDIA H200` → `nvidia-h200`."""
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-") or "gpu"


class TuningCache:
    """The tuning choices of one generated module (by its digest) on one GPU (by name), in
    ``<directory>/tuning/<gpu>.json``. A file written for another module, GPU or Triton version
    holds no choices for this one; an unreadable file is ignored with a warning, and replaced
    at the next choice."""

    def __init__(self, directory: Path, digest: str, gpu: str) -> None:
        self.path = Path(directory) / TUNING_DIR / f"{gpu_slug(gpu)}.json"
        self.digest = digest
        self.gpu = gpu
        self.triton = _triton_version()
        self._choices: dict[str, dict[str, Config]] | None = None   # read on first use

    def _read(self, *, warn: bool = True) -> dict[str, dict[str, Config]]:
        """The file's choices for this module, GPU and Triton ({} when there are none); an
        unreadable file is said once, when first read."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            if warn:
                warnings.warn(f"ignoring the tuning cache {self.path}: {err}", stacklevel=3)
            return {}
        if not isinstance(data, dict) or not isinstance(data.get("choices"), dict) or any(
                not isinstance(v, dict) for v in data["choices"].values()):
            if warn:
                warnings.warn(f"ignoring the tuning cache {self.path}: not a tuning cache file",
                              stacklevel=3)
            return {}
        if (data.get("format"), data.get("module"), data.get("gpu"), data.get("triton")) != \
                (FORMAT, self.digest, self.gpu, self.triton):
            return {}
        return data["choices"]

    @property
    def choices(self) -> dict[str, dict[str, Config]]:
        if self._choices is None:
            self._choices = self._read()
        return self._choices

    def get(self, kernel: str, b: Bucket) -> Config | None:
        """The config chosen before for `kernel` at bucket `b`, or None."""
        config = self.choices.get(kernel, {}).get(bucket_text(b))
        return dict(config) if isinstance(config, dict) else None

    def put(self, kernel: str, b: Bucket, config: Config) -> None:
        """Keep `config` for `kernel` at `b`: merged into the file as it is now (another process
        may have added choices), written whole to a temporary file and renamed over it. A cache
        that cannot be written costs only a tuning next time."""
        merged = self._read(warn=self._choices is None)
        merged.setdefault(kernel, {})[bucket_text(b)] = dict(config)
        self._choices = merged
        data = {"format": FORMAT, "module": self.digest, "gpu": self.gpu, "triton": self.triton,
                "choices": merged}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
            tmp.replace(self.path)
        except OSError as err:
            warnings.warn(f"cannot write the tuning cache {self.path}: {err.strerror}",
                          stacklevel=2)


# ---- the pre-filter ------------------------------------------------------------------------

def aot_prefilter(module_path: Path, target: str, *, jobs: int | None = None,
                  cache_dir: Path | None = None) -> Prefilter:
    """A pre-filter that compiles each candidate of a kernel ahead of time for `target` and
    keeps those that compile without spilling; compiles are cached in `cache_dir` (default: the
    module's `aot` directory, shared with the occupancy report)."""
    cache_dir = cache_dir or module_path.parent / "aot"
    jobs = jobs or max(1, min(8, (os.cpu_count() or 2) // 2))

    def prefilter(kernel: str, configs: list[Config]) -> list[Config]:
        results = aot.compile_configs(module_path, target, [(kernel, c) for c in configs],
                                      jobs=min(jobs, len(configs)), cache_dir=cache_dir)
        return keep_compiled(configs, results)
    return prefilter


def keep_compiled(configs: Sequence[Config], results: Sequence[aot.AotResult]) -> list[Config]:
    """The configs whose ahead-of-time compile succeeded with no spilled registers."""
    return [c for c, r in zip(configs, results, strict=True) if r.ok and not r.spill_bytes]


# ---- timing --------------------------------------------------------------------------------

def time_configs(kernel: str, configs: list[Config], run: Callable[[Config], None]
                 ) -> list[float]:
    """Seconds per launch of each config, by Triton's benchmark (the median of repeated runs
    after a warm-up, the L2 cache flushed between). A config that fails to run (shared memory
    beyond the device's) gets infinity."""
    from triton.testing import do_bench
    times = []
    for config in configs:
        try:
            times.append(do_bench(lambda config=config: run(config), return_mode="median") / 1e3)
        except Exception:  # noqa: BLE001 — any failure of a candidate only rules it out
            times.append(float("inf"))
    return times


# ---- the tuner -----------------------------------------------------------------------------

@dataclass
class TuningStats:
    """What tuning cost a session: its first-run cost, and how often the cache answered."""

    seconds: float = 0.0          # pre-filter compiles + timing the candidates, device synced
    kernels_tuned: int = 0        # (kernel, bucket) pairs timed in this session
    cache_hits: int = 0           # (kernel, bucket) pairs whose config came from the cache
    cache_misses: int = 0
    configs_dropped: int = 0      # candidates the pre-filter dropped (no compile, or spills)


class Tuner:
    """One session's tuning: which kernels it tunes, the cache, the pre-filter, the timer and
    their statistics. ``kernel(...)`` stands a tuned launch in for a kernel in a launch plan."""

    def __init__(self, tuned: set[str], cache: TuningCache, *,
                 prefilter: Prefilter | None = None, benchmark: Benchmark = time_configs,
                 synchronize: Callable[[], None] = lambda: None) -> None:
        self.tuned = tuned                # kernel names of families that have candidates
        self.cache = cache
        self.prefilter = prefilter        # None: no ahead-of-time target for this device
        self.benchmark = benchmark
        self.synchronize = synchronize    # waits for the device, so tuning's time is all counted
        self.stats = TuningStats()
        self._chosen: dict[tuple[str, Bucket], Config] = {}

    def kernel(self, kernel: Any, name: str, configs: list[Config], types: Mapping[str, str],
               args: Sequence[Any], static: Mapping[str, int] | None = None) -> TunedKernel:
        """`kernel` (a Triton kernel) tuned over `configs` at the bucket of `args`' integer
        arguments (by `types`, the kernel's signature) and its constexpr sizes `static`, exact:
        each value is a specialization of its own."""
        values = {n: int(a) for (n, t), a in zip(types.items(), args) if t == "i32"}
        static = {n: int(v) for n, v in (static or {}).items()}
        return TunedKernel(self, kernel, name, configs, bucket(values) + tuple(static.items()),
                           static)

    def choose(self, name: str, b: Bucket, configs: list[Config],
               run: Callable[[Config], None], static: Mapping[str, int] | None = None
               ) -> Config:
        """The config `name` launches with at bucket `b`: from this session or the disk cache
        if chosen before, else pre-filtered (at the kernel's constexpr sizes `static`), timed
        with `run` and kept."""
        config = self._chosen.get((name, b))
        if config is None:
            config = self.cache.get(name, b)
            if config is not None:
                self._chosen[(name, b)] = config
        if config is not None:
            self.stats.cache_hits += 1
            return config
        self.stats.cache_misses += 1
        start = time.perf_counter()
        try:
            config = self._tune(name, configs, run, static or {})
        finally:
            self.synchronize()
            self.stats.seconds += time.perf_counter() - start
        self.stats.kernels_tuned += 1
        self._chosen[(name, b)] = config
        self.cache.put(name, b, config)
        return config

    def _tune(self, name: str, configs: list[Config], run: Callable[[Config], None],
              static: Mapping[str, int]) -> Config:
        """The fastest of `configs` that pass the pre-filter (compiled at `static`); the
        heuristic (the first) when none pass or none runs."""
        kept = configs
        if self.prefilter is not None:
            compiled = self.prefilter(name, [{**c, **static} for c in configs])
            kept = [c for c in configs if {**c, **static} in compiled]
        self.stats.configs_dropped += len(configs) - len(kept)
        kept = kept or configs[:1]
        if len(kept) == 1:
            return kept[0]
        times = self.benchmark(name, kept, run)
        best = min(range(len(kept)), key=lambda i: times[i])
        return kept[best] if times[best] != float("inf") else configs[0]

    def summary(self) -> dict[str, Any]:
        return asdict(self.stats)


class TunedKernel:
    """A kernel as a launch plan holds it when tuned: ``tuned[grid](*args, **meta)`` launches
    the kernel with its chosen config, choosing it (``Tuner.choose``) at the first launch."""

    def __init__(self, tuner: Tuner, kernel: Any, name: str, configs: list[Config],
                 b: Bucket, static: Mapping[str, int] | None = None) -> None:
        self.tuner, self.kernel, self.name, self.configs, self.bucket = \
            tuner, kernel, name, configs, b
        self.static = dict(static or {})   # its constexpr sizes: the launch passes them in meta
        self.config: Config | None = None

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        def launch(*args: Any, **meta: Any) -> Any:
            if self.config is None:
                self.config = self.tuner.choose(
                    self.name, self.bucket, self.configs,
                    lambda config: self.kernel[grid](*args, **config, **meta), self.static)
            return self.kernel[grid](*args, **self.config, **meta)
        return launch
