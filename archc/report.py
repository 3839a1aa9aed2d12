"""Facts about a model, computed from its IR: what `archc show`, `archc specs` and the
comparison tables print."""

from __future__ import annotations

from dataclasses import dataclass

from archc.ir.cost import (
    graph_cost,
    kernel_count,
    kv_cache_bytes_per_token,
    parameter_bytes,
    parameter_count,
    per_layer,
    recurrent_state_bytes,
    without_layers,
)
from archc.ir.graph import Program
from archc.ir.lower import lower
from archc.spec.schema import Spec


@dataclass(frozen=True)
class Facts:
    params: int
    weight_bytes: int
    kv_bytes_per_token: int
    flops_per_token: dict[str, int]       # graph name → FLOPs for one new token, no past
    flops_per_token_full: dict[str, int]  # … with max_seq_len − 1 tokens already cached
    kernels: int
    kernels_per_layer: float
    state_bytes: int = 0                  # recurrent state of one sequence (fixed size)


def facts(spec: Spec, program: Program | None = None) -> Facts:
    """Numbers of `spec` in its own weight dtype (`spec.dtype`)."""
    program = program or lower(spec, spec.dtype)
    base = lower(without_layers(spec), spec.dtype)
    one = {"B": 1, "T": 1, "P": 0, "S": 1}
    full = {"B": 1, "T": 1, "P": spec.max_seq_len - 1, "S": spec.max_seq_len}
    return Facts(
        params=parameter_count(program),
        weight_bytes=parameter_bytes(program),
        kv_bytes_per_token=kv_cache_bytes_per_token(program),
        flops_per_token={g.name: graph_cost(g).at(one)[0] for g in program},
        flops_per_token_full={g.name: graph_cost(g).at(full)[0] for g in program},
        kernels=kernel_count(program),
        kernels_per_layer=per_layer(spec, kernel_count(program), kernel_count(base)),
        state_bytes=recurrent_state_bytes(program),
    )
