"""GLM-4 (0414): sandwich RMSNorms (`post_self_attn_layernorm` after attention,
`post_mlp_layernorm` after the MLP), biases on q, k and v but not on the output projection,
gate and up fused in one `gate_up_proj` ([gate | up]), and RoPE on the first half of each head
(partial_rotary_factor 0.5 by default) rotating interleaved pairs (2j, 2j + 1)."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.llama import NAMES, SKIP
from archc.sources.hf_config import Architecture, HFConfig, activation, rope_position
from archc.sources.tensor_map import Checkpoint, Layout


def glm4(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    bias = cfg.flag("attention_bias", True)
    out = {
        "d_model": cfg.number("hidden_size"), "layers": cfg.number("num_hidden_layers"),
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None),
                      "head_dim": cfg.number("head_dim", None),
                      "bias": {"q": bias, "k": bias, "v": bias, "o": False}},
        "ffn": {"kind": activation(cfg, "hidden_act", "silu", gated=True),
                "d_ff": cfg.number("intermediate_size")},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1.5625e-7, kind=float),
                 "placement": "sandwich"},
        **rope_position(cfg, cfg.number("max_position_embeddings", 131072),
                        default_fraction=0.5)}
    out["position"]["interleaved"] = True
    return out


GLM4 = Architecture(("glm4",), glm4, Layout({
        **NAMES, "attn_post_norm": "post_self_attn_layernorm",
        "ffn_norm": "post_attention_layernorm", "ffn_post_norm": "post_mlp_layernorm",
        **dict.fromkeys(("ffn.gate", "ffn.up"), "mlp.gate_up_proj")}), skip=SKIP)
