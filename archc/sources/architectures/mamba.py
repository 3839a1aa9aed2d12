"""State-space models.

- Mamba (Gu & Dao 2023): pre-RMSNorm blocks of one selective state-space mixer each, no attention
  or FFN, a tied head; its mixer tensors map one to one onto archc's Mamba layer.
- Jamba: Mamba layers (RMSNorm on Δ, B and C) and an attention layer, taking no positions, every
  `attn_layer_period` (at `attn_layer_offset`); every layer has a pre-norm FFN: SwiGLU, or every
  `expert_layer_period` (at `expert_layer_offset`) a top-k mixture of experts with unnormalized
  router weights.
"""

from __future__ import annotations

from typing import Any

from archc.sources.hf_config import Architecture, HFConfig, activation, layer_pattern
from archc.sources.tensor_map import Checkpoint, Layout, TensorMap, each


def mamba(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("hidden_size")
    layers = cfg.number("num_hidden_layers")
    # configs converted from the original code carry its layer count and norm switch too
    cfg.expect("n_layer", (layers,), f"it must equal num_hidden_layers ({layers})")
    cfg.expect("rms_norm", (True,), "transformers' Mamba blocks normalize with RMSNorm")
    # transformers runs the conv through `hidden_act` and gates with SiLU; archc, SiLU in both
    cfg.expect("hidden_act", ("silu", "swish"), "archc's Mamba layer applies SiLU after the "
               "convolution")
    expand = cfg.number("expand", 2)
    cfg.expect("intermediate_size", (expand * d,), f"Mamba's inner width is expand·hidden_size "
               f"= {expand * d}")
    rank = cfg.get("time_step_rank", "auto")
    return {
        "d_model": d, "layers": layers, "mixer": {"kind": "mamba", "mamba": {
            "d_state": cfg.number("state_size", 16), "d_conv": cfg.number("conv_kernel", 4),
            "expand": expand, "conv_bias": cfg.flag("use_conv_bias", True),
            "bias": cfg.flag("use_bias", False),
            "dt_rank": None if rank == "auto" else cfg.number("time_step_rank")}},
        "ffn": {"kind": "none"}, "position": {"kind": "none"},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)}}


def every(cfg: HFConfig, period_key: str, offset_key: str, default: tuple[int, int],
          layers: int) -> list[bool]:
    """Which layers are chosen by `i % period == offset`, as transformers' Jamba decides."""
    period = cfg.number(period_key, default[0])
    offset = cfg.number(offset_key, default[1])
    if period < 1 or not 0 <= offset < period:
        raise cfg.refuse(offset_key, offset, f"the offset must lie in [0, {period_key} = "
                         f"{period})")
    return [i % period == offset for i in range(layers)]


def jamba(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    layers = cfg.number("num_hidden_layers")
    cfg.expect("hidden_act", ("silu", "swish"), "archc's Mamba layer applies SiLU after the "
               "convolution")
    attends = every(cfg, "attn_layer_period", "attn_layer_offset", (8, 4), layers)
    rank = cfg.get("mamba_dt_rank", "auto")
    mamba = {"d_state": cfg.number("mamba_d_state", 16), "d_conv": cfg.number("mamba_d_conv", 4),
             "expand": cfg.number("mamba_expand", 2), "inner_norms": True,
             "conv_bias": cfg.flag("mamba_conv_bias", True),
             "bias": cfg.flag("mamba_proj_bias", False),
             "dt_rank": None if rank == "auto" else cfg.number("mamba_dt_rank")}
    cfg.expect("mamba_inner_layernorms", (True,), "transformers' Jamba normalizes Δ, B and C "
               "in every Mamba layer")   # the original code's switch
    kind = activation(cfg, "hidden_act", "silu", gated=True)
    experts = cfg.number("num_experts", 16)
    routed = every(cfg, "expert_layer_period", "expert_layer_offset", (2, 1), layers)
    top_k = cfg.number("num_experts_per_tok", 2)
    ffn: dict[str, Any] = {"kind": kind, "d_ff": cfg.number("intermediate_size")}
    if experts > 1 and any(routed):
        ffn |= {"kind": "moe", "moe": {"experts": experts, "top_k": top_k, "expert": kind,
                                       "normalize_top_k": False},
                "pattern": None if all(routed) else layer_pattern(
                    ["moe" if r else "dense" for r in routed])}
    mixer: dict[str, Any] = {"pattern": layer_pattern(
        ["attention" if a else "mamba" for a in attends])} if any(attends) else {"kind": "mamba"}
    attention = {"heads": cfg.number("num_attention_heads"),
                 "kv_heads": cfg.number("num_key_value_heads", None)}
    return {
        "d_model": cfg.number("hidden_size"), "layers": layers,
        "max_seq_len": cfg.number("max_position_embeddings", cfg.number("n_ctx", 262144)),
        "mixer": {**mixer, "mamba": None if all(attends) else mamba},
        "attention": attention if any(attends) else None, "ffn": ffn,
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float)},
        "position": {"kind": "none"}}


def mixer_names(theirs: str) -> dict[str, str]:
    """archc's Mamba layer `ssm` in transformers' mixer module `theirs` (Jamba's with Δ, B and C
    norms)."""
    return {"ssm": theirs, "ssm.conv": f"{theirs}.conv1d",
            **each("ssm.*", f"{theirs}.*_proj", "in x dt out"),
            **each("ssm.*_norm", f"{theirs}.*_layernorm", "dt b c")}


def depthwise_conv(t: TensorMap) -> None:
    """nn.Conv1d(groups=C) stores its depthwise filter [C, 1, K]; archc's is [C, K]."""
    for target in [x for x in t.want if x.endswith("ssm.conv.weight")]:
        c, k = t.want[target]
        t.add([t.name(target)], [(c, 1, k)], [target], lambda xs: [xs[0].squeeze(1)])


def jamba_tensors(t: TensorMap) -> None:
    """The depthwise filters, and experts fused as transformers 5 may keep them: `gate_up_proj`
    [E, 2F, d] (gate rows first) and `down_proj` [E, d, F]."""
    depthwise_conv(t)
    for i in range(t.spec.layers):
        hf, ax = t.ckpt(f"layers.{i}.feed_forward.experts."), f"layers.{i}.ffn.experts."
        if hf + "gate_up_proj" in t.ckpt.names:
            n, f, d = t.want[ax + "gate.weight"]
            t.add([hf + "gate_up_proj"], [(n, 2 * f, d)], [ax + "gate.weight", ax + "up.weight"],
                  lambda xs: [x.contiguous() for x in xs[0].chunk(2, dim=1)])
            t.add([hf + "down_proj"], [t.want[ax + "down.weight"]], [ax + "down.weight"],
                  lambda xs: xs)


MAMBA = Architecture(("mamba",), mamba, Layout({
        "embed": "embeddings", "final_norm": "norm_f", "ssm_norm": "norm", **mixer_names("mixer")},
        special=depthwise_conv), tied=True,
    # Initialisation and training switches (time-step init, residual rescaling), choices of the
    # scan (mamba.py, associative) and of the original CUDA code (a fused residual-add + norm),
    # the vocabulary padding already in vocab_size, and the f32 residual, which rounds differently
    # only below f32 (archc keeps the residual stream in the model dtype).
    inert=frozenset({"time_step_scale", "time_step_min", "time_step_max",
                     "time_step_init_scheme", "time_step_floor", "rescale_prenorm_residual",
                     "use_mambapy", "use_associative_scan", "residual_in_fp32", "fused_add_norm",
                     "pad_vocab_size_multiple"}))
JAMBA = Architecture(("jamba",), jamba, Layout({
        "embed": "embed_tokens", "final_norm": "final_layernorm", "ssm_norm": "input_layernorm",
        "attn_norm": "input_layernorm", **mixer_names("mamba"),
        **each("attn.*", "self_attn.*_proj", "q k v o"), "ffn_norm": "pre_ff_layernorm",
        **each("ffn.*", "feed_forward.*_proj", "gate up down"), "ffn.router": "feed_forward.router",
        **each("ffn.experts.*", "feed_forward.experts.{e}.*_proj", "gate up down")},
        special=jamba_tensors),
    # Training-only router settings, implementation choices of the Mamba scan, and which
    # positions' logits the original code returns (archc returns them all).
    inert=frozenset({"router_aux_loss_coef", "output_router_logits", "use_mamba_kernels",
                     "use_mambapy", "use_associative_scan", "calc_logits_for_entire_prompt",
                     "num_logits_to_keep"}))
