"""Phi-3: Llama's block with the query, key and value projections in one `qkv_proj` ([q | k | v]
rows) and gate and up in one `gate_up_proj` ([gate | up]), an optional sliding window on every
layer, partial rotary, and LongRoPE (`longrope`, once `su`) for the long-context models:
per-frequency short and long factors, the long ones once a call passes the trained context."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.llama import NAMES, SKIP
from archc.sources.hf_config import Architecture, HFConfig, activation, rope_position
from archc.sources.tensor_map import QKV, Checkpoint, Layout


def phi3(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "d_model": cfg.number("hidden_size"), "layers": cfg.number("num_hidden_layers"),
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None),
                      "head_dim": cfg.number("head_dim", None),
                      "window": cfg.number("sliding_window", None)},
        "ffn": {"kind": activation(cfg, "hidden_act", "silu", gated=True),
                "d_ff": cfg.number("intermediate_size")},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-5, kind=float)},
        **rope_position(cfg, cfg.number("max_position_embeddings", 4096))}


PHI3 = Architecture(("phi3",), phi3, Layout({
        **NAMES, **dict.fromkeys(QKV, "self_attn.qkv_proj"),
        **dict.fromkeys(("ffn.gate", "ffn.up"), "mlp.gate_up_proj")}),
    # dropout on the sublayer outputs and the embeddings: inactive at inference
    inert=frozenset({"resid_pdrop", "embd_pdrop"}), skip=SKIP)
