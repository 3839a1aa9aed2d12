"""One kernel-level graph compiled to Triton kernels and run once, with a KV cache and a recurrent
state set up beforehand: what the kernel tests compare with the eager interpreter."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from archc.errors import RunError
from archc.ir.graph import Graph, Program
from archc.runtime.launch import StaticStore
from archc.runtime.triton_backend import TritonOptions, TritonSession


@dataclass
class GraphRun:
    outputs: dict[str, torch.Tensor]
    cache: StaticStore                      # the KV cache and the recurrent state after the run
    states: StaticStore


def run_graph_triton(graph: Graph, params: Mapping[str, torch.Tensor],
                     inputs: Mapping[str, torch.Tensor], dims: Mapping[str, int], *,
                     past_kv: Mapping[tuple[int, str], torch.Tensor] | None = None,
                     past_state: Mapping[tuple[int, str], torch.Tensor] | None = None,
                     max_seq_len: int = 64, device: str | torch.device = "cpu",
                     cache_dir: Path | None = None, decode_max_rows: int | None = None
                     ) -> GraphRun:
    """Compile one kernel-level graph and run it once at `dims` (B, T, P, S). `past_kv` holds
    the first P positions of each (layer, k|v) cache, [B, H_kv, P, D]; `past_state` the
    recurrent state each (layer, kind) starts from (zeros where not given)."""
    s = TritonSession(Program(graph.name, (graph,)), params, max_seq_len=max_seq_len,
                      device=device, options=TritonOptions(passes=None, cache_dir=cache_dir))
    full = {"B": 1, "T": 1, "P": 0, "S": 0, **dims}
    s.cache.ensure(full["B"])
    s.states.ensure(full["B"])
    for (layer, kind), past in (past_kv or {}).items():
        s.cache.get(layer, kind)[:, :, :past.shape[2]] = past
    for (layer, kind), value in (past_state or {}).items():
        held = s.states.get(layer, kind)
        if value.shape != held.shape:
            raise RunError(f"the {kind} state of layer {layer} is {list(value.shape)}; the "
                           f"graph keeps {list(held.shape)}")
        held.copy_(value)
    if decode_max_rows is not None:
        s.ctx.decode_max_rows = decode_max_rows
    runner = s.runners[graph.name]
    plan = runner.plan(s.ctx, **full, kv_len_max=full["P"] + full["T"])
    missing = [name for name in plan.inputs if name not in inputs]
    if missing:
        raise RunError(f"graph {graph.name} needs input {missing[0]!r}")
    runner.feed(plan, inputs)
    runner.execute(plan, s.ctx, full["P"])
    return GraphRun({name: t.clone() for name, t in plan.outputs.items()}, s.cache, s.states)
