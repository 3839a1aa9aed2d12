"""Mixture of experts: top-k routing into dense gates [..., E] (zero off the top k), and the
grouped expert matmuls (`moe_linear` stages `up` and `down`). Lowering emits a gated expert FFN
as gate and up stages, an activation, a product and the down stage, as it lowers a dense one;
fuse-moe makes gate and up one matmul with a glu() epilogue. Only routed experts are computed,
and costs count only them.
"""

from __future__ import annotations

import sympy
import torch
import torch.nn.functional as F

from archc.ir.attrs import Attr, Attrs
from archc.ir.ops.base import (
    Args,
    EagerCtx,
    Op,
    OpDef,
    Sig,
    float_dtype,
    io_bytes,
    register,
    require,
    same_dim,
)
from archc.ir.ops.core import EPILOGUE, matmul_flops, matmul_infer
from archc.ir.ops.steps import RowStats, apply_epilogue, check_epilogue, epilogue_roles
from archc.ir.shapes import DTYPE_BYTES, Shape, numel


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> torch.Tensor:
    """Softmax over experts, keep the top k per token (renormalized to sum to 1 if asked),
    zero the rest (Mixtral's router)."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = probs.topk(top_k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, idx, top).to(logits.dtype)


def _router_infer(sig: Sig) -> tuple[Shape, str]:
    gates, dtype = matmul_infer(sig) if sig.has("weight") else (sig.shape("x"), float_dtype(sig))
    require(sig.attr("top_k") <= int(gates[-1]), f"top_k {sig.attr('top_k')} of {gates[-1]} "
            "experts")
    return gates, dtype


def _router(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    x = a["x"]
    logits = F.linear(x.float(), a["weight"].float()) if "weight" in a else x
    return route(logits, at["top_k"], at["normalize"]).to(x.dtype)


register(OpDef(
    Op.ROUTER, "Top-k routing: dense gates (zeros off the top k) from router logits, or from x "
    "and the router weight in one kernel (the logits never stored).",
    "%30 : f32[B,T,4] = router(%28, %29) {normalize=true, top_k=2}",
    lambda attrs, n: ["x", "weight"][:max(1, min(n, 2))], _router_infer, _router,
    attrs=(Attr("top_k", int, at_least=1), Attr("normalize", bool)),
    flops=lambda sig: matmul_flops(sig) if sig.has("weight") else 6 * numel(sig.out_shape),
    template="moe", arity=(1, 2), docs={"x": "activations", "weight": "router weight"}))


def selected_experts(gates: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts each token was routed to, in ascending expert order: [..., top_k]."""
    return gates.float().topk(top_k, dim=-1).indices.sort(dim=-1).values


def moe_linear(ctx: EagerCtx, a: Args, at: Attrs) -> torch.Tensor:
    """Expert by expert over the (token, slot) pairs routed to it, in f32."""
    x, gates, w = a["x"], a["gates"], a["weight"]
    k, up = at["top_k"], at["stage"] == "up"
    n_experts, n = w.shape[:2]
    pairs = selected_experts(gates, k).reshape(-1, k)                # (M, k)
    g = gates.reshape(-1, n_experts).float()
    rows = x.reshape(-1, x.shape[-1]) if up else x.reshape(-1, k, x.shape[-1])
    acc = torch.zeros((rows.shape[0], k, n) if up else (rows.shape[0], n), device=x.device)
    for e in range(n_experts):
        tok, slot = torch.nonzero(pairs == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        if up:
            acc[tok, slot] = F.linear(rows[tok].float(), w[e].float())
        else:
            acc.index_add_(0, tok, F.linear(rows[tok, slot].float(), w[e].float())
                           * g[tok, e, None])
    acc = acc.reshape(*_tokens(x.shape, up), *((k, n) if up else (n,)))
    rest = list(a.values())[3:]
    return apply_epilogue(ctx, acc, at["epilogue"], rest, RowStats(None, None, x.dtype)).to(
        x.dtype)


def _tokens(x: Shape | torch.Size, up: bool) -> Shape:
    """The token dims of x: [..., K] (up) or [..., k, K] (down)."""
    return tuple(x[:-1] if up else x[:-2])


def _moe_infer(sig: Sig) -> tuple[Shape, str]:
    x, gates, w = sig.shape("x"), sig.shape("gates"), sig.shape("weight")
    k, up = sig.attr("top_k"), sig.attr("stage") == "up"
    require(len(w) == 3 and same_dim(gates[-1], w[0]), f"weights {list(w)} for {gates[-1]} "
            "experts")
    require(same_dim(x[-1], w[2]), f"x width {x[-1]} ≠ expert input {w[2]}")
    require(up or (len(x) >= 2 and int(x[-2]) == k), f"hidden {list(x)} must be [..., {k}, "
            f"{w[2]}]")
    rows = (*x[:-1], sympy.Integer(k)) if up else x[:-2]      # [..., k] (up) or [...] (down)
    width = check_epilogue(sig, Op.MOE_LINEAR, int(w[1]), 3, rows)
    return (*rows, sympy.Integer(width)), float_dtype(sig)


def _routed(sig: Sig) -> sympy.Expr:
    """(token, slot) pairs: each is one row through one expert."""
    return numel(_tokens(sig.shape("x"), sig.attr("stage") == "up")) * sig.attr("top_k")


def _moe_bytes(sig: Sig) -> sympy.Expr:
    # every input and the output once, but only the weights of experts some token is routed to
    w = sig.shape("weight")
    unread = w[0] - sympy.Min(w[0], _routed(sig))
    return io_bytes(sig) - unread * w[1] * w[2] * DTYPE_BYTES[sig.dtype("weight")]


register(OpDef(
    Op.MOE_LINEAR, "Grouped expert matmul over the routed (token, slot) pairs: `up` gives a row "
    "per pair [..., k, N]; `down` projects the pairs back and sums them weighted by the gates; "
    "then an epilogue (glu or an activation after up, a residual add after down).",
    '%31 : f32[B,T,2,96] = moe_linear(%28, %30, %26) {epilogue=[glu(fn="silu")], stage="up", '
    'top_k=2}',
    lambda attrs, n: ["x", "gates", "weight", *epilogue_roles(attrs)], _moe_infer, moe_linear,
    attrs=(Attr("stage", str, choices=("up", "down")), Attr("top_k", int, at_least=1), EPILOGUE),
    flops=lambda sig: 2 * _routed(sig) * sig.shape("weight")[1] * sig.shape("weight")[2],
    bytes=_moe_bytes, template="moe", arity=(3, -1),
    docs={"x": "activations, or one row per (token, slot)", "gates": "dense gates",
          "weight": "expert weights"}))
