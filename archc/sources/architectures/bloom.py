"""BLOOM: ALiBi, a LayerNorm right after the embeddings, fused per-head Q/K/V, pre-LayerNorm,
biases everywhere, tanh-GELU MLP of 4·d_model, tied head."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

# Megatron-DeepSpeed training and kernel switches saved with the released checkpoints; the model
# code never reads them (`pretraining_tp` and `slow_but_exact` only reorder the same sums).
INERT = frozenset({"pretraining_tp", "slow_but_exact", "attention_softmax_in_fp32",
                   "bias_dropout_fusion", "masked_softmax_fusion", "offset_alibi",
                   "skip_bias_add", "skip_bias_add_qkv", "seq_length"})


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.first(("hidden_size", "n_embed"))
    cfg.expect("apply_residual_connection_post_layernorm", (False,), False)
    cfg.expect("n_inner", (None,))
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("word_embeddings.weight"),
                             default=True)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": cfg.first(("num_hidden_layers", "n_layer")), "max_seq_len": 2048,
        "dtype": dtype_name(cfg),
        "attention": {"heads": cfg.first(("num_attention_heads", "n_head")), "bias": True},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": 4 * d, "activation": "gelu_tanh"},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "position": {"kind": "alibi"}, "embedding": {"tied": tied, "norm": True},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("word_embeddings.weight"), "embed.weight")
    t.rename(ckpt("word_embeddings_layernorm.weight"), "embed_norm.weight")
    t.rename(ckpt("word_embeddings_layernorm.bias"), "embed_norm.bias")
    t.rename(ckpt("ln_f.weight"), "final_norm.weight")
    t.rename(ckpt("ln_f.bias"), "final_norm.bias")
    output_head(s, t, ckpt)
    heads = s.attention.heads
    for i in range(s.layers):
        hf, ax = ckpt(f"h.{i}."), f"layers.{i}."
        for theirs, mine in (("input_layernorm", "attn_norm"),
                             ("post_attention_layernorm", "ffn_norm")):
            t.rename(f"{hf}{theirs}.weight", f"{ax}{mine}.weight")
            t.rename(f"{hf}{theirs}.bias", f"{ax}{mine}.bias")
        qkv = [f"{ax}attn.{p}" for p in ("q", "k", "v")]
        for kind in ("weight", "bias"):
            t.fused(f"{hf}self_attention.query_key_value.{kind}", [f"{q}.{kind}" for q in qkv],
                    groups=heads)
            t.rename(f"{hf}self_attention.dense.{kind}", f"{ax}attn.o.{kind}")
        for theirs, mine in (("dense_h_to_4h", "up"), ("dense_4h_to_h", "down")):
            t.rename(f"{hf}mlp.{theirs}.weight", f"{ax}ffn.{mine}.weight")
            t.rename(f"{hf}mlp.{theirs}.bias", f"{ax}ffn.{mine}.bias")


BLOOM = Architecture(("bloom",), spec, tensors, INERT, prefixes=("transformer.",))
