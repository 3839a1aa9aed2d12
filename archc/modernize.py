"""The architecture steps (``archc.spec.steps``) applied: what each buys — the walk's costs, step
by step — and converting a loaded checkpoint through the steps that need no training."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from archc.ir.cost import graph_cost, kv_cache_bytes_per_token, parameter_count
from archc.ir.lower import lower
from archc.passes import optimize
from archc.passes.measure import kernels_per_layer
from archc.runtime.weights import checkpoint_shapes
from archc.spec.schema import Spec
from archc.spec.steps import StepCall, StepError


def decode_intensity(d: int, n: int, kv_heads: int, q_heads: int, b: int) -> float:
    """The first seed's rough model ("A rough arithmetic-intensity model"): over n decode steps
    at batch b, dense work is O(b·n·d²) against memory O(b·n·d + b·n²·d·H_kv/H_q + n·d²), so
    AI = (1/d + n·H_kv/(d·H_q) + 1/b)⁻¹ up to constants: compare it across steps, not with a
    GPU."""
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
    call: StepCall | None = None   # the step that made it (None: the start)


def measure(step: str, spec: Spec, batch: int, context: int) -> Row:
    program = lower(spec, spec.dtype)
    dims = {"B": batch, "T": 1, "P": context - 1, "S": context}
    flops, moved = map(sum, zip(*(graph_cost(g).at(dims) for g in optimize(program))))
    kv = kv_cache_bytes_per_token(program)
    att = spec.attention
    # a model without softmax attention keeps no KV cache that grows with the context
    kv_heads, heads = (att.kv_heads, att.heads) if spec.softmax_attends else (0, 1)
    return Row(step, spec, parameter_count(program), flops // batch, kv, kv * context * batch,
               decode_intensity(spec.d_model, context, kv_heads, heads, batch),
               kernels_per_layer(spec, dtype=spec.dtype)[1], moved // batch)


def walk(spec: Spec, calls: list[StepCall], batch: int, context: int, *,
         skipped: Callable[[StepCall, StepError], None] | None = None) -> list[Row]:
    """The starting spec and the spec after each step, measured. With `skipped`, a step that
    does not apply is passed to it and left out (else its StepError is raised)."""
    rows = [measure("(start)", spec, batch, context)]
    for call in calls:
        try:
            spec = call.apply(spec)
        except StepError as err:
            if skipped is None:
                raise
            skipped(call, err)
            continue
        rows.append(replace(measure(call.text, spec, batch, context), call=call))
    return rows


_KV = re.compile(r"^(.*layers\.\d+\.(?:attn|cross))\.([kv])\.(weight|bias)$")


@dataclass
class Conversion:
    """What a conversion did to each tensor it touched."""

    exact: list[str] = field(default_factory=list)
    dropped: list[tuple[str, float]] = field(default_factory=list)   # name, RMS of the values
    pooled: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = []
        if self.pooled:
            out.append(f"mean-pooled the K/V heads of {len(self.pooled)} tensors")
        if self.exact:
            out.append(f"removed exactly ({len(self.exact)}): " + ", ".join(self.exact[:4]) +
                       (" …" if len(self.exact) > 4 else ""))
        if self.dropped:
            name, rms = max(self.dropped, key=lambda x: x[1])
            out.append(f"dropped, changing the function ({len(self.dropped)}): largest RMS "
                       f"{rms:.3g} in {name}")
        return out


def convert(call: StepCall, before: Spec, after: Spec,
            weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Conversion]:
    """The checkpoint of `after` from the checkpoint of `before`, or StepError. ``gqa:N``/``mqa``
    give each new KV head the mean of the old heads of its group (Ainslie et al. 2023, "GQA:
    Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints");
    ``no-bias`` removes zero biases, and key biases nothing position-dependent acts on, exactly
    (q·(k + b) = q·k + q·b is constant along the softmax axis), and drops every other bias, which
    changes the function, reporting its size."""
    if not call.step.converts_weights:
        raise StepError(f"{call.text} changes what the weights compute and needs training; "
                        "only gqa:N, mqa and no-bias convert a loaded checkpoint")
    quantized = sorted(k for k, w in weights.items() if not isinstance(w, torch.Tensor))
    if quantized:
        raise StepError(f"{call.text} converts float weights; {quantized[0]} and "
                        f"{len(quantized) - 1} more are quantized: convert the float "
                        "checkpoint, then quantize the result")
    out, report = dict(weights), Conversion()
    if call.step.name in ("gqa", "mqa"):
        old, new = before.attention.kv_heads, after.attention.kv_heads
        for name in filter(_KV.match, weights):
            # [H_old·D, …] → [H_new, H_old/H_new, D, …]: each new head is its group's mean
            out[name] = weights[name].unflatten(0, (new, old // new, -1)).mean(1).flatten(0, 1)
            report.pooled.append(name)
        return out, report
    # no-bias. Nothing position-dependent may act on k after its bias for it to fold: RoPE
    # rotates k_j + b by R_j (q·R_j b then varies with j); qk-norm rescales k + b per key.
    key_bias_folds = before.position.kind != "rope" and not before.attention.qk_norm
    for name in sorted(set(weights) - set(checkpoint_shapes(lower(after)))):
        t, m = out.pop(name).float(), _KV.match(name)
        key_bias = m is not None and m.group(2, 3) == ("k", "bias")
        if not bool(t.abs().max() > 0) or (key_bias and key_bias_folds):
            report.exact.append(name)
        else:
            report.dropped.append((name, float(t.pow(2).mean().sqrt())))
    return out, report
