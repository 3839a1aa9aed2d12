"""What each architecture step buys, computed from the IR of the spec after it.

The decode intensity is the first seed's rough model ("A rough arithmetic-intensity model"): over
n decode steps at batch b, dense work is O(b·n·d²) against memory O(b·n·d + b·n²·d·H_kv/H_q +
n·d²), so AI = O((1/d + n·H_kv/(d·H_q) + 1/b)⁻¹). It omits constants: compare it across steps,
not with a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from archc.ir.cost import graph_cost, kv_cache_bytes_per_token, parameter_count
from archc.ir.lower import lower
from archc.modernize.steps import StepCall
from archc.passes import optimize
from archc.passes.measure import kernels_per_layer
from archc.spec.schema import Spec


def decode_intensity(d: int, n: int, kv_heads: int, q_heads: int, b: int) -> float:
    """AI = (1/d + n·H_kv/(d·H_q) + 1/b)⁻¹."""
    return 1.0 / (1.0 / d + n * kv_heads / (d * q_heads) + 1.0 / b)


@dataclass(frozen=True)
class Row:
    step: str
    spec: Spec
    params: int
    flops_per_token: int
    kv_bytes_per_token: int
    kv_bytes_at_context: int
    intensity: float
    kernels_per_layer: float   # after the default exact pipeline
    decode_bytes_per_token: int


def measure(step: str, spec: Spec, batch: int, context: int) -> Row:
    program = lower(spec, spec.dtype)
    dims = {"B": batch, "T": 1, "P": context - 1, "S": context}
    flops, moved = map(sum, zip(*(graph_cost(g).at(dims) for g in optimize(program))))
    kv = kv_cache_bytes_per_token(program)
    att = spec.attention
    return Row(step, spec, parameter_count(program), flops // batch, kv, kv * context * batch,
               decode_intensity(spec.d_model, context, att.kv_heads, att.heads, batch),
               kernels_per_layer(spec, dtype=spec.dtype)[1], moved // batch)


def walk(spec: Spec, calls: list[StepCall], batch: int, context: int) -> list[Row]:
    """The starting spec and the spec after each step, measured."""
    rows = [measure("(start)", spec, batch, context)]
    for call in calls:
        spec = call.apply(spec)
        rows.append(measure(call.text, spec, batch, context))
    return rows
