"""Converting a loaded checkpoint through an architecture step, where no training is needed:
``gqa:N``/``mqa`` give each new KV head the mean of the old heads of its group (Ainslie et al.
2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head Checkpoints");
``no-bias`` removes zero biases, and key biases nothing position-dependent acts on, exactly
(q·(k + b) = q·k + q·b is constant along the softmax axis), and drops every other bias, which
changes the function, reporting its size. Every other step needs training and is refused."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from archc.ir.lower import lower
from archc.modernize.steps import StepCall, StepError
from archc.runtime.weights import checkpoint_shapes
from archc.spec.schema import Spec

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


def mean_pool_kv(tensor: torch.Tensor, old_heads: int, new_heads: int) -> torch.Tensor:
    """[H_old·D, …] → [H_new·D, …]: the mean of each group of H_old/H_new consecutive heads."""
    head_dim, rest = tensor.shape[0] // old_heads, tensor.shape[1:]
    grouped = tensor.reshape(new_heads, old_heads // new_heads, head_dim, *rest)
    return grouped.mean(dim=1).reshape(new_heads * head_dim, *rest)


def convert(call: StepCall, before: Spec, after: Spec,
            weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Conversion]:
    """The checkpoint of `after` from the checkpoint of `before`, or StepError."""
    if not call.step.converts_weights:
        raise StepError(f"{call.text} changes what the weights compute and needs training; "
                        "only gqa:N, mqa and no-bias convert a loaded checkpoint")
    out, report = dict(weights), Conversion()
    if call.step.name in ("gqa", "mqa"):
        for name in filter(_KV.match, weights):
            out[name] = mean_pool_kv(weights[name], before.attention.kv_heads,
                                     after.attention.kv_heads)
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
