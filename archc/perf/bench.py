"""`archc bench`: the generated kernels and the whole model beside PyTorch, in one run, on the
same random weights and shapes, held against the roofline. The report is saved after each
section, so a run cut short keeps what it measured and says which section it was in:
1. setup — one seeded random checkpoint on the device; a triton session of the kernel-level
   program with every node's buffer kept, and the unfused program on the eager interpreter
   without its checks (``EagerSession(checks=False)``): a plain torch program;
2. ceilings — a large device-to-device copy and a large matmul, measured;
3. kernels — at the prefill shape and at one decode step, each unique generated kernel launched
   alone on the buffers of a real run by its own launch line (the very kernel and layouts the
   model runs), beside its PyTorch counterparts (``archc.perf.baselines``);
4. model — the whole prefill and batch decode tokens/s (a greedy loop after a warm-up) of archc
   as users run it (CUDA graphs for decode), PyTorch eager (the unfused graph) and
   ``torch.compile`` of the same torch program in each mode;
5. contexts (``--contexts``) — decode at each given context length: every runner decodes after
   a prefill of that many tokens, against the decode floor at that length; and the decode
   attention kernel alone at that past length beside a device-to-device copy of the same KV
   bytes (the copy is what the kernel's reads could cost at best);
6. autotune (a GPU run with autotuning on) — the tuning cache's first-run cost: an autotuned
   session built and a prefill run on an empty tuning cache, then again on the cache it left;
7. goals — the targets on what was measured (recorded, never asserted): at the prefill shape
   every fused matmul against ``torch.matmul`` on the same GEMM and against the unfused
   sequence, attention against ``scaled_dot_product_attention`` and, in TFLOP/s, against
   FlashAttention-3's published forward figure; decode against the bandwidth bound,
   ``torch.compile`` and a copy of the KV bytes.

Speed-ups are baseline time / archc time (above 1: archc is faster). Fractions of the roofline
are roofline time over measured time: for decode the floor (weights and KV cache read once at
the datasheet bandwidth), for prefill FLOPs at the datasheet peak.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from archc.dtypes import TORCH_DTYPES
from archc.errors import ArchcError
from archc.gpus import GPU, GPUS
from archc.ir.attrs import Call
from archc.ir.cost import state_keys
from archc.ir.graph import Graph, Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.ir.paramexpr import leaves
from archc.ir.shapes import DTYPE_BYTES, evaluate
from archc.perf.baselines import Counterpart, Unavailable, counterparts, scratch_caches
from archc.perf.roofline import decode_floor, kernels
from archc.perf.summary import fmt_percent, fmt_ratio, fmt_seconds
from archc.quant.schemes import SCHEMES
from archc.runtime.eager import EagerSession
from archc.runtime.validation import TOLERANCE, error_and_scale
from archc.runtime.weights import checkpoint_shapes
from archc.spec.schema import Spec
from archc.versions import software

SCHEMA = "archc-bench/1"

WARMUP_STEPS = 3       # decode steps before timing: compiles, autotunes, captures CUDA graphs


# ---- the clock: one for every measurement of a run ---------------------------------------------

def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timer:
    """Seconds per call of a callable on `device` (median). On a GPU by
    ``triton.testing.do_bench``: warm-up runs first (compiles, autotuning, allocator growth stay
    out of the number), then repeats between CUDA events, the L2 flushed before each. On a CPU
    (``--dry-run``) there are no device events: one untimed call, then a few host-clock repeats;
    the numbers mean nothing, the code paths are the same."""

    device: torch.device
    warmup_ms: float = 25.0        # do_bench's warm-up budget (GPU)
    rep_ms: float = 100.0          # do_bench's measurement budget (GPU)
    cpu_repeats: int = 3           # host-clock repeats after one untimed call (CPU)

    @property
    def method(self) -> str:
        if self.device.type == "cuda":
            return (f"triton.testing.do_bench, median, warm-up {self.warmup_ms:g} ms, "
                    f"repeats for {self.rep_ms:g} ms, L2 flushed before each")
        return f"host clock, median of {self.cpu_repeats} after one untimed call (CPU dry run)"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            from triton.testing import do_bench
            return float(do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms,
                                  return_mode="median")) / 1e3
        fn()
        return statistics.median(self.loop(fn, 1) for _ in range(self.cpu_repeats))

    def loop(self, step: Callable[[], object], n: int) -> float:
        """Seconds for `n` calls of `step` in a row (a loop that carries state from call to
        call, as decode steps do), between two device synchronizations."""
        synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        synchronize(self.device)
        return time.perf_counter() - t0


def measure_ceilings(cfg: BenchConfig) -> dict[str, Any]:
    """What this card really does, beside its datasheet: a device-to-device copy of
    `cfg.copy_mib` MiB (bytes read plus bytes written) and a square `cfg.matmul_size`³ product
    in the model dtype on random data, timed."""
    timer, n = cfg.timer, cfg.matmul_size
    gen = torch.Generator(timer.device).manual_seed(0)
    src = torch.randn(cfg.copy_mib * 2**20 // 4, generator=gen, device=timer.device)
    dst = torch.empty_like(src)
    copy_s, copied = timer(lambda: dst.copy_(src)), 2 * src.numel() * src.element_size()
    a, b = (torch.randn(n, n, generator=gen, device=timer.device).to(TORCH_DTYPES[cfg.dtype])
            for _ in range(2))
    mm_s = timer(lambda: torch.matmul(a, b))
    return {"copy_bytes": copied, "copy_seconds": copy_s, "copy_bandwidth": copied / copy_s,
            "matmul_shape": (n, n, n), "matmul_seconds": mm_s, "matmul_flops": 2 * n**3 / mm_s,
            "matmul_dtype": cfg.dtype}


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
    contexts: tuple[int, ...] = ()      # past lengths decode is also measured at (--contexts)
    quant: str | None = None            # the scheme linear weights are quantized to (--quantize)

    @property
    def decode_past(self) -> int:
        """The past length of the decode step whose kernels are timed: the middle of the
        decoded run, where the per-step roofline equals its mean."""
        return self.prompt + self.decode // 2


def keep_layers(spec: Spec, layers: int | None) -> Spec:
    if layers is not None and layers > spec.layers:
        raise ArchcError(f"--layers {layers}: {spec.name} has {spec.layers} blocks")
    return spec if layers is None else dataclasses.replace(spec, layers=layers)


def check_config(spec: Spec, prompt: int, decode: int, contexts: tuple[int, ...] = ()) -> None:
    if spec.family != "decoder":
        raise ArchcError(f"archc bench measures decoder-only models (prefill and decode); "
                         f"{spec.name} is an {spec.family}")
    if decode < 1:
        raise ArchcError("--new-tokens must be ≥ 1: decode tokens/s are measured")
    if prompt + max(decode, WARMUP_STEPS) > spec.max_seq_len:
        raise ArchcError(f"--prompt-len {prompt} + --new-tokens {max(decode, WARMUP_STEPS)} "
                         f"exceed max_seq_len = {spec.max_seq_len} of {spec.name}")
    if len(set(contexts)) != len(contexts):
        raise ArchcError(f"--contexts {' '.join(map(str, contexts))}: a context is given twice")
    for c in contexts:      # a context is a prefill of c tokens, then the decode steps
        if c < 1 or c + max(decode, WARMUP_STEPS) > spec.max_seq_len:
            raise ArchcError(f"--contexts {c}: a context must be ≥ 1, and it + --new-tokens "
                             f"{max(decode, WARMUP_STEPS)} within max_seq_len = "
                             f"{spec.max_seq_len} of {spec.name}")


# ---- the report ------------------------------------------------------------------------------

@dataclass
class Report:
    """Everything measured, as plain data; saved as JSON after every section, with the
    speed-ups and goals derived again from what is there."""

    cfg: BenchConfig
    data: dict[str, Any]
    path: Path | None = None
    log: Callable[[str], None] = lambda line: None

    def save(self) -> None:
        model = self.data["model"]
        for runs, key in ((model["prefill"]["runs"], "seconds"),
                          (model["decode"]["runs"], "step_seconds"),
                          *((c["runs"], "step_seconds") for c in model["contexts"])):
            archc = next((r.get(key) for r in runs if r["name"].startswith("archc")), None)
            for r in runs:
                r["archc_speedup"] = r[key] / archc if r.get(key) is not None and archc else None
        self.data["goals"] = evaluate_goals(self.cfg, self.data)
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1) + "\n")
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
            self.error(name, err)
            self.log(f"{name}: failed: {_describe(err)}")
        else:
            status[name] = "done"
        self.data["section_seconds"][name] = time.perf_counter() - t0
        self.log(f"{name}: {status[name]} in {time.perf_counter() - t0:.1f} s")
        self.save()

    def error(self, section: str, err: BaseException, **where: str) -> None:
        """Record `err`, raised in `section` (`where` may name the kernel)."""
        self.data["errors"].append({"section": section, **where, "error": _describe(err),
                                    "traceback": traceback.format_exc(limit=8)})

    @property
    def failed(self) -> list[str]:
        return [k for k, v in self.data["status"].items() if v != "done"]


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


# ---- weights ---------------------------------------------------------------------------------

def random_checkpoint(program: Program, device: torch.device, seed: int, *,
                      evaluated_by: tuple[Program, ...] = ()) -> dict[str, torch.Tensor]:
    """Seeded random f32 weights, drawn on the device (a real-size model in seconds): matrices
    and tables N(0, 1/fan_in), vectors 1 + N(0, 0.1²), so activations keep unit scale through
    norms and residuals. On the CPU instead when a parameter expression of `program` or of one
    `evaluated_by` (the kernel-level one, with folded weights) mixes checkpoint tensors with
    tensors it makes itself (``zeros`` for a missing bias), which the evaluator makes there."""
    if any(_makes_tensors(p) for p in (program, *evaluated_by)):
        device = torch.device("cpu")
    gen = torch.Generator(device).manual_seed(seed)
    out = {}
    for name, dims in sorted(checkpoint_shapes(program).items()):
        x = torch.randn(dims, generator=gen, device=device)
        out[name] = x / dims[-1] ** 0.5 if len(dims) > 1 else 1.0 + 0.1 * x
    return out


def quantized(cfg: BenchConfig, dense: Program, checkpoint: dict[str, torch.Tensor]
              ) -> tuple[Program, dict[str, Any]]:
    """The program and checkpoint archc runs: `dense`'s, or with `cfg.quant`, the weights of
    linear layers and experts quantized round-to-nearest to that scheme."""
    if cfg.quant is None:
        return dense, checkpoint
    from archc.quant.pack import quantize
    from archc.runtime.weights import quantizable
    scheme = SCHEMES[cfg.quant]
    kind, group = ("int8", 128) if scheme.bits == 8 else ("int4", scheme.group)
    names = quantizable(dense)
    out: dict[str, Any] = dict(checkpoint)
    for name in names:
        out[name] = quantize(checkpoint[name], kind, group)
    return lower(cfg.spec, cfg.dtype, dict.fromkeys(names, cfg.quant)), out


def _makes_tensors(program: Program) -> bool:
    """Does a parameter expression that reads checkpoint tensors also make a tensor of its own?"""
    def constant_inside(e: object) -> bool:
        return isinstance(e, Call) and e.fn != "w" and (
            not leaves(e) or any(constant_inside(a) for a in e.args))
    return any(e is not None and leaves(e) and constant_inside(e)
               for g in program for e in (g.nodes[i].attr("expr") for i in g.ids(Op.PARAM)))


# ---- per-kernel ------------------------------------------------------------------------------

def _sizes(g: Graph, i: int, dims: Mapping[str, int]) -> tuple[dict[str, int], str]:
    """The sizes that say what a kernel works on, and as text: M×N×K of a matmul; of attention
    queries×keys heads/KV heads×head_dim (and the batch); the output's dims otherwise."""
    n = g.nodes[i]

    def at(j: int) -> list[int]:
        return [evaluate(d, dims) for d in g.nodes[j].shape]
    if n.op == Op.FUSED_LINEAR:
        m = math.prod(at(n.inputs[0])[:-1])
        cols, k = at(n.inputs[2 if n.attr("concat_k") else 1])      # the weight, [N, K]
        return {"M": m, "N": cols, "K": k}, f"{m}×{cols}×{k}"
    if n.op == Op.ATTENTION:
        b, h, t, d = at(n.inputs[0])
        keys = dims["P"] + t if n.attr("cache_layer") is not None else at(n.inputs[1])[2]
        kv = n.attr("kv_heads") or h
        return ({"B": b, "H": h, "H_kv": kv, "T": t, "L": keys, "D": d},
                f"{t}×{keys} {h}/{kv}×{d}" + (f" B{b}" if b > 1 else ""))
    out = at(i)
    return {f"d{k}": v for k, v in enumerate(out)}, "×".join(map(str, out))


def flash_attention_flops(sizes: Mapping[str, int], causal: bool) -> int:
    """An attention kernel's FLOPs as FlashAttention's benchmarks count them, so its FLOP/s
    compare with their published figures: the two products, 4·B·H·T·L·D, halved when causal
    over as many keys as queries (a prefill). Softmax and masking are not counted, unlike the
    roofline's ``flops``."""
    b, h, t, keys, d = (sizes[k] for k in ("B", "H", "T", "L", "D"))
    flops = 4 * b * h * t * keys * d
    return flops // 2 if causal and t == keys else flops


def _rel_error(got: torch.Tensor, want: torch.Tensor) -> float | None:
    """The largest difference over the largest magnitude of `want`; None if they differ in
    shape or the difference is not finite."""
    diff, scale = error_and_scale(got, want)
    err = diff / (scale or 1.0)
    return err if math.isfinite(err) else None


def time_kernels(cfg: BenchConfig, session: Any, phase: str, dims: dict[str, int],
                 report: Report, *, ops: tuple[str, ...] | None = None,
                 rows: list[dict[str, Any]] | None = None) -> None:
    """Each unique kernel of the decoder graph at `dims` (only those of `ops`, when given),
    launched alone on the buffers of the run `session` just made, beside its PyTorch
    counterparts; a decode attention kernel also beside a copy of the KV bytes it reads. The
    rows go to `rows` (default: the report's kernels)."""
    g = session.program.graph("decoder")
    roofs = {k.index: k for k in kernels(session.program, dims) if k.graph == g.name}
    steps = session.generated.steps["decoder"]
    ids = g.compute_ids()
    if len(ids) != len(steps) or any(not s.node.startswith(f"%{i} ") for i, s in zip(ids, steps)):
        raise RuntimeError("the generated module's launch steps do not follow the graph's "
                           "compute nodes one to one")
    launches = Counter(s.unit for s in steps)
    first: dict[str, tuple[int, Any]] = {}
    for i, step in zip(ids, steps):
        first.setdefault(step.unit, (i, step))
    for i, step in first.values():
        if ops is not None and g.nodes[i].op.value not in ops:
            continue
        n, roof, (sizes, shape) = g.nodes[i], roofs[i], _sizes(g, i, dims)
        row: dict[str, Any] = {
            "phase": phase, "kernel": step.unit, "op": n.op.value, "reads": roof.label,
            "node": f"%{i}", "sizes": sizes, "shape": shape,
            "prologue": n.attr("prologue"), "epilogue": [st.fn for st in n.attr("epilogue", ())],
            "launches": launches[step.unit], "flops": roof.flops, "bytes": roof.bytes,
            "roofline_seconds": roof.time(cfg.gpu), "bound": roof.bound(cfg.gpu),
            "archc_seconds": None, "baselines": [], "error": None}
        if n.op == Op.ATTENTION:
            row.update(causal=bool(n.attr("causal")), window=n.attr("window"),
                       fa_flops=flash_attention_flops(sizes, bool(n.attr("causal"))))
        (report.data["kernels"] if rows is None else rows).append(row)
        try:
            _time_kernel(cfg, session, g, i, step.call, dims, row)
            if row.get("fa_flops") is not None:
                row["fa_flops_per_second"] = row["fa_flops"] / row["archc_seconds"]
            if n.op == Op.ATTENTION and n.attr("cache_layer") is not None and dims["T"] == 1:
                _copy_beside(cfg, row, live_kv_bytes(g, i, dims))
        except Exception as err:  # noqa: BLE001 — one kernel's failure is recorded
            row["error"] = _describe(err)
            report.error(f"kernels:{phase}", err, kernel=step.unit)
        report.log(f"  {phase} {step.unit}: {fmt_seconds(row['archc_seconds'])}")


def _time_kernel(cfg: BenchConfig, session: Any, g: Graph, i: int, call: str,
                 dims: dict[str, int], row: dict[str, Any]) -> None:
    """Kernel i alone, by its launch line `call` in the generated module, then its
    counterparts."""
    runner = session.runners["decoder"]
    # a recurrent kernel updates its state at every launch: each timed launch continues the
    # last, and the checked one starts again from the state the run began with — zeros at
    # P = 0, else what the run left (a step further, as a later step would be)
    states = {key: session.states.get(*key) for key in state_keys(g, i)}
    held = {k: s.clone() if dims["P"] else torch.zeros_like(s) for k, s in states.items()}

    def restore() -> None:
        for key, value in held.items():
            states[key].copy_(value)
    # the launches the line makes, recorded once at the dims of the run's plan
    namespace = {**vars(session.module), "v": runner.last.v, "d": session.ctx}
    batch, tokens, _, enc_len, kv_len, ring = runner.last.key
    recorded = session.ctx.record(lambda: eval(call, namespace),  # noqa: S307
                                  batch, tokens, enc_len, kv_len, ring)

    def launch() -> None:
        for fn, args, meta in recorded:
            fn(*args, **meta)
    t = cfg.timer(launch)
    row.update(archc_seconds=t, achieved_flops=row["flops"] / t,
               achieved_bandwidth=row["bytes"] / t, roofline_fraction=row["roofline_seconds"] / t)
    if held:
        restore()
        launch()
    synchronize(cfg.device)
    out = runner.value(i, dims).clone()
    xs = [runner.value(j, dims) for j in g.nodes[i].inputs]
    scratch = scratch_caches(g, i, dims, TORCH_DTYPES[session.dtype], cfg.device)
    row["baselines"] = [_baseline_row(cfg, c, out, t) for c in counterparts(
        g, i, xs, dims, session.cache.store, scratch, held)]
    restore()


def live_kv_bytes(g: Graph, i: int, dims: Mapping[str, int]) -> int:
    """The K and V bytes cached attention node i reads: its layer's cache over the keys its
    mask lets through (P + T, or the window and global tokens of a local layer), as the decode
    floor counts them."""
    n = g.nodes[i]
    q = g.nodes[n.inputs[0]]
    b, _, t, d = (evaluate(x, dims) for x in q.shape)
    keys, window = dims["P"] + t, n.attr("window")
    if window is not None:
        keys = min(keys, window + t - 1 + (n.attr("global_tokens") or 0))
    return 2 * b * n.attr("kv_heads") * keys * d * DTYPE_BYTES[q.dtype]


def _copy_beside(cfg: BenchConfig, row: dict[str, Any], kv_bytes: int) -> None:
    """A device-to-device copy of `kv_bytes` bytes in the model dtype, timed as the kernel of
    `row` was: what reading the attention kernel's K and V could cost at best, at the same
    size (a small copy is further from the ceiling than a large one). Its bandwidth counts the
    bytes read and written, as the ceilings' copy does; `copy_fraction` is the kernel's
    bandwidth over the copy's."""
    dtype = TORCH_DTYPES[cfg.dtype]
    numel = kv_bytes // torch.empty((), dtype=dtype).element_size()
    src = torch.randn(numel, generator=torch.Generator(cfg.device).manual_seed(cfg.seed),
                      device=cfg.device).to(dtype)
    dst = torch.empty_like(src)
    t = cfg.timer(lambda: dst.copy_(src))
    bandwidth = 2 * kv_bytes / t
    row.update(kv_bytes=kv_bytes, copy_seconds=t, copy_bandwidth=bandwidth,
               copy_fraction=row["achieved_bandwidth"] / bandwidth)


def _baseline_row(cfg: BenchConfig, c: Counterpart | Unavailable, out: torch.Tensor,
                  archc_seconds: float) -> dict[str, Any]:
    if isinstance(c, Unavailable):
        return {"name": c.name, "seconds": None, "unavailable": c.reason}
    row: dict[str, Any] = {"name": c.name, "what": c.what, "ops": c.ops}
    try:
        if c.result is not None:    # validation's tolerance: a few roundings of the dtype
            err = _rel_error(c.result(c.run()), out)
            row.update(max_rel_error=err, tolerance=TOLERANCE[cfg.dtype],
                       agrees=err is not None and err <= TOLERANCE[cfg.dtype])
        t = cfg.timer(c.run)
        row.update(seconds=t, archc_speedup=t / archc_seconds)
    except Exception as err:  # noqa: BLE001
        row.update(seconds=None, error=_describe(err))
    return row


# ---- whole model -----------------------------------------------------------------------------

Forward = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass
class _Runner:
    """One way of running the model, `forward(tokens, past)` → logits: a prefill of `prompt`
    (a fresh cache; `reset` starts a sequence where the runner keeps its own), then greedy
    decode steps. A context's prefill runs `fill` when given (the torch runners' eager
    program: the same cache, and no compiled prefill per context length) on tokens moved to
    `device` when given."""

    name: str
    forward: Forward
    prompt: torch.Tensor
    reset: Callable[[], None] = lambda: None
    fill: Forward | None = None
    device: torch.device | None = None
    past: int = 0
    next: torch.Tensor = dataclasses.field(init=False)     # the tokens the next step runs

    def prefill(self) -> torch.Tensor:
        return self.start(self.prompt, self.forward)

    def start_context(self, prompt: torch.Tensor) -> torch.Tensor:
        """A fresh sequence from `prompt` (on the host), prefilled by `fill`."""
        return self.start(prompt if self.device is None else prompt.to(self.device),
                          self.fill or self.forward)

    def start(self, prompt: torch.Tensor, forward: Forward) -> torch.Tensor:
        self.reset()
        self.past, self.next = 0, prompt
        return self.step(forward)

    def step(self, forward: Forward | None = None) -> torch.Tensor:
        logits = (forward or self.forward)(self.next, self.past)
        self.past += self.next.shape[1]
        self.next = logits[:, -1].argmax(-1, keepdim=True)
        return logits


def measure_runner(cfg: BenchConfig, runner: _Runner, reference: torch.Tensor | None,
                   report: Report) -> torch.Tensor | None:
    """Prefill time, then decode tokens/s, of one runner; returns its prefill logits."""
    prefill, decode = report.data["model"]["prefill"], report.data["model"]["decode"]
    prow: dict[str, Any] = {"name": runner.name}
    drow: dict[str, Any] = {"name": runner.name}
    prefill["runs"].append(prow)
    decode["runs"].append(drow)
    logits = None
    with report.section(f"model:{runner.name}:prefill"):
        t0 = time.perf_counter()
        logits = runner.prefill()                 # compiles, autotunes
        synchronize(cfg.device)
        prow["first_call_seconds"] = time.perf_counter() - t0
        if reference is not None:
            prow["max_rel_error_vs_eager"] = _rel_error(logits, reference)
        t = cfg.timer(runner.prefill)
        prow.update(seconds=t, tokens_per_second=cfg.batch * cfg.prompt / t,
                    flops_per_second=prefill["flops"] / t,
                    peak_fraction=prefill["flops"] / t / cfg.gpu.peak_flops,
                    roofline_fraction=prefill["roofline_seconds"] / t)
    if report.data["status"][f"model:{runner.name}:prefill"] != "done":
        report.data["status"][f"model:{runner.name}:decode"] = "skipped (prefill failed)"
        report.save()
        return logits
    with report.section(f"model:{runner.name}:decode"):
        runner.prefill()
        for _ in range(WARMUP_STEPS):             # compiles, captures the CUDA graph
            runner.step()
        runner.prefill()
        step_s = cfg.timer.loop(runner.step, cfg.decode) / cfg.decode
        bandwidth = decode["bytes_per_step"] / step_s
        copy = (report.data.get("ceilings") or {}).get("copy_bandwidth")
        drow.update(step_seconds=step_s, tokens_per_second=cfg.batch / step_s,
                    floor_fraction=decode["floor_seconds"] / step_s, bandwidth=bandwidth,
                    copy_fraction=bandwidth / copy if copy else None)
    return logits


def measure_context(cfg: BenchConfig, runner: _Runner, entry: dict[str, Any],
                    prompt: torch.Tensor, report: Report) -> None:
    """Decode tokens/s of one runner after a prefill of `prompt` (the context of `entry`),
    timed as the main decode run is: warm-up steps, the prefill again, then the steps."""
    row: dict[str, Any] = {"name": runner.name}
    entry["runs"].append(row)
    with report.section(f"model:{runner.name}:decode@{entry['context']}"):
        runner.start_context(prompt)
        for _ in range(WARMUP_STEPS):
            runner.step()
        runner.start_context(prompt)
        if runner.past != entry["past_first"]:
            raise RuntimeError(f"the prefill left past length {runner.past}, not "
                               f"{entry['past_first']}")
        step_s = cfg.timer.loop(runner.step, cfg.decode) / cfg.decode
        row.update(step_seconds=step_s, tokens_per_second=cfg.batch / step_s,
                   floor_fraction=entry["floor_seconds"] / step_s,
                   bandwidth=entry["bytes_per_step"] / step_s)


# ---- goals -----------------------------------------------------------------------------------

# FlashAttention-3's forward speed as its paper publishes it, TFLOP/s by head dim, then sequence
# length (batch × length = 16k tokens, hidden size 2048: 16 heads at head dim 128), counted as
# ``flash_attention_flops`` counts. Source: J. Shah, G. Bikshandi, Y. Zhang, V. Thakkar,
# P. Ramani, T. Dao, "FlashAttention-3: Fast and Accurate Attention with Asynchrony and
# Low-precision", arXiv:2407.08608 (2024), Figure 5, "Attention forward speed, head dim 128
# (H100 80GB SXM5)", FP16/BF16, without causal mask (the FlashAttention-3 bars).
FA3_PUBLISHED: dict[int, dict[int, float]] = {
    128: {512: 467e12, 1024: 565e12, 2048: 625e12, 4096: 638e12, 8192: 646e12,
          16384: 648e12}}
FA3_SOURCE = ("FlashAttention-3 paper (arXiv:2407.08608) Fig. 5: H100 80GB SXM5, FP16/BF16 "
              "forward, head dim 128, without causal mask")
FA3_GPUS = tuple(g.name.split()[0] for g in GPUS.values() if g.target.name == "sm_90a")   # Hopper


def evaluate_goals(cfg: BenchConfig, data: dict[str, Any]) -> list[dict[str, Any]]:
    """The performance targets, on what this run measured. Recorded, never asserted."""
    measured = not cfg.dry_run

    def rows(phase: str, op: str) -> list[dict[str, Any]]:
        return [r for r in data["kernels"] if r["phase"] == phase and r["op"] == op]

    def speedups(kernels: list[dict[str, Any]], name: str) -> list[float]:
        """archc's speed-up over the counterpart `name` of each of `kernels` that has one."""
        return [b["archc_speedup"] for r in kernels for b in r["baselines"]
                if b["name"] == name and b.get("seconds") is not None]

    # the decode goals speak of the contexts when they were run, else of the main decode run
    contexts = data["model"].get("contexts") or []
    decode_runs = ([(f"context {c['context']}", c["runs"]) for c in contexts] if contexts else
                   [(f"prompt {data['model']['decode'].get('past_first')}",
                     data["model"]["decode"]["runs"])])

    def of_runs(prefix: str, key: str) -> list[tuple[str, float]]:
        """(where, value) of `key` of every decode run whose runner's name starts `prefix`."""
        return [(where, r[key]) for where, runs in decode_runs for r in runs
                if r["name"].startswith(prefix) and r.get(key) is not None]

    # 1. prefill attention ≥ 1.2× sdpa at head_dim 128, seq ≥ 2k, bf16
    att = rows("prefill", "attention")
    hd = att[0]["sizes"]["D"] if att else None
    goals = [_goal("prefill_attention_vs_sdpa",
                   "prefill attention ≥ 1.2× scaled_dot_product_attention (head_dim 128, "
                   "seq ≥ 2k, bf16)", speedups(att, "sdpa"), 1.2, "×",
                   hd == 128 and cfg.prompt >= 2048 and cfg.dtype == "bf16" and measured,
                   f"head_dim {hd}, prompt {cfg.prompt}, {cfg.dtype}"),
             _fa3_goal(cfg, data, att, measured)]
    # 2. prefill: every fused matmul ≥ 0.95× torch.matmul on the same GEMM, and its ratio to
    # the unfused sequence; decode: the fused norm+matmul and SwiGLU matmuls
    fused = rows("prefill", "fused_linear")
    for name, target, strict, what in (
            ("torch.matmul", 0.95, False, "≥ 0.95× torch.matmul on the same GEMM"),
            ("unfused", 1.0, True, "faster than the unfused sequence")):
        per = sorted(((r["kernel"], b["archc_speedup"]) for r in fused for b in r["baselines"]
                      if b["name"] == name and b.get("seconds") is not None),
                     key=lambda kv: kv[1])
        goals.append(_goal(f"prefill_matmul_vs_{name.replace('.', '_')}",
                           f"prefill: each fused matmul {what}", [v for _, v in per], target,
                           "×", measured, f"{len(fused)} kernels, slowest first: "
                           + _each(per, fmt_ratio), strict=strict))
    fused = [r for r in rows("decode", "fused_linear")
             if r["prologue"] is not None or "glu" in r["epilogue"]]
    note = f"{len(fused)} kernels; the slowest"
    goals += [_goal("decode_matmul_vs_torch_matmul",
                    "decode: fused norm+matmul and SwiGLU matmuls ≥ 0.95× torch.matmul",
                    speedups(fused, "torch.matmul"), 0.95, "×", measured, note),
              _goal("decode_matmul_vs_unfused", "decode: … and faster than the unfused sequence",
                    speedups(fused, "unfused"), 1.0, "×", measured, note, strict=True)]
    # 3. decode attention ≥ 0.9× a copy of the same KV bytes (each context's kernel, else the
    # kernels section's decode step)
    attention = ([(f"context {c['context']}", r) for c in contexts for r in c["attention"]]
                 if contexts else [(f"past {cfg.decode_past}", r)
                                   for r in rows("decode", "attention")])
    copies = [(where, r["copy_fraction"]) for where, r in attention
              if r.get("copy_fraction") is not None]
    goals.append(_goal("decode_attention_vs_copy", "decode attention ≥ 0.9× a "
                       "device-to-device copy of the same KV bytes", [v for _, v in copies],
                       0.9, "×", measured, _each(copies, fmt_ratio)))
    # 4. batch-1 decode ≥ 80% of the bandwidth bound, and ≥ 1.2× torch.compile
    batch_1 = cfg.batch == 1 and measured
    bound, compiled = of_runs("archc", "floor_fraction"), of_runs("torch.compile",
                                                                   "archc_speedup")
    goals += [_goal("decode_vs_bound", "batch-1 decode ≥ 80% of the bandwidth bound (weights "
                    "+ KV cache read once per token)", [v for _, v in bound], 0.80, "of bound",
                    batch_1, f"{cfg.spec.name}, {cfg.spec.layers} blocks; "
                    + _each(bound, fmt_percent)),
              _goal("decode_vs_torch_compile", "batch-1 decode ≥ 1.2× torch.compile (every "
                    "mode)", [v for _, v in compiled], 1.2, "×", batch_1,
                    _each(compiled, fmt_ratio))]
    return goals


def _each(values: list[tuple[str, float]], fmt: Callable[[float], str]) -> str:
    """`values` as text, each after where it was measured."""
    return ", ".join(f"{where}: {fmt(v)}" for where, v in values) or "not measured"


def _fa3_goal(cfg: BenchConfig, data: dict[str, Any], att: list[dict[str, Any]],
              measured: bool) -> dict[str, Any]:
    """Prefill attention's TFLOP/s (FlashAttention's count) over FlashAttention-3's published
    forward figure at the same head dim and the longest published length not above the
    prompt. Judged only where the comparison holds: a run measured on an H100 or H200, in a
    16-bit dtype, at a head dim and length the figure covers."""
    device = str(data.get("environment", {}).get("device_name", ""))
    hopper = any(name in device.upper() for name in FA3_GPUS)
    found, where = [], []
    for r in att:
        s = r["sizes"]
        figures = FA3_PUBLISHED.get(s["D"], {})
        at = max((n for n in figures if n <= s["T"]), default=None)
        if s["T"] != s["L"] or at is None or r.get("fa_flops_per_second") is None:
            continue
        found.append(r["fa_flops_per_second"] / figures[at])
        where.append(f"{r['kernel']} ({'causal' if r.get('causal') else 'no mask'}, "
                     f"head dim {s['D']}, T {s['T']}): "
                     f"{r['fa_flops_per_second'] / 1e12:.0f} TFLOP/s vs "
                     f"{figures[at] / 1e12:.0f} at length {at}")
    applies = measured and hopper and cfg.dtype in ("bf16", "f16") and bool(found)
    note = (f"{'; '.join(where) or 'no comparable kernel (head dim 128, T ≥ 512, no past)'}; "
            f"{FA3_SOURCE}; a causal kernel is held against the figure without mask (the "
            f"faster case); judged only on an H100/H200 in bf16/f16 ({device}, {cfg.dtype})")
    return _goal("prefill_attention_vs_fa3", "prefill attention ≥ 0.75× FlashAttention-3's "
                 "published forward TFLOP/s (H100, head dim 128)", found, 0.75, "×", applies,
                 note)


def _goal(key: str, goal: str, values: list[float], target: float, unit: str, applies: bool,
          note: str, *, strict: bool = False) -> dict[str, Any]:
    """A goal on the worst of `values` (measured: None when there are none); `key` names it
    for tools that read the report."""
    measured = min(values) if values else None
    met = (None if measured is None or not applies else
           bool(measured > target if strict else measured >= target))
    return {"key": key, "goal": goal, "measured": measured, "target": target, "unit": unit,
            "applies": applies, "met": met, "note": note}


# ---- the run ---------------------------------------------------------------------------------

def environment(cfg: BenchConfig) -> dict[str, Any]:
    env: dict[str, Any] = {**software(), "device": str(cfg.device)}
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
    return Report(cfg, {
        "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": " ".join(sys.argv), "dry_run": cfg.dry_run,
        "spec": cfg.spec.name, "quantize": cfg.quant, "layers": cfg.spec.layers,
        "spec_layers": cfg.layers_of_spec or cfg.spec.layers, "dtype": cfg.dtype,
        "shapes": {"batch": cfg.batch, "prompt": cfg.prompt, "decode": cfg.decode,
                   "contexts": list(cfg.contexts),
                   "kernel_decode_past": cfg.decode_past},
        "environment": environment(cfg),
        "gpu_model": {"name": g.name, "peak_flops": g.peak_flops, "bandwidth": g.bandwidth,
                      "detected": cfg.gpu_detected},
        "timing": {"method": cfg.timer.method, "decode": f"greedy loop of {cfg.decode} steps "
                   f"after {WARMUP_STEPS} warm-up steps, host clock between device syncs",
                   "compile_backend": cfg.compile_backend,
                   "autotune": "every archc session" if cfg.autotune else False},
        "status": {}, "section_seconds": {}, "errors": [], "ceilings": None, "kernels": [],
        "model": {"prefill": {"runs": []}, "decode": {"runs": []}, "contexts": []},
        "autotune": autotune_entry(cfg), "goals": [],
    }, path, log)


def run_bench(cfg: BenchConfig, json_path: Path | None = None,
              log: Callable[[str], None] = lambda line: None) -> Report:
    from archc.passes import optimize
    from archc.runtime.triton_backend import TritonOptions, TritonSession
    report = new_report(cfg, json_path, log)
    data, spec, model = report.data, cfg.spec, report.data["model"]

    def session(**options: Any) -> TritonSession:
        return TritonSession(unfused, checkpoint, max_seq_len=spec.max_seq_len, dtype=cfg.dtype,
                             device=cfg.device,
                             options=TritonOptions(**{"cache_dir": cfg.cache_dir, **options}))

    with report.section("setup"):
        # archc runs the quantized model (--quantize); PyTorch and the bf16 floor, the dense one
        dense = lower(spec, cfg.dtype)
        dense_checkpoint = random_checkpoint(dense, cfg.device, cfg.seed,
                                             evaluated_by=(optimize(dense),))
        unfused, checkpoint = quantized(cfg, dense, dense_checkpoint)
        # every node's buffer kept and no CUDA graphs: kernels are launched one by one, with
        # the block sizes the model runs with (tuned at launch unless autotuning is off)
        probe = session(reuse_buffers=False, cuda_graphs=False, autotune=cfg.autotune)
        data.update(module=str(probe.module_path), unique_kernels=probe.generated.program_units,
                    launches_per_pass={g: len(s)
                                       for g, s in probe.generated.program_steps.items()})
        program = EagerSession(dense, dense_checkpoint, max_seq_len=spec.max_seq_len,
                               device=cfg.device, checks=False)
        tokens = torch.randint(0, spec.vocab_size, (cfg.batch, cfg.prompt),
                               generator=torch.Generator().manual_seed(cfg.seed))
        b, n = cfg.batch, cfg.prompt
        roofs = kernels(probe.program, {"B": b, "T": n, "P": 0, "S": 0})
        model["prefill"].update(tokens=b * n, flops=sum(k.flops for k in roofs),
                                bytes=sum(k.bytes for k in roofs),
                                roofline_seconds=sum(k.time(cfg.gpu) for k in roofs))
        model["decode"].update(decode_steps_floor(cfg, probe.program, n))
        if cfg.quant is not None:     # the floor the quantized bytes buy, beside the dense one
            model["decode"]["dense_floor"] = decode_steps_floor(cfg, optimize(dense), n)
        model["contexts"] = [{"context": c, **decode_steps_floor(cfg, probe.program, c),
                              "runs": [], "attention": []} for c in cfg.contexts]
        # a context's prompt: the same random tokens for every runner, on the host
        prompts = {c: torch.randint(0, spec.vocab_size, (cfg.batch, c), generator=torch
                                    .Generator().manual_seed(cfg.seed + 2)) for c in cfg.contexts}
    if data["status"]["setup"] != "done":
        return report

    with report.section("ceilings"):
        data["ceilings"] = measure_ceilings(cfg)

    phases = (("prefill", 0, cfg.prompt), ("decode", cfg.decode_past, 1))
    for phase, past, t in phases if cfg.kernel_section else ():
        with report.section(f"kernels:{phase}"):
            probe.reset()
            if past:  # fill the cache up to P, then the step whose kernels are timed
                gen = torch.Generator().manual_seed(cfg.seed + 1)
                probe.step(torch.randint(0, spec.vocab_size, (cfg.batch, past), generator=gen))
            probe.step(tokens[:, :t])
            synchronize(cfg.device)
            time_kernels(cfg, probe, phase, {"B": cfg.batch, "T": t, "P": past, "S": 0}, report)
    # decode attention alone at each context's past length (on a GPU its grid covers the whole
    # cache, as in users' CUDA graphs; the kernel reads the live length from the device)
    for entry in model["contexts"] if cfg.kernel_section else ():
        c = entry["context"]
        with report.section(f"kernels:decode@{c}"):
            probe.reset()
            probe.step(prompts[c])
            probe.step(prompts[c][:, -1:])
            synchronize(cfg.device)
            time_kernels(cfg, probe, f"decode@{c}", {"B": cfg.batch, "T": 1, "P": c, "S": 0},
                         report, ops=(Op.ATTENTION.value,), rows=entry["attention"])
    del probe

    # the same checkpoint, as users run it: buffers reused, CUDA graphs for decode; the torch
    # programs take the prompt already on the device
    on_device = tokens.to(cfg.device)

    def archc(name: str) -> _Runner:
        s = session(autotune=cfg.autotune)
        return _Runner(name, lambda tokens, past: s.step(tokens), tokens, s.reset)
    makers: dict[str, Callable[[str], _Runner]] = {
        "torch eager": lambda name: _Runner(name, program.logits, on_device,
                                            device=cfg.device),
        "archc" + (" (CUDA graphs)" if cfg.device.type == "cuda" else ""): archc}
    for mode in cfg.compile_modes:
        makers[f"torch.compile {mode}"] = lambda name, mode=mode: _Runner(
            name, _compiled(cfg, program, mode), on_device, fill=program.logits,
            device=cfg.device)
    reference = None
    for name, make in makers.items():
        runner = None
        with report.section(f"model:{name}:setup"):
            runner = make(name)
        if runner is None:
            continue
        logits = measure_runner(cfg, runner, reference, report)
        if reference is None and logits is not None:
            reference = logits.detach().clone()
        for entry in model["contexts"]:
            measure_context(cfg, runner, entry, prompts[entry["context"]], report)
        del runner
    # last: two more archc sessions, each tuning or reading the tuning cache at the prefill
    if data["autotune"]["applicable"]:
        with report.section("autotune"):
            measure_autotune(cfg, session, tokens, data["autotune"])
    return report


def autotune_entry(cfg: BenchConfig) -> dict[str, Any]:
    """The report's ``autotune`` before it is measured: whether the tuning cache's first-run
    cost applies to this run, and why not."""
    if cfg.dry_run or cfg.device.type != "cuda":
        return {"applicable": False, "reason": "not applicable: a dry run launches the kernels "
                "under Triton's interpreter, which never autotunes"}
    if not cfg.autotune:
        return {"applicable": False, "reason": "not applicable: autotuning is off in this run"}
    return {"applicable": True, "runs": [], "tuning_stats": None}


def measure_autotune(cfg: BenchConfig, make: Callable[..., Any], tokens: torch.Tensor,
                     entry: dict[str, Any]) -> None:
    """The autotune cache's first-run cost, into `entry`: an autotuned archc session built by
    `make` on a fresh, empty kernel cache directory (the tuning cache is kept under it) and its
    first prefill of `tokens`, timed; then a second session on the same directory, which finds
    the choices the first made. Each run records the seconds to build the session, to prefill
    and in all, and the session's ``tuning_stats()`` (seconds spent tuning, kernels tuned, cache
    hits and misses) where the session has that hook."""
    with tempfile.TemporaryDirectory(prefix="archc-bench-tuning-") as tmp:
        for run in ("first (empty tuning cache)", "second (the cache the first left)"):
            row: dict[str, Any] = {"run": run}
            entry["runs"].append(row)
            synchronize(cfg.device)
            t0 = time.perf_counter()
            s = make(cache_dir=Path(tmp), autotune=True)
            t1 = time.perf_counter()
            s.step(tokens)
            synchronize(cfg.device)
            t2 = time.perf_counter()
            stats = getattr(s, "tuning_stats", None)
            row.update(build_seconds=t1 - t0, prefill_seconds=t2 - t1, seconds=t2 - t0,
                       tuning=dict(stats()) if callable(stats) else None)
            del s
    first, second = entry["runs"]
    entry["first_run_extra_seconds"] = first["seconds"] - second["seconds"]
    entry["tuning_stats"] = ("available" if first["tuning"] is not None else
                             "unavailable: this archc's session has no tuning_stats()")


def decode_steps_floor(cfg: BenchConfig, program: Program, past: int) -> dict[str, Any]:
    """The decode floor of `cfg.decode` steps from past length `past` on `program` (the
    layers the run keeps, and the head): weights read once per step, the KV cache as it grows
    (the mean of the first and last step's), at the datasheet bandwidth."""
    b, m = cfg.batch, cfg.decode
    first, last = (decode_floor(program, cfg.gpu, b, p) for p in (past, past + m - 1))
    per_step = (first.bytes + last.bytes) / 2
    return {"steps": m, "past_first": past, "past_last": past + m - 1,
            "weight_bytes": first.weight_bytes, "kv_bytes_mean": (first.kv_bytes + last.kv_bytes)
            / 2, "state_bytes": first.state_bytes, "bytes_per_step": per_step,
            "floor_seconds": per_step / cfg.gpu.bandwidth,
            "floor_tokens_per_second": b * cfg.gpu.bandwidth / per_step}


def _compiled(cfg: BenchConfig, program: EagerSession, mode: str
              ) -> Callable[[torch.Tensor, int], torch.Tensor]:
    import torch._dynamo
    torch._dynamo.reset()
    # the modes are inductor's: a dry run's cheap backend takes none
    return torch.compile(program.logits, backend=cfg.compile_backend,
                         mode=mode if cfg.compile_backend == "inductor" else None)


def default_json_name(cfg: BenchConfig, when: float | None = None) -> str:
    """`<date>_<device>_<spec>[-Ln]_<dtype>.json`, every part from the run."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(when))
    device = environment(cfg)["device_name"] if cfg.device.type == "cuda" else "cpu-dry-run"
    safe = "".join(ch if ch.isalnum() else "-" for ch in device).strip("-").lower()
    layers = f"-L{cfg.spec.layers}" if cfg.layers_of_spec else ""
    return f"{stamp}_{safe}_{cfg.spec.name}{layers}_{cfg.dtype}.json"
