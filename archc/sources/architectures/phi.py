"""Phi (1, 1.5, 2): attention and MLP in parallel off one LayerNorm, partial RoPE (half of each
head by default), biases everywhere including the head, optional per-head LayerNorm on q and k."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, activation, dtype_name, rope_position
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("hidden_size")
    heads = cfg.number("num_attention_heads")
    max_seq = cfg.number("max_position_embeddings", 2048)
    position = rope_position(cfg, max_seq_len=max_seq, default_fraction=0.5)
    max_seq = position.pop("_max_seq_len", max_seq)
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("embed_tokens.weight"), default=False)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": cfg.number("num_hidden_layers"), "max_seq_len": max_seq,
        "dtype": dtype_name(cfg),
        "attention": {"heads": heads, "kv_heads": cfg.number("num_key_value_heads", heads),
                      "bias": True, "qk_norm": cfg.flag("qk_layernorm", False)},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("intermediate_size"),
                "activation": activation(cfg, ("hidden_act",), "gelu_new")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_eps", 1e-5, kind=float)},
        "block": {"parallel": True}, "position": position,
        "embedding": {"tied": tied}, "output": {"bias": True},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("embed_tokens.weight"), "embed.weight")
    t.rename(ckpt("final_layernorm.weight"), "final_norm.weight")
    t.rename(ckpt("final_layernorm.bias"), "final_norm.bias")
    t.rename("lm_head.bias", "head.bias")
    output_head(s, t, ckpt)
    for i in range(s.layers):
        hf, ax = ckpt(f"layers.{i}."), f"layers.{i}."
        for kind in ("weight", "bias"):
            t.rename(f"{hf}input_layernorm.{kind}", f"{ax}attn_norm.{kind}")
            for p in ("q", "k", "v"):
                t.rename(f"{hf}self_attn.{p}_proj.{kind}", f"{ax}attn.{p}.{kind}")
                if s.attention.qk_norm and p != "v":
                    t.rename(f"{hf}self_attn.{p}_layernorm.{kind}", f"{ax}attn.{p}_norm.{kind}")
            t.rename(f"{hf}self_attn.dense.{kind}", f"{ax}attn.o.{kind}")
            t.rename(f"{hf}mlp.fc1.{kind}", f"{ax}ffn.up.{kind}")
            t.rename(f"{hf}mlp.fc2.{kind}", f"{ax}ffn.down.{kind}")


PHI = Architecture(("phi",), spec, tensors, frozenset(), prefixes=("model.",))
