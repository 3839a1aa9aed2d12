"""GPT-NeoX (Pythia): fused per-head Q/K/V, partial RoPE (a quarter of each head by default),
LayerNorm, and a parallel residual with a norm per branch — or serial with
`use_parallel_residual: false`."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, activation, dtype_name, rope_position
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

HEADS = ("embed_out.weight", "lm_head.weight")   # transformers 4 and 5 spellings


def _head(ckpt: Checkpoint) -> str:
    return next((h for h in HEADS if ckpt.has(h, base=False)), HEADS[0])


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("hidden_size")
    max_seq = cfg.number("max_position_embeddings", 2048)
    position = rope_position(cfg, max_seq_len=max_seq, theta_keys=("rotary_emb_base",
                             "rope_theta"), fraction_keys=("rotary_pct", "partial_rotary_factor"),
                             default_fraction=0.25)
    max_seq = position.pop("_max_seq_len", max_seq)
    parallel = cfg.flag("use_parallel_residual", True)
    tied = ckpt.head_is_tied(cfg, _head(ckpt), ckpt("embed_in.weight"), default=False)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": cfg.number("num_hidden_layers"), "max_seq_len": max_seq,
        "dtype": dtype_name(cfg),
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "bias": cfg.flag("attention_bias", True)},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("intermediate_size"),
                "activation": activation(cfg, ("hidden_act",), "gelu")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_eps", 1e-5, kind=float)},
        "block": {"parallel": True, "shared_norm": False} if parallel else {},
        "position": position, "embedding": {"tied": tied},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("embed_in.weight"), "embed.weight")
    t.rename(ckpt("final_layer_norm.weight"), "final_norm.weight")
    t.rename(ckpt("final_layer_norm.bias"), "final_norm.bias")
    output_head(s, t, ckpt, _head(ckpt))
    heads = s.attention.heads
    for i in range(s.layers):
        hf, ax = ckpt(f"layers.{i}."), f"layers.{i}."
        for theirs, mine in (("input_layernorm", "attn_norm"),
                             ("post_attention_layernorm", "ffn_norm")):
            t.rename(f"{hf}{theirs}.weight", f"{ax}{mine}.weight")
            t.rename(f"{hf}{theirs}.bias", f"{ax}{mine}.bias")
        qkv = [f"{ax}attn.{p}" for p in ("q", "k", "v")]
        t.fused(hf + "attention.query_key_value.weight", [q + ".weight" for q in qkv],
                groups=heads)
        t.rename(hf + "attention.dense.weight", ax + "attn.o.weight")
        if s.attention.bias.any:
            t.fused(hf + "attention.query_key_value.bias", [q + ".bias" for q in qkv],
                    groups=heads)
            t.rename(hf + "attention.dense.bias", ax + "attn.o.bias")
        for theirs, mine in (("dense_h_to_4h", "up"), ("dense_4h_to_h", "down")):
            t.rename(f"{hf}mlp.{theirs}.weight", f"{ax}ffn.{mine}.weight")
            t.rename(f"{hf}mlp.{theirs}.bias", f"{ax}ffn.{mine}.bias")


NEOX = Architecture(
    ("gpt_neox",), spec, tensors, frozenset(),
    # causal-mask and RoPE buffers older checkpoints saved
    skip=(r"(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",),
    prefixes=("gpt_neox.",))
