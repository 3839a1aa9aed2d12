"""Cohere 2 (Command R7B, Command A): a parallel block — attention and the gated MLP both read
one bias-free LayerNorm of the residual — with RoPE on interleaved pairs in the sliding-window
layers and none (NoPE) in the global ones (by default every fourth), a tied head and the logits
multiplied by `logit_scale`."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.llama import NAMES, SKIP
from archc.sources.hf_config import (
    Architecture,
    HFConfig,
    activation,
    attention_kinds,
    rope_position,
    typed_layers,
)
from archc.sources.tensor_map import Checkpoint, Layout


def cohere2(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    layers = cfg.number("num_hidden_layers")
    kinds = attention_kinds(cfg, layers, "sliding_window_pattern", 4)
    heads = cfg.number("num_attention_heads")
    d = cfg.number("hidden_size")
    if cfg.number("head_dim", d // heads) != d // heads:   # transformers sets it so
        raise cfg.refuse("head_dim", cfg.get("head_dim"), f"Cohere 2's heads are "
                         f"hidden_size / num_attention_heads = {d // heads} wide")
    spec = {
        "d_model": d, "layers": layers,
        "attention": {"heads": heads, "kv_heads": cfg.number("num_key_value_heads", None),
                      "bias": cfg.flag("attention_bias", False)},
        "ffn": {"kind": activation(cfg, "hidden_act", "silu", gated=True),
                "d_ff": cfg.number("intermediate_size")},
        "norm": {"kind": "layernorm", "bias": False,
                 "eps": cfg.number("layer_norm_eps", 1e-5, kind=float)},
        "block": {"parallel": True},
        "output": {"logit_scale": cfg.number("logit_scale", 0.0625, kind=float)},
        **rope_position(cfg, cfg.number("max_position_embeddings", 8192), whole_heads=True)}
    spec["position"]["interleaved"] = True
    sections = {"local": {"attention": {"window": cfg.number("sliding_window")}},
                "global": {"position": {"kind": "none"}}}
    return typed_layers(spec, kinds, sections)


COHERE2 = Architecture(("cohere2",), cohere2, Layout(NAMES), tied=True, skip=SKIP)
