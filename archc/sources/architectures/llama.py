"""Llama and the models built like it: Mistral (sliding window), Qwen2 (Q/K/V biases, sliding
window on the upper layers), Mixtral (top-k mixture of experts). Pre-RMSNorm, RoPE, GQA, a gated
FFN."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, layer_pattern, output_head
from archc.sources.hf_config import HFConfig, activation, dtype_name, rope_position
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

# The gated FFN each activation makes (the spec names the pair).
GATED_KIND = {"silu": "swiglu", "gelu_tanh": "geglu", "relu": "reglu", "sigmoid": "glu"}

# `pretraining_tp` only splits the same matmuls; router noise and losses act in training;
# `is_llama_config` and `transformers.js_config` are notes other exporters leave, which
# transformers' Llama never reads.
INERT = frozenset({"pretraining_tp", "router_jitter_noise", "router_aux_loss_coef",
                   "output_router_logits", "is_llama_config", "transformers.js_config"})


def gated_kind(cfg: HFConfig, keys: tuple[str, ...] = ("hidden_act",)) -> str:
    act = activation(cfg, keys, "silu")
    if act not in GATED_KIND:
        raise cfg.refuse(keys[0], cfg.first(keys), "a gated FFN with exact (erf) GELU has no "
                         "spec kind; archc's GEGLU uses the tanh GELU")
    return GATED_KIND[act]


def full_rotary(cfg: HFConfig, position: dict[str, Any]) -> None:
    """transformers' Llama and Gemma rotate whole heads: a partial factor would not run there."""
    if position["fraction"] != 1.0:
        key = "rope_parameters.partial_rotary_factor" if "rope_parameters" in cfg else \
            "partial_rotary_factor"
        raise cfg.refuse(key, position["fraction"], f"{cfg.model_type} rotates whole heads")


def window_kinds(cfg: HFConfig, layers: int) -> tuple[int | None, list[str] | None]:
    """Sliding window and per-layer local/global kinds. transformers 5 writes `layer_types`;
    older Qwen2 configs say `use_sliding_window` + `max_window_layers` (layers from that index on
    are windowed); Mistral and Mixtral window every layer when `sliding_window` is set."""
    mt = cfg.model_type
    window = cfg.get("sliding_window")
    if mt == "qwen2":
        use = cfg.flag("use_sliding_window", False)
        first = cfg.number("max_window_layers", 28)
        if not use:
            window = None
        default_types = ["sliding_attention" if window is not None and i >= first
                         else "full_attention" for i in range(layers)]
    else:
        default_types = ["sliding_attention" if window is not None else "full_attention"] * layers
    types = cfg.get("layer_types") or default_types
    if not isinstance(types, list) or len(types) != layers or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        raise cfg.refuse("layer_types", types, f"one of sliding_attention, full_attention per "
                         f"layer ({layers}) is expected")
    if "sliding_attention" not in types:
        return None, None
    if window is None:
        raise cfg.refuse("layer_types", types, "sliding layers need sliding_window")
    kinds = ["local" if t == "sliding_attention" else "global" for t in types]
    return int(window), (None if all(k == "local" for k in kinds) else layer_pattern(kinds))


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    mt = cfg.model_type
    # Nanotron exports say whether their own RoPE interleaved; transformers always rotates
    # halves, and a checkpoint that needs pairs is not one transformers' Llama can run
    cfg.expect("rope_interleaved", (False,), False)
    cfg.expect("use_mrope", (False,), False)
    d = cfg.number("hidden_size")
    heads = cfg.number("num_attention_heads")
    layers = cfg.number("num_hidden_layers")
    max_seq = cfg.number("max_position_embeddings", 2048)
    head_dim = cfg.number("head_dim", d // heads)
    if mt == "qwen2":
        bias: Any = {"q": True, "k": True, "v": True, "o": False}
    elif mt == "llama":
        bias = cfg.flag("attention_bias", False)
    else:
        bias = cfg.expect("attention_bias", (False,), False)
    ffn_bias = cfg.flag("mlp_bias", False) if mt == "llama" else False
    position = rope_position(cfg, max_seq_len=max_seq)
    max_seq = position.pop("_max_seq_len", max_seq)
    full_rotary(cfg, position)
    window, pattern = window_kinds(cfg, layers)
    attention: dict[str, Any] = {
        "heads": heads, "kv_heads": cfg.number("num_key_value_heads", heads),
        "head_dim": head_dim, "bias": bias}
    if window is not None:
        attention["window"] = window
        if pattern:
            attention["pattern"] = pattern
    kind = gated_kind(cfg)
    ffn: dict[str, Any] = {"kind": kind, "d_ff": cfg.number("intermediate_size"),
                           "bias": ffn_bias}
    if mt == "mixtral":
        ffn = {"kind": "moe", "d_ff": cfg.number("intermediate_size"), "moe": {
            "experts": cfg.number("num_local_experts"),
            "top_k": cfg.number("num_experts_per_tok", 2), "expert": kind}}
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("embed_tokens.weight"), default=False)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": layers, "max_seq_len": max_seq, "dtype": dtype_name(cfg),
        "attention": attention, "ffn": ffn,
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float)},
        "position": position, "embedding": {"tied": tied},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("embed_tokens.weight"), "embed.weight")
    t.rename(ckpt("norm.weight"), "final_norm.weight")
    output_head(s, t, ckpt)
    bias = s.attention.bias
    for i in range(s.layers):
        hf, ax = ckpt(f"layers.{i}."), f"layers.{i}."
        t.rename(hf + "input_layernorm.weight", ax + "attn_norm.weight")
        t.rename(hf + "post_attention_layernorm.weight", ax + "ffn_norm.weight")
        for p in ("q", "k", "v", "o"):
            t.rename(f"{hf}self_attn.{p}_proj.weight", f"{ax}attn.{p}.weight")
            if getattr(bias, p):
                t.rename(f"{hf}self_attn.{p}_proj.bias", f"{ax}attn.{p}.bias")
        if s.ffn.kind == "moe":
            moe = f"{hf}block_sparse_moe."
            assert s.ffn.moe is not None
            experts = range(s.ffn.moe.experts)
            t.rename(moe + "gate.weight", ax + "ffn.router.weight")
            for mine, theirs in (("gate", "w1"), ("down", "w2"), ("up", "w3")):
                t.stacked([f"{moe}experts.{e}.{theirs}.weight" for e in experts],
                          f"{ax}ffn.experts.{mine}.weight")
            continue
        for p in ("gate", "up", "down"):
            t.rename(f"{hf}mlp.{p}_proj.weight", f"{ax}ffn.{p}.weight")
            if s.ffn.bias:
                t.rename(f"{hf}mlp.{p}_proj.bias", f"{ax}ffn.{p}.bias")


LLAMA = Architecture(
    ("llama", "mistral", "qwen2", "mixtral"), spec, tensors, INERT,
    skip=(r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",), prefixes=("model.",))
