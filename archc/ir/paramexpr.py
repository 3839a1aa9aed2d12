"""Parameter expressions: how a graph parameter is made from checkpoint tensors.

A ``param`` node without an ``expr`` is the checkpoint tensor of its ``name``. A pass that
changes a weight (folding a norm gain, concatenating Q/K/V) gives it an ``expr`` such as
``cat(w("layers.0.attn.q.weight"), w("layers.0.attn.k.weight"), dim=0)``, evaluated once when
weights load; buffers no checkpoint holds (RoPE frequencies and cos/sin tables) have no
leaves. Evaluation is in float32 (float64 where rounding matters); the caller casts to the
node's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from archc.errors import WeightsError
from archc.ir.attrs import Call
from archc.quant.schemes import is_quantized
from archc.quant.tensor import QTensor, Weight


def leaf(name: str) -> Call:
    return Call("w", (name,))


def calls(expr: Any) -> Iterator[Call]:
    """Every call in an expression, each before its arguments."""
    if isinstance(expr, Call):
        yield expr
        expr = (*expr.args, *(v for _, v in expr.kwargs))
    if isinstance(expr, tuple):
        for e in expr:
            yield from calls(e)


def leaves(expr: Any) -> list[str]:
    """Checkpoint tensor names an expression reads, in order of first use."""
    return list(dict.fromkeys(c.args[0] for c in calls(expr) if c.fn == "w"))


def evaluate(expr: Call, tensors: Mapping[str, Weight], *, rank: int = 0) -> Weight:
    """Evaluate `expr` (its functions verified), reading leaves from `tensors` by name. A
    quantized leaf stays quantized through functions that only move its rows (ROW_FNS) and is
    dequantized to f32 by any other. `shard()` takes tensor-parallel rank `rank`'s slice."""
    def ev(e: Any) -> Any:
        if isinstance(e, tuple):
            return tuple(ev(a) for a in e)
        if not isinstance(e, Call):
            return e
        if e.fn == "w":
            if e.args[0] not in tensors:
                raise WeightsError(f"checkpoint tensor {e.args[0]!r} is missing")
            w = tensors[e.args[0]]
            return w if isinstance(w, QTensor) else w.float()
        args = [ev(a) for a in e.args]
        kwargs = {k: ev(v) for k, v in e.kwargs}
        if e.fn == "shard":
            kwargs["rank"] = rank
        if any(isinstance(a, QTensor) for a in args):
            if e.fn in ROW_FNS and all(isinstance(a, QTensor) for a in args):
                return ROW_FNS[e.fn](*args, **kwargs)
            args = [a.float() if isinstance(a, QTensor) else a for a in args]
        return PARAM_FNS[e.fn](*args, **kwargs)

    return ev(expr)


def quantized_result(expr: Any, known: Mapping[Call, str]) -> str | None:
    """The scheme a parameter expression's value keeps: that of its quantized operands when
    only ROW_FNS touch them and they share one scheme; None when the value is a plain tensor.
    `known` gives the dtype of expressions already declared (each param node's expression, or
    its leaf); a leaf not in it is a plain tensor. Raises WeightsError for a row function joining
    weights of different schemes."""
    if not isinstance(expr, Call):
        return None
    if expr in known:
        return known[expr] if is_quantized(known[expr]) else None
    below = [quantized_result(a, known) for a in expr.args if isinstance(a, Call)]
    if not any(below) or expr.fn not in ROW_FNS or not all(below):
        return None
    if len(set(below)) > 1:
        raise WeightsError(f"{expr.fn}() joins weights of different schemes: "
                           f"{', '.join(dict.fromkeys(b for b in below if b))}")
    return below[0]


def shard(a: Weight, dim: int, parts: int, every: int = 1, rank: int = 0) -> Weight:
    """Part rank // every of `parts` equal parts of `a` along `dim`: a tensor-parallel rank's
    slice of a weight (every > 1: `every` consecutive ranks share a part — KV heads replicated
    where there are fewer than ranks). A quantized weight is cut along K only on whole groups."""
    size, index = a.shape[dim] // parts, rank // every
    if isinstance(a, QTensor):
        return a.narrow(dim, index * size, size)
    return a.narrow(dim, index * size, size).contiguous()


def _q_interleave(a: QTensor, dim: int = 0) -> QTensor:
    half = a.shape[dim] // 2
    order = torch.arange(2 * half).reshape(2, half).t().flatten()
    return a.index_select(dim, order)


def _q_rope_pairs(a: QTensor, heads: int, head_dim: int, rotary_dim: int, interleaved: bool,
                  dim: int = 0) -> QTensor:
    order = rope_pair_order(a.shape[dim], heads, head_dim, rotary_dim, interleaved)
    return a.index_select(dim, torch.tensor(order, dtype=torch.long))


def rope_inv_freq(dim: int, theta: float, kind: str = "default", factor: float = 1.0,
                  original_max_seq_len: int | None = None, low_freq_factor: float = 1.0,
                  high_freq_factor: float = 4.0, beta_fast: float = 32.0,
                  beta_slow: float = 1.0, truncate: bool = True,
                  factors: tuple[float, ...] = ()) -> torch.Tensor:
    """Rotation frequency of each pair of rotary dims, θ_j = theta^(-2j/dim), after scaling:
    linear (positions / factor), ntk (theta · factor^(dim/(dim-2))), llama3 (long wavelengths
    / factor, short kept, smooth between), yarn (per-dim blend of interpolation and
    extrapolation) or longrope (θ_j / factors[j])."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    if kind == "ntk":
        theta = theta * factor ** (dim / (dim - 2))
    inv_freq = 1.0 / theta ** exponents
    if kind == "longrope":
        inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float64)
    if kind == "linear":
        inv_freq = inv_freq / factor
    elif kind == "llama3":
        assert original_max_seq_len is not None
        low_wavelen = original_max_seq_len / low_freq_factor
        high_wavelen = original_max_seq_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        if high_freq_factor > low_freq_factor:   # equal (Llama 4): no band between
            smooth = (original_max_seq_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
            inv_freq = torch.where(medium, smoothed, scaled)
        else:
            inv_freq = scaled
    elif kind == "yarn":
        assert original_max_seq_len is not None
        # the dims whose wavelengths turn beta_fast and beta_slow times over the original context
        low, high = ((dim * math.log(original_max_seq_len / (rotations * 2 * math.pi)))
                     / (2 * math.log(theta)) for rotations in (beta_fast, beta_slow))
        if truncate:   # whole dims (transformers' default; gpt-oss blends from fractions)
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq.float()


def rope_cos_sin(inv_freq: torch.Tensor, rows: int, mscale: float = 1.0) -> torch.Tensor:
    """The RoPE table [rows, 2, R/2]: row p holds cos(p·θ_j)·mscale, then sin(p·θ_j)·mscale,
    for the R/2 frequencies θ_j of `inv_freq`, computed once at load. The formula is the one
    the rope op computes per call under dynamic NTK, step by step in f32 (positions to f32,
    times θ, cos and sin, times mscale), so row p is bitwise what a call at position p would
    compute, whatever the other positions of that call."""
    positions = torch.arange(rows)                                     # i64, as the op's input
    angles = positions.to(torch.float32)[:, None] * inv_freq.float()[None, :]  # (rows, R/2)
    return torch.stack([angles.cos() * mscale, angles.sin() * mscale], dim=1)  # (rows, 2, R/2)


def buffer_shape(expr: object) -> tuple[int, ...] | None:
    """The shape a computed RoPE buffer's expression makes (None for any other expression),
    so the verifier can hold its param node to it: the table's rows are the model's
    max_seq_len, its pairs rotary_dim/2."""
    if isinstance(expr, Call) and expr.fn == "cat" and expr.kw("dim", 0) == 0:
        # tables one after another (LongRoPE's short and long ones)
        parts = [buffer_shape(a) for a in expr.args]
        if not parts or any(p is None for p in parts) or len({p[1:] for p in parts}) != 1:
            return None
        return (sum(p[0] for p in parts), *parts[0][1:])
    if not isinstance(expr, Call) or expr.fn not in ("rope_inv_freq", "rope_cos_sin"):
        return None
    if expr.fn == "rope_inv_freq":
        return (int(expr.kw("dim")) // 2,)
    freq = buffer_shape(expr.args[0]) if expr.args else None
    return None if freq is None else (int(expr.kw("rows")), 2, *freq)


def rope_pair_order(width: int, heads: int, head_dim: int, rotary_dim: int,
                    interleaved: bool) -> list[int]:
    """The columns of a rope() epilogue step over `width` columns, pair after pair: each pair's
    two columns side by side (2p, 2p + 1 ← cols1[p], cols2[p]), as the matmul kernel pairs them —
    over the first `heads` heads the rotary pairs (interleaved: dims 2j and 2j + 1; half-split: j
    and j + rotary_dim/2), then the dims past rotary_dim paired half their count apart; then the
    `width − heads·head_dim` tail columns paired half their count (rounded up) apart. An odd tail's
    last column has no partner: it appears once, so the order is a permutation of the columns."""
    per_head, rot_pairs = head_dim // 2, rotary_dim // 2
    tail = width - heads * head_dim
    tail_half = (tail + 1) // 2
    order: list[int] = []
    for p in range(heads * per_head + tail_half):
        if p < heads * per_head:
            h, e = divmod(p, per_head)
            if e < rot_pairs:
                first = h * head_dim + (2 * e if interleaved else e)
                second = first + (1 if interleaved else rot_pairs)
            else:   # passed through, paired (per_head − rot_pairs) apart
                first = h * head_dim + 2 * rot_pairs + (e - rot_pairs)
                second = first + per_head - rot_pairs
        else:
            first = heads * head_dim + (p - heads * per_head)
            second = first + tail_half
        order += [first] if second >= width else [first, second]
    return order


def rope_pairs(a: torch.Tensor, heads: int, head_dim: int, rotary_dim: int, interleaved: bool,
               dim: int = 0) -> torch.Tensor:
    """`a` with the entries of `dim` in rope_pair_order: a rope() step's partners side by side."""
    order = rope_pair_order(a.shape[dim], heads, head_dim, rotary_dim, interleaved)
    return a.index_select(dim, torch.tensor(order, dtype=torch.long)).contiguous()


def alibi_slopes(heads: int) -> torch.Tensor:
    """Press et al. 2021: a geometric sequence 2^(-8/n), 2^(-16/n)… for n a power of two; other
    counts interleave the slopes of the next power of two."""
    closest = 2 ** math.floor(math.log2(heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** i for i in range(1, closest + 1)]
    if closest != heads:
        extra_base = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra_base ** i for i in range(1, 2 * (heads - closest), 2)]
    return torch.tensor(slopes, dtype=torch.float32)


def sinusoidal(rows: int, dim: int) -> torch.Tensor:
    """Vaswani et al. 2017: PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(…)."""
    pos = torch.arange(rows, dtype=torch.float64)[:, None]
    div = 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(rows, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos / div)
    table[:, 1::2] = torch.cos(pos / div)
    return table.float()


PARAM_FNS: dict[str, Callable[..., torch.Tensor]] = {
    # structural
    "cat": lambda *parts, dim=0: torch.cat(parts, dim=dim),
    "stack": lambda *parts, dim=0: torch.stack(parts, dim=dim),
    "t": lambda a: a.transpose(-1, -2).contiguous(),
    "rows": lambda a, start=0, stop=None: a[start:stop].contiguous(),
    "reshape": lambda a, shape: a.reshape(shape).contiguous(),
    # rows [start, stop) of each of `heads` equal blocks of rows: [heads, stop − start, K]
    "head_rows": lambda a, heads, start, stop: a.reshape(heads, -1, a.shape[-1])[
        :, start:stop].contiguous(),
    # the two halves of `dim` interleaved (rows n and n + N/2 made neighbours 2n and 2n + 1): a
    # permutation, exact, that puts a paired epilogue's partners side by side in one tile
    "interleave": lambda a, dim=0: a.unflatten(dim, (2, a.shape[dim] // 2)).transpose(
        dim, dim + 1).flatten(dim, dim + 1).contiguous(),
    # a rope() step's partner rows side by side (rope_pair_order): a permutation, exact
    "rope_pairs": rope_pairs,
    # arithmetic, for passes that rewrite weights
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "scale": lambda a, by: a * by,
    "offset": lambda a, by: a + by,
    "neg_exp": lambda a: -torch.exp(a),   # Mamba's A = −exp(A_log), made once at load time
    "mm": lambda a, b: a @ b,
    "sum": lambda a, dim=-1: a.sum(dim=dim),
    "zeros": lambda shape: torch.zeros(shape),
    "values": lambda values: torch.tensor(values, dtype=torch.float32),   # given by the spec
    # a per-head vector [heads·D] with each head repeated `groups` times (GQA: KV head h //
    # groups serves query head h)
    "repeat_heads": lambda a, heads, groups: a.reshape(heads, -1).repeat_interleave(
        groups, dim=0).flatten(),
    "tile": lambda a, times: a.repeat(times),   # one head's norm gain for every head
    # a tensor-parallel rank's slice (archc.passes.shard): rank given at evaluation
    "shard": shard,
    # computed buffers
    "rope_inv_freq": rope_inv_freq,
    "rope_cos_sin": rope_cos_sin,
    "alibi_slopes": alibi_slopes,
    "sinusoidal": sinusoidal,
}

# the functions that move whole rows, and so keep a quantized weight quantized (each the same
# permutation of rows as its PARAM_FNS entry)
ROW_FNS: dict[str, Callable[..., QTensor]] = {
    "cat": lambda *parts, dim=0: QTensor.cat(parts, dim=dim),
    "stack": lambda *parts, dim=0: QTensor.stack(parts, dim=dim),
    "rows": lambda a, start=0, stop=None: a.rows(start, stop),
    "interleave": _q_interleave,
    "rope_pairs": _q_rope_pairs,
    "shard": shard,
}
