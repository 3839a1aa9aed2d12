"""The triton backend: run a kernel-level program on its generated kernels.

    compiled = archc.load("tiny-llama3").compile("triton")     # same API as eager

``TritonSession`` is the backend's ``Session``: the default pass pipeline turns the unfused
program into kernel-level graphs, codegen renders them into one module (cached on disk by a hash
of graph + options), and each call runs ``run_<graph>(v, d)`` of that module:

- weights: parameter expressions evaluated once, in the model dtype, on the device;
- activations: buffers planned by liveness (``archc.runtime.buffers``), reused across calls;
- KV cache: static, [B, H_kv, max_seq_len, D] per layer and k|v, KV heads only, written by the
  QKV projection's epilogue at offset P; P lives on the device too, so a decode step is the same
  launches every time — on a GPU it is captured once in a CUDA graph and replayed;
- recurrent state (Mamba's conv window and SSM state, linear attention's running sums): one
  tensor per layer and kind, as the op table declares it, updated in place by its kernel and
  zeroed when a sequence starts (P = 0).

Without a GPU, archc sets ``TRITON_INTERPRET=1`` before Triton is imported and the same kernels
run under Triton's CPU interpreter (f32 or f16: the interpreter computes bf16 wrongly).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from archc.errors import ArchcError, RunError
from archc.ir.graph import CROSS_KV, Graph, Program
from archc.ir.ops import Op
from archc.ir.shapes import concrete
from archc.ir.text import format_node
from archc.kernel_cache import default_cache_dir
from archc.runtime.cross_kv import CrossKV
from archc.runtime.state import StaticState, StaticStore
from archc.runtime.weights import TORCH_DTYPES, materialize


def prepare_triton(device: torch.device) -> str:
    """Make Triton importable for `device`; returns the codegen target ("gpu" | "interpret").

    On a CPU, Triton's interpreter must be chosen before any kernel is defined:
    TRITON_INTERPRET=1 is set here, ahead of the first import of triton by archc."""
    if device.type == "cuda":
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            raise ArchcError("TRITON_INTERPRET is set but a CUDA device was asked for: unset it "
                             "to run the compiled kernels")
        return "gpu"
    if device.type != "cpu":
        raise ArchcError(f"the triton backend runs on cuda or (interpreted) cpu, not "
                         f"{device.type}")
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton" in sys.modules:
        _interpret_loaded_triton()
    return "interpret"


def _interpret_loaded_triton() -> None:
    """Something imported Triton before archc chose its interpreter (Hugging Face code does):
    the standard library's @triton.jit functions (tl.sum, tl.max, tl.cdiv…) were then built for
    the compiler and cannot be called from interpreted kernels. Rebuild them for the interpreter,
    in place — on a machine without a GPU nothing can run them compiled anyway."""
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    knobs.runtime.interpret = True
    converted: dict[int, InterpretedFunction] = {}

    def interpreted(fn: JITFunction) -> InterpretedFunction:
        if id(fn) not in converted:
            converted[id(fn)] = InterpretedFunction(
                fn.fn, version=getattr(fn, "version", None),
                do_not_specialize=fn.do_not_specialize, debug=fn.debug, noinline=fn.noinline)
        return converted[id(fn)]

    import triton.language as tl
    spaces: list[Any] = [m for name, m in list(sys.modules.items())
                         if m is not None and name.startswith("triton.language")]
    spaces.append(tl.tensor)
    for space in spaces:
        for name, value in list(vars(space).items()):
            if isinstance(value, JITFunction):
                setattr(space, name, interpreted(value))


def check_dtype(dtype: str, target: str) -> None:
    if dtype == "bf16" and target == "interpret":
        raise ArchcError("bf16 on the CPU: Triton's interpreter computes bfloat16 wrongly, so the "
                         "triton backend runs f32 or f16 there (use --dtype f32 or f16, or a GPU)")


# ---- the KV cache and the launch context ---------------------------------------------------

class StaticKVCache(StaticStore):
    """[B, H_kv, max_len, D] per (layer, k|v)."""

    what = "cache"

    def __init__(self, specs: list[tuple[int, int, int]], max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__(device)
        self.specs = specs
        self.max_len = max_len
        self.dtype = dtype

    def allocate(self, batch: int) -> dict[tuple[int, str], torch.Tensor]:
        return {(layer, kind): torch.zeros(batch, kv_heads, self.max_len, hd, dtype=self.dtype,
                                           device=self.device)
                for layer, kv_heads, hd in self.specs for kind in ("k", "v")}


@dataclass
class LaunchContext:
    """What the generated launchers read: dims, the past length on the device, the KV cache,
    scratch buffers and block sizes."""

    target: str
    device: torch.device
    cache: StaticKVCache | None
    autotuned: set[str] = field(default_factory=set)
    states: StaticState | None = None
    B: int = 1
    T: int = 1
    P: int = 0
    S: int = 0
    kv_len_max: int = 0                 # keys a decode-attention grid must cover
    decode_max_rows: int = 128          # blocks.DECODE_MAX_ROWS; tests force either kernel
    past: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int32))
    _scratch: dict[tuple[str, torch.dtype], torch.Tensor] = field(default_factory=dict)

    def set_dims(self, B: int, T: int, P: int, S: int, kv_len_max: int) -> None:  # noqa: N803
        self.B, self.T, self.P, self.S = B, T, P, S
        self.kv_len_max = kv_len_max
        self.past.fill_(P)

    def kv(self, layer: int, kind: str) -> torch.Tensor:
        if self.cache is None:
            raise RunError("this graph uses a KV cache but none was given")
        return self.cache.get(layer, kind)

    def state(self, layer: int, kind: str) -> torch.Tensor:
        if self.states is None:
            raise RunError("this graph keeps a recurrent state but none was given")
        return self.states.get(layer, kind)

    def scratch(self, name: str, numel: int, dtype: str) -> torch.Tensor:
        """A scratch buffer of at least `numel` elements of IR dtype `dtype`, reused by every
        launch that asks for `name` (launches on one stream run in order)."""
        key = (name, TORCH_DTYPES[dtype])
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(max(numel, 1), dtype=key[1], device=self.device)
            self._scratch[key] = buf
        return buf[:numel]


    def decode_splits(self, keys: int, programs: int, block_n: int) -> tuple[int, int]:
        from archc.codegen.blocks import decode_splits
        return decode_splits(self.target, keys, programs, block_n)

    def moe_routing(self, gates: torch.Tensor, top_k: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token, slot) pairs sorted by expert, each expert's run padded to `block_m` with −1,
        and the expert of each block (−1 past the end). Device ops only: the block count is the
        upper bound cdiv(pairs, block_m) + E, so nothing waits on the host."""
        return moe_routing(gates, top_k, block_m)

    def config(self, kernel: str, family: str, **sizes: int) -> dict[str, Any]:
        if kernel in self.autotuned:
            return {}
        from archc.codegen.blocks import launch_config
        return launch_config(family, self.target, **sizes)


def moe_routing(gates: torch.Tensor, top_k: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    from archc.ir.ops.fused import selected_experts
    n_experts = gates.shape[-1]
    chosen = selected_experts(gates.reshape(-1, n_experts), top_k)   # (M, k), ascending experts
    experts = chosen.reshape(-1)                                    # pair p = token·k + slot
    pairs = experts.numel()
    order = torch.argsort(experts, stable=True)
    counts = torch.zeros(n_experts, dtype=torch.long, device=gates.device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded = (counts + block_m - 1) // block_m * block_m
    start = torch.cumsum(padded, 0) - padded                        # each expert's first slot
    first = torch.cumsum(counts, 0) - counts                        # its first sorted pair
    sorted_experts = experts[order]
    dest = start[sorted_experts] + torch.arange(pairs, device=gates.device) - first[sorted_experts]
    blocks = -(-pairs // block_m) + n_experts
    table = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=gates.device)
    table[dest] = order.to(torch.int32)
    ends = torch.cumsum(padded, 0)
    block_start = torch.arange(blocks, device=gates.device) * block_m
    owner = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(owner < n_experts, owner, -1).to(torch.int32)
    return table, block_expert


# ---- running one graph ---------------------------------------------------------------------

class GraphRunner:
    """One graph of a generated module: its parameters, buffer plan and run function."""

    def __init__(self, module: ModuleType, graph: Graph, params: Mapping[str, torch.Tensor],
                 device: torch.device, *, reuse_buffers: bool = True) -> None:
        from archc.codegen.layout import layouts
        from archc.runtime.buffers import plan_buffers
        self.graph = graph
        self.device = device
        self.lays = layouts(graph)
        self.plan = plan_buffers(graph, self.lays, reuse=reuse_buffers)
        self.run_fn = getattr(module, f"run_{graph.name}")
        self.v: list[torch.Tensor | None] = [None] * len(graph.nodes)
        for name, i in graph.params.items():
            self.v[i] = params[name]
        self.inputs = graph.inputs
        self.last_v: list[torch.Tensor | None] = []
        self.last_dims: dict[str, int] = {}

    def run(self, inputs: Mapping[str, torch.Tensor], d: LaunchContext) -> dict[str, torch.Tensor]:
        g = self.graph
        dims = {"B": d.B, "T": d.T, "P": d.P, "S": d.S}
        v = list(self.v)
        for name, i in self.inputs.items():
            if name not in inputs:
                raise RunError(f"graph {g.name} needs input {name!r}")
            x = inputs[name]
            n = g.nodes[i]
            want = concrete(n.shape, dims)
            if tuple(x.shape) != want:
                raise RunError(f"input {name!r} is {list(x.shape)}, graph {g.name} expects "
                               f"{list(want)}")
            v[i] = x.to(self.device, TORCH_DTYPES[n.dtype]).contiguous()
        for root, t in self.plan.tensors(g, dims, self.device).items():
            v[root] = t
        if d.target == "interpret":
            # the interpreter computes with numpy, which warns where a GPU silently gives IEEE
            # results the kernels rely on (exp overflowing to inf in a sigmoid is exact 0 or 1)
            import numpy as np
            with np.errstate(over="ignore", under="ignore"):
                self.run_fn(v, d)
        else:
            self.run_fn(v, d)
        self.last_v = v
        self.last_dims = dims
        return {name: self.value(o, dims).clone() for name, o in g.outputs.items()}

    def value(self, i: int, dims: Mapping[str, int],
              v: list[torch.Tensor | None] | None = None) -> torch.Tensor:
        """Node i's value after the last run (or in buffers `v`), read through its layout."""
        from archc.ir.shapes import evaluate
        lay = self.lays[i]
        base = (self.last_v if v is None else v)[lay.root]
        if base is None:
            raise RunError(f"node %{i} has no value")
        shape = [evaluate(s, dims) for s in lay.shape]
        strides = [evaluate(s, dims) for s in lay.strides]
        return base.as_strided(shape, strides, base.storage_offset() + evaluate(lay.offset, dims))


# ---- the session ---------------------------------------------------------------------------

@dataclass
class TritonOptions:
    passes: str | None = "default"      # pass pipeline to reach kernel level (None: as given)
    cache_dir: Path | None = None
    autotune: bool = False
    cuda_graphs: bool = True
    reuse_buffers: bool = True

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> TritonOptions:
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ArchcError(f"unknown triton backend option {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(known))})")
        out = cls(**options)
        if out.cache_dir is not None:
            out.cache_dir = Path(out.cache_dir)
        return out


def kernel_program(program: Program, passes: str | None) -> Program:
    """The kernel-level program the templates render: `program` after the pass pipeline."""
    if passes is None:
        return program
    from archc.passes import optimize
    return optimize(program, passes)


class TritonSession:
    """A program compiled to Triton kernels, with weights, a static KV cache and past length P.

    Same surface as ``EagerSession``: ``reset``, ``encode``, ``step``."""

    def __init__(self, program: Program, checkpoint: Mapping[str, torch.Tensor], *,
                 max_seq_len: int, dtype: str = "f32", device: str | torch.device = "cpu",
                 options: TritonOptions | None = None) -> None:
        from archc.codegen.options import CodegenOptions
        from archc.codegen.render import generate, load_module, write_module
        self.device = torch.device(device)
        self.target = prepare_triton(self.device)
        check_dtype(dtype, self.target)
        self.options = options or TritonOptions()
        self.dtype = dtype
        self.unfused = program
        self.program = kernel_program(program, self.options.passes)
        self.codegen_options = CodegenOptions(
            target=self.target, max_seq_len=max_seq_len,
            autotune=self.options.autotune and self.target == "gpu")
        self.generated = generate(self.program, self.codegen_options)
        cache_dir = self.options.cache_dir or default_cache_dir()
        self.module_path = write_module(self.generated, cache_dir / self.generated.digest[:24])
        self.module = load_module(self.module_path, self.generated.digest)
        autotuned = _apply_autotune(self.module) if self.codegen_options.autotune else set()
        self.runners = {g.name: GraphRunner(self.module, g, materialize(g, checkpoint,
                                                                          self.device),
                                            self.device,
                                            reuse_buffers=self.options.reuse_buffers)
                        for g in self.program}
        self.cache = StaticKVCache(self.generated.kv, max_seq_len, TORCH_DTYPES[dtype],
                                   self.device)
        self.states = StaticState(self.generated.states, self.device)
        self.ctx = LaunchContext(self.target, self.device, self.cache, autotuned, self.states,
                                 past=torch.zeros(1, dtype=torch.int32, device=self.device))
        self.max_seq_len = max_seq_len
        self.past = 0
        self.prefix_len: int | None = None
        self._graphs: dict[tuple[int, int], _CapturedStep] = {}
        self.cross_kv = CrossKV(self.program, self._run_cross_kv)

    def reset(self) -> None:
        self.past = 0
        self.prefix_len = None
        self.cross_kv.reset()

    def _run_cross_kv(self, encoder_hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        b, s = encoder_hidden.shape[:2]
        return self._run(CROSS_KV, {"encoder_hidden": encoder_hidden}, B=b, T=1, P=0, S=s)

    def _check_ids(self, graph: Graph, inputs: Mapping[str, torch.Tensor], *,
                   on_device: bool = True) -> None:
        """Token ids index embedding tables: out-of-range ids are refused here, naming the node.
        Ids still on the host are checked there, at no cost to the device. Ids already on the
        device are checked only when `on_device` (a prefill, which waits on the GPU anyway): a
        decode step must not stop the host to read them back. The embedding kernel masks ids
        outside the table, so an unchecked id never reads out of bounds."""
        for i in graph.ids(Op.EMBEDDING):
            n = graph.nodes[i]
            src = graph.nodes[n.inputs[1]]
            if src.op != Op.INPUT or src.name not in inputs:
                continue
            rows = int(graph.nodes[n.inputs[0]].shape[0])
            ids = inputs[src.name]
            if ids.device.type != "cpu" and not on_device:
                continue
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
                raise RunError(f"while running {format_node(i, n)}: {src.name} holds ids "
                               f"outside [0, {rows})")

    def _run(self, name: str, inputs: dict[str, torch.Tensor], *, B: int, T: int,  # noqa: N803
             P: int, S: int) -> dict[str, torch.Tensor]:
        runner = self.runners[name]
        self._check_ids(runner.graph, inputs, on_device=P == 0)
        self._ensure(B)
        self.ctx.set_dims(B, T, P, S, P + T)
        return runner.run(inputs, self.ctx)

    def encode(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
               token_types: torch.Tensor | None = None) -> torch.Tensor:
        b, t = tokens.shape
        dev = self.device
        inputs = {"tokens": tokens,
                  "positions": torch.arange(t, device=dev),
                  "attention_mask": (torch.ones(b, t, dtype=torch.long, device=dev)
                                     if attention_mask is None else attention_mask.long()),
                  "token_types": (torch.zeros(b, t, dtype=torch.long, device=dev)
                                  if token_types is None else token_types.long())}
        inputs = {k: v for k, v in inputs.items() if k in self.runners["encoder"].inputs}
        return self._run("encoder", inputs, B=b, T=t, P=0, S=0)["hidden"]

    def step(self, tokens: torch.Tensor, *, encoder_hidden: torch.Tensor | None = None,
             encoder_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t = tokens.shape
        if self.past + t > self.max_seq_len:
            raise RunError(f"sequence of {self.past + t} tokens exceeds the KV cache "
                           f"(max_seq_len = {self.max_seq_len})")
        if self.prefix_len is None:
            self.prefix_len = t
        # made on the device (kernel launches, no host-to-device copies to wait for)
        dev = self.device
        inputs: dict[str, torch.Tensor] = {
            "tokens": tokens,
            "positions": torch.arange(self.past, self.past + t, device=dev),
            "prefix_len": torch.full((), self.prefix_len, dtype=torch.long, device=dev),
        }
        s = 0
        if encoder_hidden is not None:
            s = encoder_hidden.shape[1]
            inputs["encoder_hidden"] = encoder_hidden
            inputs["encoder_mask"] = (torch.ones(b, s, dtype=torch.long, device=dev)
                                      if encoder_mask is None else encoder_mask.long())
            inputs.update(self.cross_kv.inputs(encoder_hidden))
        runner = self.runners["decoder"]
        inputs = {k: v for k, v in inputs.items() if k in runner.inputs}
        if self.past == 0:   # a sequence starts: the recurrent state reads zeros
            self._ensure(b)
            self.states.zero()
        if self._graph_ok(t):
            out = self._replay(inputs, b, s)
        else:
            out = self._run("decoder", inputs, B=b, T=t, P=self.past, S=s)["logits"]
        self.past += t
        return out

    def _ensure(self, batch: int) -> None:
        """KV cache and recurrent state for `batch` sequences: reallocated together, so a
        captured decode graph (keyed on the cache's generation) never outlives either."""
        self.cache.ensure(batch)
        self.states.ensure(batch)

    # ---- CUDA graphs for decode ------------------------------------------------------------
    def _graph_ok(self, t: int) -> bool:
        return (self.target == "gpu" and self.options.cuda_graphs and t == 1
                and self.device.type == "cuda")

    def _replay(self, inputs: dict[str, torch.Tensor], b: int, s: int) -> torch.Tensor:
        """A decode step through a CUDA graph. The first step at a (batch, encoder length) runs
        normally — compiling and tuning the kernels, allocating every buffer — and is then
        captured with those buffers, its own scratch and private copies of the inputs; later
        steps copy their inputs in, write P to the device and replay. A graph is dropped when
        the KV cache it writes is reallocated (a new batch size)."""
        runner = self.runners["decoder"]
        self._check_ids(runner.graph, inputs, on_device=self.past == 0)
        self._ensure(b)
        dims = {"B": b, "T": 1, "P": self.past, "S": s}
        entry = self._graphs.get((b, s))
        if entry is None or entry.cache_generation != self.cache.generation:
            shared_scratch = self.ctx._scratch
            self.ctx._scratch = {}            # the graph's own scratch, kept alive with it
            try:
                self.ctx.set_dims(b, 1, self.past, s, self.max_seq_len)
                out = runner.run(inputs, self.ctx)["logits"]     # warm-up: compile, tune
                v = list(runner.last_v)
                for name, i in runner.inputs.items():             # inputs the graph owns,
                    if name not in self.cross_kv.values:          # but the cross-KV cache's
                        v[i] = v[i].clone()                       # own tensors are read in place
                graph = torch.cuda.CUDAGraph()
                torch.cuda.synchronize()
                with torch.cuda.graph(graph):
                    runner.run_fn(v, self.ctx)
                self._graphs[(b, s)] = _CapturedStep(graph, v, self.ctx._scratch,
                                                     self.cache.generation)
            finally:
                self.ctx._scratch = shared_scratch
            return out
        for k, x in inputs.items():
            i = runner.inputs[k]
            if entry.v[i].data_ptr() != x.data_ptr():             # not the tensor it reads
                entry.v[i].copy_(x.to(entry.v[i].dtype))
        self.ctx.set_dims(b, 1, self.past, s, self.max_seq_len)   # P on the device
        entry.graph.replay()
        logits = runner.graph.outputs["logits"]
        return runner.value(logits, dims, entry.v).clone()


@dataclass
class _CapturedStep:
    graph: Any                                  # torch.cuda.CUDAGraph
    v: list[torch.Tensor | None]                # the buffers it reads and writes
    scratch: dict[tuple[str, torch.dtype], torch.Tensor]
    cache_generation: int


def _apply_autotune(module: ModuleType) -> set[str]:
    """Wrap each kernel of a family with a config set in triton.autotune; returns their names."""
    import triton

    from archc.codegen.blocks import autotune_configs
    tuned: set[str] = set()
    for name, entry in module.KERNELS.items():
        configs = autotune_configs(entry["family"], **entry["sizes"])
        if not configs:
            continue
        key = [k for k, t in entry["types"].items() if t == "i32"]
        fn = getattr(module, name)
        tconfigs = [triton.Config({k: v for k, v in c.items()
                                   if k not in ("num_warps", "num_stages")},
                                  num_warps=c["num_warps"], num_stages=c["num_stages"])
                    for c in configs]
        setattr(module, name, triton.autotune(configs=tconfigs, key=key)(fn))
        tuned.add(name)
    return tuned


def triton_backend(model: Any, program: Program, dtype: str, device: torch.device,
                   options: Mapping[str, Any]) -> TritonSession:
    return TritonSession(program, model.weights, max_seq_len=model.spec.max_seq_len,
                         dtype=dtype, device=device, options=TritonOptions.parse(options))


def register() -> None:
    from archc.api import register_backend
    register_backend("triton", triton_backend)


register()


# ---- one graph, for tests and validation ---------------------------------------------------

@dataclass
class GraphRun:
    outputs: dict[str, torch.Tensor]
    runner: GraphRunner
    cache: StaticKVCache
    generated: Any
    dims: dict[str, int]
    states: StaticState | None = None       # the recurrent state after the run

    def value(self, i: int) -> torch.Tensor:
        return self.runner.value(i, self.dims)


def run_graph_triton(graph: Graph, params: Mapping[str, torch.Tensor],
                     inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int], *,
                     past_kv: Mapping[tuple[int, str], torch.Tensor] | None = None,
                     past_state: Mapping[tuple[int, str], torch.Tensor] | None = None,
                     max_seq_len: int = 64, device: str | torch.device = "cpu",
                     cache_dir: Path | None = None, reuse_buffers: bool = True,
                     decode_max_rows: int | None = None) -> GraphRun:
    """Compile one kernel-level graph and run it once at `dims` (B, T, P, S). `past_kv` holds
    the first P positions of each (layer, k|v) cache, [B, H_kv, P, D]; `past_state` the
    recurrent state each (layer, kind) starts from (zeros where not given)."""
    from archc.codegen.options import CodegenOptions
    from archc.codegen.render import generate, load_module, write_module
    device = torch.device(device)
    target = prepare_triton(device)
    opts = CodegenOptions(target=target, max_seq_len=max_seq_len)
    gen = generate(Program(graph.name, (graph,)), opts)
    path = write_module(gen, (cache_dir or default_cache_dir()) / gen.digest[:24])
    module = load_module(path, gen.digest)
    full = {"B": 1, "T": 1, "P": 0, "S": 0, **dims}
    dtype = next((p.dtype for p in params.values() if p.is_floating_point()), torch.float32)
    for x in inputs.values():
        if x.is_floating_point():
            dtype = x.dtype
            break
    cache = StaticKVCache(gen.kv, max_seq_len, dtype, device)
    cache.ensure(full["B"])
    for (layer, kind), past in (past_kv or {}).items():
        cache.get(layer, kind)[:, :, :past.shape[2]] = past.to(device, dtype)
    states = StaticState(gen.states, device)
    states.ensure(full["B"])
    for (layer, kind), value in (past_state or {}).items():
        held = states.get(layer, kind)
        if tuple(value.shape) != tuple(held.shape):
            raise RunError(f"the {kind} state of layer {layer} is {list(value.shape)}; the "
                           f"graph keeps {list(held.shape)}")
        held.copy_(value.to(device, held.dtype))
    runner = GraphRunner(module, graph, {k: v.to(device) for k, v in params.items()}, device,
                         reuse_buffers=reuse_buffers)
    ctx = LaunchContext(target, device, cache, states=states,
                        past=torch.zeros(1, dtype=torch.int32, device=device))
    if decode_max_rows is not None:
        ctx.decode_max_rows = decode_max_rows
    ctx.set_dims(full["B"], full["T"], full["P"], full["S"], full["P"] + full["T"])
    outputs = runner.run(inputs, ctx)
    return GraphRun(outputs, runner, cache, gen, full, states)
