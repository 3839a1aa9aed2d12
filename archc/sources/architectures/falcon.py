"""Falcon: fused Q/K/V in one of three layouts (per-head MHA, multi-query, or the grouped GQA of
`new_decoder_architecture`), parallel attention/MLP off one or two LayerNorms, or serial;
RoPE, or ALiBi added before the score scale (Falcon-RW)."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, activation, dtype_name, rope_position
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec


def _layout(cfg: HFConfig) -> tuple[str, int, int]:
    """(layout, heads, kv_heads): "grouped" (new architecture), "mqa" or "mha"."""
    heads = cfg.first(("num_attention_heads", "n_head"))
    kv = cfg.first(("num_kv_heads", "n_head_kv"), None)
    multi_query = cfg.flag("multi_query", True)   # the new architecture ignores it
    if cfg.flag("new_decoder_architecture", False):
        if not cfg.flag("parallel_attn", True):
            raise cfg.refuse("parallel_attn", False, "transformers' Falcon has no serial block "
                             "in the new decoder architecture")
        return "grouped", heads, kv or heads
    if multi_query:
        return "mqa", heads, 1
    if kv not in (None, heads):
        raise cfg.refuse("num_kv_heads", kv, "without new_decoder_architecture or multi_query "
                         "every head has its own key and value")
    return "mha", heads, heads


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("hidden_size")
    layout, heads, kv = _layout(cfg)
    parallel = cfg.flag("parallel_attn", True)
    norms = cfg.get("num_ln_in_parallel_attn")
    if layout == "grouped":
        norms = 2 if norms is None else norms
        if norms not in (1, 2):
            raise cfg.refuse("num_ln_in_parallel_attn", norms, "1 or 2 norms")
    elif norms not in (None, 1):
        raise cfg.refuse("num_ln_in_parallel_attn", norms, "transformers' Falcon reads it only "
                         "with new_decoder_architecture")
    block: dict[str, Any] = {}
    if parallel:
        block = {"parallel": True, "shared_norm": norms != 2}
    max_seq = cfg.number("max_position_embeddings", 2048)
    if cfg.flag("alibi", False):
        position: dict[str, Any] = {"kind": "alibi", "alibi_scaled": True}
        cfg.used.update(("rope_theta", "rope_scaling", "rope_parameters"))
    else:
        position = rope_position(cfg, max_seq_len=max_seq)
        max_seq = position.pop("_max_seq_len", max_seq)
    bias = cfg.flag("bias", False)
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("word_embeddings.weight"),
                             default=True)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": cfg.first(("num_hidden_layers", "n_layer")), "max_seq_len": max_seq,
        "dtype": dtype_name(cfg),
        "attention": {"heads": heads, "kv_heads": kv, "bias": bias},
        "ffn": {"kind": "mlp", "bias": bias, "d_ff": cfg.number("ffn_hidden_size", 4 * d),
                "activation": activation(cfg, ("activation",), "gelu")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "block": block, "position": position, "embedding": {"tied": tied},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    att = s.attention
    t.rename(ckpt("word_embeddings.weight"), "embed.weight")
    t.rename(ckpt("ln_f.weight"), "final_norm.weight")
    t.rename(ckpt("ln_f.bias"), "final_norm.bias")
    output_head(s, t, ckpt)
    # Every layout is kv_heads groups of [the group's queries | its key | its value]: per head
    # [q, k, v] when kv_heads = heads, [q heads | k | v] for multi-query.
    groups = att.kv_heads
    if s.block.parallel and not s.block.shared_norm:
        norms = (("ln_attn", "attn_norm"), ("ln_mlp", "ffn_norm"))
    elif s.block.parallel:
        norms = (("input_layernorm", "attn_norm"),)
    else:
        norms = (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"))
    for i in range(s.layers):
        hf, ax = ckpt(f"h.{i}."), f"layers.{i}."
        for theirs, mine in norms:
            t.rename(f"{hf}{theirs}.weight", f"{ax}{mine}.weight")
            t.rename(f"{hf}{theirs}.bias", f"{ax}{mine}.bias")
        qkv = [f"{ax}attn.{p}" for p in ("q", "k", "v")]
        t.fused(hf + "self_attention.query_key_value.weight", [q + ".weight" for q in qkv],
                groups=groups)
        t.rename(hf + "self_attention.dense.weight", ax + "attn.o.weight")
        if att.bias.any:
            t.fused(hf + "self_attention.query_key_value.bias", [q + ".bias" for q in qkv],
                    groups=groups)
            t.rename(hf + "self_attention.dense.bias", ax + "attn.o.bias")
        for theirs, mine in (("dense_h_to_4h", "up"), ("dense_4h_to_h", "down")):
            t.rename(f"{hf}mlp.{theirs}.weight", f"{ax}ffn.{mine}.weight")
            if s.ffn.bias:
                t.rename(f"{hf}mlp.{theirs}.bias", f"{ax}ffn.{mine}.bias")


FALCON = Architecture(("falcon",), spec, tensors, frozenset(), prefixes=("transformer.",))
