"""Mixture-of-experts ops: top-k routing and the expert FFNs.

Routing produces dense gates [..., E] (zero for experts a token is not routed to), so the expert
op is one node with one output; only routed experts are computed, and costs count only them.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch
import torch.nn.functional as F

from archc.ir.attrs import Attrs
from archc.ir.ops.base import (
    EagerCtx,
    Op,
    OpDef,
    Sig,
    float_dtype,
    per_element,
    register,
    require,
    same_as_input,
    same_dim,
)
from archc.ir.ops.core import ACTIVATIONS, activation
from archc.ir.shapes import DTYPE_BYTES, Shape, numel


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> torch.Tensor:
    """Softmax over experts, keep the top k per token (renormalized to sum to 1 if asked),
    zero the rest (Mixtral's router)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = probs.topk(top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, idx, top).to(logits.dtype)


register(OpDef(
    Op.ROUTER, "Top-k routing: dense gates from router logits (zeros off the top k).",
    "%30 : f32[B,T,4] = router(%29) {normalize=true, top_k=2}", (1, 1), same_as_input,
    lambda ctx, xs, a: route(xs[0], a["top_k"], a["normalize"]),
    flops=per_element(6), attrs=("top_k", "normalize")))


def experts(x: torch.Tensor, gates: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
            gate: torch.Tensor | None, act: str) -> torch.Tensor:
    """Σ_e gates[e]·FFN_e(x) over the experts each token was routed to."""
    flat = x.reshape(-1, x.shape[-1])
    g = gates.reshape(-1, gates.shape[-1])
    out = torch.zeros_like(flat)
    for e in range(up.shape[0]):
        rows = torch.nonzero(g[:, e], as_tuple=True)[0]
        if rows.numel() == 0:
            continue
        h = F.linear(flat[rows], up[e])
        if gate is not None:
            h = activation(F.linear(flat[rows], gate[e]), act) * h
        else:
            h = activation(h, act)
        out.index_add_(0, rows, F.linear(h, down[e]) * g[rows, e, None])
    return out.reshape(x.shape)


def _experts_infer(sig: Sig) -> tuple[Shape, str]:
    x, gates, up, down = sig.shapes[:4]
    n_experts, d_ff, d = up
    require(sig.attr("act") in ACTIVATIONS, f"unknown activation {sig.attr('act')!r}")
    require(same_dim(x[-1], d), f"x width {x[-1]} ≠ expert input width {d}")
    require(same_dim(gates[-1], n_experts), f"gates for {gates[-1]} experts, weights for "
            f"{n_experts}")
    require(len(down) == 3 and same_dim(down[1], d) and same_dim(down[2], d_ff),
            f"down weights {list(down)} must be [E, {d}, {d_ff}]")
    if sig.attr("gated"):
        require(len(sig.shapes) == 5 and sig.shapes[4] == up, "gated experts need gate weights "
                "shaped like up")
    return x, float_dtype(sig)


def _experts_eager(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    gate = xs[4] if a["gated"] else None
    return experts(xs[0], xs[1], xs[2], xs[3], gate, a["act"])


def _routed(sig: Sig) -> tuple[sympy.Expr, sympy.Expr]:
    """Tokens, and experts any token is routed to (at most all of them)."""
    tokens = numel(sig.shapes[0][:-1])
    n_experts = sig.shapes[2][0]
    return tokens, sympy.Min(n_experts, tokens * sig.attr("top_k"))


def _experts_flops(sig: Sig) -> sympy.Expr:
    tokens, _ = _routed(sig)
    _, d_ff, d = sig.shapes[2]
    matrices = 3 if sig.attr("gated") else 2
    return 2 * tokens * sig.attr("top_k") * matrices * d_ff * d


def _experts_bytes(sig: Sig) -> sympy.Expr:
    tokens, active = _routed(sig)
    _, d_ff, d = sig.shapes[2]
    matrices = 3 if sig.attr("gated") else 2
    weights = active * matrices * d_ff * d * DTYPE_BYTES[sig.dtypes[2]]
    acts = 2 * numel(sig.shapes[0]) * DTYPE_BYTES[sig.dtypes[0]]
    return weights + acts + numel(sig.shapes[1]) * DTYPE_BYTES[sig.dtypes[1]]


register(OpDef(
    Op.MOE_EXPERTS, "Expert FFNs weighted by their gates; weights stacked [E, F, d] "
    "(down [E, d, F]).",
    '%31 : f32[B,T,64] = moe_experts(%28, %30, %24, %25, %26) {act="silu", gated=true, '
    'top_k=2}', (4, 5), _experts_infer, _experts_eager, flops=_experts_flops,
    bytes=_experts_bytes, attrs=("act", "gated", "top_k")))

