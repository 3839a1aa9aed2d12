"""Jamba: a hybrid of Mamba and attention layers, one attention layer every `attn_layer_period`
(at `attn_layer_offset`), the rest Mamba mixers with RMSNorm on Δ, B and C; every layer has a
pre-norm FFN — SwiGLU, or a top-k mixture of experts every `expert_layer_period` layers (at
`expert_layer_offset`) with unnormalized router weights. Attention takes no positions."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import (
    Architecture,
    Checkpoint,
    layer_pattern,
    output_head,
)
from archc.sources.architectures.llama import gated_kind
from archc.sources.architectures.mamba import mixer_activation, mixer_tensors
from archc.sources.hf_config import HFConfig, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

# Training-only router settings, implementation choices of the Mamba scan, and which positions'
# logits the original code returns (archc returns them all).
INERT = frozenset({"router_aux_loss_coef", "output_router_logits", "use_mamba_kernels",
                   "use_mambapy", "use_associative_scan", "calc_logits_for_entire_prompt",
                   "num_logits_to_keep"})


def _every(cfg: HFConfig, period_key: str, offset_key: str, default: tuple[int, int],
           layers: int) -> list[bool]:
    """Which layers are chosen by `i % period == offset`, as transformers' Jamba decides."""
    period = cfg.number(period_key, default[0])
    offset = cfg.number(offset_key, default[1])
    if period < 1 or not 0 <= offset < period:
        raise cfg.refuse(offset_key, offset, f"the offset must lie in [0, {period_key} = "
                         f"{period})")
    return [i % period == offset for i in range(layers)]


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("hidden_size")
    layers = cfg.number("num_hidden_layers")
    mixer_activation(cfg)
    attends = _every(cfg, "attn_layer_period", "attn_layer_offset", (8, 4), layers)
    mixers = ["attention" if a else "mamba" for a in attends]
    rank = cfg.get("mamba_dt_rank", "auto")
    mamba: dict[str, Any] = {
        "d_state": cfg.number("mamba_d_state", 16), "d_conv": cfg.number("mamba_d_conv", 4),
        "expand": cfg.number("mamba_expand", 2), "conv_bias": cfg.flag("mamba_conv_bias", True),
        "bias": cfg.flag("mamba_proj_bias", False), "inner_norms": True}
    if not cfg.flag("mamba_inner_layernorms", True):   # the original code's switch
        raise cfg.refuse("mamba_inner_layernorms", False, "transformers' Jamba normalizes Δ, B "
                         "and C in every Mamba layer")
    if rank != "auto":
        mamba["dt_rank"] = cfg.number("mamba_dt_rank")
    mixer: dict[str, Any] = {"pattern": layer_pattern(mixers)} if any(attends) else \
        {"kind": "mamba"}
    if any(not a for a in attends):
        mixer["mamba"] = mamba
    kind = gated_kind(cfg)
    d_ff = cfg.number("intermediate_size")
    experts = cfg.number("num_experts", 16)
    routed = _every(cfg, "expert_layer_period", "expert_layer_offset", (2, 1), layers)
    top_k = cfg.number("num_experts_per_tok", 2)
    ffn: dict[str, Any] = {"kind": kind, "d_ff": d_ff}
    if experts > 1 and any(routed):
        ffn = {"kind": "moe", "d_ff": d_ff, "moe": {"experts": experts, "top_k": top_k,
                                                    "expert": kind, "normalize_top_k": False}}
        if not all(routed):
            ffn["pattern"] = layer_pattern(["moe" if r else "dense" for r in routed])
    spec: dict[str, Any] = {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": layers,
        "max_seq_len": cfg.number("max_position_embeddings", cfg.number("n_ctx", 262144)),
        "dtype": dtype_name(cfg), "mixer": mixer, "ffn": ffn,
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float)},
        "position": {"kind": "none"},
        "embedding": {"tied": ckpt.head_is_tied(cfg, "lm_head.weight",
                                                ckpt("embed_tokens.weight"), default=False)},
    }
    heads = cfg.number("num_attention_heads")
    kv_heads = cfg.number("num_key_value_heads", heads)
    if any(attends):
        spec["attention"] = {"heads": heads, "kv_heads": kv_heads}
    return spec


def _experts(s: Spec, t: TensorMap, ckpt: Checkpoint, hf: str, ax: str) -> None:
    """Expert weights stored one module per expert, or fused as transformers 5 keeps them:
    `gate_up_proj` [E, 2F, d] (gate rows first) and `down_proj` [E, d, F]."""
    moe = s.ffn.moe
    assert moe is not None
    n, f, d = moe.experts, s.ffn.d_ff, s.d_model
    t.rename(hf + "router.weight", ax + "router.weight")
    if ckpt.has(hf + "experts.gate_up_proj", base=False):
        t.custom([hf + "experts.gate_up_proj"], [(n, 2 * f, d)],
                 [ax + "experts.gate.weight", ax + "experts.up.weight"],
                 lambda xs: [xs[0][:, :f].contiguous(), xs[0][:, f:].contiguous()])
        t.rename(hf + "experts.down_proj", ax + "experts.down.weight")
        return
    for p in ("gate", "up", "down"):
        t.stacked([f"{hf}experts.{e}.{p}_proj.weight" for e in range(n)],
                  f"{ax}experts.{p}.weight")


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("embed_tokens.weight"), "embed.weight")
    t.rename(ckpt("final_layernorm.weight"), "final_norm.weight")
    output_head(s, t, ckpt)
    ffns = s.layer_ffns() if s.ffn.kind == "moe" else ("dense",) * s.layers
    for i, mixer in enumerate(s.layer_mixers()):
        hf, ax = ckpt(f"layers.{i}."), f"layers.{i}."
        if mixer == "mamba":
            t.rename(hf + "input_layernorm.weight", ax + "ssm_norm.weight")
            mixer_tensors(s, t, hf + "mamba.", ax + "ssm.")
        else:
            t.rename(hf + "input_layernorm.weight", ax + "attn_norm.weight")
            for p in ("q", "k", "v", "o"):
                t.rename(f"{hf}self_attn.{p}_proj.weight", f"{ax}attn.{p}.weight")
        t.rename(hf + "pre_ff_layernorm.weight", ax + "ffn_norm.weight")
        if ffns[i] == "moe":
            _experts(s, t, ckpt, hf + "feed_forward.", ax + "ffn.")
        else:
            for p in ("gate", "up", "down"):
                t.rename(f"{hf}feed_forward.{p}_proj.weight", f"{ax}ffn.{p}.weight")


JAMBA = Architecture(("jamba",), spec, tensors, INERT, prefixes=("model.",))
