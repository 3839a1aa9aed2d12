"""Gemma and Gemma 2: Llama's layout with RMSNorm gains stored as (1 + w), embeddings scaled by
sqrt(d_model), GeGLU, tied head. Gemma 2 adds sandwich norms, alternating sliding-window and
global layers, attention and final-logit soft-capping, and a score scale from
`query_pre_attn_scalar`."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.architectures.llama import full_rotary, gated_kind, window_kinds
from archc.sources.hf_config import HFConfig, dtype_name, rope_position
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    gemma2 = cfg.model_type == "gemma2"
    d = cfg.number("hidden_size")
    heads = cfg.number("num_attention_heads")
    layers = cfg.number("num_hidden_layers")
    max_seq = cfg.number("max_position_embeddings", 8192)
    head_dim = cfg.number("head_dim", 256)
    cfg.expect("use_bidirectional_attention", (None, False))
    position = rope_position(cfg, max_seq_len=max_seq)
    max_seq = position.pop("_max_seq_len", max_seq)
    full_rotary(cfg, position)
    attention: dict[str, Any] = {
        "heads": heads, "kv_heads": cfg.number("num_key_value_heads", heads),
        "head_dim": head_dim, "bias": cfg.flag("attention_bias", False)}
    output: dict[str, Any] = {}
    if gemma2:
        attention["scale"] = cfg.number("query_pre_attn_scalar", 256, kind=float) ** -0.5
        if "layer_types" not in cfg:  # Gemma 2's default: even layers slide, odd are global
            cfg.data["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(layers)]
        window, pattern = window_kinds(cfg, layers)
        if window is not None:
            attention["window"] = window
            if pattern:
                attention["pattern"] = pattern
        cap = cfg.number("attn_logit_softcapping", None, kind=float)
        if cap is not None:
            attention["softcap"] = cap
        final_cap = cfg.number("final_logit_softcapping", None, kind=float)
        if final_cap is not None:
            output["softcap"] = final_cap
    kind = gated_kind(cfg, ("hidden_activation", "hidden_act"))
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("embed_tokens.weight"), default=True)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": layers, "max_seq_len": max_seq, "dtype": dtype_name(cfg),
        "attention": attention,
        "ffn": {"kind": kind, "d_ff": cfg.number("intermediate_size")},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float),
                 "unit_offset": True, "placement": "sandwich" if gemma2 else "pre"},
        "position": position,
        "embedding": {"tied": tied, "scale": "sqrt_d_model"},
        "output": output,
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("embed_tokens.weight"), "embed.weight")
    t.rename(ckpt("norm.weight"), "final_norm.weight")
    output_head(s, t, ckpt)
    sandwich = s.norm.placement == "sandwich"
    for i in range(s.layers):
        hf, ax = ckpt(f"layers.{i}."), f"layers.{i}."
        t.rename(hf + "input_layernorm.weight", ax + "attn_norm.weight")
        if sandwich:
            t.rename(hf + "post_attention_layernorm.weight", ax + "attn_post_norm.weight")
            t.rename(hf + "pre_feedforward_layernorm.weight", ax + "ffn_norm.weight")
            t.rename(hf + "post_feedforward_layernorm.weight", ax + "ffn_post_norm.weight")
        else:
            t.rename(hf + "post_attention_layernorm.weight", ax + "ffn_norm.weight")
        for p in ("q", "k", "v", "o"):
            t.rename(f"{hf}self_attn.{p}_proj.weight", f"{ax}attn.{p}.weight")
            if s.attention.bias.any:
                t.rename(f"{hf}self_attn.{p}_proj.bias", f"{ax}attn.{p}.bias")
        for p in ("gate", "up", "down"):
            t.rename(f"{hf}mlp.{p}_proj.weight", f"{ax}ffn.{p}.weight")


GEMMA = Architecture(("gemma", "gemma2"), spec, tensors, frozenset(),
                     skip=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
                     prefixes=("model.",))
