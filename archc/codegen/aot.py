"""Ahead-of-time compiles for real GPUs, without one.

Tests under Triton's interpreter cannot see a kernel that will not compile for a GPU: a `tl.dot`
on blocks smaller than 16, a dtype the hardware lacks, registers that spill. Triton compiles
without a GPU (``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``), and the
``ptxas`` that ships with Triton reports registers and spills.

Triton decides when it is first imported whether ``@triton.jit`` builds compiler or interpreter
functions, so compiles run in fresh worker processes (``aot_worker.py``) with ``TRITON_INTERPRET``
unset — they work the same from a process that runs kernels under the interpreter.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archc.codegen.aot_worker import last_line
from archc.codegen.blocks import aot_config

TARGETS = {"sm_80": 80, "sm_90a": 90}
MEASURED = ("registers", "spill_bytes", "shared_bytes", "tensor_core_ops", "seconds", "error")


@dataclass
class AotResult:
    kernel: str
    unit: str
    family: str
    target: str
    registers: int = 0
    spill_bytes: int = 0           # spill stores + spill loads
    shared_bytes: int = 0
    tensor_core_ops: int = 0       # mma.sync (sm_80) / wgmma.mma_async (sm_90a) in the PTX
    config: str = ""
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def compile_module(module_path: Path, target: str, *, jobs: int = 2,
                   kernels: list[str] | None = None, timeout: float = 900.0) -> list[AotResult]:
    """AOT-compile every kernel of a generated module (or those named) for `target`."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r} (known: {', '.join(TARGETS)})")
    table = kernel_table(module_path)
    names = kernels if kernels is not None else list(table)
    results: dict[str, AotResult] = {}
    work: list[dict[str, Any]] = []
    for name in names:
        entry = table.get(name)
        if entry is None:
            results[name] = AotResult(name, "", "", target, error="no such kernel")
            continue
        cfg = aot_config(entry["family"], entry["sizes"])
        options = {k: cfg.pop(k) for k in ("num_warps", "num_stages")}
        results[name] = AotResult(name, entry["unit"], entry["family"], target, config=", ".join(
            f"{k}={v}" for k, v in {**cfg, **options}.items()))
        work.append({"kernel": name, "signature": entry["types"], "constexprs": cfg,
                     "options": options, "capability": TARGETS[target]})
    jobs = max(1, min(jobs, len(work)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    worker = Path(__file__).with_name("aot_worker.py")
    procs = [(subprocess.Popen([sys.executable, str(worker), str(module_path)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env), work[i::jobs])
             for i in range(jobs)]
    for p, chunk in procs:
        try:
            out, err = p.communicate("".join(json.dumps(j) + "\n" for j in chunk),
                                     timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        done = set()
        for got in (json.loads(line) for line in out.splitlines() if line.startswith("{")):
            for k in MEASURED:
                setattr(results[got["kernel"]], k, got[k])
            done.add(got["kernel"])
        for job in chunk:
            if job["kernel"] not in done:
                results[job["kernel"]].error = last_line(err) or "the compile worker failed"
    return [results[n] for n in names]


def kernel_table(module_path: Path) -> dict[str, dict[str, Any]]:
    """The module's KERNELS table, read as a literal — without importing the module (and so
    Triton) in this process."""
    tree = ast.parse(module_path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "KERNELS"
                                                for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{module_path} has no KERNELS table")
