"""fold-norms: a norm read only by matmuls runs inside them. The gain folds into the weight once,
at load time; the row statistics are gathered by the matmul's prologue along the K loop it already
runs and applied in its epilogue; the normalized activation is never stored.

A quantized weight's stored values cannot change, so there the same algebra runs on the other
side of the product: x·diag(γ)·Wᵀ = (x∘γ)·Wᵀ, the gain applied to the activations as the K loop
reads them (fused_linear's `gain` operand).
"""

from __future__ import annotations

import math
import os

import archc.ir.expr as E
from archc.ir.ops import Op
from archc.ir.shapes import QUANT_DTYPES
from archc.passes.linear import Linear, Step, emit, norm_parts, step, view, view_with_bias
from archc.passes.rewrite import Refusal, Rewriter, register_rewrite_pass


def _tag(weight: str, gain: str) -> str:
    """What distinguishes the gain's name from the weight's: layers.0.attn_norm.weight beside
    layers.0.attn.q.weight → attn_norm."""
    w, g = weight.split("."), gain.split(".")
    k = min(len(os.path.commonprefix([w, g])), len(w) - 1, len(g) - 1)
    return ".".join(g[k:-1] if g[-1] == "weight" else g[k:]) or gain


def _readers(rw: Rewriter, norm: int) -> list[Linear]:
    """The linear layers reading `norm`, each with a bias_add after it looked through, when the
    norm can fold into all of them; Refusal naming what stops it otherwise."""
    out: list[Linear] = []
    for u in rw.users(norm):
        lin = view(rw, u)
        if lin is None or lin.operands != (norm,):
            raise Refusal(f"%{u} ({rw.op(u).value}) reads the normalized value, and only a "
                          "matmul can fold it: the norm must be stored")
        if lin.prologue:
            raise Refusal(f"%{u} already folds a norm")
        lin = view_with_bias(rw, u) or lin
        if rw.op(lin.weight) != Op.PARAM:
            raise Refusal(f"the weight of %{u} is computed, not a parameter")
        out.append(lin)
    if not out:
        raise Refusal("nothing reads it")
    norm_parts(rw, norm)
    for lin in out:
        others = [u for u in rw.users(lin.weight) if u not in lin.covers]
        if others and rw.nodes[lin.weight].dtype not in QUANT_DTYPES:   # (no copy: x∘γ)
            w = rw.nodes[lin.weight]
            raise Refusal(f"weight {w.name!r} is also read by %{others[0]} "
                          f"({rw.op(others[0]).value}): folding the gain would store a second, "
                          f"scaled copy of it ({math.prod(int(d) for d in w.shape):,} elements)",
                          profitability=True)
    return out


def _fold(rw: Rewriter, norm: int, lin: Linear) -> None:
    n = rw.nodes[norm]
    x, gain, beta = norm_parts(rw, norm)
    w = rw.nodes[lin.weight]
    tag = _tag(w.name, rw.nodes[gain].name)
    gamma = rw.param_expr(gain)
    if n.attr("unit_offset"):
        gamma = E.call("offset", gamma, by=1.0)        # Gemma: γ = 1 + w
    # W' = W·diag(γ): scale column k of W by γ_k
    folded = E.call("mul", rw.param_expr(lin.weight), gamma)
    like = [norm, *lin.covers]
    on_x = None
    if w.dtype in QUANT_DTYPES:     # the weight keeps its values; x∘γ as the K loop reads it
        w2 = lin.weight
        on_x = gain if not n.attr("unit_offset") else rw.add_param(
            f"{rw.nodes[gain].name}+1", gamma, (w.shape[1],), "f32", like=like, at=lin.root)
    else:
        w2 = rw.add_param(f"{w.name}*{tag}", folded, w.shape, w.dtype, like=like, at=lin.root)
    rest = list(lin.steps)
    if n.attr("kind") == "rms":
        # rms(x)·γ·Wᵀ = rstd·(x·W'ᵀ),  rstd = 1/sqrt(mean(x²) + eps)
        head: list[Step] = [step("rms_scale")]
    else:
        # LN(x)·Wᵀ + c = rstd·(x·W'ᵀ − μ·1ᵀW'ᵀ) + (β·Wᵀ + c): the mean is a rank-1 correction
        # with the column sums of W'; the shift β passes through W into the bias
        # kept in f32 whatever the weights: μ·c cancels against acc, so c must not be rounded
        colsum = rw.add_param(f"{w.name}*{tag}.colsum", E.call("sum", folded, dim=-1),
                              (w.shape[0],), "f32", like=like, at=lin.root)
        head = [step("ln_scale", colsum)]
        if beta is not None:
            shift = E.call("mm", rw.param_expr(lin.weight), rw.param_expr(beta))
            if rest and rest[0].fn == "bias":
                old = rest.pop(0).inputs[0]
                shift = E.call("add", shift, rw.param_expr(old))
                name = f"{rw.nodes[old].name}*{tag}"
            else:
                name = f"{w.name.removesuffix('.weight')}.bias*{tag}"
            b = rw.add_param(name, shift, (w.shape[0],), w.dtype, like=like, at=lin.root)
            head.append(step("bias", b))
    # the prologue gathers the row statistics of the norm's kind: "rms" or "layer"
    new = lin.replace(operands=(x,), weight=w2, prologue=n.attr("kind"), eps=n.attr("eps"),
                      steps=tuple(head + rest), gain=on_x)
    rw.replace(lin.root, emit(rw, new, like=lin.covers))


@register_rewrite_pass("fold-norms", "RMSNorm/LayerNorm read only by matmuls: gain into the "
                       "weights, statistics in the matmuls' prologue, 1/rms (and the mean "
                       "correction) in their epilogue")
def fold_norms(rw: Rewriter) -> None:
    # 1. Legal if every reader of the norm is a linear layer reading it as its one input, with
    #    parameter weights and no prologue yet, and gain and shift are parameters: then the
    #    norm disappears. One other reader (a residual add, a router, the output) must see it.
    # 2. Profitable unless a weight is also read elsewhere (a tied head): folding the gain
    #    would store a second, scaled copy of the table.
    # 3. Each reader gets W' = W·diag(γ) (γ = 1 + w for Gemma) and, for RMSNorm, prologue rms
    #    and epilogue rms_scale, …; for LayerNorm prologue layer, ln_scale(Σ_k W'), bias(W·β + c).
    for i in [i for i in rw.order() if rw.op(i) == Op.NORM]:
        rule = "fold-rmsnorm" if rw.nodes[i].attr("kind") == "rms" else "fold-layernorm"
        readers = rw.attempt(rule, i, _readers, rw, i)
        if readers is None:
            continue
        for lin in readers:
            _fold(rw, i, lin)
        quantized = sorted({rw.nodes[lin.weight].dtype for lin in readers} & set(QUANT_DTYPES))
        why = f"; the gain scales the activations instead of the {', '.join(quantized)} " \
            "weights, whose stored values cannot change" if quantized else ""
        rw.ctx.applied(rule, i, f"into {len(readers)} matmul(s){why}")
