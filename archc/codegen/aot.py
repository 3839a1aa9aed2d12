"""Ahead-of-time compiles for real GPUs, without one.

Tests under Triton's interpreter cannot see a kernel that will not compile for a GPU: a `tl.dot`
on blocks smaller than 16, a dtype the hardware lacks, registers that spill. Triton compiles
without a GPU (``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``; 100 for
Blackwell's sm_100a), and the ``ptxas`` that ships with Triton reports registers and spills.

Triton decides when it is first imported whether ``@triton.jit`` builds compiler or interpreter
functions, so compiles run in fresh worker processes (``aot_worker.py``) with ``TRITON_INTERPRET``
unset — they work the same from a process that runs kernels under the interpreter.

``compile_module`` compiles each kernel at ``aot_config`` (a full-size prefill);
``compile_configs`` compiles (kernel, configuration) pairs as launches make them, and keeps each
result on disk keyed by the module's text, the kernel, its configuration, the target and Triton's
version, so a second report of the same kernels compiles nothing.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from archc.codegen.aot_worker import last_line
from archc.codegen.blocks import aot_config
from archc.gpus import GPU_TARGETS
from archc.versions import version

MEASURED = ("registers", "spill_bytes", "shared_bytes", "tensor_core_ops", "wgmma", "mma", "tma",
            "pdl", "early_reads", "warp_specialized", "warps", "seconds", "error")
# compile options (maxnreg: the register budget ptxas is held to, where a config sets one); the
# rest of a config: constexprs
OPTIONS = ("num_warps", "num_stages", "maxnreg")
LAUNCH = ("PDL", "launch_pdl")              # how a launch is made: set here from the target


@dataclass
class AotResult:
    kernel: str
    unit: str
    family: str
    target: str
    registers: int = 0
    spill_bytes: int = 0           # spill stores + spill loads
    shared_bytes: int = 0
    tensor_core_ops: int = 0       # mma.sync / wgmma.mma_async / tcgen05.mma in the PTX
    config: str = ""
    seconds: float = 0.0
    error: str = ""
    wgmma: list[str] = field(default_factory=list)     # shapes, "m64n128k16"
    mma: list[str] = field(default_factory=list)       # the target's: wgmma or tcgen05 shapes
    tma: bool = False              # cp.async.bulk.tensor in the PTX
    pdl: bool = False              # griddepcontrol.wait in the PTX: programmatic dependent launch
    # pointer arguments read before that wait (a matmul's weight tiles: no kernel writes them)
    early_reads: list[str] = field(default_factory=list)
    warp_specialized: bool = False  # its loop split into producer/consumer warp partitions
    warps: int = 0                 # warps a program runs with (partitions included); 0: unknown
    cached: bool = False           # read from the on-disk cache, not compiled now

    @property
    def ok(self) -> bool:
        return not self.error


def compile_module(module_path: Path, target: str, *, jobs: int = 2,
                   kernels: list[str] | None = None, timeout: float = 900.0) -> list[AotResult]:
    """AOT-compile every kernel of a generated module (or those named) for `target`, each at
    ``aot_config`` — a kernel with constexpr sizes at each of their values (``static``)."""
    table = kernel_table(module_path)
    names = kernels if kernels is not None else list(table)
    capability = GPU_TARGETS[target].capability if target in GPU_TARGETS else 90
    configs: list[tuple[str, Mapping[str, Any]]] = []
    for n in names:
        entry = table.get(n)
        if entry is None:    # compile_configs reports it
            configs.append((n, {}))
            continue
        for static in entry.get("static") or [{}]:
            sizes = {**entry["sizes"], **static}
            configs.append((n, {**static, **aot_config(entry["family"], sizes, capability)}))
    return compile_configs(module_path, target, configs, jobs=jobs, timeout=timeout)


def config_text(config: Mapping[str, Any]) -> str:
    """`BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=4`: block sizes first, then options."""
    ordered = [*(k for k in config if k not in OPTIONS + LAUNCH),
               *(k for k in OPTIONS if k in config)]
    return ", ".join(f"{k}={config[k]}" for k in ordered)


def compile_configs(module_path: Path, target: str,
                    configs: list[tuple[str, Mapping[str, Any]]], *, jobs: int = 2,
                    timeout: float = 900.0, cache_dir: Path | None = None,
                    progress: Callable[[AotResult], None] | None = None) -> list[AotResult]:
    """AOT-compile each (kernel, configuration) of a generated module for `target`: a
    configuration holds its block sizes (constexprs) and, optionally, num_warps and num_stages;
    a kernel's constexpr sizes (``static`` in its entry) it does not set are its first use's.
    With `cache_dir`, results found there are not compiled again and new ones are kept there.
    `progress` is called with each result as it is known."""
    if target not in GPU_TARGETS:
        raise ValueError(f"unknown target {target!r} (known: {', '.join(GPU_TARGETS)})")
    table = kernel_table(module_path)
    source = hashlib.sha256(module_path.read_bytes()).hexdigest()
    results: list[AotResult] = []
    work: list[dict[str, Any]] = []
    for i, (name, config) in enumerate(configs):
        entry = table.get(name)
        if entry is None:
            results.append(AotResult(name, "", "", target, error="no such kernel"))
            continue
        # programmatic dependent launch where the target has it (sm_90 and later), as the
        # runtime launches
        pdl = GPU_TARGETS[target].pdl
        config = {**(entry.get("static") or [{}])[0], **config}
        constexprs = {k: v for k, v in config.items() if k not in OPTIONS + LAUNCH} | {"PDL": pdl}
        options = {k: config[k] for k in OPTIONS if k in config} | {"launch_pdl": pdl}
        r = AotResult(name, entry["unit"], entry["family"], target, config=config_text(config))
        results.append(r)
        key = _cache_key(source, name, config, target)
        if cache_dir is not None and _read_cached(cache_dir / f"{key}.json", r):
            continue
        work.append({"kernel": name, "signature": entry["types"], "constexprs": constexprs,
                     "options": options, "capability": GPU_TARGETS[target].capability,
                     "tensor_core_op": GPU_TARGETS[target].tensor_core_op, "index": i,
                     "key": key})
    for r in results:
        if progress is not None and (r.cached or not r.ok):
            progress(r)
    _compile(module_path, work, results, jobs, timeout, cache_dir, progress)
    return results


def _compile(module_path: Path, work: list[dict[str, Any]], results: list[AotResult],
             jobs: int, timeout: float, cache_dir: Path | None,
             progress: Callable[[AotResult], None] | None) -> None:
    """Run `work` in `jobs` worker processes, filling `results` (by each job's index)."""
    if not work:
        return
    jobs = max(1, min(jobs, len(work)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    worker = Path(__file__).with_name("aot_worker.py")
    with contextlib.ExitStack() as stack:
        procs = []
        for chunk in (work[i::jobs] for i in range(jobs)):
            # stderr to a file: a full pipe nobody reads yet would stop the worker
            log = stack.enter_context(tempfile.TemporaryFile("w+"))
            p = subprocess.Popen([sys.executable, str(worker), str(module_path)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                 text=True, env=env)
            # every chunk is written before any answer is read: the workers run side by side
            assert p.stdin is not None
            p.stdin.write("".join(json.dumps(j) + "\n" for j in chunk))
            p.stdin.close()
            procs.append((p, chunk, log))
        for p, chunk, log in procs:
            done = _collect(p, chunk, results, timeout, cache_dir, progress)
            log.seek(0)
            err = log.read()
            for job in chunk:
                if job["index"] not in done:
                    r = results[job["index"]]
                    r.error = last_line(err) or "the compile worker failed"
                    if progress is not None:
                        progress(r)


def _collect(p: subprocess.Popen, chunk: list[dict[str, Any]], results: list[AotResult],
             timeout: float, cache_dir: Path | None,
             progress: Callable[[AotResult], None] | None) -> set[int]:
    """Read a worker's answers into `results`, as they come; the indices answered."""
    assert p.stdout is not None
    by_index = {j["index"]: j for j in chunk}
    done: set[int] = set()
    watchdog = threading.Timer(timeout, p.kill)     # a compile that hangs ends its worker
    watchdog.start()
    try:
        for line in p.stdout:
            if not line.startswith("{"):
                continue
            got = json.loads(line)
            job = by_index[got["index"]]
            r = results[job["index"]]
            for k in MEASURED:
                setattr(r, k, got[k])
            done.add(job["index"])
            if cache_dir is not None and r.ok:
                _write_cached(cache_dir / f"{job['key']}.json", r)
            if progress is not None:
                progress(r)
        p.wait()
    finally:
        watchdog.cancel()
    return done


def _cache_key(source: str, kernel: str, config: Mapping[str, Any], target: str) -> str:
    triton = version("triton") or ""
    worker = hashlib.sha256(Path(__file__).with_name("aot_worker.py").read_bytes()).hexdigest()
    text = json.dumps([source, kernel, sorted(config.items()), target, triton, worker])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _read_cached(path: Path, r: AotResult) -> bool:
    """Fill `r` from a cached result at `path`; False when there is none (or it is unreadable)."""
    try:
        got = json.loads(path.read_text())
        for k in MEASURED:
            setattr(r, k, got[k])
    except (OSError, ValueError, KeyError):
        return False
    r.cached = True
    return True


def _write_cached(path: Path, r: AotResult) -> None:
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({k: asdict(r)[k] for k in MEASURED}))
        tmp.replace(path)


def kernel_table(module_path: Path) -> dict[str, dict[str, Any]]:
    """The module's KERNELS table, read as a literal — without importing the module (and so
    Triton) in this process."""
    tree = ast.parse(module_path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "KERNELS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{module_path} has no KERNELS table")
