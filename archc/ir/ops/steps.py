"""Epilogue steps: what a kernel that writes rows (``fused_linear``, ``norm``, ``moe_linear``) does
to each row of its f32 accumulator before the one store, in order, such as ``[rms_scale(), bias(),
act(fn="silu")]``; a step's inputs follow the node's own operands, named by step (``bias1``…).
*Elementwise* steps are an expression (``archc.ir.expr``) over the accumulator ``x(0)`` and their
inputs; *structural* steps change the width or reach across columns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch

import archc.ir.expr as E
from archc.ir.attrs import Attr, Call, call_problem
from archc.ir.ops.attention import KV_QUANT_ATTR, ROPE_ATTRS, ROTATION_DOC, check_rope, rope
from archc.ir.ops.base import (
    ROW_KERNELS,
    EagerCtx,
    Op,
    Shape,
    ShapeError,
    Sig,
    require,
    same_shape,
)
from archc.ir.paramexpr import rope_pair_order


@dataclass(frozen=True)
class RowStats:
    """The dtype the kernel stores in, and the row statistics a prologue gathered — rstd =
    1/sqrt(mean(x²) + eps) for rms; mean and rstd = 1/sqrt(var + eps) for layer."""

    dtype: torch.dtype
    mean: torch.Tensor | None = None
    rstd: torch.Tensor | None = None


def normalize(x: torch.Tensor, kind: str, eps: float) -> tuple[torch.Tensor, RowStats]:
    """x normalized over its last dim in f32 (rms: x·rstd; layer: (x − mean)·rstd), and the
    statistics."""
    xf = x.float()
    mean = xf.mean(-1, keepdim=True) if kind == "layer" else None
    centered = xf if mean is None else xf - mean
    rstd = torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + eps)
    return centered * rstd, RowStats(x.dtype, mean, rstd)


# a structural step's rule: the step, the width before it, its inputs' shapes and the node; it
# checks them, and gives the width after the step
WidthFn = Callable[[Call, int, Sequence[Shape], Sig], int]
ApplyFn = Callable[[EagerCtx, torch.Tensor, Call, Sequence[torch.Tensor], RowStats], torch.Tensor]


@dataclass(frozen=True)
class StepDecl:
    name: str
    doc: str
    inputs: tuple[str, ...] = ()
    params: tuple[Attr, ...] = ()
    expr: Call | None = None        # elementwise: over x(0) = the accumulator, then the inputs
    width: WidthFn | None = None    # structural: checks, and the width after the step
    apply: ApplyFn | None = None    # structural: eager semantics
    kernels: frozenset[Op] = frozenset({Op.FUSED_LINEAR})
    docs: tuple[str, ...] = ()      # what each input holds
    prologue: str | None = None     # the row statistics it needs (a folded norm's)

    @property
    def elementwise(self) -> bool:
        return self.expr is not None


# ---- structural steps ---------------------------------------------------------------------------

def _heads(st: Call, width: int) -> int:
    """The columns of the first `heads` heads, which rope() and head_norm() work on."""
    heads, hd = st.kw("heads"), st.kw("head_dim")
    require(heads * hd <= width, f"{st.fn}() over {heads} heads of {hd} exceeds width {width}")
    return heads * hd


def _rope_width(st: Call, width: int, inputs: Sequence[Shape], node: Sig) -> int:
    _heads(st, width)
    require(st.kw("rotary_start", 0) + st.kw("rotary_dim") <= st.kw("head_dim"),
            f"rope() rotates dims [{st.kw('rotary_start', 0)}, "
            f"{st.kw('rotary_start', 0) + st.kw('rotary_dim')}) of heads of {st.kw('head_dim')}")
    pos, rotation = inputs
    k = list(node.attr("epilogue")).index(st)     # the step's inputs are named by its index
    check_rope(st.kw("rotary_dim"), st.kw("head_dim"), node.shapes[0][-2], pos, rotation,
               node.dtype(f"rotation{k}"), st.kw("dynamic"))
    return width


def _head_norm_width(st: Call, width: int, inputs: Sequence[Shape], node: Sig) -> int:
    cols = _heads(st, width)
    for shape in inputs:
        require(len(shape) == 1 and int(shape[0]) == cols,
                f"head_norm() takes [{cols}] gain and shift, got {list(shape)}")
    return width


def _kv_write_width(st: Call, width: int, inputs: Sequence[Shape], node: Sig) -> int:
    hd, kv = st.kw("head_dim"), st.kw("kv_heads")
    for col in (st.kw("k_start"), st.kw("v_start")):
        require(col + kv * hd <= width,
                f"kv_write() columns from {col} for {kv} heads of {hd} exceed width {width}")
    require(len(node.shapes[0]) == 3, "kv_write() needs x shaped [B, T, K]")
    return width


def _paged_kv_write_width(st: Call, width: int, inputs: Sequence[Shape], node: Sig) -> int:
    _kv_write_width(st, width, inputs, node)
    pos, table = inputs
    tokens = node.shapes[0][1]
    require(len(pos) == 1 and pos[0] == tokens and len(table) == 2 and table[0] == tokens and
            table[1].is_Integer, f"paged_kv_write() takes positions [{tokens}] and a block "
            f"table [{tokens}, blocks], got {list(pos)} and {list(table)}")
    return width


def _act_width(st: Call, width: int, inputs: Sequence[Shape], node: Sig) -> int:
    start, stop = st.kw("start", 0), st.kw("stop", width)
    require(start < stop <= width, f"act() columns [{start}, {stop}) outside {width}")
    return width


def glu_expr(st: Call) -> Call:
    """What a glu() step computes from the gate x(0) and the up x(1): act(gate)·up, with the
    step's `gate` and `up` expressions (each over its own column, x(0)) applied first."""
    gate, up = (E.substitute(st.kw(k), [E.x(i)]) if st.kw(k) is not None else E.x(i)
                for i, k in enumerate(("gate", "up")))
    return E.call("mul", E.call("act", gate, fn=st.kw("fn")), up)


def glu_triton(st: Call, gate: str, up: str) -> str:
    """A glu() step as Triton code over the gate and up values named `gate` and `up`."""
    gate, up = (E.triton(st.kw(k), [v]) if st.kw(k) is not None else v
                for k, v in (("gate", gate), ("up", up)))
    return f"{E.act_code(st.kw('fn'), gate)} * {up}"


def _glu_width(st: Call, width: int, inputs: Sequence[Shape], node: Sig) -> int:
    require(width % 2 == 0, f"glu() needs an even width, got {width}")
    for key in ("gate", "up"):
        if st.kw(key) is not None:
            problem = E.problem(st.kw(key), 1)
            require(problem is None, f"glu() {key}: {problem}")
    return width // 2


def _apply_glu(ctx: EagerCtx, acc: torch.Tensor, st: Call, xs: Sequence[torch.Tensor],
               stats: RowStats) -> torch.Tensor:
    if st.kw("interleaved", False):   # gate row n and up row n side by side: columns 2n, 2n + 1
        gate, up = acc[..., 0::2], acc[..., 1::2]
    else:
        n = acc.shape[-1] // 2
        gate, up = acc[..., :n], acc[..., n:]
    return E.evaluate(glu_expr(st), [gate, up])


def _apply_rope(ctx: EagerCtx, acc: torch.Tensor, st: Call, xs: Sequence[torch.Tensor],
                stats: RowStats) -> torch.Tensor:
    heads, hd, start = st.kw("heads"), st.kw("head_dim"), st.kw("rotary_start", 0)
    x = acc[..., :heads * hd].unflatten(-1, (heads, hd)).transpose(-3, -2)   # (B, heads, T, D)
    x = torch.cat([x[..., :start], rope(x[..., start:], xs[0], xs[1], st.kw("rotary_dim"),
                                        st.kw("interleaved"), st.kw("dynamic"))], dim=-1)
    return torch.cat([x.transpose(-3, -2).flatten(-2), acc[..., heads * hd:]], dim=-1)


def _apply_kv_write(ctx: EagerCtx, acc: torch.Tensor, st: Call, xs: Sequence[torch.Tensor],
                    stats: RowStats) -> torch.Tensor:
    hd, kv = st.kw("head_dim"), st.kw("kv_heads")
    # without `values` the key rows alone (latent attention's values are their first columns)
    for kind in ("k", "v") if st.kw("values", True) else ("k",):
        start = st.kw(f"{kind}_start")
        part = acc[..., start:start + kv * hd].unflatten(-1, (kv, hd)).transpose(1, 2)
        ctx.cache_append(st.kw("layer"), kind, part.to(stats.dtype).contiguous(),   # (B, Hkv, T, D)
                         st.kw("quant"))
    return acc


def _apply_paged_kv_write(ctx: EagerCtx, acc: torch.Tensor, st: Call,
                          xs: Sequence[torch.Tensor], stats: RowStats) -> torch.Tensor:
    hd, kv = st.kw("head_dim"), st.kw("kv_heads")
    for kind in ("k", "v"):
        start = st.kw(f"{kind}_start")
        part = acc[..., start:start + kv * hd].unflatten(-1, (kv, hd)).transpose(1, 2)
        ctx.paged_write(st.kw("layer"), kind, part.to(stats.dtype), *xs)    # (1, Hkv, T, D)
    return acc


def _apply_head_norm(ctx: EagerCtx, acc: torch.Tensor, st: Call, xs: Sequence[torch.Tensor],
                     stats: RowStats) -> torch.Tensor:
    cols = st.kw("heads") * st.kw("head_dim")
    x = acc[..., :cols].unflatten(-1, (st.kw("heads"), st.kw("head_dim")))  # (..., heads, D)
    y = normalize(x, st.kw("kind"), st.kw("eps"))[0].flatten(-2)
    return torch.cat([y * xs[0].float() + xs[1].float(), acc[..., cols:]], dim=-1)


ACC = E.x(0)
ACT_FN = Attr("fn", str, choices=tuple(E.ACTIVATIONS))
HEADS = (Attr("heads", int, at_least=1), Attr("head_dim", int, at_least=2))
# the kernels whose rows hold whole heads of q, k and v: a projection's, and a norm over them
# (a QK-norm over the whole projection, which a projection's column tiles cannot compute)
HEAD_KERNELS = frozenset({Op.FUSED_LINEAR, Op.NORM})

STEPS: dict[str, StepDecl] = {d.name: d for d in (
    StepDecl("rms_scale", "acc·rstd — the 1/rms of a folded RMSNorm", prologue="rms",
             apply=lambda ctx, acc, st, xs, s: acc * s.rstd),
    StepDecl("ln_scale", "(acc − mean·c)·rstd — a folded LayerNorm; c[n] = Σ_k W'[n, k]",
             ("colsum",), prologue="layer", docs=("column sums Σ_k W'[n, k]",),
             apply=lambda ctx, acc, st, xs, s: (acc - s.mean * xs[0].float()) * s.rstd),
    StepDecl("bias", "acc + b", ("bias",), expr=E.call("add", ACC, E.x(1)), kernels=ROW_KERNELS,
             docs=("bias",)),
    StepDecl("glu", "act(acc[:, :N]) · acc[:, N:] — gate rows first, then up rows; with "
             "`interleaved` act(acc[:, 0::2]) · acc[:, 1::2] — gate row n and up row n side by "
             "side (the weight's halves interleaved at load time); `gate` and `up`, elementwise "
             "expressions of x(0), apply to each half first: act(gate(g))·up(u) (gpt-oss's "
             "clamps)",
             params=(ACT_FN, Attr("interleaved", bool, False), Attr("gate", Call, None),
                     Attr("up", Call, None)), width=_glu_width, apply=_apply_glu,
             kernels=frozenset({Op.FUSED_LINEAR, Op.MOE_LINEAR})),
    StepDecl("act", "act(acc) on columns [start, stop)",
             params=(ACT_FN, Attr("start", int, 0, at_least=0), Attr("stop", int, None)),
             expr=E.call("act", ACC, fn="identity"), width=_act_width, kernels=ROW_KERNELS),
    StepDecl("rope", "rotate the first `heads` heads (positions; cos and sin from the table, "
             "or with `dynamic` from frequencies rescaled by the sequence length) — dims "
             "[rotary_start, rotary_start + rotary_dim) of each",
             ("pos", "rotation"), params=(*HEADS, *ROPE_ATTRS,
                                          Attr("rotary_start", int, 0, at_least=0)),
             width=_rope_width,
             apply=_apply_rope, kernels=HEAD_KERNELS, docs=("positions", ROTATION_DOC)),
    StepDecl("kv_write", "write k/v columns into layer `layer`'s cache at offset P (without "
             "`values` the key rows only: values that are the keys' first columns); with "
             "`quant` (int8, fp8) as codes and an f32 scale per (token, head) = max|x|/QMAX",
             params=(Attr("head_dim", int, at_least=1), Attr("k_start", int, at_least=0),
                     Attr("kv_heads", int, at_least=1), Attr("layer", int, at_least=0),
                     Attr("v_start", int, at_least=0), KV_QUANT_ATTR,
                     Attr("values", bool, True)),
             width=_kv_write_width, apply=_apply_kv_write, kernels=HEAD_KERNELS),
    StepDecl("paged_kv_write", "write k/v columns into layer `layer`'s paged pool: token t "
             "at position pos[t] into block block_table[t, pos[t] // block_size], offset "
             "pos[t] % block_size", ("pos", "block_table"),
             params=(Attr("block_size", int, at_least=1), Attr("head_dim", int, at_least=1),
                     Attr("k_start", int, at_least=0), Attr("kv_heads", int, at_least=1),
                     Attr("layer", int, at_least=0), Attr("v_start", int, at_least=0)),
             width=_paged_kv_write_width, apply=_apply_paged_kv_write, kernels=HEAD_KERNELS,
             docs=("positions", "each token's sequence's blocks")),
    StepDecl("residual", "acc + r", ("res",), expr=E.call("add", ACC, E.x(1)),
             kernels=ROW_KERNELS, docs=("residual rows",)),
    StepDecl("gate", "acc·y — the rows times another kernel's (an attention output by its "
             "σ(gate) projection)", ("other",), expr=E.call("mul", ACC, E.x(1)),
             kernels=frozenset({Op.FUSED_LINEAR, Op.NORM}), docs=("rows it multiplies",)),
    StepDecl("softcap", "cap·tanh(acc/cap)", params=(Attr("cap", float),),
             expr=E.call("softcap", ACC, cap=1.0), kernels=ROW_KERNELS),
    StepDecl("scale", "acc·by", params=(Attr("by", float),), expr=E.call("scale", ACC, by=1.0),
             kernels=ROW_KERNELS),
    StepDecl("head_norm", "normalize each of the first `heads` heads over its head_dim columns "
             "(kind rms or layer), times gain, plus shift (the [heads·head_dim] inputs) — "
             "QK-norm", ("gain", "shift"),
             params=(Attr("kind", str, choices=("rms", "layer")), Attr("eps", float), *HEADS),
             width=_head_norm_width, apply=_apply_head_norm, docs=("head gains", "head shifts")),
)}


PAIRING = ("glu", "rope")   # the steps that combine two columns of the accumulator


def pair_order(steps: Sequence[Call], width: int) -> list[int]:
    """The weight rows of a projection whose rows are paired-adjacent (fused_linear's
    `paired`): the columns of its pairing step (glu, rope) pair after pair, each pair's partners
    side by side — glu: gate n, up n + N/2 (the param function `interleave`); rope:
    `rope_pair_order` (the param function `rope_pairs`)."""
    for st in steps:
        if st.fn == "glu":
            return [c for n in range(width // 2) for c in (n, n + width // 2)]
        if st.fn == "rope":
            return rope_pair_order(width, st.kw("heads"), st.kw("head_dim"), st.kw("rotary_dim"),
                                   st.kw("interleaved"))
    raise ShapeError("paired rows need a glu() or rope() epilogue step")


def unpair(acc: torch.Tensor, steps: Sequence[Call]) -> torch.Tensor:
    """The accumulator of paired-adjacent weight rows back in column order (a permutation)."""
    out = torch.empty_like(acc)
    out[..., pair_order(steps, acc.shape[-1])] = acc
    return out


def step_expr(st: Call) -> Call:
    """An elementwise step's expression, its parameters filled in from the step."""
    e = STEPS[st.fn].expr
    assert e is not None
    params = {k: v for k, v in st.kwargs if k not in ("start", "stop")}
    return E.call(e.fn, *e.args, **{**dict(e.kwargs), **params})


step = E.call   # an epilogue step: a call with keyword parameters only


def epilogue_docs(attrs: Mapping[str, Any]) -> dict[str, str]:
    """What each input the epilogue reads holds, by role `<input><step index>`, in order (an
    unknown step, which the verifier reports, reads none)."""
    return {f"{name}{k}": doc for k, st in enumerate(attrs.get("epilogue") or ()) if st.fn in STEPS
            for name, doc in zip(STEPS[st.fn].inputs, STEPS[st.fn].docs, strict=True)}


def epilogue_roles(attrs: Mapping[str, Any]) -> list[str]:
    return list(epilogue_docs(attrs))


def check_epilogue(sig: Sig, op: Op, width: int, taken: int, rows: Shape) -> int:
    """Check the epilogue of a node whose own operands are the first `taken` inputs and whose
    result is `width` wide (over leading dims `rows`) before it; the width after it."""
    rest = list(sig.shapes[taken:])
    for st in sig.attr("epilogue", ()):
        if (d := STEPS.get(st.fn)) is None:
            raise ShapeError(f"unknown epilogue step {st!r} (known: {', '.join(STEPS)})")
        require(op in d.kernels, f"{st.fn}() is not an epilogue step of {op.value}")
        require(d.prologue in (None, sig.attr("prologue")), f"{st.fn}() needs prologue "
                f"{d.prologue!r}")
        problem = call_problem(st, d.params)
        require(problem is None, str(problem))
        inputs, rest = tuple(rest[:len(d.inputs)]), rest[len(d.inputs):]
        require(len(inputs) == len(d.inputs), f"{st.fn}() needs {len(d.inputs)} more inputs")
        if d.width is not None:
            width = d.width(st, width, inputs, sig)
        for shape, name in zip(inputs, d.inputs):   # the others' width rules check theirs
            if name in ("bias", "colsum"):            # a value per column
                require(len(shape) == 1 and int(shape[0]) == width,
                        f"{st.fn}() takes a [{width}] vector, got {list(shape)}")
            elif name == "res":                       # a value per element
                want = (*rows, sympy.Integer(width))
                require(same_shape(shape, want),
                        f"{st.fn}() {list(shape)} does not match the rows {list(want)}")
    require(not rest, f"{len(rest)} inputs left over after the epilogue")
    return width


def apply_epilogue(ctx: EagerCtx, acc: torch.Tensor, steps: Sequence[Call],
                   inputs: Sequence[torch.Tensor], stats: RowStats) -> torch.Tensor:
    """The epilogue on an f32 accumulator [..., N]."""
    rest = list(inputs)
    for st in steps:
        d = STEPS[st.fn]
        xs, rest = rest[:len(d.inputs)], rest[len(d.inputs):]
        if d.apply is not None:
            acc = d.apply(ctx, acc, st, xs, stats)
            continue
        start, stop = st.kw("start", 0), st.kw("stop", acc.shape[-1])
        part = E.evaluate(step_expr(st), [acc[..., start:stop], *xs])
        acc = part if part.shape == acc.shape else \
            torch.cat([acc[..., :start], part, acc[..., stop:]], dim=-1)
    return acc
