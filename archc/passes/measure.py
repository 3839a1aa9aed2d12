"""Numbers about a program at any point of a pipeline, all computed from its IR: what
`archc passes`, `archc diff` and the tests print and check."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from archc.ir.cost import (
    graph_cost,
    kv_cache_bytes_per_token,
    parameter_bytes,
    parameter_count,
    without_layers,
)
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.ir.ops import Op
from archc.passes.manager import optimize
from archc.spec.schema import Spec


@dataclass(frozen=True)
class Stats:
    nodes: int
    kernels: int                 # compute nodes: one kernel each
    params: int                  # parameter elements (computed buffers excluded)
    weight_bytes: int
    flops_per_token: float       # at the given dims, divided by the B·T new tokens
    bytes_per_token: float
    kv_bytes_per_token: int      # cache growth per token of one sequence


def dims(batch: int = 1, tokens: int = 1, past: int = 0, encoder_len: int | None = None
         ) -> dict[str, int]:
    return {"B": batch, "T": tokens, "P": past, "S": tokens if encoder_len is None else encoder_len}


def _kernels(p: Program) -> int:
    return sum(len(g.compute_ids()) for g in p)


def stats(p: Program, at: dict[str, int]) -> Stats:
    costs = [graph_cost(g).at(at) for g in p]
    tokens = at["B"] * at["T"]
    return Stats(sum(len(g) for g in p), _kernels(p), parameter_count(p), parameter_bytes(p),
                 sum(f for f, _ in costs) / tokens, sum(b for _, b in costs) / tokens,
                 kv_cache_bytes_per_token(p))


def kernels_per_layer(spec: Spec, pipeline: str | Sequence[str] = "default",
                      dtype: str = "f32") -> tuple[float, float]:
    """Compute nodes per block before and after `pipeline`, by difference with the same model
    without blocks (so embedding and head are left out)."""
    full, base = lower(spec, dtype), lower(without_layers(spec), dtype)
    layers = spec.layers + (spec.decoder_layers or 0)
    return ((_kernels(full) - _kernels(base)) / layers,
            (_kernels(optimize(full, pipeline)) - _kernels(optimize(base, pipeline))) / layers)


def op_delta(before: Program, after: Program) -> str:
    """'−3 matmul, +1 fused_linear, +3 slice': how the op mix changed."""
    a, b = (Counter(n.op.value for g in p for n in g if n.op not in (Op.INPUT, Op.OUTPUT))
            for p in (before, after))
    return ", ".join(f"{'+' if b[op] > a[op] else '−'}{abs(b[op] - a[op])} {op}"
                     for op in sorted(set(a) | set(b), key=lambda o: (b[o] - a[o] > 0, o))
                     if b[op] != a[op])
