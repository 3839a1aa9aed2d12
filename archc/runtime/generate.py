"""Choosing the next token: greedy, or sampled with temperature, top-k and top-p, seeded.

Backend-independent: it sees only logits. The generation loop (prefill, then one decode step per
token, stopping at EOS) lives with the compiled model in ``archc.model``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from archc.errors import ArchcError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0        # 0: greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ArchcError(f"temperature must be ≥ 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ArchcError(f"top_k must be ≥ 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ArchcError(f"top_p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, sampling: Sampling) -> None:
        self.s = sampling
        self.gen = torch.Generator()
        if sampling.seed is not None:
            self.gen.manual_seed(sampling.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """Next token per row of `logits` [B, vocab] → [B]."""
        logits = logits.float().cpu()
        if self.s.temperature == 0:
            return logits.argmax(dim=-1)
        logits = logits / self.s.temperature
        if self.s.top_k is not None:
            k = min(self.s.top_k, logits.shape[-1])
            kth = logits.topk(k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.s.top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            probs = sorted_logits.softmax(dim=-1)
            # drop a token when the tokens ranked above it already hold top_p of the mass
            drop = probs.cumsum(dim=-1) - probs >= self.s.top_p
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=self.gen).squeeze(-1)
