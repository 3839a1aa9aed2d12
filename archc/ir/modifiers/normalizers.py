"""Normalizers: how an attention's scores become the weights of its value sum, each in two
forms that agree — the one-shot reference over all L keys, and the online form a kernel runs
over key tiles (init, a step per tile, finish), whose algebra is the kernels' to copy.

- softmax: w = e^(s − m) / Σ e^(s − m). Online (FlashAttention): a running max m, sum l and
  accumulator acc; a tile with max m′ = max(m, max s) rescales both by e^(m − m′).
- softmax with sinks (gpt-oss): a learned logit per head joins the denominator only,
  w = e^s / (e^sink + Σ e^s). A sink is a key of score `sink` and value 0, so online it is the
  starting state: m = sink, l = 1, acc = 0 — nothing changes per tile. (Split-KV decode gives
  the sink to one split, or adds it when the splits merge.)
- sigmoid with a bias (sigmoid attention, Ramapuram et al. 2024, arXiv:2409.04431):
  w = σ(s + b), no denominator — the paper takes b = −log(L) for L training keys. Online it is
  a plain sum of σ(s + b)·v over tiles: no running max, splits merge by adding.

Masked scores are f32's most negative finite value, as in eager attention and the kernels:
under softmax a row that sees no key averages the values it was shown, with sinks it is ~0
(the sink takes the weight), under sigmoid it is 0 (σ of it is 0).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from archc.ir.attrs import Attr, Call

MASKED = torch.finfo(torch.float32).min
SOFTMAX = Call("softmax")

# a normalizer is a Call: softmax(), softmax(sinks="NAME") with NAME a per-head parameter,
# sigmoid(bias=−5.0): the choices of an IR attribute Attr("normalizer", Call, None, PARAMS)
PARAMS: dict[str, tuple[Attr, ...]] = {
    "softmax": (Attr("sinks", str, None),),
    "sigmoid": (Attr("bias", float, 0.0),),
}

State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]   # running max, sum, Σ w·v


def _masked(s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, s.float(), MASKED)


def weights(normalizer: Call, scores: torch.Tensor, mask: torch.Tensor,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The one-shot weights [B, H, T, L] of scores [B, H, T, L] under `mask` (broadcast);
    `sinks` [H] for softmax(sinks=…)."""
    s = _masked(scores, mask)
    if normalizer.fn == "sigmoid":
        return torch.where(mask, torch.sigmoid(s + normalizer.kw("bias", 0.0)), 0.0)
    if normalizer.kw("sinks") is None:
        return torch.softmax(s, dim=-1)
    assert sinks is not None, "softmax with sinks needs their values"
    sink = sinks.float()[None, :, None, None].expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]


def attend(normalizer: Call, scores: torch.Tensor, mask: torch.Tensor, v: torch.Tensor,
           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Σ w·v: [B, H, T, D] for values v [B, H, L, D]."""
    return weights(normalizer, scores, mask, sinks) @ v.float()


@dataclass(frozen=True)
class Online:
    """The online form: `init` the state of the scores' [B, H, T] rows, `step` it over one
    key tile (its masked scores [B, H, T, n], values [B, H, n, D]), `finish` the output
    [B, H, T, D]."""

    init: Callable[[Call, torch.Tensor, int, torch.Tensor | None], State]
    step: Callable[[Call, State, torch.Tensor, torch.Tensor], State]
    finish: Callable[[State], torch.Tensor]


def _softmax_init(nz: Call, s: torch.Tensor, d: int, sinks: torch.Tensor | None) -> State:
    rows = s.shape[:3]                                           # (B, H, T)
    acc = s.new_zeros(*rows, d)
    if nz.kw("sinks") is None:
        return s.new_full(rows, -torch.inf), s.new_zeros(rows), acc
    assert sinks is not None, "softmax with sinks needs their values"
    m = sinks.to(s)[None, :, None].expand(rows).clone()         # the sink: a key of value 0
    return m, s.new_ones(rows), acc


def _softmax_step(nz: Call, state: State, s: torch.Tensor, v: torch.Tensor) -> State:
    m, total, acc = state
    m_new = torch.maximum(m, s.amax(-1))
    p = torch.exp(s - m_new[..., None])
    alpha = torch.exp(m - m_new)
    return m_new, total * alpha + p.sum(-1), acc * alpha[..., None] + p @ v


def _sigmoid_init(nz: Call, s: torch.Tensor, d: int, sinks: torch.Tensor | None) -> State:
    none = s.new_zeros(0)
    return none, none, s.new_zeros(*s.shape[:3], d)


def _sigmoid_step(nz: Call, state: State, s: torch.Tensor, v: torch.Tensor) -> State:
    # σ(MASKED + b) = 0: a masked key adds nothing
    return state[0], state[1], state[2] + torch.sigmoid(s + nz.kw("bias", 0.0)) @ v


ONLINE: dict[str, Online] = {
    "softmax": Online(_softmax_init, _softmax_step, lambda st: st[2] / st[1][..., None]),
    "sigmoid": Online(_sigmoid_init, _sigmoid_step, lambda st: st[2]),
}


def attend_online(normalizer: Call, scores: torch.Tensor, mask: torch.Tensor,
                  v: torch.Tensor, block_n: int, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """`attend`, computed over key tiles of `block_n` as a kernel does (the last tile holds
    what is left)."""
    s = _masked(scores, mask.expand(scores.shape))
    form = ONLINE[normalizer.fn]
    state = form.init(normalizer, s, v.shape[-1], sinks)
    for j in range(0, s.shape[-1], block_n):
        state = form.step(normalizer, state, s[..., j:j + block_n],
                          v[..., j:j + block_n, :].float())
    return form.finish(state)
