"""The triton backend: run a kernel-level program on its generated kernels.

    compiled = archc.load("tiny-llama3").compile("triton")     # same API as eager

The default pass pipeline reaches kernel level, codegen renders one module
(``archc.codegen.render``), and each call replays a launch plan (``archc.runtime.launch``).
Without a GPU the same kernels run under Triton's CPU interpreter (f32 or f16: the interpreter
computes bf16 wrongly).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from archc.codegen.build import CodegenOptions
from archc.codegen.render import generate, load_module, write_module
from archc.devices import check_compilable
from archc.errors import ArchcError, RunError
from archc.gpus import target_of
from archc.ir.graph import CROSS_KV, Graph, Program
from archc.ir.ops import Op
from archc.ir.text import format_node
from archc.kernel_cache import default_cache_dir
from archc.passes import optimize
from archc.passes.attention import unfused_cache_writes
from archc.runtime import tuning
from archc.runtime.comm import Comm
from archc.runtime.eager import SessionBase
from archc.runtime.launch import GraphRunner, LaunchContext, LaunchPlan, StaticStore
from archc.runtime.weights import materialize


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


def install_tma_allocator(device: torch.device) -> None:
    """Device-side tensor descriptors (the matmul's TMA loads, `tl.make_tensor_descriptor`) keep
    each descriptor in a global scratch that Triton asks for at launch: a torch allocation on the
    device (torch's blocks are 512-byte aligned, past the 128 bytes asked for), so CUDA-graph
    capture takes it from the graph's pool like any other tensor."""
    import triton

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, dtype=torch.int8, device=device)

    triton.set_allocator(alloc)


def _interpret_loaded_triton() -> None:
    """Something imported Triton before archc chose its interpreter (Hugging Face code does):
    the standard library's @triton.jit functions (tl.sum, tl.max, tl.cdiv…) were then built for
    the compiler and cannot be called from interpreted kernels. Rebuild them for the interpreter,
    in place — on a machine without a GPU nothing can run them compiled anyway."""
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    knobs.runtime.interpret = True
    converted: dict[int, InterpretedFunction] = {}  # by id: hashing a JITFunction reads globals

    def interpreted(fn: JITFunction) -> InterpretedFunction:
        if id(fn) not in converted:
            converted[id(fn)] = InterpretedFunction(
                fn.fn, version=getattr(fn, "version", None),
                do_not_specialize=fn.do_not_specialize, debug=fn.debug, noinline=fn.noinline)
        return converted[id(fn)]

    import triton.language as tl
    for space in [*(m for name, m in list(sys.modules.items())
                    if m is not None and name.startswith("triton.language")), tl.tensor]:
        for name, value in list(vars(space).items()):
            if isinstance(value, JITFunction):
                setattr(space, name, interpreted(value))


# ---- the session ---------------------------------------------------------------------------

# Whether a session tunes when its options leave it unsaid: yes. A test suite sets it off
# (tests/conftest.py): on a GPU every launch of more than 16 rows would tune, and only the
# tests of tuning should.
AUTOTUNE_DEFAULT = True



# ops of the unfused program that no Triton kernel runs yet → the spec field that makes them
NO_KERNELS: dict[Op, str] = {}


def check_kernels_exist(program: Program) -> None:
    """Refuse a `program` with an op no Triton kernel runs, by the spec field, before any pass."""
    for g in program:
        for n in g:
            if n.op in NO_KERNELS:
                raise ArchcError(f"the triton backend cannot run {program.model}: layer "
                                 f"{n.attr('layer')}'s {NO_KERNELS[n.op]} has no Triton kernels "
                                 "yet; run it on the eager backend")


def check_cache_writes(program: Program) -> None:
    """Refuse a kernel-level `program` whose KV-cache writes no kernel's epilogue makes (the
    triton backend has no kernel for a lone cache write)."""
    for g in program:
        if problem := unfused_cache_writes(g):
            raise ArchcError(f"the triton backend cannot run {program.model}: {problem}; "
                             "run it on the eager backend")


@dataclass
class TritonOptions:
    passes: str | None = "default"      # pass pipeline to reach kernel level (None: as given)
    cache_dir: Path | None = None
    # on a CUDA GPU: tune prefill tiles (archc.runtime.tuning); default AUTOTUNE_DEFAULT
    autotune: bool = field(default_factory=lambda: AUTOTUNE_DEFAULT)
    cuda_graphs: bool = True
    reuse_buffers: bool = True
    pdl: bool = True                    # programmatic dependent launch on sm_90 and later


class TritonSession(SessionBase):
    """A program compiled to Triton kernels, with weights, a static KV cache and past length P."""

    def __init__(self, program: Program, checkpoint: Mapping[str, torch.Tensor], *,
                 max_seq_len: int, dtype: str = "f32", device: str | torch.device = "cpu",
                 options: TritonOptions | None = None,
                 comms: Mapping[str, Comm] | None = None) -> None:
        device = torch.device(device)
        self.target = self._target(device)
        if self.target == "interpret":   # (a GPU target's session on the host runs no kernel)
            check_compilable("triton", dtype, device)
        self.options = options or TritonOptions()
        self.dtype = dtype
        passes = self.options.passes
        check_kernels_exist(program)
        super().__init__(program if passes is None else optimize(program, passes), max_seq_len,
                         device, comms)
        check_cache_writes(self.program)
        # tuning happens at launch, not in the generated code: a tuned and an untuned session
        # share one module (and its ahead-of-time compiles)
        self.codegen_options = CodegenOptions(target=self.target, max_seq_len=max_seq_len)
        self.has_last_token()           # the variant's kernels are the module's too
        self.generated = generate(self.program, self.codegen_options, {
            name: g for name, g in self.runs.items() if name not in self.program_graphs})
        self.module_path = write_module(self.generated, Path(
            self.options.cache_dir or default_cache_dir()) / self.generated.digest[:24])
        self.module = load_module(self.module_path, self.generated.digest)
        self.tuner = None
        if tuning.tuning_enabled(self.options.autotune, self.target, self.device.type):
            self.tuner = _tuner(self.module.KERNELS, self.module_path, self.generated.digest,
                                self.device)
        if self.target == "gpu":
            install_tma_allocator(self.device)
        # a variant reads the parameters of the graph it varies (its name's), evaluated once
        self._hand_over(checkpoint)
        params = {g.name: self._parameters(g, checkpoint) for g in self.program}
        self.runners = {name: GraphRunner(self.module, g, params[g.name], self.device, run=name,
                                          reuse_buffers=self.options.reuse_buffers)
                        for name, g in self.runs.items()}
        # (input name, table rows, the node as text) of each input that indexes an embedding;
        # a vocabulary-parallel table holds 1/parts of the rows the ids index
        self.id_checks = {name: [(g.nodes[n.inputs[1]].name,
                                  int(g.nodes[n.inputs[0]].shape[0]) * int(n.attr("parts") or 1),
                                  format_node(i, n)) for i, n in enumerate(g.nodes)
                                 if n.op == Op.EMBEDDING and g.nodes[n.inputs[1]].op == Op.INPUT]
                          for name, g in self.runs.items()}
        self.cache, self.states = (StaticStore(what, self.generated.stores[what], self.device)
                                   for what in ("cache", "state"))
        self.ctx = LaunchContext(self.target, self.device, self.cache, self.states,
                                 self.tuner.tuned if self.tuner else set(), tuner=self.tuner,
                                 types={k: e["types"] for k, e in self.module.KERNELS.items()},
                                 comms=self.comms)
        # each kernel's prologue overlaps the previous kernel's tail (templates/pdl.j2)
        self.ctx.pdl = (self.options.pdl and self.device.type == "cuda" and self.target == "gpu"
                        and torch.cuda.get_device_capability(self.device)[0] >= 9)
        if self.device.type == "cuda":  # the heuristics' GPU: its capability and SM count
            props = torch.cuda.get_device_properties(self.device)
            self.ctx.sm, self.ctx.sms = 10 * props.major + props.minor, props.multi_processor_count
        # a CUDA graph captures NCCL collectives with the kernels; any other process group
        # (gloo) runs on the host, which a replay would skip
        self.cuda_graphs = (self.target == "gpu" and self.options.cuda_graphs
                            and self.device.type == "cuda"
                            and all(_capturable(c) for c in self.comms.values()))

    def _target(self, device: torch.device) -> str:
        return prepare_triton(device)

    def _parameters(self, graph: Graph, checkpoint: Mapping[str, torch.Tensor]
                    ) -> dict[str, torch.Tensor]:
        """The graph's parameters; a sharded program's `shard()` slices are this rank's."""
        rank = self.comms["tp"].rank if "tp" in self.comms else 0
        return materialize(graph, checkpoint, self.device, rank=rank)

    def kv_len(self, past: int, t: int) -> int:
        """Keys a decode-attention grid covers. On a GPU the whole cache: one plan (and one
        captured graph) serves every step, the kernels reading the live length from the device.
        The interpreter pays for every program it runs, so there the keys so far: a plan per
        past length."""
        return past + t if self.target == "interpret" else self.max_seq_len

    def _check_ids(self, graph: str, inputs: Mapping[str, torch.Tensor], on_device: bool) -> None:
        """Token ids index embedding tables: out-of-range ids are refused here, naming the node.
        Ids still on the host are checked there, at no cost to the device. Ids already on the
        device are checked only when `on_device` (a prefill, which waits on the GPU anyway): a
        decode step must not stop the host to read them back. The embedding kernel masks ids
        outside the table, so an unchecked id never reads out of bounds."""
        for name, rows, node in self.id_checks[graph]:
            ids = inputs.get(name)
            if ids is None or not ids.numel() or (ids.device.type != "cpu" and not on_device):
                continue
            low, high = torch.aminmax(ids)                  # one op, one read-back
            if int(low) < 0 or int(high) >= rows:
                raise RunError(f"while running {node}: {name} holds ids outside [0, {rows})")

    def _run(self, name: str, inputs: dict[str, torch.Tensor], *, B: int, T: int,  # noqa: N803
             P: int, S: int, held: Mapping[str, torch.Tensor] | None = None,  # noqa: N803
             ) -> dict[str, torch.Tensor]:
        """Graph `name` on `inputs` (copied into its plan's buffers): copies of its outputs."""
        self._check_ids(name, inputs, on_device=P == 0)
        self.cache.ensure(B)
        self.states.ensure(B)
        runner = self.runners[name]
        if runner.graph.name == "decoder" and P == 0:   # a sequence starts: the recurrent
            self.states.zero()                          # state reads zeros
        # a ring step (context parallel): its attentions pass K/V blocks of the longest rank's
        # token count round the cp group (the cross-KV graph has none)
        ring = self._ring_keys if name != CROSS_KV else 0
        plan = runner.plan(self.ctx, B, T, P, S, self.kv_len(P, T), held, ring=ring)
        # the inputs, into the plan's buffers: one small op each, none waiting on the device;
        # positions are archc's own: below max_seq_len, within every position table — in a
        # ring step, the global positions of this rank's tokens
        if "positions" in plan.inputs:
            if ring:
                plan.inputs["positions"].copy_(self._ring_positions)
            else:
                torch.arange(P, P + T, out=plan.inputs["positions"])
        if "prefix_len" in plan.inputs:
            plan.inputs["prefix_len"].fill_(self.prefix_len)
        runner.feed(plan, inputs)
        # a decode step's plan launches once (compiling, tuning), then replays as a CUDA graph
        graphs = self.cuda_graphs and T == 1 and name == "decoder"
        runner.execute(plan, self.ctx, P, replay=graphs and plan.replay is not None)
        if graphs and plan.replay is None:
            plan.replay = self._capture(plan)
        return {k: t.clone() for k, t in plan.outputs.items()}

    def _cache_tensors(self) -> list[torch.Tensor]:
        return [self.cache.get(*key) for key in sorted(self.generated.stores["cache"])]

    def tuning_stats(self) -> dict[str, Any]:
        """What autotuning cost this session so far — its first-run cost: `seconds` spent
        tuning (pre-filter compiles and timing, the device synced), `kernels_tuned`,
        `cache_hits`, `cache_misses`, `configs_dropped` by the pre-filter — and whether it
        tunes at all (`enabled`)."""
        stats = self.tuner.summary() if self.tuner else asdict(tuning.TuningStats())
        return {"enabled": self.tuner is not None, **stats}

    def _capture(self, plan: LaunchPlan) -> Any:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            plan.launch()
        return graph


def _capturable(comm: Comm) -> bool:
    """Can a CUDA graph capture `comm`'s collectives? NCCL's, which run as kernels on the
    current stream; a group of one moves nothing."""
    if comm.size == 1:
        return True
    group = getattr(comm, "group", None)
    if getattr(comm, "dist", None) is None:
        return False
    return str(comm.dist.get_backend(group)) == "nccl"


def _tuner(kernels: Mapping[str, Mapping[str, Any]], module_path: Path, digest: str,
           device: torch.device) -> tuning.Tuner:
    """The tuning of a module's kernels on CUDA `device`: those of a family with candidates
    (``blocks.autotune_configs``), the cache beside the module keyed by the device's name, and
    the pre-filter for the device's capability (none where the ahead-of-time compile has no
    target for it)."""
    target = target_of(torch.cuda.get_device_capability(device))
    cache = tuning.TuningCache(module_path.parent, digest, torch.cuda.get_device_name(device))
    return tuning.Tuner(tuning.tuned_kernels(kernels), cache,
                        prefilter=tuning.aot_prefilter(module_path, target) if target else None,
                        synchronize=lambda: torch.cuda.synchronize(device))


def triton_backend(model: Any, weights: Mapping[str, Any], program: Program, dtype: str,
                   device: torch.device, options: Mapping[str, Any]) -> TritonSession:
    options = dict(options)
    comms = options.pop("comms", None)
    unknown = sorted(set(options) - set(TritonOptions.__dataclass_fields__))
    if unknown:
        raise ArchcError(f"unknown triton backend option {', '.join(unknown)} (known: "
                         f"{', '.join(sorted(TritonOptions.__dataclass_fields__))})")
    return TritonSession(program, weights, max_seq_len=model.spec.max_seq_len,
                         dtype=dtype, device=device, options=TritonOptions(**options),
                         comms=comms)
