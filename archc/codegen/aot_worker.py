"""The ahead-of-time compile worker (see ``aot``): it imports Triton and the generated module,
and nothing of archc — in particular not torch — so it starts in a fraction of a second. It reads
jobs as JSON lines on stdin, one kernel each:

    {"kernel": name, "signature": {arg: type}, "constexprs": {arg: value},
     "options": {"num_warps": w, "num_stages": s, "launch_pdl": b}, "capability": 80 | 90,
     "index": i}

and writes one JSON line per kernel, with the job's index: registers and spill bytes (from the
log of Triton's ptxas run), shared memory (Triton's metadata), the count of tensor-core
instructions in the PTX (`mma.sync` for sm_80, `wgmma.mma_async` for sm_90a), the wgmma shapes
(`m64n128k16`), whether it moves tiles with the Hopper tensor-memory accelerator
(`cp.async.bulk.tensor`), whether it waits on the previous kernel for programmatic dependent
launch (`griddepcontrol.wait`), or the error.
"""

import contextlib
import importlib.util
import io
import json
import os
import re
import sys
import time

TENSOR_CORE_OP = {80: "mma.sync", 90: "wgmma.mma_async"}
WGMMA_SHAPE = re.compile(r"wgmma\.mma_async\S*?\.(m\d+n\d+k\d+)\b")
TMA_OP = "cp.async.bulk.tensor"
PDL_OP = "griddepcontrol.wait"


def wgmma_shapes(ptx: str) -> list[str]:
    """The distinct wgmma shapes of a PTX text, smallest first (`m64n128k16`)."""
    return sorted(set(WGMMA_SHAPE.findall(ptx)),
                  key=lambda s: tuple(int(x) for x in re.findall(r"\d+", s)))


def last_line(text: object) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def compile_one(module: object, job: dict) -> dict:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    out = {"kernel": job["kernel"], "index": job.get("index", 0), "registers": 0,
           "spill_bytes": 0, "shared_bytes": 0, "tensor_core_ops": 0, "wgmma": [], "tma": False,
           "pdl": False, "error": ""}
    t0 = time.perf_counter()
    try:
        fn = getattr(module, job["kernel"])
        signature, attrs = {}, {}
        for i, arg in enumerate(fn.arg_names):
            if arg in job["signature"]:
                signature[arg] = job["signature"][arg]
                if signature[arg].startswith("*"):  # buffers are 16-byte aligned, as JIT assumes
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif arg in job["constexprs"]:
                signature[arg] = "constexpr"
            else:
                raise RuntimeError(f"argument {arg!r} has no type and no block size")
        # Triton's own ptxas run (its flags: -lineinfo, --regAllocOptLevel=2) prints the log; a
        # kernel from Triton's cache has none, and ptxas run here without those flags reports
        # other register counts, so every kernel is compiled afresh
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        log = io.StringIO()
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                triton.compiler.ASTSource(fn, signature, job["constexprs"], attrs),
                target=GPUTarget("cuda", job["capability"], 32), options=job["options"])
        text = log.getvalue()
        regs = re.search(r"Used (\d+) registers", text)
        stores = re.search(r"(\d+) bytes spill stores", text)
        loads = re.search(r"(\d+) bytes spill loads", text)
        if regs is None:
            raise RuntimeError("no register count in the ptxas log")
        out["registers"] = int(regs.group(1))
        out["spill_bytes"] = sum(int(m.group(1)) for m in (stores, loads) if m)
        out["shared_bytes"] = int(compiled.metadata.shared)
        ptx = compiled.asm["ptx"]
        out["tensor_core_ops"] = ptx.count(TENSOR_CORE_OP[job["capability"]])
        out["wgmma"] = wgmma_shapes(ptx)
        out["tma"] = TMA_OP in ptx
        out["pdl"] = PDL_OP in ptx
    except Exception as err:  # reported per kernel; the caller's table shows all of them
        out["error"] = f"{type(err).__name__}: {last_line(err)}"
    out["seconds"] = time.perf_counter() - t0
    return out


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("TRITON_INTERPRET must be unset for ahead-of-time compiles", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("archc_aot_module", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(compile_one(module, json.loads(line))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
