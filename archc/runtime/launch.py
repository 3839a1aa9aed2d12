"""Launch plans: what one run of a graph launches, built once per dims and replayed.

A generated module's ``run_<graph>(v, d)`` calls one launcher per kernel-level node to work out
sizes, block configuration and grid; none of that changes between decode steps, so the launchers
run once per plan key, with a ``LaunchContext`` that records instead of launching. A step copies
its inputs into the ``LaunchPlan``'s buffers, writes P to the device and replays the launches (on
a GPU, one CUDA graph captured from them). Shapes, strides and offsets are compiled once into
plain functions of (B, T, P, S) (``dim_function``): nothing symbolic, and no read of P, runs on
the host per step. The KV cache and the recurrent state that kernels update in place are static
(``StaticStore``).
"""

from __future__ import annotations

import functools
import operator
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from archc.codegen import blocks
from archc.codegen.layout import layouts
from archc.codegen.printer import DimFn, dim_function, uses_past
from archc.dtypes import TORCH_DTYPES
from archc.errors import RunError
from archc.ir.graph import Graph
from archc.ir.ops import OP_TABLE, Op
from archc.memory import zeros
from archc.runtime import tuning
from archc.runtime.buffers import plan_buffers
from archc.runtime.comm import Comm, LocalComm

# (callable, positional arguments, keyword arguments): a kernel launch or a host step
Launch = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]
# B, T, P (0 unless sizes depend on it), S, keys, ring block rows (0 outside a ring step)
PlanKey = tuple[int, int, int, int, int, int]
MAX_PLANS = 8                                # distinct prompt lengths: keep a few


class StaticStore:
    """Static tensors per (layer, kind), [B, ...], that generated kernels read and write in
    place: allocated anew (zeroed) when the batch size changes, and kept otherwise so a
    captured CUDA graph keeps reading the same addresses (`generation` counts the
    allocations)."""

    def __init__(self, what: str, specs: Mapping[tuple[int, str], tuple[tuple[int, ...], str]],
                 device: torch.device) -> None:
        self.what = what          # for errors: "no k cache for layer 3"
        self.specs = specs        # (layer, kind) → shape after B, IR dtype (``Generated.stores``)
        self.device = device
        self.batch = 0
        self.generation = 0
        self.store: dict[tuple[int, str], torch.Tensor] = {}

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """One tensor of the store (`archc bench --host-time` stands in views of one element):
        on the host, rows not yet written hold no memory (`archc.devices.zeros`)."""
        return zeros(shape, dtype, self.device)

    def ensure(self, batch: int) -> None:
        if batch != self.batch:
            self.generation += 1
            self.store = {key: self.zeros((batch, *shape), TORCH_DTYPES[dtype])
                          for key, (shape, dtype) in self.specs.items()}
            self.batch = batch

    def get(self, layer: int, kind: str) -> torch.Tensor:
        try:
            return self.store[(layer, kind)]
        except KeyError:
            raise RunError(f"no {kind} {self.what} for layer {layer}") from None

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.store.values())

    def zero(self) -> None:
        """A sequence starts: kernels at P = 0 read the state as it is, so it must be zeros."""
        for t in self.store.values():
            t.zero_()


# Triton's interpreter patches triton.language module-wide while a kernel runs: the kernels of
# simulated ranks (threads of one process, archc.runtime.comm.run_simulated) take turns. Only a
# kernel holds it, never a collective (ranks meet there).
_INTERPRETER = threading.Lock()


def _one_at_a_time(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (an interpreted kernel launch) run under the interpreter's lock."""
    @functools.wraps(fn)
    def locked(*args: Any, **kw: Any) -> Any:
        with _INTERPRETER:
            return fn(*args, **kw)
    return locked


@dataclass
class LaunchContext:
    """What generated launchers read while a plan is built, as a generated module's docstring
    lists it. ``launch`` records a kernel launch into the plan being built; it launches nothing."""

    target: str
    device: torch.device
    cache: StaticStore
    states: StaticStore
    autotuned: set[str] = field(default_factory=set)
    # on a GPU with tuning on (archc.runtime.tuning.Tuner): tuned launches choose their blocks
    tuner: Any = None
    types: Mapping[str, Mapping[str, str]] = field(default_factory=dict)  # kernel → signature
    B: int = 1
    T: int = 1
    S: int = 0
    kv_len_max: int = 0                 # keys a decode-attention grid must cover
    ring_keys: int = 0                  # in a ring step (context parallel): a K/V block's rows
    decode_max_rows: int = blocks.DECODE_MAX_ROWS   # tests force either attention kernel
    pdl: bool = False                   # programmatic dependent launch (a GPU of sm_90 or later)
    sm: int = 90                        # the GPU's compute capability (tiles differ below sm_90)
    sms: int = blocks.DEFAULT_SMS       # its SM count: decode launches aim for two programs each
    # kernel, grid → the launch: Triton's kernel[grid] (`archc bench --host-time` binds no-ops)
    bind: Callable[[Any, Any], Callable[..., Any]] = operator.getitem
    # a sharded program's groups ("tp", "cp"): this rank's communicators (none: groups of one)
    comms: Mapping[str, Comm] = field(default_factory=dict)
    _scratch: dict[tuple[str, torch.dtype], torch.Tensor] = field(default_factory=dict)
    _launches: list[Launch] | None = None
    _routing: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = field(default_factory=dict)
    _tuning: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # kernel → candidates

    def __post_init__(self) -> None:
        self.past = torch.zeros(1, dtype=torch.int32, device=self.device)   # P, on the device

    def record(self, run: Callable[[], None], B: int, T: int, S: int,  # noqa: N803
               kv_len_max: int, ring_keys: int = 0) -> list[Launch]:
        """The launches `run` (a graph's run function or one launcher) makes at these dims."""
        self.B, self.T, self.S, self.kv_len_max = B, T, S, kv_len_max
        self.ring_keys = ring_keys
        self._launches = []
        try:
            run()
            return self._launches
        finally:
            self._launches = None
            self._routing.clear()
            self._tuning.clear()

    def launch(self, kernel: Any, grid: Any, *args: Any, **meta: Any) -> None:
        """Record `kernel[grid](*args, **meta)`. A grid that is a function of the block sizes is
        evaluated now, unless the kernel is autotuned (its sizes are chosen at the launch): a
        tuned launch's `meta` holds none of them, only the kernel's constexpr sizes."""
        name = getattr(kernel, "__name__", "")
        candidates = self._tuning.get(name)
        if candidates is not None and not meta.keys() & candidates[0].keys():
            # tuned: the kernel's first launch chooses its block sizes
            del self._tuning[name]
            kernel = self.tuner.kernel(kernel, name, candidates, self.types.get(name, {}), args,
                                       meta)
        elif callable(grid):
            grid = grid(meta)
        if self.pdl:  # every kernel waits for the previous one's writes (templates/pdl.j2)
            meta = {**meta, "launch_pdl": True}
        run = self.bind(kernel, grid)
        if self.target == "interpret":
            run = _one_at_a_time(run)
        self.call(run, *args, PDL=self.pdl, **meta)

    def call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> None:
        """Record `fn(*args, **kw)`: a launch, or a host step (device ops) the plan runs in order
        with its launches."""
        if self._launches is None:
            raise RunError("a generated launcher ran outside a launch plan")
        self._launches.append((fn, args, kw))

    def comm(self, group: str) -> Comm:
        """This rank's communicator of `group` ("tp", "cp"): a group of one when the run has
        none."""
        return self.comms.get(group) or LocalComm()

    def rank(self, group: str) -> int:
        """This rank's index in `group`: 0 in a group of one. A vocabulary-parallel
        embedding's launcher reads it to find its part of the table."""
        return self.comm(group).rank

    def collective(self, op: str, out: torch.Tensor, x: torch.Tensor, *, group: str,
                   ranks: int, dim: int = -1) -> None:
        """Record a collective node's host step: `op` ("all_reduce", "all_gather",
        "reduce_scatter", "ring_pass") of x over this rank's communicator of `group`, written
        into out. It runs in order with the launches around it — on a GPU on the same stream,
        so the kernels before it have written x and those after it read out (and a CUDA graph
        captures NCCL's kernels with them)."""
        comm = self.comm(group)
        if comm.size != ranks:
            raise RunError(f"the program is sharded over {ranks} {group} ranks; this run has "
                           f"{comm.size}")
        exchange, attrs = OP_TABLE[Op(op)].eager, {"group": group, "ranks": ranks, "dim": dim}

        def step() -> None:   # the op's own semantics, through this rank's communicator
            out.copy_(exchange(self, {"x": x}, attrs))

        self.call(step)

    def ring(self, ranks: int, local: Sequence[torch.Tensor], dims: Sequence[int],
             fills: Sequence[float], launch: Callable[[list[torch.Tensor], int, int], None],
             ) -> None:
        """Record a ring attention's steps over the "cp" group of `ranks` ranks. `local`: this
        rank's K/V block — its own tokens' rows of k and v (codes and scales of a quantized
        cache), their positions, the keys' padding — each with its tokens along `dims`. Every
        rank's block is filled to `ring_keys` rows (`fills`: position −1, which no query sees)
        so that a send and its receive agree on the shape. Then `ranks` times: begin passing
        the block in hand to rank + 1 (and receiving rank − 1's into the other buffer), record
        `launch(block, first, last)` over the block in hand, wait for the one coming. Two
        buffers alternate, so a pass never overwrites the block a kernel reads."""
        comm = self.comm("cp")
        if comm.size != ranks:
            raise RunError(f"the program's attention is a ring over {ranks} cp ranks; this run "
                           f"has {comm.size}")
        keys = self.ring_keys
        shapes = [tuple(keys if j == dim else n for j, n in enumerate(x.shape))
                  for x, dim in zip(local, dims)]
        buffers = [[torch.full(shape, fill, dtype=x.dtype, device=self.device)
                    for x, shape, fill in zip(local, shapes, fills)] for _ in range(2)]

        def fill_in() -> None:   # this rank's rows, then the filler (received rows linger)
            for x, buf, dim, fill in zip(local, buffers[0], dims, fills):
                n = x.shape[dim]
                buf.narrow(dim, n, keys - n).fill_(fill)
                buf.narrow(dim, 0, n).copy_(x)

        self.call(fill_in)
        coming: list[Callable[[], list[torch.Tensor]]] = []

        def start(block: list[torch.Tensor]) -> None:
            coming.append(comm.ring_pass_start(block))

        def land(into: list[torch.Tensor]) -> None:
            for buf, got in zip(into, coming.pop()()):
                buf.copy_(got)

        for step in range(ranks):
            block, nxt = buffers[step % 2], buffers[(step + 1) % 2]
            if step < ranks - 1:
                self.call(start, block)
            launch(block, int(step == 0), int(step == ranks - 1))
            if step < ranks - 1:
                self.call(land, nxt)

    def scratch(self, name: str, numel: int, dtype: str) -> torch.Tensor:
        """A scratch buffer of at least `numel` elements of IR dtype `dtype`, shared by every
        launch that asks for `name` (launches on one stream run in order). A plan keeps the
        views it was given, so growing the buffer never frees memory a plan still uses."""
        key = (name, TORCH_DTYPES[dtype])
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=key[1], device=self.device)
            self._scratch[key] = buf
        return buf[:numel]

    def counters(self, name: str, numel: int) -> torch.Tensor:
        """At least `numel` int32 counters, zeroed once and shared by every launch that asks for
        `name`. A kernel whose programs count arrivals (the last program of a tile reduces the
        others' partial results) sets each counter it used back to zero before it ends, so the
        next launch — or the next replay of a CUDA graph — finds them zeroed."""
        key = (f"counters:{name}", torch.int32)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.zeros(max(numel, 1), dtype=torch.int32, device=self.device)
            self._scratch[key] = buf
        return buf[:numel]

    def decode_split_count(self, programs: int, max_keys: int) -> int:
        """Splits of a decode-attention grid on this target (``blocks.decode_split_count``)."""
        return blocks.decode_split_count(self.target, programs, max_keys, self.sms)

    def moe_routing(self, gates: torch.Tensor, tokens: int, experts: int, top_k: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The routing of an MoE layer's (token, slot) pairs: tensors of the plan for the table
        of pairs sorted by expert, each expert's run padded to `block_m` with −1, and the expert
        of each block (−1 past the end) — the upper bound cdiv(tokens·k, block_m) + experts
        blocks, so nothing waits on the host — and whether a launch already fills them. Once per
        gates tensor: the first launcher to ask routes (the router whose last program routes,
        or an expert matmul's routing kernel); the others — an MoE layer's up and down
        projections — read the same table."""
        key = (id(gates), top_k, block_m)
        if key in self._routing:
            return (*self._routing[key][1:], True)
        n_blocks = -(-(tokens * top_k) // block_m) + experts
        table = torch.empty(n_blocks * block_m, dtype=torch.int32, device=gates.device)
        block_expert = torch.empty(n_blocks, dtype=torch.int32, device=gates.device)
        self._routing[key] = (gates, table, block_expert)     # gates held: its id stays its own
        return table, block_expert, False

    def configs(self, kernel: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
        """The configs a launch of `kernel` may run with: `cfg`, or for a tuned launch (`cfg`
        empty) every candidate — what its scratch buffers must be sized for."""
        if not cfg and kernel in self._tuning:
            return self._tuning[kernel]
        return [cfg]

    def config(self, kernel: str, family: str, **sizes: int) -> dict[str, Any]:
        """Block sizes for a launch of `kernel` at `sizes`: the heuristic's, or none (`{}`) for a
        launch that is tuned — its `launch` then records a tuned kernel over the candidates."""
        sizes = {"sm": self.sm, "sms": self.sms, **sizes}   # the GPU's, for the heuristics
        if kernel in self.autotuned and self.tuner is not None:
            configs = tuning.candidates(family, sizes, self.target)
            if configs:
                self._tuning[kernel] = configs
                return {}
        return blocks.launch_config(family, self.target, **sizes)  # looked up now: tests patch it


@dataclass(eq=False)
class LaunchPlan:
    """One graph at fixed dims: its buffers, launches and output views."""

    key: PlanKey
    v: list[torch.Tensor | None]                # node → buffer (roots, params, inputs)
    inputs: dict[str, torch.Tensor]             # where each input is copied (or read in place)
    launches: list[Launch]
    outputs: dict[str, torch.Tensor]            # views of the output buffers
    replay: Any = None                          # a CUDA graph captured from the launches

    def launch(self) -> None:
        for fn, args, meta in self.launches:
            fn(*args, **meta)


class GraphRunner:
    """One graph of a generated module: its parameters, buffer plan, compiled sizes and the
    launch plans built so far."""

    def __init__(self, module: ModuleType, graph: Graph, params: Mapping[str, torch.Tensor],
                 device: torch.device, *, run: str | None = None,
                 reuse_buffers: bool = True) -> None:
        self.graph = graph
        self.device = device
        self.lays = layouts(graph)
        self.buffers = plan_buffers(graph, self.lays, reuse=reuse_buffers)
        # the module's run function: the graph's, or a variant's (``generate``'s `variants`)
        self.run_fn = getattr(module, f"run_{run or graph.name}")
        self.params = [params[n.name] if n.op == Op.PARAM else None for n in graph.nodes]
        in_shapes = {i: graph.nodes[i].shape for i in graph.inputs.values()}
        self._input_shapes = {i: dim_function(s, f"input_shape_{i}") for i, s in in_shapes.items()}
        self._layouts: dict[int, DimFn] = {}
        self.by_past = uses_past([e for s in in_shapes.values() for e in s] +
                                 [e for i in graph.outputs.values() for e in self._exprs(i)] +
                                 list(self.buffers.nbytes.values()))
        self.plans: dict[PlanKey, LaunchPlan] = {}
        self.max_plans = MAX_PLANS
        self._generations: tuple[int, int] | None = None
        self.last: LaunchPlan | None = None
        self.last_dims: dict[str, int] = {}

    # ---- plans ---------------------------------------------------------------------------
    def plan(self, d: LaunchContext, B: int, T: int, P: int, S: int,  # noqa: N803
             kv_len_max: int, held: Mapping[str, torch.Tensor] | None = None, *,
             ring: int = 0) -> LaunchPlan:
        """The launch plan at these dims, built on first use. `held` inputs (tensors that stay
        put, such as the cross-KV cache) are read in place rather than copied. `ring`: in a
        ring step, the rows of the K/V blocks its attentions pass round the cp group."""
        # a plan holds the KV cache's and the recurrent state's tensors: rebuilt with either
        generations = (d.cache.generation, d.states.generation)
        if generations != self._generations:
            self.plans.clear()
            self._generations = generations
        key = (B, T, P if self.by_past else 0, S, kv_len_max, ring)
        plan = self.plans.pop(key, None)     # kept last: the least recently used goes first
        if plan is None:
            return self._build(d, key, held or {})
        self.plans[key] = plan
        return plan

    def _build(self, d: LaunchContext, key: PlanKey, held: Mapping[str, torch.Tensor]
               ) -> LaunchPlan:
        B, T, P, S, kv_len_max, ring = key  # noqa: N806
        dims = (B, T, P, S)
        g = self.graph
        v = list(self.params)
        inputs: dict[str, torch.Tensor] = {}
        for name, i in g.inputs.items():
            shape, dtype = self._input_shapes[i](*dims), TORCH_DTYPES[g.nodes[i].dtype]
            x = held.get(name)
            if x is None or tuple(x.shape) != shape or x.dtype != dtype or \
                    x.device != self.device or not x.is_contiguous():
                x = torch.zeros(shape, dtype=dtype, device=self.device)
            inputs[name] = v[i] = x
        for root, t in self.buffers.tensors(dims, self.device).items():
            v[root] = t
        launches = d.record(lambda: self.run_fn(v, d), B, T, S, kv_len_max, ring)
        outputs = {name: self.value(o, dict(zip("BTPS", dims)), v)
                   for name, o in g.outputs.items()}
        plan = LaunchPlan(key, v, inputs, launches, outputs)
        if len(self.plans) >= self.max_plans:
            self.plans.pop(next(iter(self.plans)))
        self.plans[key] = plan
        return plan

    def execute(self, plan: LaunchPlan, d: LaunchContext, P: int, *,  # noqa: N803
                replay: bool = False) -> None:
        """Replay `plan`'s launches (its inputs already fed) at past length P — or, with
        `replay`, the CUDA graph captured from them."""
        d.past.fill_(P)
        if replay:
            plan.replay.replay()
        elif d.target == "interpret":
            # the interpreter computes with numpy, which warns where a GPU silently gives IEEE
            # results the kernels rely on (exp overflowing to inf in a sigmoid is exact 0 or 1)
            with np.errstate(over="ignore", under="ignore"):
                plan.launch()
        else:
            plan.launch()
        self.last = plan
        self.last_dims = dict(zip("BTPS", (*plan.key[:2], P, plan.key[3])))

    def feed(self, plan: LaunchPlan, inputs: Mapping[str, torch.Tensor]) -> None:
        """Copy `inputs` into the plan's buffers, each checked against its shape (an input the
        plan reads in place stays put; one it does not read is ignored)."""
        for name, x in inputs.items():
            buf = plan.inputs.get(name)
            if buf is None or buf is x:
                continue
            if x.shape != buf.shape:
                raise RunError(f"input {name!r} is {list(x.shape)}, graph {self.graph.name} "
                               f"expects {list(buf.shape)}")
            buf.copy_(x)

    # ---- reading values --------------------------------------------------------------------
    def _exprs(self, i: int) -> list[Any]:
        lay = self.lays[i]
        return [*lay.shape, *lay.strides, lay.offset]

    def value(self, i: int, dims: Mapping[str, int], v: list[torch.Tensor | None] | None = None
              ) -> torch.Tensor:
        """Node i's value after the last run (or in buffers `v`), read through its layout."""
        lay = self.lays[i]
        base = (self.last.v if v is None else v)[lay.root]  # type: ignore[union-attr]
        if base is None:
            raise RunError(f"node %{i} has no value")
        fn = self._layouts.get(i)     # shape, strides and offset: compiled on first use
        if fn is None:
            fn = self._layouts[i] = dim_function(self._exprs(i), f"layout_{i}")
        at = fn(*(dims[k] for k in "BTPS"))
        r = lay.rank
        return base.as_strided(at[:r], at[r:2 * r], base.storage_offset() + at[2 * r])
