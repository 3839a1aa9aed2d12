"""`archc bench`: the generated kernels and the whole model beside PyTorch, in one run, on the
same random weights and shapes, held against the roofline.

The run, section by section (the report is saved after each, so a run cut short keeps what it
measured and says which section it was in):
1. setup — one seeded random checkpoint on the device; two triton sessions of the kernel-level
   program (one with every node's buffer kept, for per-kernel work; one as users run it, CUDA
   graphs on for decode) and the unfused graph as a plain torch program (``TorchProgram``).
2. ceilings — a large device-to-device copy and a large matmul, measured.
3. kernels — at the prefill shape and at one decode step: each unique generated kernel launched
   alone on the buffers of a real run (its launch statement from the generated module, so the
   very kernel and layouts the model runs), beside its PyTorch counterparts
   (``archc.perf.baselines``), each counterpart checked against the kernel's output.
4. model — the whole prefill (``do_bench``) and batch decode tokens/s (a greedy loop timed after
   a warm-up that compiles, autotunes and captures) for archc, PyTorch eager (the unfused graph)
   and ``torch.compile`` of the same torch program in each mode asked for.
5. goals — the issue's targets, evaluated on what was measured (recorded, never asserted).

Speed-ups are baseline time / archc time (above 1: archc is faster). Fractions of the roofline
are the roofline time over the measured time: for decode the floor (weights and KV cache read
once at the datasheet bandwidth), for prefill FLOPs at the datasheet peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from archc.errors import ArchcError
from archc.ir.graph import Graph, Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.shapes import evaluate
from archc.perf.baselines import (
    Counterpart,
    Unavailable,
    counterparts,
    scratch_caches,
    state_keys,
)
from archc.perf.gpus import GPU
from archc.perf.roofline import KernelRoof, decode_floor, kernels, label
from archc.perf.timing import Ceilings, Timer, measure_ceilings, synchronize
from archc.perf.torch_program import TorchProgram
from archc.spec.schema import Spec

SCHEMA = "archc-bench/1"

# Relative to the kernel output's largest magnitude: the unfused sequence rounds to the model
# dtype after every op where the kernel rounds once, so a few roundings of the dtype, as in
# validation (f32 1e-4 allows for TF32-free summation order; 16-bit: several roundings).
TOLERANCE = {"f32": 1e-4, "f16": 1e-2, "bf16": 5e-2}

WARMUP_STEPS = 3       # decode steps before timing: compiles, autotunes, captures CUDA graphs


# ---- configuration ---------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchConfig:
    spec: Spec
    dtype: str
    device: torch.device
    gpu: GPU                        # the roofline's GPU model
    gpu_detected: bool              # the model was read off the device (not assumed)
    batch: int
    prompt: int
    decode: int
    timer: Timer
    compile_modes: tuple[str, ...]
    compile_backend: str            # "inductor" on a GPU; a cheap dynamo backend in a dry run
    copy_mib: int
    matmul_size: int
    dry_run: bool = False
    autotune: bool = False
    seed: int = 0
    layers_of_spec: int | None = None   # the spec's own block count, when --layers kept fewer
    kernel_section: bool = True
    cache_dir: Path | None = None

    @property
    def decode_past(self) -> int:
        """The past length of the decode step whose kernels are timed: the middle of the
        decoded run, where the per-step roofline equals its mean."""
        return self.prompt + self.decode // 2


def keep_layers(spec: Spec, layers: int | None) -> Spec:
    if layers is None or layers == spec.layers:
        return spec
    if layers > spec.layers:
        raise ArchcError(f"--layers {layers}: {spec.name} has {spec.layers} blocks")
    return dataclasses.replace(spec, layers=layers)


def check_config(spec: Spec, prompt: int, decode: int) -> None:
    if spec.family != "decoder":
        raise ArchcError(f"archc bench measures decoder-only models (prefill and decode); "
                         f"{spec.name} is an {spec.family}")
    if decode < 1:
        raise ArchcError("--new-tokens must be ≥ 1: decode tokens/s are measured")
    need = prompt + max(decode, WARMUP_STEPS)
    if need > spec.max_seq_len:
        raise ArchcError(f"--prompt-len {prompt} + --new-tokens {max(decode, WARMUP_STEPS)} exceed "
                         f"max_seq_len = {spec.max_seq_len} of {spec.name}")


# ---- the report ------------------------------------------------------------------------------

@dataclass
class Report:
    """Everything measured, as plain data; saved as JSON after every section."""

    data: dict[str, Any]
    path: Path | None = None
    log: Callable[[str], None] = lambda line: None

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default) + "\n")
        tmp.replace(self.path)

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Mark `name` running (saved), then done or failed: an error is recorded, not
        raised, so later sections still run."""
        status = self.data["status"]
        status[name] = "running"
        self.save()
        t0 = time.perf_counter()
        self.log(f"{name} …")
        try:
            yield
        except Exception as err:  # noqa: BLE001 — recorded and reported, the run goes on
            status[name] = "failed"
            self.data["errors"].append({"section": name, "error": _describe(err),
                                        "traceback": traceback.format_exc(limit=8)})
            self.log(f"{name}: failed: {_describe(err)}")
        else:
            status[name] = "done"
        self.data["section_seconds"][name] = time.perf_counter() - t0
        self.log(f"{name}: {status[name]} in {time.perf_counter() - t0:.1f} s")
        self.save()

    @property
    def failed(self) -> list[str]:
        return [k for k, v in self.data["status"].items() if v != "done"]


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def _json_default(x: object) -> object:
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"{type(x).__name__} is not JSON")


def _ratio(baseline: float | None, archc: float | None) -> float | None:
    if baseline is None or archc is None or archc <= 0:
        return None
    return baseline / archc


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


# ---- weights ---------------------------------------------------------------------------------

def random_checkpoint(program: Program, device: torch.device, seed: int, *,
                      evaluated_by: tuple[Program, ...] = ()) -> dict[str, torch.Tensor]:
    """Seeded random f32 weights, drawn on the device (a real-size model in seconds):
    matrices and tables N(0, 1/fan_in), vectors 1 + N(0, 0.1²) — activations keep unit
    scale through norms and residuals; the values matter for nothing else here. Drawn on the
    CPU instead when a parameter expression mixes checkpoint tensors with tensors it makes
    itself (``zeros`` for a missing bias), which the expression evaluator makes on the CPU —
    in `program` or in any program `evaluated_by` (the kernel-level one, with folded weights)."""
    from archc.runtime.weights import checkpoint_shapes
    if any(_makes_tensors(p) for p in (program, *evaluated_by)):
        device = torch.device("cpu")
    gen = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, dims in sorted(checkpoint_shapes(program).items()):
        x = torch.randn(dims, generator=gen, device=device)
        out[name] = x / dims[-1] ** 0.5 if len(dims) > 1 else 1.0 + 0.1 * x
    return out


def _makes_tensors(program: Program) -> bool:
    """Does a parameter expression that reads checkpoint tensors also make a tensor of its own?"""
    from archc.ir.attrs import Call
    from archc.ir.paramexpr import leaves

    def constant_inside(e: object) -> bool:
        if not isinstance(e, Call) or e.fn == "w":
            return False
        if not leaves(e):
            return True
        return any(constant_inside(a) for a in e.args)

    for g in program:
        for i in g.ids(Op.PARAM):
            expr = g.nodes[i].attr("expr")
            if expr is not None and leaves(expr) and constant_inside(expr):
                return True
    return False


# ---- per-kernel ------------------------------------------------------------------------------

def _sizes(g: Graph, i: int, dims: Mapping[str, int]) -> dict[str, int]:
    """The sizes that say what a kernel works on: M, N, K of a matmul; B, H, H_kv, T, L, D of
    attention; the output's dims otherwise."""
    n = g.nodes[i]

    def at(j: int) -> list[int]:
        return [evaluate(d, dims) for d in g.nodes[j].shape]
    if n.op == Op.FUSED_LINEAR:
        x = at(n.inputs[0])
        w = at(n.inputs[2 if n.attr("concat_k") else 1])
        return {"M": math.prod(x[:-1]), "N": w[0], "K": w[1]}
    if n.op == Op.ATTENTION:
        b, h, t, d = at(n.inputs[0])
        keys = dims["P"] + t if n.attr("cache_layer") is not None else at(n.inputs[1])[2]
        return {"B": b, "H": h, "H_kv": n.attr("kv_heads") or h, "T": t, "L": keys, "D": d}
    return {f"d{k}": v for k, v in enumerate(at(i))}


def _shape_text(sizes: Mapping[str, int]) -> str:
    if "H_kv" in sizes:   # queries × keys, heads/KV heads × head_dim (batch B)
        return (f"{sizes['T']}×{sizes['L']} {sizes['H']}/{sizes['H_kv']}×{sizes['D']}"
                + (f" B{sizes['B']}" if sizes["B"] > 1 else ""))
    if "M" in sizes:
        return f"{sizes['M']}×{sizes['N']}×{sizes['K']}"
    return "×".join(str(v) for v in sizes.values())


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().float(), want.detach().float()
    if got.shape != want.shape:
        return float("inf")
    scale = float(want.abs().max()) if want.numel() else 0.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    return err / scale if scale else err


def time_kernels(cfg: BenchConfig, session: Any, phase: str, dims: dict[str, int],
                 roofs: Mapping[int, KernelRoof], report: Report) -> None:
    """Each unique kernel of the decoder graph at `dims`, launched alone on the buffers of the
    run `session` just made, beside its PyTorch counterparts."""
    g = session.program.graph("decoder")
    runner = session.runners["decoder"]
    gen = session.generated
    steps = gen.steps["decoder"]
    ids = g.compute_ids()
    if len(ids) != len(steps) or any(not s.node.startswith(f"%{i} ") for i, s in zip(ids, steps)):
        raise RuntimeError("the generated module's launch steps do not follow the graph's "
                           "compute nodes one to one")
    unit_of = {i: s.unit for i, s in zip(ids, steps)}
    launches: dict[str, int] = {}
    for i in ids:
        launches[unit_of[i]] = launches.get(unit_of[i], 0) + 1
    namespace = dict(vars(session.module))
    namespace.update(v=runner.last_v, d=session.ctx)
    batch, tokens, _, enc_len, kv_len = runner.last.key        # the dims of the run's plan
    dtype = session.cache.dtype
    seen: set[str] = set()
    rows = report.data["kernels"]
    for i, step in zip(ids, steps):
        if step.unit in seen:
            continue
        seen.add(step.unit)
        n = g.nodes[i]
        roof = roofs[i]
        sizes = _sizes(g, i, dims)
        row: dict[str, Any] = {
            "phase": phase, "kernel": step.unit, "op": n.op.value, "reads": label(g, i),
            "node": f"%{i}", "sizes": sizes, "shape": _shape_text(sizes),
            "prologue": n.attr("prologue"),
            "epilogue": [st.fn for st in n.attr("epilogue", ()) or ()],
            "launches": launches[step.unit],
            "flops": roof.flops, "bytes": roof.bytes,
            "roofline_seconds": roof.time(cfg.gpu), "bound": roof.bound(cfg.gpu),
            "archc_seconds": None, "baselines": [], "error": None}
        rows.append(row)
        # a recurrent kernel updates its state at every launch: each timed launch continues
        # the last, and the checked one starts again from the state the run began with —
        # zeros at P = 0, else what the run left (a step further, as a later step would be)
        held = {key: session.states.get(*key).clone().zero_() if dims["P"] == 0 else
                session.states.get(*key).clone() for key in state_keys(g, i)}

        def restore(held: dict = held) -> None:
            for (layer, kind), value in held.items():
                session.states.get(layer, kind).copy_(value)
        try:
            # the generated module's own launch line, recorded once at the run's dims
            code = compile(step.call, f"<{step.unit}>", "eval")
            recorded = session.ctx.record(lambda code=code: eval(code, namespace),  # noqa: S307
                                          batch, tokens, enc_len, kv_len)

            def launch(recorded: list = recorded) -> None:
                for fn, args, meta in recorded:
                    fn(*args, **meta)
            t = cfg.timer(launch)
            row["archc_seconds"] = t
            row["achieved_flops"] = roof.flops / t
            row["achieved_bandwidth"] = roof.bytes / t
            row["roofline_fraction"] = roof.time(cfg.gpu) / t
            if held:
                restore()
                launch()
            synchronize(cfg.device)
            out = runner.value(i, dims).clone()
            xs = [runner.value(j, dims) for j in n.inputs]
            scratch = scratch_caches(g, i, dims, dtype, cfg.device)
            for c in counterparts(g, i, xs, dims, session.cache.store, scratch, held):
                row["baselines"].append(_baseline_row(cfg, c, out, t))
            restore()
        except Exception as err:  # noqa: BLE001 — one kernel's failure is recorded
            row["error"] = _describe(err)
            report.data["errors"].append({"section": f"kernels:{phase}", "kernel": step.unit,
                                          "error": _describe(err),
                                          "traceback": traceback.format_exc(limit=8)})
        report.log(f"  {phase} {step.unit}: {_us(row['archc_seconds'])}")
    report.save()


def _baseline_row(cfg: BenchConfig, c: Counterpart | Unavailable, out: torch.Tensor,
                  archc_seconds: float) -> dict[str, Any]:
    if isinstance(c, Unavailable):
        return {"name": c.name, "seconds": None, "unavailable": c.reason}
    row: dict[str, Any] = {"name": c.name, "what": c.what, "ops": c.ops}
    try:
        if c.result is not None:
            err = _rel_error(c.result(c.run()), out)
            row["max_rel_error"] = _finite(err)
            row["tolerance"] = TOLERANCE[cfg.dtype]
            row["agrees"] = bool(err <= TOLERANCE[cfg.dtype])
        t = cfg.timer(c.run)
        row["seconds"] = t
        row["archc_speedup"] = _ratio(t, archc_seconds)
    except Exception as err:  # noqa: BLE001
        row["seconds"] = None
        row["error"] = _describe(err)
    return row


def _us(t: float | None) -> str:
    return "—" if t is None else f"{t * 1e6:.1f} µs"


# ---- whole model -----------------------------------------------------------------------------

class _Runner:
    """One way of running the model: prefill (a fresh cache), then greedy decode steps."""

    name = ""

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError


class _ArchcRunner(_Runner):
    def __init__(self, name: str, session: Any) -> None:
        self.name = name
        self.session = session
        self.next: torch.Tensor | None = None

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        self.session.reset()
        logits = self.session.step(tokens)
        self.next = logits[:, -1].argmax(-1, keepdim=True)
        return logits

    def step(self) -> None:
        logits = self.session.step(self.next)
        self.next = logits[:, -1].argmax(-1, keepdim=True)


class _TorchRunner(_Runner):
    def __init__(self, name: str, program: TorchProgram,
                 fn: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        self.name = name
        self.program = program
        self.fn = fn
        self.past = 0
        self.next: torch.Tensor | None = None
        self._on_device: tuple[torch.Tensor, torch.Tensor] | None = None

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._on_device is None or self._on_device[0] is not tokens:
            self._on_device = (tokens, tokens.to(self.program.device))
        tokens = self._on_device[1]
        logits = self.fn(tokens, 0)
        self.past = tokens.shape[1]
        self.next = logits[:, -1].argmax(-1, keepdim=True)
        return logits

    def step(self) -> None:
        logits = self.fn(self.next, self.past)
        self.past += 1
        self.next = logits[:, -1].argmax(-1, keepdim=True)


def measure_runner(cfg: BenchConfig, runner: _Runner, tokens: torch.Tensor,
                   reference: torch.Tensor | None, model: dict[str, Any], report: Report
                   ) -> torch.Tensor | None:
    """Prefill time, then decode tokens/s, of one runner; returns its prefill logits."""
    prefill = model["prefill"]
    decode = model["decode"]
    prow: dict[str, Any] = {"name": runner.name}
    drow: dict[str, Any] = {"name": runner.name}
    prefill["runs"].append(prow)
    decode["runs"].append(drow)
    logits = None
    with report.section(f"model:{runner.name}:prefill"):
        t0 = time.perf_counter()
        logits = runner.prefill(tokens)           # compiles, autotunes
        synchronize(cfg.device)
        prow["first_call_seconds"] = time.perf_counter() - t0
        if reference is not None:
            prow["max_rel_error_vs_eager"] = _finite(_rel_error(logits, reference))
        t = cfg.timer(lambda: runner.prefill(tokens))
        prow["seconds"] = t
        prow["tokens_per_second"] = cfg.batch * cfg.prompt / t
        prow["flops_per_second"] = prefill["flops"] / t
        prow["peak_fraction"] = prefill["flops"] / t / cfg.gpu.peak_flops
        prow["roofline_fraction"] = prefill["roofline_seconds"] / t
    if report.data["status"][f"model:{runner.name}:prefill"] != "done":
        report.data["status"][f"model:{runner.name}:decode"] = "skipped (prefill failed)"
        return logits
    with report.section(f"model:{runner.name}:decode"):
        runner.prefill(tokens)
        for _ in range(WARMUP_STEPS):             # compiles, captures the CUDA graph
            runner.step()
        runner.prefill(tokens)
        t = cfg.timer.loop(runner.step, cfg.decode)
        step_s = t / cfg.decode
        drow["step_seconds"] = step_s
        drow["tokens_per_second"] = cfg.batch / step_s
        drow["floor_fraction"] = decode["floor_seconds"] / step_s
        drow["bandwidth"] = decode["bytes_per_step"] / step_s
        copy = (report.data.get("ceilings") or {}).get("copy_bandwidth")
        drow["copy_fraction"] = drow["bandwidth"] / copy if copy else None
    return logits


def _speedups(model: dict[str, Any]) -> None:
    for kind, key in (("prefill", "seconds"), ("decode", "step_seconds")):
        runs = model[kind]["runs"]
        archc = next((r.get(key) for r in runs if r["name"].startswith("archc")), None)
        for r in runs:
            r["archc_speedup"] = _ratio(r.get(key), archc)


# ---- goals -----------------------------------------------------------------------------------

def evaluate_goals(cfg: BenchConfig, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets on an H200, on what this run measured. Recorded, never asserted."""
    goals = []
    rows = data["kernels"]
    ceil = data.get("ceilings") or {}

    def best(row: dict[str, Any], name: str) -> dict[str, Any] | None:
        return next((b for b in row["baselines"] if b["name"] == name and
                     b.get("seconds") is not None), None)

    # 1. prefill attention ≥ 1.2× sdpa at head_dim 128, seq ≥ 2k, bf16
    att = [r for r in rows if r["phase"] == "prefill" and r["op"] == "attention"]
    hd = att[0]["sizes"]["D"] if att else None
    applies = hd == 128 and cfg.prompt >= 2048 and cfg.dtype == "bf16" and not cfg.dry_run
    ratios = [b["archc_speedup"] for r in att if (b := best(r, "sdpa"))]
    goals.append(_goal("prefill attention ≥ 1.2× scaled_dot_product_attention (head_dim 128, "
                       "seq ≥ 2k, bf16)", min(ratios) if ratios else None, 1.2, "×", applies,
                       f"head_dim {hd}, prompt {cfg.prompt}, {cfg.dtype}"))
    # 2. fused norm+matmul and SwiGLU matmuls ≥ 0.95× torch.matmul and beat the unfused sequence
    for phase in ("prefill", "decode"):
        fused = [r for r in rows if r["phase"] == phase and r["op"] == "fused_linear"
                 and (r["prologue"] is not None or "glu" in r["epilogue"])]
        vs_mm = [b["archc_speedup"] for r in fused if (b := best(r, "torch.matmul"))]
        vs_unf = [b["archc_speedup"] for r in fused if (b := best(r, "unfused"))]
        goals.append(_goal(f"{phase}: fused norm+matmul and SwiGLU matmuls ≥ 0.95× torch.matmul",
                           min(vs_mm) if vs_mm else None, 0.95, "×", not cfg.dry_run,
                           f"{len(fused)} kernels; the slowest"))
        goals.append(_goal(f"{phase}: … and faster than the unfused sequence",
                           min(vs_unf) if vs_unf else None, 1.0, "×", not cfg.dry_run,
                           f"{len(fused)} kernels; the slowest", strict=True))
    # 3. decode attention ≥ 85% of copy bandwidth
    datt = [r for r in rows if r["phase"] == "decode" and r["op"] == "attention"
            and r.get("achieved_bandwidth")]
    copy_bw = ceil.get("copy_bandwidth")
    frac = [r["achieved_bandwidth"] / copy_bw for r in datt] if copy_bw else []
    goals.append(_goal("decode attention ≥ 85% of the measured copy bandwidth",
                       min(frac) if frac else None, 0.85, "of copy", not cfg.dry_run,
                       f"context {cfg.decode_past + 1}"))
    # 4. batch-1 decode ≥ 80% of the bandwidth bound and faster than torch.compile
    runs = data["model"]["decode"]["runs"]
    archc = next((r for r in runs if r["name"].startswith("archc")), None)
    applies = cfg.batch == 1 and not cfg.dry_run
    goals.append(_goal("batch-1 decode ≥ 80% of the bandwidth bound (weights + KV cache read "
                       "once per token)", archc.get("floor_fraction") if archc else None, 0.80,
                       "of bound", applies, f"{cfg.spec.name}, {cfg.spec.layers} blocks"))
    compiled = [r["archc_speedup"] for r in runs if r["name"].startswith("torch.compile")
                and r.get("archc_speedup") is not None]
    goals.append(_goal("batch-1 decode faster than torch.compile (every mode)",
                       min(compiled) if compiled else None, 1.0, "×", applies,
                       f"{len(compiled)} modes measured", strict=True))
    return goals


def _goal(goal: str, measured: float | None, target: float, unit: str, applies: bool,
          note: str, *, strict: bool = False) -> dict[str, Any]:
    met = None
    if measured is not None and applies:
        met = bool(measured > target if strict else measured >= target)
    return {"goal": goal, "measured": measured, "target": target, "unit": unit,
            "applies": applies, "met": met, "note": note}


# ---- the run ---------------------------------------------------------------------------------

def environment(cfg: BenchConfig) -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "device": str(cfg.device)}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if cfg.device.type == "cuda":
        p = torch.cuda.get_device_properties(cfg.device)
        env.update(device_name=p.name, capability=f"{p.major}.{p.minor}",
                   multiprocessors=p.multi_processor_count, memory_bytes=p.total_memory,
                   cuda=torch.version.cuda)
    else:
        env["device_name"] = f"CPU ({platform.processor() or platform.machine()})"
    return env


def new_report(cfg: BenchConfig, path: Path | None, log: Callable[[str], None]) -> Report:
    g = cfg.gpu
    return Report({
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv),
        "dry_run": cfg.dry_run,
        "spec": cfg.spec.name, "layers": cfg.spec.layers, "spec_layers": cfg.layers_of_spec
        or cfg.spec.layers, "dtype": cfg.dtype,
        "shapes": {"batch": cfg.batch, "prompt": cfg.prompt, "decode": cfg.decode,
                   "kernel_decode_past": cfg.decode_past},
        "environment": environment(cfg),
        "gpu_model": {"name": g.name, "peak_flops": g.peak_flops, "bandwidth": g.bandwidth,
                      "detected": cfg.gpu_detected},
        "timing": {"method": cfg.timer.method, "decode": f"greedy loop of {cfg.decode} steps "
                   f"after {WARMUP_STEPS} warm-up steps, host clock between device syncs",
                   "compile_backend": cfg.compile_backend,
                   "autotune": "whole-model archc runs" if cfg.autotune else False},
        "status": {}, "section_seconds": {}, "errors": [],
        "ceilings": None, "kernels": [],
        "model": {"prefill": {"runs": []}, "decode": {"runs": []}},
        "goals": [],
    }, path, log)


def run_bench(cfg: BenchConfig, json_path: Path | None = None,
              log: Callable[[str], None] = lambda line: None) -> Report:
    from archc.runtime.triton_backend import TritonOptions, TritonSession
    report = new_report(cfg, json_path, log)
    data = report.data
    torch_dtype = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}[cfg.dtype]
    spec = cfg.spec
    state: dict[str, Any] = {}

    with report.section("setup"):
        unfused = lower(spec, cfg.dtype)
        from archc.passes import optimize
        checkpoint = random_checkpoint(unfused, cfg.device, cfg.seed,
                                       evaluated_by=(optimize(unfused),))
        # every node's buffer kept and no CUDA graphs: kernels are launched one by one. Never
        # autotuned: both sessions share one generated module, which autotuning wraps in place
        state["probe"] = TritonSession(unfused, checkpoint, max_seq_len=spec.max_seq_len,
                                       dtype=cfg.dtype, device=cfg.device, options=TritonOptions(
                                           reuse_buffers=False, cuda_graphs=False,
                                           cache_dir=cfg.cache_dir))
        kernel_level = state["probe"].program
        data["module"] = str(state["probe"].module_path)
        data["unique_kernels"] = len(state["probe"].generated.units)
        data["launches_per_pass"] = {g: len(s) for g, s in
                                     state["probe"].generated.steps.items()}
        from archc.runtime.weights import materialize
        params = materialize(unfused.graph("decoder"), checkpoint, cfg.device)
        state["torch"] = TorchProgram(unfused.graph("decoder"), params, batch=cfg.batch,
                                      max_len=spec.max_seq_len, device=cfg.device,
                                      dtype=torch_dtype)
        state["kernel_level"] = kernel_level
        gen = torch.Generator().manual_seed(cfg.seed)
        state["tokens"] = torch.randint(0, spec.vocab_size, (cfg.batch, cfg.prompt),
                                        generator=gen)
        state["checkpoint"] = checkpoint
        b, n, m = cfg.batch, cfg.prompt, cfg.decode
        prefill_roofs = kernels(kernel_level, {"B": b, "T": n, "P": 0, "S": 0})
        flops = sum(k.flops for k in prefill_roofs)
        data["model"]["prefill"].update(
            tokens=b * n, flops=flops, bytes=sum(k.bytes for k in prefill_roofs),
            roofline_seconds=sum(k.time(cfg.gpu) for k in prefill_roofs))
        first = decode_floor(kernel_level, cfg.gpu, b, n)
        last = decode_floor(kernel_level, cfg.gpu, b, n + m - 1)
        per_step = (first.bytes + last.bytes) / 2
        data["model"]["decode"].update(
            steps=m, past_first=n, past_last=n + m - 1, weight_bytes=first.weight_bytes,
            kv_bytes_mean=(first.kv_bytes + last.kv_bytes) / 2,
            state_bytes=first.state_bytes, bytes_per_step=per_step,
            floor_seconds=per_step / cfg.gpu.bandwidth,
            floor_tokens_per_second=b * cfg.gpu.bandwidth / per_step)
    if "probe" not in state:
        data["goals"] = evaluate_goals(cfg, data)
        report.save()
        return report

    with report.section("ceilings"):
        c: Ceilings = measure_ceilings(cfg.timer, torch_dtype, copy_mib=cfg.copy_mib,
                                       matmul_size=cfg.matmul_size)
        data["ceilings"] = {"copy_bytes": c.copy_bytes, "copy_seconds": c.copy_seconds,
                            "copy_bandwidth": c.copy_bandwidth, "matmul_shape": c.matmul_shape,
                            "matmul_seconds": c.matmul_seconds, "matmul_flops": c.matmul_flops,
                            "matmul_dtype": cfg.dtype}

    if cfg.kernel_section:
        probe = state["probe"]
        g = probe.program.graph("decoder")
        for phase, past, t in (("prefill", 0, cfg.prompt), ("decode", cfg.decode_past, 1)):
            with report.section(f"kernels:{phase}"):
                dims = {"B": cfg.batch, "T": t, "P": past, "S": 0}
                if past:  # fill the cache up to P, then the step whose kernels are timed
                    fill = torch.randint(0, spec.vocab_size, (cfg.batch, past),
                                         generator=torch.Generator().manual_seed(cfg.seed + 1))
                    _run_at(probe, fill, 0)
                _run_at(probe, state["tokens"][:, :t] if not past else
                        state["tokens"][:, :1], past)
                roofs = {k.index: k for k in kernels(probe.program, dims) if k.graph == g.name}
                time_kernels(cfg, probe, phase, dims, roofs, report)
            data["goals"] = evaluate_goals(cfg, data)
        del state["probe"]

    # the same checkpoint, as users run it: buffers reused, CUDA graphs for decode
    reference = None
    archc_name = "archc" + (" (CUDA graphs)" if cfg.device.type == "cuda" else "")
    runners: list[tuple[str, Callable[[], _Runner]]] = [
        ("torch eager", lambda: _TorchRunner("torch eager", state["torch"],
                                             state["torch"].forward)),
        (archc_name, lambda: _ArchcRunner(archc_name, TritonSession(
            unfused, state["checkpoint"], max_seq_len=spec.max_seq_len, dtype=cfg.dtype,
            device=cfg.device, options=TritonOptions(autotune=cfg.autotune,
                                                     cache_dir=cfg.cache_dir)))),
    ]
    for mode in cfg.compile_modes:
        name = f"torch.compile {mode}"
        runners.append((name, lambda name=name, mode=mode: _TorchRunner(
            name, state["torch"], _compiled(cfg, state["torch"], mode))))
    for name, make in runners:
        runner = None
        with report.section(f"model:{name}:setup"):
            runner = make()
        if runner is None:
            continue
        logits = measure_runner(cfg, runner, state["tokens"], reference, data["model"], report)
        if reference is None and logits is not None:
            reference = logits.detach().clone()
        _speedups(data["model"])
        data["goals"] = evaluate_goals(cfg, data)
        del runner
        report.save()
    data["goals"] = evaluate_goals(cfg, data)
    report.save()
    return report


def _run_at(session: Any, tokens: torch.Tensor, past: int) -> None:
    """One run of the decoder graph over `tokens` after `past` cached positions."""
    b, t = tokens.shape
    runner = session.runners["decoder"]
    inputs = {"tokens": tokens, "positions": torch.arange(past, past + t),
              "prefix_len": torch.tensor(t if past == 0 else session.prefix_len or t)}
    session.cache.ensure(b)
    session.states.ensure(b)
    if past == 0:   # a sequence starts: the recurrent state reads zeros
        session.states.zero()
    runner.run(inputs, session.ctx, B=b, T=t, P=past, S=0, kv_len_max=session.kv_len(past, t))
    synchronize(session.device)


def _compiled(cfg: BenchConfig, program: TorchProgram, mode: str
              ) -> Callable[[torch.Tensor, int], torch.Tensor]:
    import torch._dynamo
    torch._dynamo.reset()
    if cfg.compile_backend == "inductor":
        return torch.compile(program.forward, mode=mode)
    return torch.compile(program.forward, backend=cfg.compile_backend)


def default_json_name(cfg: BenchConfig, when: float | None = None) -> str:
    """`<date>_<device>_<spec>[-Ln]_<dtype>.json`, every part from the run."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    device = environment(cfg)["device_name"] if cfg.device.type == "cuda" else "cpu-dry-run"
    safe = "".join(ch if ch.isalnum() else "-" for ch in device).strip("-").lower()
    layers = f"-L{cfg.spec.layers}" if cfg.layers_of_spec else ""
    return f"{stamp}_{safe}_{cfg.spec.name}{layers}_{cfg.dtype}.json"
