"""Parameter expressions: how a graph parameter is made from checkpoint tensors.

A ``param`` node without an ``expr`` attr is the checkpoint tensor of its ``name``. A pass that
changes a weight — folding a norm gain into a matmul, concatenating Q/K/V — gives the node an
``expr`` instead, such as ``cat(w("layers.0.attn.q.weight"), w("layers.0.attn.k.weight"), dim=0)``,
evaluated once when weights load. Buffers that no checkpoint holds (RoPE frequencies, ALiBi slopes,
sinusoidal tables) are expressions with no leaves.

Every function is declared once in ``PARAM_FNS``; passes register the ones they need with
``param_fn``. Evaluation is in float32 (float64 for tables whose rounding matters); the caller
casts to the node's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from archc.errors import WeightsError
from archc.ir.attrs import Call

ParamFn = Callable[..., torch.Tensor]
PARAM_FNS: dict[str, ParamFn] = {}


def param_fn(name: str) -> Callable[[ParamFn], ParamFn]:
    """Register `fn` as parameter-expression function `name`."""
    def register(fn: ParamFn) -> ParamFn:
        if name in PARAM_FNS:
            raise ValueError(f"parameter function {name!r} registered twice")
        PARAM_FNS[name] = fn
        return fn
    return register


def leaf(name: str) -> Call:
    return Call("w", (name,))


def leaves(expr: Any) -> list[str]:
    """Checkpoint tensor names an expression reads, in order of first use."""
    found: list[str] = []

    def walk(e: Any) -> None:
        if isinstance(e, Call):
            if e.fn == "w":
                if e.args[0] not in found:
                    found.append(e.args[0])
                return
            for a in e.args:
                walk(a)
            for _, v in e.kwargs:
                walk(v)
        elif isinstance(e, tuple):
            for a in e:
                walk(a)

    walk(expr)
    return found


def evaluate(expr: Call, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Evaluate `expr`, reading leaves from `tensors` (checkpoint name → tensor)."""
    def ev(e: Any) -> Any:
        if isinstance(e, Call):
            if e.fn == "w":
                name = e.args[0]
                if name not in tensors:
                    raise WeightsError(f"checkpoint tensor {name!r} is missing")
                return tensors[name].float()
            fn = PARAM_FNS.get(e.fn)
            if fn is None:
                raise WeightsError(f"unknown parameter function {e.fn!r}")
            args = [ev(a) for a in e.args]
            kwargs = {k: ev(v) for k, v in e.kwargs}
            return fn(*args, **kwargs)
        if isinstance(e, tuple):
            return tuple(ev(a) for a in e)
        return e

    return ev(expr)


# ---- structural ----------------------------------------------------------------------------

@param_fn("cat")
def _cat(*parts: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cat(parts, dim=dim)


@param_fn("stack")
def _stack(*parts: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.stack(parts, dim=dim)


@param_fn("t")
def _transpose(a: torch.Tensor) -> torch.Tensor:
    return a.transpose(-1, -2).contiguous()


@param_fn("rows")
def _rows(a: torch.Tensor, start: int = 0, stop: int | None = None) -> torch.Tensor:
    return a[start:stop].contiguous()


@param_fn("reshape")
def _reshape(a: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return a.reshape(shape).contiguous()


# ---- arithmetic (for passes that rewrite weights) -------------------------------------------

@param_fn("add")
def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


@param_fn("mul")
def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


@param_fn("scale")
def _scale(a: torch.Tensor, by: float) -> torch.Tensor:
    return a * by


@param_fn("offset")
def _offset(a: torch.Tensor, by: float) -> torch.Tensor:
    return a + by


@param_fn("neg_exp")
def _neg_exp(a: torch.Tensor) -> torch.Tensor:
    """−exp(a): Mamba's A from the stored A_log (Gu & Dao 2023), made once at load time."""
    return -torch.exp(a)


@param_fn("mm")
def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@param_fn("sum")
def _sum(a: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return a.sum(dim=dim)


@param_fn("zeros")
def _zeros(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.zeros(shape)


@param_fn("repeat_heads")
def _repeat_heads(a: torch.Tensor, heads: int, groups: int) -> torch.Tensor:
    """A per-head vector [heads·D] with each head repeated `groups` times, [heads·groups·D]:
    KV head h // groups serves query head h (GQA)."""
    return a.reshape(heads, -1).repeat_interleave(groups, dim=0).flatten()


@param_fn("tile")
def _tile(a: torch.Tensor, times: int) -> torch.Tensor:
    """A vector repeated `times` times end to end: one head's norm gain for every head."""
    return a.repeat(times)


# ---- computed buffers ----------------------------------------------------------------------

@param_fn("rope_inv_freq")
def rope_inv_freq(dim: int, theta: float, kind: str = "default", factor: float = 1.0,
                  original_max_seq_len: int | None = None, low_freq_factor: float = 1.0,
                  high_freq_factor: float = 4.0, beta_fast: float = 32.0,
                  beta_slow: float = 1.0) -> torch.Tensor:
    """Rotation frequency of each pair of rotary dims, θ_j = theta^(-2j/dim), after scaling:
    linear (positions / factor), ntk (theta · factor^(dim/(dim-2))), llama3 (long wavelengths
    / factor, short kept, smooth between) or yarn (per-dim blend of interpolation and
    extrapolation)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    if kind == "ntk":
        theta = theta * factor ** (dim / (dim - 2))
    inv_freq = 1.0 / theta ** exponents
    if kind == "linear":
        inv_freq = inv_freq / factor
    elif kind == "llama3":
        assert original_max_seq_len is not None
        low_wavelen = original_max_seq_len / low_freq_factor
        high_wavelen = original_max_seq_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_max_seq_len / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        assert original_max_seq_len is not None

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(original_max_seq_len / (rotations * 2 * math.pi))) / (
                2 * math.log(theta))

        low = max(math.floor(correction_dim(beta_fast)), 0)
        high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolate = 1 - ramp
        inv_freq = (inv_freq / factor) * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq.float()


def yarn_attention_factor(factor: float, attention_factor: float | None) -> float:
    """YaRN scales cos and sin by 0.1·ln(factor) + 1 unless a factor is given."""
    if attention_factor is not None:
        return attention_factor
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


@param_fn("alibi_slopes")
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


@param_fn("sinusoidal")
def sinusoidal(rows: int, dim: int) -> torch.Tensor:
    """Vaswani et al. 2017: PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(…)."""
    pos = torch.arange(rows, dtype=torch.float64)[:, None]
    div = 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    table = torch.zeros(rows, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos / div)
    table[:, 1::2] = torch.cos(pos / div)
    return table.float()
