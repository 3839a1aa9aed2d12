"""Gemma 3 (text): Gemma 2's block — sandwich norms, RMSNorm gains stored as (1 + w), embeddings
scaled by sqrt(d_model), GeGLU, a score scale from `query_pre_attn_scalar`, a tied head — with a
per-head QK RMSNorm (also 1 + w), and sliding-window and global layers that differ in their RoPE:
θ = `rope_local_base_freq` (10⁴) on sliding layers, `rope_theta` (10⁶) and any scaling (linear
×8 on the large models) on global ones. transformers 5 writes one `rope_parameters` per layer
type; soft-caps are optional and off in the published models."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.llama import GEMMA, SKIP
from archc.sources.hf_config import (
    HF_LAYER_TYPES,
    Architecture,
    HFConfig,
    activation,
    attention_kinds,
    rope_position,
    typed_layers,
)
from archc.sources.tensor_map import Checkpoint, Layout, each


def gemma3(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    layers = cfg.number("num_hidden_layers")
    kinds = attention_kinds(cfg, layers, ("sliding_window_pattern", "_sliding_window_pattern"), 6)
    max_seq_len = cfg.number("max_position_embeddings", 131072)
    rope = {  # transformers 4: rope_theta and rope_scaling for global layers, a local θ
        "full_attention": rope_position(cfg, max_seq_len, whole_heads=True,
                                        layer_type="full_attention"),
        "sliding_attention": rope_position(cfg, max_seq_len, whole_heads=True,
                                           layer_type="sliding_attention", scaled=False,
                                           theta_keys="rope_local_base_freq")}
    sections: dict[str, dict[str, Any]] = {
        HF_LAYER_TYPES[t]: {"position": r["position"]} for t, r in rope.items()}
    if "local" in kinds:
        sections["local"]["attention"] = {"window": cfg.number("sliding_window")}
    spec = {
        "d_model": cfg.number("hidden_size"), "layers": layers,
        "max_seq_len": max(r["max_seq_len"] for r in rope.values()),
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None),
                      "head_dim": cfg.number("head_dim", 256),
                      "bias": cfg.flag("attention_bias", False), "qk_norm": True,
                      "scale": cfg.number("query_pre_attn_scalar", 256, kind=float) ** -0.5,
                      "softcap": cfg.number("attn_logit_softcapping", None, kind=float)},
        "ffn": {"kind": activation(cfg, ("hidden_activation", "hidden_act"), "gelu_pytorch_tanh",
                                   gated=True),
                "d_ff": cfg.number("intermediate_size")},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float),
                 "unit_offset": True, "placement": "sandwich"},
        "embedding": {"scale": "sqrt_d_model"},
        "output": {"softcap": cfg.number("final_logit_softcapping", None, kind=float)}}
    return typed_layers(spec, kinds, sections)


GEMMA3 = Architecture(("gemma3_text",), gemma3, Layout({
        **GEMMA.layout.names, **each("attn.*_norm", "self_attn.*_norm", "q k")}),
    tied=True, only={"use_bidirectional_attention": (False,)}, skip=SKIP)
