"""Kernel-level ops: what the passes leave behind, one GPU kernel per node.

Each has eager semantics here, so a fused graph runs under the eager interpreter and every fusion
is testable on a CPU; codegen renders the same ops into Triton, and the two must agree.

- ``fused_linear``: ``x @ wᵀ`` with a prologue (row statistics of a folded norm, gathered along
  the K loop) and an epilogue chain (row scale, LayerNorm rank-1 correction, bias, gated or plain
  activation, RoPE, KV-cache write, residual add, soft-cap, scale, per-head norm of QK-norm).
- ``norm``: a row norm with the residual add before it (post-norm) or after it (sandwich).
- ``attention``: flash attention with every score modifier, GQA by index, reading the KV cache.
- ``pointwise``: a fused elementwise chain written as an expression over its inputs.
- ``topk_router`` / ``moe_linear``: MoE routing and grouped expert matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
import torch
import torch.nn.functional as F

from archc.ir.attrs import Attrs, Call
from archc.ir.ops.attention import (
    alibi_bias,
    apply_mask,
    check_dynamic_rope,
    check_window,
    expand_kv,
    groups,
    relative_bias,
    rope,
)
from archc.ir.ops.base import (
    EagerCtx,
    Op,
    OpDef,
    ShapeError,
    Sig,
    broadcast,
    float_dtype,
    register,
    require,
    same_dim,
)
from archc.ir.ops.core import ACTIVATIONS, activation, layernorm, rmsnorm, softcap
from archc.ir.ops.moe import route
from archc.ir.sdpa import sdpa_attention
from archc.ir.shapes import DTYPE_BYTES, P, Shape, numel

# ---- fused_linear ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RowStats:
    """Row statistics a prologue gathered — rstd = 1/sqrt(mean(x²) + eps) for rms; mean and
    rstd = 1/sqrt(var + eps) for layer — and the dtype the kernel stores in."""

    mean: torch.Tensor | None
    rstd: torch.Tensor | None
    dtype: torch.dtype


@dataclass(frozen=True)
class Step:
    """One epilogue step: how many extra inputs it takes, how it changes the width, and what it
    does."""

    inputs: int
    doc: str
    width: Callable[[Call, int, Sequence[Shape], Sig], int]
    apply: Callable[[EagerCtx, torch.Tensor, Call, Sequence[torch.Tensor], RowStats],
                    torch.Tensor]


def _same_width(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
    return width


def _needs_prologue(kind: str) -> Callable[[Call, int, Sequence[Shape], Sig], int]:
    def check(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
        require(sig.attr("prologue") == kind, f"{step.fn}() needs prologue {kind!r}")
        for s in shapes:
            require(len(s) == 1 and int(s[0]) == width, f"{step.fn}() takes a [{width}] vector")
        return width
    return check


def _vector(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
    require(len(shapes[0]) == 1 and int(shapes[0][0]) == width,
            f"{step.fn}() takes a [{width}] vector, got {list(shapes[0])}")
    return width


def _glu_width(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
    require(width % 2 == 0, f"glu() needs an even width, got {width}")
    require(step.kw("fn") in ACTIVATIONS, f"unknown activation {step.kw('fn')!r}")
    return width // 2


def _act_width(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
    require(step.kw("fn") in ACTIVATIONS, f"unknown activation {step.kw('fn')!r}")
    start, stop = step.kw("start", 0), step.kw("stop", width)
    require(0 <= start < stop <= width, f"act() columns [{start}, {stop}) outside {width}")
    return width


def _rope_width(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
    heads, hd, rot = step.kw("heads"), step.kw("head_dim"), step.kw("rotary_dim")
    require(heads * hd <= width, f"rope() over {heads} heads of {hd} exceeds width {width}")
    require(rot % 2 == 0 and 2 <= rot <= hd, f"rotary_dim={rot} for head_dim {hd}")
    pos, freq = shapes
    require(len(pos) == 1 and same_dim(pos[0], sig.shapes[0][-2]),
            f"rope() positions {list(pos)} must be [T]")
    require(len(freq) == 1 and int(freq[0]) == rot // 2, "rope() frequencies ≠ rotary_dim/2")
    check_dynamic_rope(step.kw("dynamic"), rot)
    return width


def _kv_write_width(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
    hd, kv = step.kw("head_dim"), step.kw("kv_heads")
    for col in (step.kw("k_start"), step.kw("v_start")):
        require(col >= 0 and col + kv * hd <= width,
                f"kv_write() columns from {col} for {kv} heads of {hd} exceed width {width}")
    require(len(sig.shapes[0]) == 3, "kv_write() needs x shaped [B, T, K]")
    return width


def _residual_width(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
    want = (*sig.shapes[0][:-1], sympy.Integer(width))
    require(len(shapes[0]) == len(want) and all(same_dim(a, b) for a, b in zip(shapes[0], want)),
            f"residual() {list(shapes[0])} does not match the output {list(want)}")
    return width


def _apply_rope(ctx: EagerCtx, acc: torch.Tensor, step: Call, xs: Sequence[torch.Tensor],
                stats: RowStats) -> torch.Tensor:
    heads, hd = step.kw("heads"), step.kw("head_dim")
    cols = heads * hd
    x = acc[..., :cols].unflatten(-1, (heads, hd)).transpose(-3, -2)   # (B, heads, T, D)
    x = rope(x, xs[0], xs[1], step.kw("rotary_dim"), step.kw("interleaved"),
             step.kw("mscale", 1.0), step.kw("dynamic"))
    return torch.cat([x.transpose(-3, -2).flatten(-2), acc[..., cols:]], dim=-1)


def _apply_kv_write(ctx: EagerCtx, acc: torch.Tensor, step: Call, xs: Sequence[torch.Tensor],
                    stats: RowStats) -> torch.Tensor:
    hd, kv, layer = step.kw("head_dim"), step.kw("kv_heads"), step.kw("layer")
    for kind, start in (("k", step.kw("k_start")), ("v", step.kw("v_start"))):
        part = acc[..., start:start + kv * hd].unflatten(-1, (kv, hd)).transpose(1, 2)
        ctx.cache_append(layer, kind, part.to(stats.dtype).contiguous())  # (B, Hkv, T, D)
    return acc


def _apply_act(ctx: EagerCtx, acc: torch.Tensor, step: Call, xs: Sequence[torch.Tensor],
               stats: RowStats) -> torch.Tensor:
    start, stop = step.kw("start", 0), step.kw("stop", acc.shape[-1])
    if start == 0 and stop == acc.shape[-1]:
        return activation(acc, step.kw("fn"))
    mid = activation(acc[..., start:stop], step.kw("fn"))
    return torch.cat([acc[..., :start], mid, acc[..., stop:]], dim=-1)


def _apply_glu(ctx: EagerCtx, acc: torch.Tensor, step: Call, xs: Sequence[torch.Tensor],
               stats: RowStats) -> torch.Tensor:
    n = acc.shape[-1] // 2
    return activation(acc[..., :n], step.kw("fn")) * acc[..., n:]


def _head_norm_width(step: Call, width: int, shapes: Sequence[Shape], sig: Sig) -> int:
    heads, hd = step.kw("heads"), step.kw("head_dim")
    require(step.kw("kind") in ("rms", "layer"), f"head_norm() kind {step.kw('kind')!r}")
    require(heads * hd <= width, f"head_norm() over {heads} heads of {hd} exceeds width {width}")
    for s in shapes:
        require(len(s) == 1 and int(s[0]) == heads * hd,
                f"head_norm() takes [{heads * hd}] gain and shift, got {list(s)}")
    return width


def _apply_head_norm(ctx: EagerCtx, acc: torch.Tensor, step: Call, xs: Sequence[torch.Tensor],
                     stats: RowStats) -> torch.Tensor:
    heads, hd, eps = step.kw("heads"), step.kw("head_dim"), step.kw("eps")
    cols = heads * hd
    x = acc[..., :cols].unflatten(-1, (heads, hd))                      # (..., heads, D)
    if step.kw("kind") == "rms":
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    else:
        mean = x.mean(-1, keepdim=True)
        y = (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + eps)
    y = y.flatten(-2) * xs[0].float() + xs[1].float()
    return torch.cat([y, acc[..., cols:]], dim=-1)


EPILOGUE: dict[str, Step] = {
    "rms_scale": Step(0, "acc·rstd — the 1/rms of a folded RMSNorm", _needs_prologue("rms"),
                      lambda ctx, acc, st, xs, s: acc * s.rstd),
    "ln_scale": Step(1, "(acc − mean·c)·rstd — a folded LayerNorm; c[n] = Σ_k W'[n, k]",
                     _needs_prologue("layer"),
                     lambda ctx, acc, st, xs, s: (acc - s.mean * xs[0].float()) * s.rstd),
    "bias": Step(1, "acc + b", _vector, lambda ctx, acc, st, xs, s: acc + xs[0].float()),
    "glu": Step(0, "act(acc[:, :N]) · acc[:, N:] — gate rows first, then up rows", _glu_width,
                _apply_glu),
    "act": Step(0, "act(acc) on columns [start, stop)", _act_width, _apply_act),
    "rope": Step(2, "rotate the first `heads` heads (positions, inverse frequencies; "
                 "`dynamic`: rescaled from the sequence length)",
                 _rope_width, _apply_rope),
    "kv_write": Step(0, "write k/v columns into layer `layer`'s cache at offset P",
                     _kv_write_width, _apply_kv_write),
    "residual": Step(1, "acc + r", _residual_width,
                     lambda ctx, acc, st, xs, s: acc + xs[0].float()),
    "softcap": Step(0, "cap·tanh(acc/cap)", _same_width,
                    lambda ctx, acc, st, xs, s: softcap(acc, st.kw("cap"))),
    "scale": Step(0, "acc·factor", _same_width, lambda ctx, acc, st, xs, s: acc * st.kw("by")),
    "head_norm": Step(2, "normalize each of the first `heads` heads over its head_dim columns "
                      "(kind rms or layer), times gain, plus shift (the [heads·head_dim] "
                      "inputs) — QK-norm", _head_norm_width, _apply_head_norm),
}


def _epilogue(sig: Sig) -> tuple[Call, ...]:
    steps = sig.attr("epilogue", ())
    for st in steps:
        require(isinstance(st, Call) and st.fn in EPILOGUE,
                f"unknown epilogue step {st!r} (known: {', '.join(EPILOGUE)})")
    return steps


def _operands(sig_or_attrs: Sig | Attrs) -> int:
    """Activation inputs before the weight: 2 when `concat_k` (x = [x1, x2] along K)."""
    get = sig_or_attrs.attr if isinstance(sig_or_attrs, Sig) else sig_or_attrs.get
    return 2 if get("concat_k") else 1


def _fused_linear_infer(sig: Sig) -> tuple[Shape, str]:
    n = _operands(sig)
    xs, w = sig.shapes[:n], sig.shapes[n]
    x = xs[0]
    k = sum((s[-1] for s in xs), sympy.Integer(0))
    if n == 2:
        require(len(xs[1]) == len(x) and all(same_dim(a, b) for a, b in zip(x[:-1], xs[1][:-1])),
                f"concatenated operands {list(x)} and {list(xs[1])} differ before K")
        require(sig.attr("prologue") is None, "a prologue needs a single operand")
    require(len(w) == 2 and same_dim(k, w[1]), f"x {[list(s) for s in xs]} and weight "
            f"{list(w)} do not match as x @ wᵀ")
    prologue = sig.attr("prologue")
    require(prologue in (None, "rms", "layer"), f"unknown prologue {prologue!r}")
    require((prologue is None) == (sig.attr("eps") is None), "eps goes with a prologue")
    width = int(w[0])
    rest = list(sig.shapes[n + 1:])
    for st in _epilogue(sig):
        step = EPILOGUE[st.fn]
        if len(rest) < step.inputs:
            raise ShapeError(f"{st.fn}() needs {step.inputs} more inputs")
        taken, rest = rest[:step.inputs], rest[step.inputs:]
        width = step.width(st, width, taken, sig)
    require(not rest, f"{len(rest)} inputs left over after the epilogue")
    return (*x[:-1], sympy.Integer(width)), float_dtype(sig)


def _row_stats(x: torch.Tensor, prologue: str | None, eps: float | None) -> RowStats:
    if prologue is None:
        return RowStats(None, None, x.dtype)
    xf = x.float()
    if prologue == "rms":
        return RowStats(None, torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps), x.dtype)
    # the kernel gathers Σx and Σx² along its K loop: var = E[x²] − E[x]²
    mean = xf.mean(-1, keepdim=True)
    var = xf.pow(2).mean(-1, keepdim=True) - mean.pow(2)
    return RowStats(mean, torch.rsqrt(var + eps), x.dtype)


def fused_linear(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    n = _operands(a)
    x, w = xs[0], xs[n]
    stats = _row_stats(x, a.get("prologue"), a.get("eps"))
    if n == 2:  # the K loop runs over x1's columns, then x2's
        k1 = x.shape[-1]
        acc = F.linear(x.float(), w[:, :k1].float()) + F.linear(xs[1].float(), w[:, k1:].float())
    else:
        acc = F.linear(x.float(), w.float())
    rest = list(xs[n + 1:])
    for st in a.get("epilogue", ()):
        step = EPILOGUE[st.fn]
        taken, rest = rest[:step.inputs], rest[step.inputs:]
        acc = step.apply(ctx, acc, st, taken, stats)
    return acc.to(x.dtype)


def _fused_linear_flops(sig: Sig) -> sympy.Expr:
    x, w = sig.shapes[0], sig.shapes[_operands(sig)]
    return 2 * numel(x[:-1]) * w[0] * w[1] + 4 * numel(sig.out_shape)


def _fused_linear_bytes(sig: Sig) -> sympy.Expr:
    total = numel(sig.out_shape) * DTYPE_BYTES[sig.out_dtype]
    for s, d in zip(sig.shapes, sig.dtypes):
        total += numel(s) * DTYPE_BYTES[d]
    for st in sig.attr("epilogue", ()):
        if st.fn == "kv_write":  # k and v rows go to the cache as well
            rows = numel(sig.shapes[0][:-1])
            total += 2 * rows * st.kw("kv_heads") * st.kw("head_dim") * DTYPE_BYTES[
                sig.out_dtype]
    return total


register(OpDef(
    Op.FUSED_LINEAR, "x @ wᵀ with a norm prologue and an epilogue chain, one kernel; with "
    "concat_k, x is two operands concatenated along K (parallel blocks' out + down).",
    '%9 : f32[B,T,128] = fused_linear(%3, %8, %1, %7) {epilogue=[rms_scale(), rope(heads=6, '
    'head_dim=16, interleaved=false, rotary_dim=16), kv_write(head_dim=16, k_start=64, '
    'kv_heads=2, layer=0, v_start=96)], eps=1e-05, prologue="rms"}',
    (2, -1), _fused_linear_infer, fused_linear, flops=_fused_linear_flops,
    bytes=_fused_linear_bytes, optional=("prologue", "eps", "epilogue", "concat_k")))


# ---- norm ------------------------------------------------------------------------------------

def _norm_inputs(a: Attrs | Sig) -> list[str]:
    get = a.attr if isinstance(a, Sig) else a.get
    names = ["x", "weight"]
    if get("bias"):
        names.append("bias")
    if get("add_before"):
        names.append("residual_before")
    if get("add_after"):
        names.append("residual_after")
    return names


def _norm_kernel_infer(sig: Sig) -> tuple[Shape, str]:
    names = _norm_inputs(sig)
    require(len(sig.shapes) == len(names), f"norm takes {', '.join(names)}")
    require(sig.attr("kind") in ("rms", "layer"), "kind must be rms or layer")
    require(not (sig.attr("unit_offset") and sig.attr("kind") == "layer"),
            "unit_offset is for rms norms")
    x = sig.shapes[0]
    for name, s in zip(names[1:], sig.shapes[1:]):
        if name.startswith("residual"):
            require(len(s) == len(x) and all(same_dim(a, b) for a, b in zip(s, x)),
                    f"{name} {list(s)} does not match x {list(x)}")
        else:
            require(len(s) == 1 and same_dim(s[0], x[-1]), f"{name} {list(s)} ≠ [{x[-1]}]")
    return x, float_dtype(sig)


def norm_kernel(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    got = dict(zip(_norm_inputs(a), xs))
    x = got["x"]
    if "residual_before" in got:
        x = (x.float() + got["residual_before"].float()).to(x.dtype)
    if a["kind"] == "rms":
        y = rmsnorm(x, got["weight"], a["eps"], a.get("unit_offset", False))
    else:
        y = layernorm(x, got["weight"], got.get("bias"), a["eps"])
    if "residual_after" in got:
        y = (y.float() + got["residual_after"].float()).to(x.dtype)
    return y


register(OpDef(
    Op.NORM, "A row norm, with a residual add before it (post-norm) or after it (sandwich).",
    '%20 : f32[B,T,64] = norm(%18, %19, %4) {add_after=true, add_before=false, bias=false, '
    'eps=1e-06, kind="rms", unit_offset=true}', (2, 5), _norm_kernel_infer, norm_kernel,
    flops=lambda sig: 8 * numel(sig.out_shape),
    attrs=("kind", "eps", "bias", "add_before", "add_after"), optional=("unit_offset",)))


# ---- attention -------------------------------------------------------------------------------

def _attention_inputs(a: Attrs | Sig) -> list[str]:
    get = a.attr if isinstance(a, Sig) else a.get
    names = ["q"]
    if get("cache_layer") is None:
        names += ["k", "v"]
    if get("padding"):
        names.append("padding")
    if get("prefix"):
        names.append("prefix_len")
    bias = get("bias")
    if bias is not None:
        names.append("slopes" if bias.fn == "alibi" else "rel_table")
    return names


def _attention_infer(sig: Sig) -> tuple[Shape, str]:
    names = _attention_inputs(sig)
    require(len(sig.shapes) == len(names), f"attention takes {', '.join(names)}")
    got = dict(zip(names, sig.shapes))
    q = got["q"]
    require(len(q) == 4, f"q must be [B, H, T, D], got {list(q)}")
    if "k" in got:
        k, v = got["k"], got["v"]
        require(len(k) == 4 and k == v, f"k {list(k)} and v {list(v)} must match [B, H_kv, L, D]")
        groups(q[1], k[1])
        require(same_dim(k[3], q[3]), f"k head dim {k[3]} ≠ q head dim {q[3]}")
        length = k[2]
    else:
        require(isinstance(sig.attr("kv_heads"), int), "a cached attention needs kv_heads")
        groups(q[1], sympy.Integer(sig.attr("kv_heads")))
        length = P + q[2]
    if "padding" in got:
        require(len(got["padding"]) == 2 and same_dim(got["padding"][1], length),
                f"padding {list(got['padding'])} must be [B, {length}]")
    bias = sig.attr("bias")
    require(bias is None or (isinstance(bias, Call) and bias.fn in ("alibi", "t5")),
            f"bias must be alibi() or t5(...), got {bias!r}")
    check_window(sig.attr("window"), sig.attr("global_tokens"), sig.attr("prefix"))
    return (q[0], q[2], q[1] * q[3]), float_dtype(sig)


def attention(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    """softmax(mask(bias(softcap(scale·q·kᵀ)))) · v, in f32, heads merged: [B, T, H·D]."""
    got = dict(zip(_attention_inputs(a), xs))
    q = got["q"]
    layer = a.get("cache_layer")
    if layer is not None:
        k, v = ctx.cache_read(layer, "k"), ctx.cache_read(layer, "v")
    else:
        k, v = got["k"], got["v"]
    fast = sdpa_attention(q, k, v, a, padding=got.get("padding"), prefix_len=got.get(
        "prefix_len"), bias_input=got.get("slopes", got.get("rel_table")))
    if fast is not None:  # PyTorch's fused attention, wherever the mask allows (archc.ir.sdpa)
        return fast
    b, h, t, d = q.shape
    k, v = expand_kv(k, h).float(), expand_kv(v, h).float()
    s = (q.float() @ k.transpose(-1, -2)) * a["scale"]
    if a.get("softcap") is not None:
        s = softcap(s, a["softcap"])
    bias = a.get("bias")
    if bias is not None and bias.fn == "alibi":
        s = s + alibi_bias(got["slopes"], t, s.shape[-1])[None]
    elif bias is not None:
        s = s + relative_bias(got["rel_table"].float(), t, s.shape[-1],
                              bias.kw("bidirectional"), bias.kw("max_distance"))[None]
    prefix = int(got["prefix_len"]) if "prefix_len" in got else None
    s = apply_mask(s, a["causal"], a.get("window"), got.get("padding"), prefix,
                   a.get("global_tokens"))
    out = torch.softmax(s, dim=-1) @ v                                  # (B, H, T, D)
    return out.transpose(1, 2).reshape(b, t, h * d).to(q.dtype)


def visible_pairs(t: sympy.Expr, length: sympy.Expr, causal: bool,
                  window: int | None, global_tokens: int | None = None) -> sympy.Expr:
    """Query-key pairs a mask lets through, for T queries at the end of L keys. Causal row i
    sees min(L − T + i + 1, W) keys; with k = clamp(W − (L − T) − 1, 0, T) rows below the cap,
    Σ = k(L − T + 1) + k(k − 1)/2 + (T − k)·W. Bidirectional windows are approximated by
    T·min(L, 2W − 1). G global tokens add, causally, the global keys behind the window,
    min(G, L − W) per row (an upper bound: the last row's count); bidirectionally, G keys per
    row and G rows that see all L keys."""
    past = length - t
    if not causal:
        if window is None:
            return t * length
        pairs = t * sympy.Min(length, 2 * window - 1)
        if global_tokens is not None:
            g = global_tokens
            pairs = sympy.Min(t * length, pairs + t * g + sympy.Min(g, t) * length)
        return pairs
    if window is None:
        return t * past + t * (t + 1) / 2
    k = sympy.Min(t, sympy.Max(0, window - past - 1))
    pairs = k * (past + 1) + k * (k - 1) / 2 + (t - k) * window
    if global_tokens is not None:
        pairs += t * sympy.Min(global_tokens, sympy.Max(0, length - window))
    return pairs


def _attention_shapes(sig: Sig) -> tuple[Shape, sympy.Expr]:
    q = sig.shapes[0]
    length = sig.shapes[1][2] if sig.attr("cache_layer") is None else P + q[2]
    return q, length


def _attention_flops(sig: Sig) -> sympy.Expr:
    q, length = _attention_shapes(sig)
    pairs = visible_pairs(q[2], length, sig.attr("causal"), sig.attr("window"),
                          sig.attr("global_tokens"))
    return q[0] * q[1] * pairs * (4 * q[3] + 5)


def _attention_bytes(sig: Sig) -> sympy.Expr:
    q, length = _attention_shapes(sig)
    kv_heads = sig.shapes[1][1] if sig.attr("cache_layer") is None else sig.attr("kv_heads")
    window, g = sig.attr("window"), sig.attr("global_tokens")
    if window is None or (g is not None and not sig.attr("causal")):
        keys = length       # bidirectional global rows read every key
    else:
        keys = sympy.Min(length, window + q[2] + (g or 0))
    item = DTYPE_BYTES[sig.dtypes[0]]
    return (2 * numel(q) + 2 * q[0] * kv_heads * keys * q[3]) * item


register(OpDef(
    Op.ATTENTION, "Flash attention: scale, soft-cap, ALiBi or T5 bias, causal/window (with "
    "global tokens)/prefix/padding mask, GQA by index, over given k/v or the layer's KV cache; "
    "heads merged.",
    '%12 : f32[B,T,64] = attention(%11) {cache_layer=0, causal=true, kv_heads=2, '
    'padding=false, prefix=false, scale=0.25, window=8}', (1, 6), _attention_infer,
    attention, flops=_attention_flops, bytes=_attention_bytes,
    attrs=("scale", "causal", "padding", "prefix"),
    optional=("window", "global_tokens", "softcap", "bias", "cache_layer", "kv_heads")))


# ---- pointwise -------------------------------------------------------------------------------

POINTWISE_FNS: dict[str, Callable[..., torch.Tensor]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "scale": lambda a, by: a * by,
    "act": lambda a, fn: activation(a, fn),
    "softcap": lambda a, cap: softcap(a, cap),
}


def eval_pointwise(expr: Call, xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Evaluate an expression tree whose leaves are `x(i)` (input i), in f32."""
    if expr.fn == "x":
        return xs[expr.args[0]].float()
    args = [eval_pointwise(a, xs) if isinstance(a, Call) else a for a in expr.args]
    return POINTWISE_FNS[expr.fn](*args, **dict(expr.kwargs))


def _check_pointwise(expr: object, n_inputs: int) -> None:
    require(isinstance(expr, Call), f"pointwise expr must be a call, got {expr!r}")
    assert isinstance(expr, Call)
    if expr.fn == "x":
        require(len(expr.args) == 1 and 0 <= expr.args[0] < n_inputs,
                f"x({expr.args}) is not one of {n_inputs} inputs")
        return
    require(expr.fn in POINTWISE_FNS, f"unknown pointwise function {expr.fn!r}")
    for arg in expr.args:
        if isinstance(arg, Call):
            _check_pointwise(arg, n_inputs)


def _pointwise_infer(sig: Sig) -> tuple[Shape, str]:
    _check_pointwise(sig.attr("expr"), len(sig.shapes))
    out = sig.shapes[0]
    for s in sig.shapes[1:]:
        out = broadcast(out, s)
    return out, float_dtype(sig)


register(OpDef(
    Op.POINTWISE, "A fused elementwise chain: an expression over inputs x(0), x(1)…",
    '%15 : f32[B,T,176] = pointwise(%13, %14) {expr=mul(act(x(0), fn="silu"), x(1))}',
    (1, -1), _pointwise_infer,
    lambda ctx, xs, a: eval_pointwise(a["expr"], xs).to(xs[0].dtype),
    flops=lambda sig: 4 * numel(sig.out_shape), attrs=("expr",)))


# ---- MoE -------------------------------------------------------------------------------------

def _router_infer(sig: Sig) -> tuple[Shape, str]:
    x, w = sig.shapes
    require(len(w) == 2 and same_dim(w[1], x[-1]), f"router weight {list(w)} ≠ [E, {x[-1]}]")
    require(1 <= sig.attr("top_k") <= int(w[0]), f"top_k {sig.attr('top_k')} of {w[0]} experts")
    return (*x[:-1], w[0]), float_dtype(sig)


register(OpDef(
    Op.TOPK_ROUTER, "Router matmul, softmax and top-k in one kernel: dense gates [..., E].",
    "%30 : f32[B,T,4] = topk_router(%28, %29) {normalize=true, top_k=2}", (2, 2),
    _router_infer,
    lambda ctx, xs, a: route(F.linear(xs[0].float(), xs[1].float()), a["top_k"],
                             a["normalize"]).to(xs[0].dtype),
    flops=lambda sig: 2 * numel(sig.shapes[0]) * sig.shapes[1][0],
    attrs=("top_k", "normalize")))


def selected_experts(gates: torch.Tensor, top_k: int) -> torch.Tensor:
    """The experts each token was routed to, in ascending expert order: [..., top_k]."""
    return gates.float().topk(top_k, dim=-1).indices.sort(dim=-1).values


def moe_linear(ctx: EagerCtx, xs: Sequence[torch.Tensor], a: Attrs) -> torch.Tensor:
    x, gates, w = xs
    idx = selected_experts(gates, a["top_k"])                     # (B, T, k)
    if a["stage"] == "up":
        wsel = w.float()[idx]                                      # (B, T, k, Nw, d)
        h = torch.einsum("btd,btknd->btkn", x.float(), wsel)
        if a["gated"]:
            n = h.shape[-1] // 2
            h = activation(h[..., :n], a["act"]) * h[..., n:]
        else:
            h = activation(h, a["act"])
        return h.to(x.dtype)                                       # (B, T, k, F)
    wsel = w.float()[idx]                                          # (B, T, k, d, F)
    y = torch.einsum("btkf,btkdf->btkd", x.float(), wsel)
    g = gates.float().gather(-1, idx)                              # (B, T, k)
    return (y * g[..., None]).sum(dim=-2).to(x.dtype)              # (B, T, d)


def _moe_linear_infer(sig: Sig) -> tuple[Shape, str]:
    x, gates, w = sig.shapes
    k = sig.attr("top_k")
    require(sig.attr("stage") in ("up", "down"), "stage must be up or down")
    require(len(w) == 3 and same_dim(gates[-1], w[0]), f"weights {list(w)} for {gates[-1]} "
            "experts")
    if sig.attr("stage") == "up":
        require(same_dim(x[-1], w[2]), f"x width {x[-1]} ≠ expert input {w[2]}")
        width = int(w[1]) // 2 if sig.attr("gated") else int(w[1])
        require(sig.attr("act") in ACTIVATIONS, f"unknown activation {sig.attr('act')!r}")
        return (*x[:-1], sympy.Integer(k), sympy.Integer(width)), float_dtype(sig)
    require(len(x) >= 2 and int(x[-2]) == k and same_dim(x[-1], w[2]),
            f"hidden {list(x)} must be [..., {k}, {w[2]}]")
    return (*x[:-2], w[1]), float_dtype(sig)


def _moe_linear_flops(sig: Sig) -> sympy.Expr:
    x, _, w = sig.shapes
    tokens = numel(x[:-1]) if sig.attr("stage") == "up" else numel(x[:-2])
    return 2 * tokens * sig.attr("top_k") * w[1] * w[2]


def _moe_linear_bytes(sig: Sig) -> sympy.Expr:
    x, gates, w = sig.shapes
    tokens = numel(x[:-1]) if sig.attr("stage") == "up" else numel(x[:-2])
    active = sympy.Min(w[0], tokens * sig.attr("top_k"))
    weights = active * w[1] * w[2] * DTYPE_BYTES[sig.dtypes[2]]
    acts = (numel(x) + numel(sig.out_shape)) * DTYPE_BYTES[sig.dtypes[0]]
    return weights + acts + numel(gates) * DTYPE_BYTES[sig.dtypes[1]]


register(OpDef(
    Op.MOE_LINEAR, "Grouped expert matmul: `up` computes act(gate)·up per routed expert "
    "[..., k, F]; `down` projects back and sums weighted by the gates.",
    '%31 : f32[B,T,2,96] = moe_linear(%28, %30, %26) {act="silu", gated=true, stage="up", '
    'top_k=2}', (3, 3), _moe_linear_infer, moe_linear, flops=_moe_linear_flops,
    bytes=_moe_linear_bytes, attrs=("stage", "top_k"), optional=("act", "gated")))
