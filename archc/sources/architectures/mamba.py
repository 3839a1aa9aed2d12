"""Mamba (Gu & Dao 2023): pre-RMSNorm blocks of one selective state-space mixer each, no attention
and no FFN, the head tied to the embedding. transformers' `MambaForCausalLM` keeps its blocks under
`backbone.`; its mixer tensors map one to one onto archc's Mamba layer (the depthwise conv filter
[C, 1, K] becomes [C, K]). Jamba reuses the mixer mapping."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, activation, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

# Initialisation and training switches (time-step init range and scheme, residual rescaling),
# implementation choices of the scan (mamba.py, associative scan) and of the original CUDA code
# (a fused residual-add + norm kernel), the vocabulary padding already applied to vocab_size, and
# the f32 residual, which rounds differently only below f32 (archc keeps the residual stream in
# the model dtype).
INERT = frozenset({"time_step_scale", "time_step_min", "time_step_max", "time_step_init_scheme",
                   "time_step_floor", "rescale_prenorm_residual", "use_mambapy",
                   "use_associative_scan", "residual_in_fp32", "fused_add_norm",
                   "pad_vocab_size_multiple"})


def layer_count(cfg: HFConfig) -> int:
    """`num_hidden_layers`, and the original code's `n_layer` that converted configs carry too."""
    layers = cfg.number("num_hidden_layers")
    if "n_layer" in cfg and cfg.number("n_layer") != layers:
        raise cfg.refuse("n_layer", cfg.data["n_layer"], f"it must equal num_hidden_layers "
                         f"({layers})")
    if not cfg.flag("rms_norm", True):
        raise cfg.refuse("rms_norm", False, "transformers' Mamba blocks normalize with RMSNorm")
    return layers


def mixer_activation(cfg: HFConfig) -> None:
    """transformers runs the conv through `hidden_act` and gates with SiLU; archc's Mamba layer
    is SiLU in both places."""
    if activation(cfg, ("hidden_act",), "silu") != "silu":
        raise cfg.refuse("hidden_act", cfg.data.get("hidden_act"), "archc's Mamba layer "
                         "applies SiLU after the convolution")


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("hidden_size")
    mixer_activation(cfg)
    expand = cfg.number("expand", 2)
    inner = cfg.number("intermediate_size", expand * d)
    if inner != expand * d:
        raise cfg.refuse("intermediate_size", inner, f"Mamba's inner width is expand·hidden_size "
                         f"= {expand * d}")
    rank = cfg.get("time_step_rank", "auto")
    mamba: dict[str, Any] = {
        "d_state": cfg.number("state_size", 16), "d_conv": cfg.number("conv_kernel", 4),
        "expand": expand, "conv_bias": cfg.flag("use_conv_bias", True),
        "bias": cfg.flag("use_bias", False)}
    if rank != "auto":
        mamba["dt_rank"] = cfg.number("time_step_rank")
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("embeddings.weight"), default=True)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": layer_count(cfg), "dtype": dtype_name(cfg),
        "mixer": {"kind": "mamba", "mamba": mamba}, "ffn": {"kind": "none"},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "position": {"kind": "none"}, "embedding": {"tied": tied},
    }


def mixer_tensors(s: Spec, t: TensorMap, hf: str, ax: str) -> None:
    """One Mamba mixer: transformers' `in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`,
    `out_proj` (and Jamba's Δ, B, C norms) under `hf` → archc's layer under `ax`."""
    m = s.mixer.mamba
    assert m is not None
    inner = s.mamba_inner
    for mine, theirs in (("in", "in_proj"), ("x", "x_proj"), ("dt", "dt_proj"),
                         ("out", "out_proj")):
        t.rename(f"{hf}{theirs}.weight", f"{ax}{mine}.weight")
    t.rename(f"{hf}dt_proj.bias", f"{ax}dt.bias")
    if m.bias:
        t.rename(f"{hf}in_proj.bias", f"{ax}in.bias")
        t.rename(f"{hf}out_proj.bias", f"{ax}out.bias")
    # nn.Conv1d(groups=C) stores its depthwise filter [C, 1, K]
    t.custom([f"{hf}conv1d.weight"], [(inner, 1, m.d_conv)], [f"{ax}conv.weight"],
             lambda xs: [xs[0].reshape(inner, m.d_conv).contiguous()])
    if m.conv_bias:
        t.rename(f"{hf}conv1d.bias", f"{ax}conv.bias")
    t.rename(f"{hf}A_log", f"{ax}A_log")
    t.rename(f"{hf}D", f"{ax}D")
    if m.inner_norms:
        for mine, theirs in (("dt", "dt"), ("b", "b"), ("c", "c")):
            t.rename(f"{hf}{theirs}_layernorm.weight", f"{ax}{mine}_norm.weight")


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("embeddings.weight"), "embed.weight")
    t.rename(ckpt("norm_f.weight"), "final_norm.weight")
    output_head(s, t, ckpt)
    for i in range(s.layers):
        hf, ax = ckpt(f"layers.{i}."), f"layers.{i}."
        t.rename(hf + "norm.weight", ax + "ssm_norm.weight")
        mixer_tensors(s, t, hf + "mixer.", ax + "ssm.")


MAMBA = Architecture(("mamba",), spec, tensors, INERT, prefixes=("backbone.",))
