"""Ahead-of-time compiles for real GPUs, without one.

Tests under Triton's interpreter cannot see a kernel that will not compile for a GPU: a `tl.dot`
on blocks smaller than 16, a dtype the hardware lacks, registers that spill. Triton compiles
without a GPU: ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`` gives PTX and a
cubin, and the ``ptxas`` that ships with Triton reports registers and spills with ``-v``.

Triton decides when it is first imported whether ``@triton.jit`` builds compiler or interpreter
functions, so compiles run in fresh worker processes with ``TRITON_INTERPRET`` unset — they work
the same from a process that runs kernels under the interpreter. Each worker execs the generated
module, builds each kernel's signature from the module's ``KERNELS`` table (argument types) and
``blocks.launch_config`` at a full-size prefill shape (block sizes, warps, stages), compiles it,
and reads from the result:

- registers and spill bytes (ptxas -v on the PTX),
- shared memory (Triton's metadata),
- tensor-core instructions in the PTX: ``mma.sync`` for sm_80, ``wgmma.mma_async`` for sm_90a.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

TARGETS = {"sm_80": 80, "sm_90a": 90}
TENSOR_CORE_OP = {80: "mma.sync", 90: "wgmma.mma_async"}


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
    names = kernels if kernels is not None else _kernel_names(module_path)
    jobs = max(1, min(jobs, len(names)))
    chunks = [names[i::jobs] for i in range(jobs)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    procs = [subprocess.Popen([sys.executable, "-m", "archc.codegen.aot", str(module_path),
                               target, *chunk], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for chunk in chunks if chunk]
    results: dict[str, AotResult] = {}
    for p, chunk in zip(procs, chunks):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        parsed = False
        for line in out.splitlines():
            if line.startswith("{"):
                r = AotResult(**json.loads(line))
                results[r.kernel] = r
                parsed = True
        if p.returncode != 0 or not parsed:
            for name in chunk:
                results.setdefault(name, AotResult(name, "", "", target,
                                                   error=_last_line(err) or "worker failed"))
    return [results[n] for n in names]


def _kernel_names(module_path: Path) -> list[str]:
    """The KERNELS table's keys, read without importing the module (and so Triton)."""
    names = []
    inside = False
    for line in module_path.read_text().splitlines():
        if line.startswith("KERNELS = {"):
            inside = True
            continue
        if inside:
            if line.startswith("}"):
                break
            m = re.match(r"\s+'(\w+)':", line)
            if m:
                names.append(m.group(1))
    return names


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


# ---- the worker (runs in a fresh process) ----------------------------------------------------

def _ptxas_usage(ptx: str, capability: int) -> tuple[int, int]:
    """(registers, spill bytes) from `ptxas -v`."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([get_ptxas(capability).path, "-v",
                              f"--gpu-name={sm_arch_from_capability(capability)}", str(src),
                              "-o", str(Path(tmp) / "k.cubin")], capture_output=True, text=True)
    log = run.stderr + run.stdout
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed: {_last_line(log)}")
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    return (int(regs.group(1)) if regs else 0,
            (int(stores.group(1)) if stores else 0) + (int(loads.group(1)) if loads else 0))


def _compile_one(module: Any, name: str, target: str) -> AotResult:
    import triton
    from triton.backends.compiler import GPUTarget

    from archc.codegen.blocks import aot_constexprs, aot_sizes, launch_config
    capability = TARGETS[target]
    entry = module.KERNELS[name]
    res = AotResult(name, entry["unit"], entry["family"], target)
    t0 = time.perf_counter()
    try:
        fn = getattr(module, name)
        cfg = launch_config(entry["family"], "gpu", **aot_sizes(entry["family"], entry["sizes"]))
        cfg.update(aot_constexprs(entry["family"]))
        options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
        signature: dict[str, str] = {}
        constexprs: dict[str, Any] = {}
        attrs: dict[tuple[int, ...], list[list[Any]]] = {}
        for i, arg in enumerate(fn.arg_names):
            if arg in entry["types"]:
                signature[arg] = entry["types"][arg]
                if signature[arg].startswith("*"):  # buffers are 16-byte aligned, as JIT assumes
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif arg in cfg:
                signature[arg] = "constexpr"
                constexprs[arg] = cfg[arg]
            else:
                raise RuntimeError(f"argument {arg!r} has no type and no block size")
        res.config = ", ".join(f"{k}={v}" for k, v in {**constexprs, **options}.items())
        compiled = triton.compile(triton.compiler.ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", capability, 32), options=options)
        ptx = compiled.asm["ptx"]
        res.tensor_core_ops = ptx.count(TENSOR_CORE_OP[capability])
        res.shared_bytes = int(compiled.metadata.shared)
        res.registers, res.spill_bytes = _ptxas_usage(ptx, capability)
    except Exception as err:  # report the failure per kernel; the table shows all of them
        res.error = f"{type(err).__name__}: {_last_line(str(err))}"
    res.seconds = time.perf_counter() - t0
    return res


def _load_for_compile(path: Path) -> Any:
    import importlib.util
    spec = importlib.util.spec_from_file_location("archc_aot_module", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _worker(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m archc.codegen.aot")
    parser.add_argument("module", type=Path)
    parser.add_argument("target", choices=sorted(TARGETS))
    parser.add_argument("kernels", nargs="*")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET must be unset for ahead-of-time compiles", file=sys.stderr)
        return 2
    module = _load_for_compile(args.module)
    for name in args.kernels or list(module.KERNELS):
        print(json.dumps(asdict(_compile_one(module, name, args.target))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
