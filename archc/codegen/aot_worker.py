"""The ahead-of-time compile worker (see ``aot``): it imports Triton and the generated module,
and nothing of archc — in particular not torch — so it starts in a fraction of a second. It reads
jobs as JSON lines on stdin, one kernel each:

    {"kernel": name, "signature": {arg: type}, "constexprs": {arg: value},
     "options": {"num_warps": w, "num_stages": s, "launch_pdl": b},
     "capability": 80 | 90 | 100, "tensor_core_op": "wgmma.mma_async", "index": i}

and writes one JSON line per kernel, with the job's index: registers and spill bytes (from the
log of Triton's ptxas run), shared memory and the warps of a program (Triton's metadata: a
warp-specialized kernel has more than it asked for), the count of tensor-core instructions in
the PTX (`mma.sync` for sm_80, `wgmma.mma_async` for sm_90a, `tcgen05.mma` for sm_100a), the
shapes of the asynchronous ones (`m64n128k16`), whether it moves tiles with the tensor-memory
accelerator (`cp.async.bulk.tensor`), whether it waits on the previous kernel for programmatic
dependent launch (`griddepcontrol.wait`) and which of its pointer arguments it reads before that
wait (a matmul's weight, no kernel's output: ``reads_before_wait``), whether Triton split its loop
into warp-specialized partitions (a `ttg.warp_specialize` op in the TTGIR), or the error.
"""

import contextlib
import importlib.util
import io
import json
import os
import re
import sys
import time

WGMMA_SHAPE = re.compile(r"wgmma\.mma_async\S*?\.(m\d+n\d+k\d+)\b")
TMA_OP = "cp.async.bulk.tensor"
PDL_OP = "griddepcontrol.wait"
WARP_SPECIALIZE_OP = "ttg.warp_specialize"
# A tcgen05.mma names no shape: M and N are fields of its 32-bit instruction descriptor (operand
# 4), which Triton materializes with `mov.b32 %rN, <constant>`; K is fixed by the kind — 32 bytes
# of A and B per instruction (PTX ISA, "Instruction descriptor" of tcgen05.mma: bits 17–22 hold
# N >> 3, bits 24–28 hold M >> 4)
TCGEN05_MMA = re.compile(r"tcgen05\.mma\.\S*?kind::(\w+)\s+\[[^\]]*\],\s*[^,]+,\s*[^,]+,"
                         r"\s*(%r\d+)")
TCGEN05_K = {"f16": 16, "tf32": 8, "f8f6f4": 32, "i8": 32}


def wgmma_shapes(ptx: str) -> list[str]:
    """The distinct wgmma shapes of a PTX text, smallest first (`m64n128k16`)."""
    return _by_size(set(WGMMA_SHAPE.findall(ptx)))


def tcgen05_shapes(ptx: str) -> list[str]:
    """The distinct tcgen05.mma shapes of a PTX text, smallest first (`m128n128k16`): those
    whose instruction descriptor is a constant in the PTX and whose kind has a known K."""
    shapes = set()
    for kind, reg in TCGEN05_MMA.findall(ptx):
        const = re.search(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx)
        if const is None or kind not in TCGEN05_K:
            continue
        desc = int(const.group(1))
        shapes.add(f"m{((desc >> 24) & 0x1F) << 4}n{((desc >> 17) & 0x3F) << 3}"
                   f"k{TCGEN05_K[kind]}")
    return _by_size(shapes)


def mma_shapes(ptx: str, capability: int) -> list[str]:
    """The shapes of the target's asynchronous tensor-core instructions (none for sm_80's
    mma.sync, whose shape is fixed per warp)."""
    return tcgen05_shapes(ptx) if capability >= 100 else wgmma_shapes(ptx) if capability >= 90 \
        else []


def _by_size(shapes: set[str]) -> list[str]:
    """Shapes ordered by (M, N, K)."""
    return sorted(shapes, key=lambda s: tuple(int(x) for x in re.findall(r"\d+", s)))


# PTX instructions, one a line: an optional predicate, the opcode, its operands
PTX_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);")
PTX_REGISTER = re.compile(r"%[a-z]+\d+")
PTX_PARAM = re.compile(r"\[\s*(\w+_param_(\d+))\s*\]")
# instructions that read global memory, and the operand that holds the address (cp.async: the
# source; a TMA copy: its tensor map)
GLOBAL_READS = (("ld.global", 1), ("cp.async.bulk.tensor", 1), ("cp.async", 1),
                ("prefetch.global", 0))


def _operands(text: str) -> list[str]:
    """Operands split at top-level commas (a vector `{%r1, %r2}` or address `[%rd1 + 0]` is one)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "{[") - (ch in "}]")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def reads_before_wait(ptx: str, params: list[str]) -> list[str]:
    """The kernel parameters (`params`, by PTX parameter index) whose memory the kernel reads
    before its first griddepcontrol.wait, in the order first read. Values flow from each
    ``ld.param`` through every instruction's operands into its destination registers; a global
    load, cp.async or TMA copy reads the parameters its address depends on. Straight-line code
    before the wait is all there is to follow (the wait comes before the kernel's loops)."""
    taint: dict[str, set[int]] = {}
    seen: list[str] = []
    for line in ptx.splitlines():
        m = PTX_INSTRUCTION.match(line)
        if m is None:
            continue
        opcode, rest = m.groups()
        if opcode.startswith("griddepcontrol.wait"):
            return seen
        ops = _operands(rest)
        param = PTX_PARAM.search(rest)
        if opcode.startswith("ld.param") and param:
            for reg in PTX_REGISTER.findall(ops[0]):
                taint[reg] = {int(param.group(2))}
            continue
        read = next((k for prefix, k in GLOBAL_READS if opcode.startswith(prefix)), None)
        if read is not None and len(ops) > read:
            for i in sorted(set().union(*(taint.get(r, set())
                                          for r in PTX_REGISTER.findall(ops[read])))):
                name = params[i] if i < len(params) else f"param_{i}"
                if name not in seen:
                    seen.append(name)
            if opcode.startswith("ld."):   # the loaded values come from memory, not the address
                for reg in PTX_REGISTER.findall(ops[0]):
                    taint[reg] = set()
            continue
        if not ops or opcode.startswith(("st.", "cp.", "bar.", "fence", "red.", "atom.")):
            continue
        srcs = set().union(*(taint.get(r, set()) for op in ops[1:]
                             for r in PTX_REGISTER.findall(op)))
        for reg in PTX_REGISTER.findall(ops[0]):
            taint[reg] = srcs
    return seen


def last_line(text: object) -> str:
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def compile_one(module: object, job: dict) -> dict:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    out = {"kernel": job["kernel"], "index": job.get("index", 0), "registers": 0,
           "spill_bytes": 0, "shared_bytes": 0, "tensor_core_ops": 0, "wgmma": [], "mma": [],
           "tma": False, "pdl": False, "early_reads": [], "warp_specialized": False, "warps": 0,
           "error": ""}
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
        out["tensor_core_ops"] = ptx.count(job["tensor_core_op"])
        out["mma"] = mma_shapes(ptx, job["capability"])
        out["wgmma"] = wgmma_shapes(ptx)
        out["tma"] = TMA_OP in ptx
        out["pdl"] = PDL_OP in ptx
        # the pointer arguments read before that wait: PTX numbers the runtime arguments in order
        runtime = [arg for arg in fn.arg_names if signature[arg] != "constexpr"]
        out["early_reads"] = [arg for arg in reads_before_wait(ptx, runtime)
                              if signature.get(arg, "").startswith("*")] if out["pdl"] else []
        out["warp_specialized"] = WARP_SPECIALIZE_OP in compiled.asm["ttgir"]
        out["warps"] = int(compiled.metadata.num_warps)
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
