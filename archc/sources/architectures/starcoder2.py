"""StarCoder 2: Llama's attention (RoPE, GQA) with biases on every projection, LayerNorm with a
bias, a GELU-tanh MLP (`c_fc`, `c_proj`), an optional sliding window on every layer, and a tied
head."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.llama import NAMES, SKIP
from archc.sources.hf_config import Architecture, HFConfig, activation, rope_position
from archc.sources.tensor_map import Checkpoint, Layout


def starcoder2(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    window = cfg.number("sliding_window", None)
    return {
        "d_model": cfg.number("hidden_size"), "layers": cfg.number("num_hidden_layers"),
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None),
                      "bias": cfg.flag("use_bias", True), "window": window},
        "ffn": {"kind": "mlp", "activation": activation(cfg, "hidden_act", "gelu_pytorch_tanh"),
                "d_ff": cfg.number("intermediate_size"), "bias": cfg.flag("use_bias", True)},
        "norm": {"kind": "layernorm", "eps": cfg.number("norm_epsilon", 1e-5, kind=float)},
        **rope_position(cfg, cfg.number("max_position_embeddings", 4096), whole_heads=True)}


STARCODER2 = Architecture(("starcoder2",), starcoder2, Layout({
        **NAMES, "ffn.up": "mlp.c_fc", "ffn.down": "mlp.c_proj"}), tied=True,
    # dropout on the sublayer outputs and the embeddings: inactive at inference
    inert=frozenset({"residual_dropout", "embedding_dropout"}), skip=SKIP)
