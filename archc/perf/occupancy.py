"""`archc compile SPEC --target sm_90a --occupancy`: how full each launch keeps a GPU, without one.

Every launch of a prefill (B × N tokens) and of a decode step (B × 1 token after N − 1 cached:
the step that brings the context to N) is taken from the launch plan the runtime builds for the
GPU target, exactly as it replays it: the session of ``archc.perf.host`` (kernels bound to
no-ops, weights and KV cache as zero-stride views), keys covered as on a GPU (decode under CUDA
graphs covers the whole cache and reads the live length on the device). For each launch:

- programs: the grid, evaluated; **with work**: the programs that have something to do. All of
  them (a split-K matmul's splits included: none is empty), except decode attention and the MoE
  expert GEMM, whose grids are sized for the worst case. Decode attention's grid is (batch × KV
  heads, splits) for the whole cache; one split is busy per SPLIT_KEYS live keys, and the keys
  are dealt over the busy splits in units of 16 (``blocks.split_keys``). An expert GEMM
  has one row block per expert that tokens are routed to; routing is assumed balanced — the M·k
  (token, slot) pairs dealt evenly over the E experts — which is exact for one token (its k
  experts are distinct).
- registers, spills, shared memory, tensor-core shapes (wgmma on sm_90a, tcgen05 on sm_100a),
  TMA use and warp specialization: an ahead-of-time compile of the kernel at the launch's own
  block sizes (``archc.codegen.aot``; decode tiles differ from prefill
  ones), each (kernel, configuration) compiled once.
- bytes and FLOPs: the IR node's cost model (``archc.perf.roofline``) at the phase's dims,
  charged to the node's main launch, its widest; another launch of the node (the one-program
  routing an expert GEMM launches when no router routes for it) shows none. Roofline time:
  max(FLOPs / peak, bytes / bandwidth).
- waves: ⌈programs with work / (SMs × programs resident per SM)⌉, residency bounded by the
  compiled kernel's registers, warps (a warp-specialized kernel's partitions included) and
  shared memory (``archc.gpus.SM``).

The generated launchers make kernel launches only; should a plan hold any other entry (a host
step: a function the plan calls between launches), it is listed and counted as one launch, the
least it costs.

Verdicts, per context, for the decode step: every launch that moves at least 4 MiB (weights or
KV cache) has at least two programs with work per SM (decode attention, whose keys are dealt in
units of 16, at least as many as it has units when that is fewer); no kernel spills registers; a
layer makes at most one launch per kernel-level node, plus one routing launch per MoE layer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich import box
from rich.markup import escape

from archc.codegen import blocks
from archc.codegen.aot import OPTIONS, AotResult, config_text
from archc.errors import ArchcError
from archc.gpus import GPU, GPU_TARGETS
from archc.ir.graph import Graph, Program
from archc.ir.ops import Op
from archc.ir.shapes import evaluate
from archc.perf.host import HostSession
from archc.perf.roofline import KernelRoof, kernels, label
from archc.perf.summary import fmt_seconds
from archc.spec.schema import Spec
from archc.ui import si, table
from archc.versions import software, software_text

PHASES = ("prefill", "decode")
DEFAULT_CONTEXTS = (512, 2048, 8192)
STREAMING_BYTES = blocks.STREAMING_BYTES   # a decode launch that moves this much must fill the GPU
PROGRAMS_PER_SM = 2                 # … with this many programs with work per SM
BALANCED = "MoE routing balanced: M·k pairs dealt evenly over E experts (exact for one token)"
HOST_STEP = "a host step counts as one launch"
_LAYER = re.compile(r"(?:layers\.|layer )(\d+)\b")


# ---- launches ---------------------------------------------------------------------------------

@dataclass
class KernelLaunch:
    """One kernel launch of a plan, as the runtime makes it."""

    phase: str
    context: int
    node: int                   # the IR node it implements (in the decoder graph)
    layer: int | None           # its layer, None for the embedding and the head
    label: str                  # what the node works on (its first weight, or its layer)
    kernel: str                 # the kernel's name in the generated module
    unit: str
    family: str
    grid: tuple[int, ...]
    work: int                   # programs with work
    units: int | None           # the most programs its work could be dealt to (work_units)
    config: dict[str, Any]      # block sizes, num_warps, num_stages
    flops: int | None = None    # the node's, on its main launch; None on another
    bytes: int | None = None
    seconds: float | None = None    # roofline time
    aot: AotResult | None = None

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def layer_label(self) -> str:
        """The label with the layer number replaced by `*`: the same launch in every layer."""
        return _LAYER.sub(lambda m: m.group(0).replace(m.group(1), "*"), self.label)


@dataclass
class HostStep:
    """A plan entry that is not a kernel launch: a function the plan calls between launches."""

    phase: str
    context: int
    node: int
    layer: int | None
    label: str
    name: str                   # the function


@dataclass
class PhasePlan:
    """The launches of one phase at one context."""

    phase: str
    context: int
    launches: list[KernelLaunch]
    host_steps: list[HostStep]
    layer_limits: dict[int, int]    # layer → launches it may make (the verdict's bound)

    @property
    def limit_text(self) -> str:
        """`5`, or `3–11` when layers differ."""
        low, high = min(self.layer_limits.values(), default=0), max(
            self.layer_limits.values(), default=0)
        return str(low) if low == high else f"{low}–{high}"

    def per_layer(self) -> dict[int, int]:
        """Layer → its launches, a host step counting one."""
        count: dict[int, int] = {}
        for x in [*self.launches, *self.host_steps]:
            if x.layer is not None:
                count[x.layer] = count.get(x.layer, 0) + 1
        return dict(sorted(count.items()))

    def parts(self, layer: int) -> str:
        """What a layer's count is made of, when host steps add to it: ` (7 kernel launches +
        2 host steps)`."""
        steps = sum(1 for h in self.host_steps if h.layer == layer)
        if not steps:
            return ""
        launched = sum(1 for x in self.launches if x.layer == layer)
        return f" ({launched} kernel launches + {steps} host step{'s' if steps > 1 else ''})"


def dims(phase: str, batch: int, context: int) -> dict[str, int]:
    """B, T, P, S of a phase: a prefill of `context` tokens, or the decode step that brings the
    context to `context` tokens."""
    if phase == "prefill":
        return {"B": batch, "T": context, "P": 0, "S": 0}
    return {"B": batch, "T": 1, "P": context - 1, "S": 0}


def balanced_blocks(pairs: int, experts: int, block_m: int) -> int:
    """Row blocks of an expert GEMM whose `pairs` (token, slot) pairs are dealt evenly over
    `experts` experts: each expert's run is padded to `block_m` rows."""
    low, extra = divmod(pairs, experts)      # `extra` experts get one pair more
    return extra * -(-(low + 1) // block_m) + (experts - extra) * -(-low // block_m)


def programs_with_work(family: str, grid: tuple[int, ...], args: Mapping[str, Any], *,
                       keys: int, tokens: int, experts: int = 0, top_k: int = 0) -> int:
    """Programs of a launch that have work (see the module docstring). `args`: the launch's
    arguments by name (block sizes included); `keys`: the live keys of decode attention, P + T;
    `tokens`: B·T."""
    if family == "attention_decode":    # (batch × KV heads, splits): splits with keys
        splits = grid[1] if len(grid) > 1 else 1
        busy = blocks.decode_work(keys, splits, args.get("SPLIT_KEYS", blocks.DECODE_DEAL))
        return grid[0] * busy * math.prod(grid[2:])
    if family == "moe" and experts:     # (row blocks, column tiles): the routed row blocks
        routed = balanced_blocks(tokens * top_k, experts, args["BLOCK_M"])
        return min(grid[0], routed) * math.prod(grid[1:])
    return math.prod(grid)


def work_units(family: str, grid: tuple[int, ...], keys: int) -> int | None:
    """The most programs a decode-attention launch could give work whatever its grid: it deals
    its keys in units of DECODE_DEAL (tl.dot's 16 rows), so a (batch, KV head) has at most
    ⌈keys / 16⌉ busy splits. None for any other launch: its grid is a choice."""
    if family == "attention_decode":
        return grid[0] * -(-max(keys, 1) // blocks.DECODE_DEAL) * math.prod(grid[2:])
    return None


class _Bound:
    """A kernel bound to its grid, as `kernel[grid]`: launching it does nothing."""

    def __init__(self, kernel: Any, grid: Any) -> None:
        self.kernel, self.grid = kernel, grid

    def __call__(self, *args: Any, **meta: Any) -> None:
        pass


class PlanRecorder(HostSession):
    """The session of ``archc.perf.host`` whose plans keep each launch's kernel, grid and IR
    node."""

    def __init__(self, program: Program, *, max_seq_len: int, dtype: str,
                 cache_dir: Path | None = None) -> None:
        super().__init__(program, max_seq_len=max_seq_len, dtype=dtype, cache_dir=cache_dir)
        self.ctx.bind = _Bound
        self.ctx.call = self._call          # type: ignore[method-assign]
        self._node = -1
        self._owners: list[int] = []

    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        self._owners.append(self._node)     # the node whose launcher is running
        type(self.ctx).call(self.ctx, fn, *args, **kw)

    @contextmanager
    def _tracked(self, graph: Graph) -> Iterator[None]:
        """While a plan of `graph` is built, each launcher of the module notes its node: the
        run function calls one launcher per compute node, in order."""
        nodes = iter(graph.compute_ids())
        originals = {u.name: getattr(self.module, u.name) for u in self.generated.units}

        def tracking(launcher: Callable[..., None]) -> Callable[..., None]:
            def run(*args: Any, **kw: Any) -> None:
                self._node = next(nodes)
                launcher(*args, **kw)
            return run
        for name, launcher in originals.items():
            setattr(self.module, name, tracking(launcher))
        try:
            yield
        finally:
            for name, launcher in originals.items():
                setattr(self.module, name, launcher)

    def entries(self, batch: int, tokens: int, past: int) -> list[tuple[int, Any, tuple, dict]]:
        """(node, callable, args, kwargs) of every plan entry at these dims, as the runtime
        builds the plan for a GPU."""
        self.cache.ensure(batch)
        self.states.ensure(batch)
        runner = self.runners["decoder"]
        runner.plans.clear()                # built afresh: the entries must be seen
        self._owners = []
        with self._tracked(runner.graph):
            plan = runner.plan(self.ctx, batch, tokens, past, 0, self.kv_len(past, tokens))
        return [(node, fn, args, kw) for node, (fn, args, kw) in zip(self._owners, plan.launches)]


def _layer_of(text: str) -> int | None:
    found = _LAYER.search(text)
    return int(found.group(1)) if found else None


def _moe_sizes(g: Graph, i: int) -> tuple[int, int]:
    """(experts, top_k) of an expert GEMM node, (0, 0) for another node."""
    n = g.nodes[i]
    if n.op != Op.MOE_LINEAR:
        return 0, 0
    return int(evaluate(g.nodes[n.inputs[2]].shape[0], {})), int(n.attr("top_k"))


def _layer_limits(g: Graph) -> dict[int, int]:
    """Layer → the most launches it may make: one per kernel-level node, plus one routing launch
    when it has MoE experts."""
    nodes: dict[int, int] = {}
    moe: set[int] = set()
    for i in g.compute_ids():
        layer = _layer_of(label(g, i))
        if layer is not None:
            nodes[layer] = nodes.get(layer, 0) + 1
            if g.nodes[i].op == Op.MOE_LINEAR:
                moe.add(layer)
    return {layer: n + (layer in moe) for layer, n in sorted(nodes.items())}


def phase_plan(recorder: PlanRecorder, phase: str, batch: int, context: int,
               gpu: GPU) -> PhasePlan:
    """Every launch of `phase` at `context` (see the module docstring), without AOT results."""
    d = dims(phase, batch, context)
    g = recorder.runners["decoder"].graph
    roofs: dict[int, KernelRoof] = {k.index: k for k in kernels(recorder.program, d)
                                    if k.graph == g.name}
    launches: list[KernelLaunch] = []
    steps: list[HostStep] = []
    entries = recorder.entries(d["B"], d["T"], d["P"])
    table = recorder.module.KERNELS
    main = _main_launches(entries)
    for at, (node, fn, args, kw) in enumerate(entries):
        text = label(g, node)
        if not isinstance(fn, _Bound):
            steps.append(HostStep(phase, context, node, _layer_of(text), text,
                                  getattr(fn, "__name__", repr(fn))))
            continue
        name = fn.kernel.fn.__name__
        entry = table[name]
        named = {**dict(zip(fn.kernel.arg_names, args)), **kw}
        grid = _grid(fn.grid)
        experts, top_k = _moe_sizes(g, node)
        work = programs_with_work(entry["family"], grid, named, keys=d["P"] + d["T"],
                                  tokens=d["B"] * d["T"], experts=experts, top_k=top_k)
        config = {k: v for k, v in kw.items() if k in OPTIONS or k in fn.kernel.arg_names}
        x = KernelLaunch(phase, context, node, _layer_of(text), text, name, entry["unit"],
                         entry["family"], grid, work,
                         work_units(entry["family"], grid, d["P"] + d["T"]), config)
        if at in main:
            roof = roofs[node]
            x.flops, x.bytes, x.seconds = roof.flops, roof.bytes, roof.time(gpu)
        launches.append(x)
    return PhasePlan(phase, context, launches, steps, _layer_limits(g))


def _main_launches(entries: list[tuple[int, Any, tuple, dict]]) -> set[int]:
    """Positions of each node's main launch, which its bytes and FLOPs are charged to: the one
    with the most programs — a node's main work is spread widest (the routing an expert GEMM
    may launch first is one program) — and of equals the last (what comes first prepares)."""
    by_node: dict[int, tuple[int, int]] = {}
    for at, (node, fn, _, _) in enumerate(entries):
        if isinstance(fn, _Bound):
            by_node[node] = max(by_node.get(node, (0, -1)), (math.prod(_grid(fn.grid)), at))
    return {at for _, at in by_node.values()}


def _grid(grid: Any) -> tuple[int, ...]:
    """A launch's grid, evaluated (launchers evaluate grid functions as they record)."""
    return tuple(int(x) for x in (grid if isinstance(grid, tuple | list) else (grid,)))


# ---- the report -------------------------------------------------------------------------------

@dataclass
class Verdict:
    what: str
    ok: bool
    offending: list[str]


@dataclass
class Occupancy:
    spec: str
    dtype: str
    target: str
    gpu: GPU
    batch: int
    contexts: list[int]
    plans: list[PhasePlan]
    module: Path
    results: list[AotResult]            # one per distinct (kernel, configuration)
    # the versions that compiled the kernels (the workers run this interpreter): registers and
    # spills, and so the verdicts, change with Triton's
    software: dict[str, str | None] = field(default_factory=software)

    @property
    def failed(self) -> list[AotResult]:
        return [r for r in self.results if not r.ok]

    @property
    def assumed(self) -> list[str]:
        """The assumptions the numbers rest on, of those that apply: balanced routing where
        there are expert GEMMs, the count of host steps where there are any."""
        launches = [x for p in self.plans for x in p.launches]
        return ([BALANCED] if any(x.family == "moe" for x in launches) else []) + \
            ([HOST_STEP] if any(p.host_steps for p in self.plans) else [])

    def resident(self, x: KernelLaunch) -> int | None:
        """Programs of `x` resident per SM, None without a compile result."""
        r = x.aot
        if r is None or not r.ok:
            return None
        # the compiled warps where known: warp specialization adds partitions' warps
        warps = r.warps or int(x.config.get("num_warps", 4))
        return GPU_TARGETS[self.target].sm.resident(r.registers, warps, r.shared_bytes)

    def waves(self, x: KernelLaunch) -> int | None:
        fit = self.resident(x)
        if not fit:
            return None
        return -(-x.work // (self.gpu.sms * fit))

    def verdicts(self, context: int) -> list[Verdict]:
        """The decode step's verdicts at `context` (see the module docstring)."""
        plan = next(p for p in self.plans if p.phase == "decode" and p.context == context)
        want = PROGRAMS_PER_SM * self.gpu.sms
        thin = _collapse(x for x in plan.launches
                         if x.bytes is not None and x.bytes >= STREAMING_BYTES and
                         x.work < min(want, x.units or want))
        spilled: dict[int, tuple[AotResult, set[str]]] = {}    # by id: one per compile
        for p in self.plans:
            for x in p.launches:
                if p.context == context and x.aot is not None and x.aot.spill_bytes:
                    spilled.setdefault(id(x.aot), (x.aot, set()))[1].add(p.phase)
        over = {layer: n for layer, n in plan.per_layer().items()
                if n > plan.layer_limits.get(layer, 0)}
        by_count: dict[int, list[int]] = {}
        for layer, n in over.items():
            by_count.setdefault(n, []).append(layer)
        return [
            Verdict(f"decode launches moving ≥ {STREAMING_BYTES >> 20} MiB have ≥ {want} "
                    f"programs with work ({PROGRAMS_PER_SM} per SM, or one per "
                    f"{blocks.DECODE_DEAL} keys)", not thin,
                    [f"{name}: " + (f"{x.work} of {x.programs} programs with work"
                                    if x.work != x.programs else f"{x.programs} programs")
                     for name, x in thin]),
            Verdict("no kernel spills registers (prefill and decode)", not spilled,
                    [f"{r.kernel.removesuffix('_kernel')} in {' and '.join(sorted(phases))} "
                     f"({r.config}): {r.spill_bytes} bytes" for r, phases in spilled.values()]),
            Verdict(f"decode launches per layer ≤ {plan.limit_text} (one per kernel-level "
                    "node, plus one routing launch in an MoE layer)", not over,
                    [f"{n} in {_span(layers)}{plan.parts(layers[0])}"
                     for n, layers in by_count.items()]),
        ]


def _span(layers: list[int]) -> str:
    """`layer 3`, `layers 0–31` (a run) or `5 layers (0, 2, 4, 6, 8)`."""
    if len(layers) == 1:
        return f"layer {layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"layers {layers[0]}–{layers[-1]}"
    return f"{len(layers)} layers ({', '.join(map(str, layers))})"


def _collapse(launches: Iterable[KernelLaunch]) -> list[tuple[str, KernelLaunch]]:
    """One (name, launch) per kernel and label across layers: `fused_linear_1 (attn.o ×32)`."""
    groups: dict[tuple[str, str, int, int], list[KernelLaunch]] = {}
    for x in launches:
        groups.setdefault((x.kernel, x.layer_label, x.work, x.programs), []).append(x)
    out = []
    for (kernel, lab, _, _), xs in groups.items():
        times = f" ×{len(xs)}" if len(xs) > 1 else ""
        out.append((f"{kernel.removesuffix('_kernel')} ({_short(lab)}{times})", xs[0]))
    return out


def check_occupancy(spec: Spec, contexts: list[int]) -> None:
    """Refuse what the report cannot show, naming the problem."""
    if spec.family != "decoder":
        raise ArchcError(f"the occupancy report covers decoder-only models' prefill and decode; "
                         f"{spec.name} is an {spec.family}")
    too_long = [c for c in contexts if c > spec.max_seq_len]
    if too_long:
        raise ArchcError(f"--context {too_long[0]} exceeds {spec.name}'s max_seq_len = "
                         f"{spec.max_seq_len}")


def record(program: Program, spec: Spec, *, dtype: str, batch: int, contexts: list[int],
           gpu: GPU, cache_dir: Path | None = None) -> tuple[PlanRecorder, list[PhasePlan]]:
    """The launch plans of prefill and decode at every context (no compile yet)."""
    check_occupancy(spec, contexts)
    recorder = PlanRecorder(program, max_seq_len=spec.max_seq_len, dtype=dtype,
                            cache_dir=cache_dir)
    # the launch heuristics see the modelled GPU, as the runtime's see its device
    recorder.ctx.sm, recorder.ctx.sms = gpu.target.capability, gpu.sms
    plans = [phase_plan(recorder, phase, batch, c, gpu) for c in contexts for phase in PHASES]
    return recorder, plans


def compile_jobs(plans: list[PhasePlan]) -> list[tuple[str, dict[str, Any]]]:
    """The distinct (kernel, configuration) pairs the launches use, in order of first use."""
    seen: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
    for p in plans:
        for x in p.launches:
            seen.setdefault((x.kernel, config_text(x.config)), (x.kernel, x.config))
    return list(seen.values())


def attach(plans: list[PhasePlan], results: list[AotResult]) -> None:
    """Give each launch the compile result of its (kernel, configuration)."""
    by_key = {(r.kernel, r.config): r for r in results}
    for p in plans:
        for x in p.launches:
            x.aot = by_key.get((x.kernel, config_text(x.config)))


# ---- tables -----------------------------------------------------------------------------------

def _rows(rep: Occupancy, plan: PhasePlan) -> list[tuple[str, ...]]:
    """One row per launch that is the same in every layer it occurs in (`×32`), host steps
    included, in plan order."""
    groups: dict[tuple[Any, ...], list[KernelLaunch | HostStep]] = {}
    for item in sorted([*plan.launches, *plan.host_steps], key=_order(plan)):
        if isinstance(item, KernelLaunch):
            key: tuple[Any, ...] = (item.kernel, item.layer_label, item.grid, item.work,
                                    config_text(item.config), item.bytes)
            lab = item.layer_label
        else:
            key = (item.name, _LAYER.sub("*", item.label))
            lab = _LAYER.sub(lambda m: m.group(0).replace(m.group(1), "*"), item.label)
        groups.setdefault((*key, lab), []).append(item)
    rows = []
    for key, items in groups.items():
        x, lab, times = items[0], _short(key[-1]), str(len(items))
        if isinstance(x, HostStep):
            rows.append((f"{x.name} (host)", escape(lab), times, *[""] * 8))
            continue
        r = x.aot
        compiled = r is not None and r.ok
        waves = rep.waves(x)
        spill = ("/[red]" + str(r.spill_bytes) + "[/]" if r.spill_bytes else "/0") \
            if compiled else ""
        rows.append((
            x.kernel.removesuffix("_kernel"), escape(lab), times,
            f"{x.work}/{x.programs}" if x.work != x.programs else str(x.programs),
            "—" if waves is None else str(waves),
            f"{r.registers}{spill}" if compiled else "—",
            _size(r.shared_bytes) if compiled else "—",
            " ".join(r.mma) if compiled and r.mma else "—",
            ("yes" if r.tma else "no") if compiled else "—",
            "—" if x.bytes is None else _size(x.bytes),
            _micros(x.seconds)))
    return rows


def _micros(seconds: float | None) -> str:
    """Microseconds: one decimal, or two significant figures below 1 µs."""
    if seconds is None:
        return "—"
    us = seconds * 1e6
    return f"{us:.1f}" if us >= 1 else f"{us:.2g}"


def _short(text: str) -> str:
    """A label without what the `×` column says and the norm a prologue applies: `attn.q+k+v`
    for `layers.*.attn.q+k+v.weight*attn_norm`."""
    return re.sub(r"^layers\.\*\.|\.weight\b|\*\w.*$", "", text)


def _size(n: int) -> str:
    """Bytes in three figures: `264 B`, `16.5 KiB`, `112 MiB`."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    v, i = float(n), 0
    while v >= 1024 and i < len(units) - 1:
        v, i = v / 1024, i + 1
    return f"{n} B" if i == 0 else f"{v:.3g} {units[i]}" if v < 1000 else f"{v:.0f} {units[i]}"


def _order(plan: PhasePlan) -> Callable[[KernelLaunch | HostStep], tuple[int, int]]:
    """Plan order: by node, a node's host steps before its launches (they fill what the
    launches read)."""
    return lambda item: (item.node, isinstance(item, KernelLaunch))


def _layers(plan: PhasePlan) -> str:
    """`6 in each of 32 layers` or `5–6 per layer (32 layers)`."""
    counts = plan.per_layer()
    if not counts:
        return "no layers"
    low, high = min(counts.values()), max(counts.values())
    each = str(low) if low == high else f"{low}–{high}"
    return f"{each} per layer ({len(counts)} layers)"


def mma_op(target: str) -> str:
    """The name of the target's tensor-core instruction family: `wgmma`, `tcgen05`, `mma`."""
    return GPU_TARGETS[target].mma


def _specialized(rep: Occupancy) -> str:
    """`warp-specialized: none` or the kernels (and configurations) Triton split into
    partitions."""
    names = sorted({f"{r.kernel.removesuffix('_kernel')} ({r.config})" for r in rep.results
                    if r.ok and r.warp_specialized})
    return "warp-specialized (loop split into producer and consumer warps): " + (
        "; ".join(names) if names else "none")


def format_report(rep: Occupancy) -> list[Any]:
    """Tables (one per phase and context) and lines: the report of ``--occupancy``."""
    g = rep.gpu
    op = mma_op(rep.target)
    out: list[Any] = [
        f"[bold]{escape(rep.spec)}[/] ({rep.dtype}, batch {rep.batch}) on {rep.target}: "
        f"{g.name}, {g.sms} SMs, {si(g.bandwidth, 'B/s')}, {si(g.peak_flops, 'FLOP/s')}",
        software_text(rep.software)]
    for plan in rep.plans:
        what = (f"prefill of {plan.context} tokens" if plan.phase == "prefill" else
                f"decode step at context {plan.context} (1 token after {plan.context - 1})")
        seconds = sum(x.seconds or 0.0 for x in plan.launches)
        # the heading on its own line: a table's title wraps at the table's width
        out.append(f"{what}: {len(plan.launches)} kernel launches"
                   + (f" + {len(plan.host_steps)} host steps" if plan.host_steps else "")
                   + f", {_layers(plan)}; roofline {fmt_seconds(seconds)}")
        t = table(
            "",
            ("kernel", "works on", "×", "programs", "waves", "regs/spill", "smem", op,
             "TMA", "bytes", "roofline"),
            _rows(rep, plan), text=("kernel", "works on", op, "TMA"))
        # narrow, to fit 120 columns: what the launch works on wraps, MMA shapes one a line
        t.box, t.padding, t.show_edge = box.SIMPLE_HEAD, (0, 1), False
        t.collapse_padding, t.pad_edge = True, False
        for col in t.columns:
            col.no_wrap = col.header not in ("works on", op)
            col.max_width = 11 if col.header == op else None
        out.append(t)
    out += [
        "×: launches alike in every layer (and grid); programs: with work/in the grid (all "
        f"have work unless shown); waves: ⌈programs with work / ({g.sms} SMs × programs "
        "resident per SM)⌉, residency from registers, warps and shared memory",
        f"regs/spill (bytes), smem, {op} (shapes), TMA: an ahead-of-time compile of each kernel "
        "at the block sizes of its launch; bytes: the IR node's cost model, on its widest launch "
        f"(— on another); roofline: max(FLOPs / peak, bytes / bandwidth) on the {g.name}, in µs",
        _specialized(rep)]
    if rep.assumed:
        out.append(f"assumed: {'; '.join(rep.assumed)}")
    for c in rep.contexts:
        for v in rep.verdicts(c):
            mark = "[green]pass[/]" if v.ok else "[red]FAIL[/]"
            tail = f": {escape('; '.join(v.offending))}" if v.offending else ""
            out.append(f"context {c}: {mark} {escape(v.what)}{tail}")
    compiled = len(rep.results) - len(rep.failed)
    cached = sum(r.cached for r in rep.results)
    out.append(f"{compiled}/{len(rep.results)} kernel configurations compile for {rep.target}"
               + (f" ({cached} from the cache)" if cached else ""))
    out += [f"[red]{escape(f'{r.kernel} ({r.config}): {r.error}')}[/]" for r in rep.failed]
    return out


# ---- JSON -------------------------------------------------------------------------------------

def to_json(rep: Occupancy) -> dict[str, Any]:
    """The report as JSON: per phase and context, every launch and host step, and the verdicts."""
    def launch(x: KernelLaunch) -> dict[str, Any]:
        r = x.aot
        compiled = r is not None and r.ok
        return {
            "kernel": x.kernel, "unit": x.unit, "family": x.family, "phase": x.phase,
            "context": x.context,
            "node": x.node, "layer": x.layer, "label": x.label, "grid": list(x.grid),
            "programs": x.programs, "programs_with_work": x.work,
            "waves": rep.waves(x), "resident_per_sm": rep.resident(x),
            "bytes": x.bytes, "flops": x.flops, "roofline_seconds": x.seconds,
            "config": x.config,
            "registers": r.registers if compiled else None,
            "spill_bytes": r.spill_bytes if compiled else None,
            "shared_bytes": r.shared_bytes if compiled else None,
            "wgmma": r.wgmma if compiled else None,
            "mma": r.mma if compiled else None,
            "tma": r.tma if compiled else None,
            "pdl": r.pdl if compiled else None,
            "warp_specialized": r.warp_specialized if compiled else None,
            "warps": (r.warps or None) if compiled else None,
            "compile_error": r.error if r is not None and not r.ok else None,
        }
    return {
        "spec": rep.spec, "dtype": rep.dtype, "target": rep.target, "mma_op": mma_op(rep.target),
        "batch": rep.batch,
        "gpu": {"name": rep.gpu.name, "sms": rep.gpu.sms, "bandwidth": rep.gpu.bandwidth,
                "peak_flops": rep.gpu.peak_flops},
        "module": str(rep.module), "software": rep.software,
        "assumptions": [*rep.assumed,
                        "decode at context N: one token after N - 1 cached; prefill: N tokens",
                        "bytes and FLOPs: the IR node's cost model, on the node's widest launch",
                        "waves: ceil(programs with work / (SMs x programs resident per SM))"],
        "phases": [{
            "phase": p.phase, "context": p.context,
            "launches": [launch(x) for x in p.launches],
            "host_steps": [{"name": h.name, "node": h.node, "layer": h.layer, "label": h.label}
                           for h in p.host_steps],
            "launches_per_layer": {str(k): v for k, v in p.per_layer().items()},
            "layer_limits": {str(k): v for k, v in p.layer_limits.items()},
        } for p in rep.plans],
        "verdicts": {str(c): [{"what": v.what, "pass": v.ok, "offending": v.offending}
                              for v in rep.verdicts(c)] for c in rep.contexts},
        "compile_failures": [{"kernel": r.kernel, "config": r.config, "error": r.error}
                             for r in rep.failed],
    }
