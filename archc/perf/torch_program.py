"""The unfused graph as a plain torch program: the PyTorch baseline of `archc bench`.

``TorchProgram`` runs a decoder graph straight through — each node's eager semantics from the op
table, in order, values dropped after their last use — with none of the interpreter's per-node
checks, so what it costs is what torch costs. Its KV cache is static ([B, H_kv, max_len, D] per
layer and k|v, written at offset P), and P is a plain argument: under ``torch.compile`` it becomes
a symbolic integer after the first decode step, so decoding does not recompile at every length.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from archc.errors import ArchcError
from archc.ir.graph import Graph
from archc.ir.ops import OP_TABLE, Op, full_attrs, roles_of
from archc.ir.shapes import evaluate

Store = MutableMapping[tuple[int, str], torch.Tensor]


@dataclass
class TorchContext:
    """What eager op semantics read besides their inputs: dims, a static KV cache written at
    offset P, and the recurrent state of Mamba and linear-attention layers. No bounds checks:
    the caller sized the cache.

    The state is read from `state_in` and written to `state_out` — one dict for a program that
    carries it from call to call; two for a kernel's counterpart, which must read the state the
    kernel read however often it is timed. At P = 0 a sequence starts: the state reads zeros."""

    dims: Mapping[str, Any]
    store: Store
    state_in: Store
    state_out: Store

    def state_read(self, layer: int, kind: str, shape: tuple[int, ...], dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
        have = self.state_in.get((layer, kind))
        if self.dims["P"] == 0 or have is None:
            return torch.zeros(shape, dtype=dtype, device=device)
        return have

    def state_write(self, layer: int, kind: str, value: torch.Tensor) -> None:
        self.state_out[(layer, kind)] = value

    def cache_append(self, layer: int, kind: str, x: torch.Tensor,
                     quant: str | None = None) -> torch.Tensor:
        if quant is not None:
            raise ArchcError(f"the PyTorch baseline keeps a plain KV cache, not {quant}")
        past = self.dims["P"]
        buf = self.store[(layer, kind)]
        buf[:, :, past:past + x.shape[2]] = x
        return buf[:, :, :past + x.shape[2]]

    def cache_read(self, layer: int, kind: str) -> torch.Tensor:
        return self.store[(layer, kind)][:, :, :self.dims["P"] + self.dims["T"]]


class TorchProgram:
    """A decoder graph (unfused) with its parameters, ready to run as plain torch:
    ``program(tokens, past)`` → logits, writing the new keys and values at offset ``past``."""

    def __init__(self, graph: Graph, params: Mapping[str, torch.Tensor], *, batch: int,
                 max_len: int, device: torch.device, dtype: torch.dtype) -> None:
        unknown = sorted(set(graph.inputs) - {"tokens", "positions", "prefix_len"})
        if unknown:
            raise ArchcError(f"the torch baseline runs decoder graphs over token ids; graph "
                             f"{graph.name} also needs {', '.join(unknown)}")
        self.graph, self.prefix_len = graph, 0
        self.store: Store = {}
        for n in graph.nodes:
            if n.op == Op.KV_CACHE:     # [B, H_kv, max_len, D] per layer and k|v
                _, heads, _, d = graph.nodes[n.inputs[0]].shape
                self.store[(n.attr("layer"), n.attr("kind"))] = torch.zeros(
                    batch, evaluate(heads, {}), max_len, evaluate(d, {}), dtype=dtype,
                    device=device)
        self.states: Store = {}         # recurrent mixers' state
        self.values: list[torch.Tensor | None] = [None] * len(graph.nodes)
        for name, i in graph.params.items():
            self.values[i] = params[name]
        last_use = {j: i for i, n in enumerate(graph.nodes) for j in n.inputs}
        kept = set(graph.params.values())
        # each node: (index, semantics, (role, input) pairs, attributes, values freed after it)
        self.steps: list[tuple[int, Callable[..., torch.Tensor], tuple[tuple[str, int], ...],
                               Mapping[str, Any], tuple[int, ...]]] = []
        for i, n in enumerate(graph.nodes):
            if n.op not in (Op.INPUT, Op.PARAM):
                a = full_attrs(n.op, n.attrs)
                frees = tuple(sorted({j for j in n.inputs if last_use[j] == i and j not in kept}))
                args = tuple(zip(roles_of(n.op, a, len(n.inputs)), n.inputs))
                self.steps.append((i, OP_TABLE[n.op].eager, args, a, frees))

    def forward(self, tokens: torch.Tensor, past: int) -> torch.Tensor:
        t = tokens.shape[1]
        if past == 0:   # prefix-LM: the first call's tokens are the prefix
            self.prefix_len = t
        ctx = TorchContext({"B": tokens.shape[0], "T": t, "P": past, "S": 0}, self.store,
                           self.states, self.states)
        values = list(self.values)
        given = {"tokens": tokens,
                 "positions": torch.arange(past, past + t, device=tokens.device)}
        if "prefix_len" in self.graph.inputs:   # read only where taken: under torch.compile a
            # read is a guard, and a new prompt length would recompile a causal model's decode
            given["prefix_len"] = torch.tensor(self.prefix_len, device=tokens.device)
        for name, i in self.graph.inputs.items():
            values[i] = given[name]
        for i, fn, args, attrs, frees in self.steps:
            values[i] = fn(ctx, {role: values[j] for role, j in args}, attrs)
            for j in frees:
                values[j] = None
        out = values[self.graph.outputs["logits"]]
        assert out is not None
        return out

    __call__ = forward
