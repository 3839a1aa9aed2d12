"""A causal linear-attention transformer in plain PyTorch, written from the paper, to check the
eager interpreter against.

Katharopoulos et al. 2020, "Transformers are RNNs", eq. 4–6 with the causal mask of eq. 8:

    V'_i = Σ_{j≤i} φ(Q_i)ᵀφ(K_j) V_j / Σ_{j≤i} φ(Q_i)ᵀφ(K_j),   φ(x) = elu(x) + 1.

This module computes exactly that sum over every pair (i, j ≤ i) — a masked T × L product, the
"quadratic" form — and keeps the φ(K) and V of past tokens for decoding, as a KV cache would. It
never forms the running sums S and z that archc's recurrence carries, so the two agree only if
the recurrence is right. Nothing here comes from archc; submodule names match the checkpoint
names archc's lowering gives (``layers.0.attn.q.weight``), so a checkpoint loads with
``load_state_dict(strict=True)``.

The rest of the block is GPT-2's: learned positions, pre-LayerNorm, erf-GELU MLP, biases, a final
LayerNorm and the head tied to the token embedding; grouped-query heads read KV head h // groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.reference_models import gelu_erf, merge_heads, split_heads


def phi(x: torch.Tensor) -> torch.Tensor:
    """The feature map of the paper's section 3.2: elu(x) + 1, positive everywhere."""
    return F.elu(x) + 1.0


def causal_mask(t: int, past: int) -> torch.Tensor:
    """[T, past + T] bool: query i (at position past + i) sums keys 0 … past + i."""
    return torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, L, D) → (B, H_kv·groups, L, D): query head h reads KV head h // groups."""
    return x.repeat_interleave(groups, dim=1)


def linear_attend(fq: torch.Tensor, fk: torch.Tensor, v: torch.Tensor,
                  keep: torch.Tensor) -> torch.Tensor:
    """Σ_j keep_ij (φq_i·φk_j) v_j / Σ_j keep_ij (φq_i·φk_j): fq (B, H, T, D), fk and v
    (B, H, L, D), keep (T, L)."""
    weights = (fq @ fk.transpose(-2, -1)) * keep          # (B, H, T, L), all ≥ 0
    return (weights @ v) / weights.sum(-1, keepdim=True)


@dataclass
class FeatureCache:
    """φ(K) and V of every token seen so far, per layer (what the quadratic form must keep)."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    def extend(self, layer: int, fk: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor,
                                                                               torch.Tensor]:
        if layer == len(self.keys):
            self.keys.append(fk)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], fk], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


@dataclass(frozen=True)
class Config:
    heads: int
    kv_heads: int
    eps: float


class LinearAttention(nn.Module):
    def __init__(self, d: int, cfg: Config) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        hd = d // cfg.heads
        self.q = nn.Linear(d, cfg.heads * hd)
        self.k = nn.Linear(d, cfg.kv_heads * hd)
        self.v = nn.Linear(d, cfg.kv_heads * hd)
        self.o = nn.Linear(cfg.heads * hd, d)

    def forward(self, x: torch.Tensor, layer: int, cache: FeatureCache | None) -> torch.Tensor:
        fq = phi(split_heads(self.q(x), self.heads))        # (B, H, T, D)
        fk = phi(split_heads(self.k(x), self.kv_heads))     # (B, H_kv, T, D)
        v = split_heads(self.v(x), self.kv_heads)
        past = cache.length if cache is not None else 0
        if cache is not None:
            fk, v = cache.extend(layer, fk, v)              # (B, H_kv, past + T, D)
        groups = self.heads // self.kv_heads
        y = linear_attend(fq, repeat_kv(fk, groups), repeat_kv(v, groups),
                          causal_mask(x.shape[1], past))
        return self.o(merge_heads(y))


class MLP(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gelu_erf(self.up(x)))


class Block(nn.Module):
    def __init__(self, d: int, d_ff: int, cfg: Config) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(d, eps=cfg.eps)
        self.attn = LinearAttention(d, cfg)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.eps)
        self.ffn = MLP(d, d_ff)

    def forward(self, x: torch.Tensor, layer: int, cache: FeatureCache | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), layer, cache)
        return x + self.ffn(self.ffn_norm(x))


class LinearTransformer(nn.Module):
    def __init__(self, cfg: Config, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        vocab, d = weights["embed.weight"].shape
        d_ff = weights["layers.0.ffn.up.weight"].shape[0]
        layers = 1 + max(int(n.split(".")[1]) for n in weights if n.startswith("layers."))
        self.embed = nn.Embedding(vocab, d)
        self.pos_embed = nn.Embedding(weights["pos_embed.weight"].shape[0], d)
        self.layers = nn.ModuleList(Block(d, d_ff, cfg) for _ in range(layers))
        self.final_norm = nn.LayerNorm(d, eps=cfg.eps)
        self.load_state_dict(weights, strict=True)

    def forward(self, ids: torch.Tensor, cache: FeatureCache | None = None) -> torch.Tensor:
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + ids.shape[1])
        x = self.embed(ids) + self.pos_embed(positions)
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cache)
        if cache is not None:
            cache.length += ids.shape[1]
        return self.final_norm(x) @ self.embed.weight.T   # the tied head
