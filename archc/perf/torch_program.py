"""The unfused graph as a plain torch program: the PyTorch baseline of `archc bench`.

``TorchProgram`` runs a decoder graph straight through — each node's eager semantics from the op
table, in order, values dropped after their last use — with none of the interpreter's per-node
checks, so what it costs is what torch costs. Its KV cache is static ([B, H_kv, max_len, D] per
layer and k|v, written at offset P), and the past length P is a plain argument: under
``torch.compile`` P becomes a symbolic integer after the first decode step, so decoding does not
recompile at every new length.

The same context serves the baselines of single kernels (``archc.perf.baselines``), which run
the unfused ops a fused kernel replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from archc.errors import ArchcError
from archc.ir.graph import Graph
from archc.ir.ops import OP_TABLE, Op
from archc.ir.shapes import evaluate

Store = MutableMapping[tuple[int, str], torch.Tensor]


class TorchContext:
    """What eager op semantics read besides their inputs: dims, and a static KV cache written at
    offset P. No bounds checks: the caller sized the cache."""

    def __init__(self, dims: Mapping[str, Any], store: Store) -> None:
        self.dims = dims
        self.store = store

    def cache_append(self, layer: int, kind: str, x: torch.Tensor) -> torch.Tensor:
        past = self.dims["P"]
        buf = self.store[(layer, kind)]
        buf[:, :, past:past + x.shape[2]] = x
        return buf[:, :, :past + x.shape[2]]

    def cache_read(self, layer: int, kind: str) -> torch.Tensor:
        return self.store[(layer, kind)][:, :, :self.dims["P"] + self.dims["T"]]


def cache_layout(graph: Graph) -> dict[tuple[int, str], tuple[int, int]]:
    """(layer, k|v) → (H_kv, D) of every `kv_cache` node of an unfused graph."""
    out = {}
    for n in graph:
        if n.op == Op.KV_CACHE:
            x = graph.nodes[n.inputs[0]]
            out[(n.attr("layer"), n.attr("kind"))] = (evaluate(x.shape[1], {}),
                                                      evaluate(x.shape[3], {}))
    return out


@dataclass(frozen=True)
class _Step:
    node: int
    fn: Callable[..., torch.Tensor]
    inputs: tuple[int, ...]
    attrs: Mapping[str, Any]
    frees: tuple[int, ...]       # values no later node reads


class TorchProgram:
    """A decoder graph (unfused) with its parameters, ready to run as plain torch:
    ``program(tokens, past)`` → logits, writing the new keys and values at offset ``past``."""

    INPUTS = ("tokens", "positions", "prefix_len")

    def __init__(self, graph: Graph, params: Mapping[str, torch.Tensor], *, batch: int,
                 max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        unknown = sorted(set(graph.inputs) - set(self.INPUTS))
        if unknown:
            raise ArchcError(f"the torch baseline runs decoder graphs over token ids; graph "
                             f"{graph.name} also needs {', '.join(unknown)}")
        self.graph = graph
        self.device = device
        self.batch = batch
        self.store: dict[tuple[int, str], torch.Tensor] = {
            key: torch.zeros(batch, heads, max_len, dim, dtype=dtype, device=device)
            for key, (heads, dim) in cache_layout(graph).items()}
        self.values: list[torch.Tensor | None] = [None] * len(graph.nodes)
        for name, i in graph.params.items():
            self.values[i] = params[name]
        self.input_ids = graph.inputs
        self.output = graph.outputs["logits"]
        last_use = list(range(len(graph.nodes)))
        for i, n in enumerate(graph.nodes):
            for j in n.inputs:
                last_use[j] = i
        keep = set(graph.params.values())
        steps = []
        for i, n in enumerate(graph.nodes):
            if n.op in (Op.INPUT, Op.PARAM):
                continue
            frees = tuple(sorted({j for j in n.inputs if last_use[j] == i and j not in keep}))
            steps.append(_Step(i, OP_TABLE[n.op].eager, n.inputs, dict(n.attrs), frees))
        self.steps: Sequence[_Step] = tuple(steps)
        self.prefix_len = 0

    def forward(self, tokens: torch.Tensor, past: int) -> torch.Tensor:
        t = tokens.shape[1]
        ctx = TorchContext({"B": tokens.shape[0], "T": t, "P": past, "S": 0}, self.store)
        values = list(self.values)
        given = {"tokens": tokens,
                 "positions": torch.arange(past, past + t, device=tokens.device),
                 "prefix_len": torch.tensor(self.prefix_len or t, device=tokens.device)}
        for name, i in self.input_ids.items():
            values[i] = given[name]
        for s in self.steps:
            values[s.node] = s.fn(ctx, [values[j] for j in s.inputs], s.attrs)
            for j in s.frees:
                values[j] = None
        out = values[self.output]
        assert out is not None
        return out

    __call__ = forward
