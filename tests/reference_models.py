"""Plain PyTorch transformers, written from the papers, to check the eager interpreter against.

Nothing here comes from archc: no spec, no graph, no op table. Each model is a short nanoGPT-style
``nn.Module`` whose submodule names match the checkpoint names archc's lowering gives its
parameters (``layers.0.attn.q.weight``, [out, in] as ``nn.Linear`` stores them), so a checkpoint
loads with ``load_state_dict(strict=True)`` — which also checks that the two agree on every name.
Sizes come from the checkpoint's shapes; the config holds only what the shapes cannot say.

- ``GPT``: GPT-1 (Radford et al. 2018: post-norm, erf GELU, no final norm) and GPT-2 (Radford et
  al. 2019: pre-norm, tanh GELU, final LayerNorm); learned positions, biases everywhere, the head
  tied to the token embedding.
- ``Llama``: Touvron et al. 2023: RMSNorm, rotary positions with half-split pairs (Su et al. 2021,
  as Hugging Face's ``rotate_half``), grouped-query attention (Ainslie et al. 2023) with each KV
  head repeated for its group of query heads, SwiGLU (Shazeer 2020), no biases, untied head.
  Layers may differ (one config each): RoPE base, linear position interpolation (Chen et al.
  2023) or no RoPE at all, a sliding window (Beltagy et al. 2020), and a mixture of SwiGLU
  experts (Jiang et al. 2024, Mixtral: softmax router, top-k, weights renormalized).
- ``Bert``: Devlin et al. 2019: token + position + token-type embeddings, embedding LayerNorm,
  post-norm blocks, erf GELU, a padding mask over the keys; returns the last hidden states.

Decoders take an optional ``KVCache``: keys and values of the tokens seen so far, per layer, so a
prompt can be prefilled and then decoded one token at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

# ---- the pieces, each as its paper writes it -------------------------------------------------

def gelu_erf(x: torch.Tensor) -> torch.Tensor:
    """GELU(x) = x·Φ(x) (Hendrycks & Gimpel 2016), Φ the standard normal CDF."""
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GELU that GPT-2 uses."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


GELU = {"gelu": gelu_erf, "gelu_tanh": gelu_tanh}


def causal_mask(t: int, past: int) -> torch.Tensor:
    """[T, past + T] bool: query i (at position past + i) sees keys 0 … past + i."""
    return torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           keep: torch.Tensor) -> torch.Tensor:
    """softmax(q·kᵀ/√d, hiding keys where `keep` is false)·v (Vaswani et al. 2017).
    q: (B, H, T, D), k and v: (B, H, L, D), keep broadcasts to (B, H, T, L)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])   # (B, H, T, L)
    scores = scores.masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v                     # (B, H, T, D)


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, t, width = x.shape
    return x.view(b, t, heads, width // heads).transpose(1, 2)  # (B, H, T, D)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)  # (B, T, H·D)


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · g (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    """θ_j = theta^(−2j/dim) for j = 0 … dim/2 − 1 (Su et al. 2021, eq. 15)."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


def rope_half_split(x: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate dim j with dim j + D/2 by angle m·θ_j (GPT-NeoX / Llama layout):
    x·cos + rotate_half(x)·sin, with rotate_half(x) = (−x₂, x₁)."""
    angles = positions.float()[:, None] * inv_freq[None, :]          # (T, D/2)
    emb = torch.cat([angles, angles], dim=-1)                        # (T, D)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def rope_interleaved(x: torch.Tensor, positions: torch.Tensor,
                     inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate dim 2j with dim 2j + 1 by angle m·θ_j (GPT-J layout, the paper's eq. 34)."""
    angles = positions.float()[:, None] * inv_freq[None, :]          # (T, D/2)
    emb = angles.repeat_interleave(2, dim=-1)                        # (T, D)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return x * emb.cos() + rotated * emb.sin()


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H_kv, L, D) → (B, H_kv·groups, L, D): query head h reads KV head h // groups."""
    b, h_kv, length, d = x.shape
    return x[:, :, None].expand(b, h_kv, groups, length, d).reshape(b, h_kv * groups, length, d)


@dataclass
class KVCache:
    """Keys and values of every token seen so far, one (k, v) pair per layer."""

    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    length: int = 0    # tokens already cached (the past length)

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor,
                                                                              torch.Tensor]:
        """Append this step's keys and values (B, H, T, D) to `layer`; return all so far."""
        if layer == len(self.keys):
            self.keys.append(k)
            self.values.append(v)
        else:
            self.keys[layer] = torch.cat([self.keys[layer], k], dim=2)
            self.values[layer] = torch.cat([self.values[layer], v], dim=2)
        return self.keys[layer], self.values[layer]


def _checkpoint_layers(weights: dict[str, torch.Tensor]) -> int:
    return 1 + max(int(name.split(".")[1]) for name in weights if name.startswith("layers."))


# ---- GPT-1 and GPT-2 ---------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    heads: int
    eps: float
    activation: str       # "gelu" (GPT-1) or "gelu_tanh" (GPT-2)
    post_norm: bool       # GPT-1: LN(x + f(x)); GPT-2: x + f(LN(x))
    final_norm: bool      # GPT-2 ends with a LayerNorm, GPT-1 does not


class GPTAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None) -> torch.Tensor:
        q = split_heads(self.q(x), self.heads)   # (B, H, T, D)
        k = split_heads(self.k(x), self.heads)
        v = split_heads(self.v(x), self.heads)
        past = cache.length if cache is not None else 0
        if cache is not None:
            k, v = cache.extend(layer, k, v)     # (B, H, past + T, D)
        y = attend(q, k, v, causal_mask(x.shape[1], past))
        return self.o(merge_heads(y))


class GPTMLP(nn.Module):
    def __init__(self, d: int, d_ff: int, activation: str) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, d_ff), nn.Linear(d_ff, d)
        self.act = GELU[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class GPTBlock(nn.Module):
    def __init__(self, d: int, d_ff: int, cfg: GPTConfig) -> None:
        super().__init__()
        self.post_norm = cfg.post_norm
        self.attn_norm = nn.LayerNorm(d, eps=cfg.eps)
        self.attn = GPTAttention(d, cfg.heads)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.eps)
        self.ffn = GPTMLP(d, d_ff, cfg.activation)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None) -> torch.Tensor:
        if self.post_norm:
            x = self.attn_norm(x + self.attn(x, layer, cache))
            return self.ffn_norm(x + self.ffn(x))
        x = x + self.attn(self.attn_norm(x), layer, cache)
        return x + self.ffn(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        vocab, d = weights["embed.weight"].shape
        d_ff = weights["layers.0.ffn.up.weight"].shape[0]
        self.embed = nn.Embedding(vocab, d)
        self.pos_embed = nn.Embedding(weights["pos_embed.weight"].shape[0], d)
        self.layers = nn.ModuleList(GPTBlock(d, d_ff, cfg)
                                    for _ in range(_checkpoint_layers(weights)))
        self.final_norm = nn.LayerNorm(d, eps=cfg.eps) if cfg.final_norm else None
        self.load_state_dict(weights, strict=True)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + ids.shape[1])
        x = self.embed(ids) + self.pos_embed(positions)          # (B, T, d)
        for i, block in enumerate(self.layers):
            x = block(x, i, cache)
        if self.final_norm is not None:
            x = self.final_norm(x)
        if cache is not None:
            cache.length += ids.shape[1]
        return x @ self.embed.weight.T                           # tied head: (B, T, vocab)


# ---- Llama -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LlamaConfig:
    heads: int
    kv_heads: int
    eps: float
    theta: float
    rope: bool = True                 # False: no rotary positions (NoPE)
    rope_factor: float = 1.0          # linear interpolation: position m rotates as m / factor
    window: int | None = None         # a query sees the last `window` keys
    top_k: int = 0                    # > 0: a mixture of experts routes each token to top_k


class LlamaAttention(nn.Module):
    def __init__(self, d: int, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = d // cfg.heads
        kv_width = cfg.kv_heads * self.head_dim
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_width, bias=False)
        self.v = nn.Linear(d, kv_width, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.inv_freq = rope_inv_freq(self.head_dim, cfg.theta) / cfg.rope_factor
        self.rope, self.window = cfg.rope, cfg.window

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None) -> torch.Tensor:
        past = cache.length if cache is not None else 0
        positions = torch.arange(past, past + x.shape[1])
        q = split_heads(self.q(x), self.heads)       # (B, H, T, D)
        k = split_heads(self.k(x), self.kv_heads)    # (B, H_kv, T, D)
        v = split_heads(self.v(x), self.kv_heads)
        if self.rope:
            q = rope_half_split(q, positions, self.inv_freq)
            k = rope_half_split(k, positions, self.inv_freq)
        if cache is not None:
            k, v = cache.extend(layer, k, v)         # (B, H_kv, past + T, D)
        groups = self.heads // self.kv_heads
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)   # (B, H, past + T, D)
        keep = causal_mask(x.shape[1], past)
        if self.window is not None:   # key j at distance i − j < window of query i
            keep = keep & ~causal_mask(x.shape[1], past).tril(diagonal=past - self.window)
        y = attend(q, k, v, keep)
        return self.o(merge_heads(y))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) ⊙ up(x)) (Shazeer 2020)."""

    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, d_ff, bias=False)
        self.up = nn.Linear(d, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        return self.down(g * torch.sigmoid(g) * self.up(x))


class Stacked(nn.Module):
    """One weight per expert, stacked: [experts, out, in]."""

    def __init__(self, experts: int, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, rows, cols))


class Experts(nn.Module):
    """Σ over the top_k experts e of softmax(router(x))_e, renormalized over the top_k, times
    SwiGLU expert e of x."""

    def __init__(self, d: int, d_ff: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.Module()
        self.experts.gate = Stacked(experts, d_ff, d)
        self.experts.up = Stacked(experts, d_ff, d)
        self.experts.down = Stacked(experts, d, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)                # (B, T, E)
        weight, chosen = probs.topk(self.top_k, dim=-1)              # (B, T, k)
        weight = weight / weight.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for slot in range(self.top_k):
            for e in range(probs.shape[-1]):
                rows = chosen[..., slot] == e                        # (B, T)
                if rows.any():
                    h = x[rows]
                    g = h @ self.experts.gate.weight[e].T
                    y = (g * torch.sigmoid(g) * (h @ self.experts.up.weight[e].T)) \
                        @ self.experts.down.weight[e].T
                    out[rows] += weight[..., slot][rows, None] * y
        return out


class LlamaBlock(nn.Module):
    def __init__(self, d: int, d_ff: int, cfg: LlamaConfig, experts: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(d, cfg.eps)
        self.attn = LlamaAttention(d, cfg)
        self.ffn_norm = RMSNorm(d, cfg.eps)
        self.ffn = Experts(d, d_ff, experts, cfg.top_k) if cfg.top_k else SwiGLU(d, d_ff)

    def forward(self, x: torch.Tensor, layer: int, cache: KVCache | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), layer, cache)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """`cfg` for every layer, or one config per layer."""

    def __init__(self, cfg: LlamaConfig | list[LlamaConfig],
                 weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        vocab, d = weights["embed.weight"].shape
        n = _checkpoint_layers(weights)
        configs = cfg if isinstance(cfg, list) else [cfg] * n
        self.embed = nn.Embedding(vocab, d)
        blocks = []
        for i, c in enumerate(configs):
            experts = weights.get(f"layers.{i}.ffn.router.weight")
            gate = weights[f"layers.{i}.ffn.experts.gate.weight" if c.top_k else
                           f"layers.{i}.ffn.gate.weight"]
            blocks.append(LlamaBlock(d, gate.shape[-2], c,
                                     experts.shape[0] if experts is not None else 0))
        self.layers = nn.ModuleList(blocks)
        self.final_norm = RMSNorm(d, configs[0].eps)
        self.head = nn.Linear(d, vocab, bias=False)
        self.load_state_dict(weights, strict=True)

    def forward(self, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = self.embed(ids)                                      # (B, T, d)
        for i, block in enumerate(self.layers):
            x = block(x, i, cache)
        if cache is not None:
            cache.length += ids.shape[1]
        return self.head(self.final_norm(x))                     # (B, T, vocab)


# ---- BERT --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BertConfig:
    heads: int
    eps: float


class BertAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.q(x), self.heads)   # (B, H, T, D)
        k = split_heads(self.k(x), self.heads)
        v = split_heads(self.v(x), self.heads)
        keep = attention_mask.bool()[:, None, None, :]   # (B, 1, 1, T): padding keys hidden
        return self.o(merge_heads(attend(q, k, v, keep)))


class BertMLP(nn.Module):
    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, d_ff), nn.Linear(d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(gelu_erf(self.up(x)))


class BertLayer(nn.Module):
    def __init__(self, d: int, d_ff: int, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = BertAttention(d, cfg.heads)
        self.attn_norm = nn.LayerNorm(d, eps=cfg.eps)
        self.ffn = BertMLP(d, d_ff)
        self.ffn_norm = nn.LayerNorm(d, eps=cfg.eps)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.attn_norm(x + self.attn(x, attention_mask))
        return self.ffn_norm(x + self.ffn(x))


class Bert(nn.Module):
    def __init__(self, cfg: BertConfig, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        vocab, d = weights["embed.weight"].shape
        d_ff = weights["layers.0.ffn.up.weight"].shape[0]
        self.embed = nn.Embedding(vocab, d)
        self.pos_embed = nn.Embedding(weights["pos_embed.weight"].shape[0], d)
        self.type_embed = nn.Embedding(weights["type_embed.weight"].shape[0], d)
        self.embed_norm = nn.LayerNorm(d, eps=cfg.eps)
        self.layers = nn.ModuleList(BertLayer(d, d_ff, cfg)
                                    for _ in range(_checkpoint_layers(weights)))
        self.load_state_dict(weights, strict=True)

    def forward(self, ids: torch.Tensor, token_types: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1])
        x = self.embed(ids) + self.pos_embed(positions) + self.type_embed(token_types)
        x = self.embed_norm(x)                                   # (B, T, d)
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x                                                 # last hidden states


def greedy_generate(model: nn.Module, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Prompt followed by `max_new_tokens` argmax tokens: one prefill, then one step a token."""
    cache = KVCache()
    logits = model(ids, cache)
    out = [ids]
    for step in range(max_new_tokens):
        nxt = logits[:, -1].argmax(dim=-1, keepdim=True)        # (B, 1)
        out.append(nxt)
        if step + 1 < max_new_tokens:
            logits = model(nxt, cache)
    return torch.cat(out, dim=1)


def prefill_then_decode(session: Any, reference: Any, ids: torch.Tensor, split: int,
                        cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """archc's session and a reference model over the same tokens: a prefill of `split` tokens,
    then one token at a time through each side's own cache. Returns (archc, reference) outputs
    concatenated along the tokens."""
    session.reset()
    got = [session.step(ids[:, :split])]
    want = [reference(ids[:, :split], cache)]
    for t in range(split, ids.shape[1]):
        got.append(session.step(ids[:, t:t + 1]))
        want.append(reference(ids[:, t:t + 1], cache))
    return torch.cat(got, dim=1), torch.cat(want, dim=1)
