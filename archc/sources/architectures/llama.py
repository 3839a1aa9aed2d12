"""Llama and the models built like it: pre-RMSNorm, RoPE, GQA, a gated FFN. Mistral adds a sliding
window, Qwen2 Q/K/V biases and a sliding window on the upper layers, Mixtral a top-k mixture of
experts. Gemma keeps Llama's layout with RMSNorm gains stored as (1 + w), embeddings scaled by
sqrt(d_model), GeGLU and a tied head; Gemma 2 adds sandwich norms, alternating sliding-window and
global layers, attention and final-logit soft-capping, and a score scale from
`query_pre_attn_scalar`."""

from __future__ import annotations

from typing import Any

from archc.sources.hf_config import Architecture, HFConfig, activation, layer_pattern, rope_position
from archc.sources.tensor_map import Checkpoint, Layout, each

# transformers' Llama rotates halves, never the pairs a Nanotron export may say it used, and has
# no multimodal RoPE
ONLY = {"rope_interleaved": (False,), "use_mrope": (False,)}
# `pretraining_tp` only splits the same matmuls; router noise and losses act in training;
# `is_llama_config` and `transformers.js_config` are notes other exporters leave, which
# transformers' Llama never reads.
INERT = frozenset({"pretraining_tp", "router_jitter_noise", "router_aux_loss_coef",
                   "output_router_logits", "is_llama_config", "transformers.js_config"})
SKIP = (r"(model\.)?layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)   # a cached RoPE buffer


def sliding_window(cfg: HFConfig, slides: list[bool]) -> dict[str, Any]:
    """The attention's window and local/global pattern. transformers 5 writes `layer_types`;
    older configs leave it to the model type, whose layer i slides where `slides[i]`."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types") or ["sliding_attention" if s else "full_attention"
                                       for s in slides]
    if not isinstance(types, list) or len(types) != len(slides) or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        raise cfg.refuse("layer_types", types, f"one of sliding_attention, full_attention per "
                         f"layer ({len(slides)}) is expected")
    if "sliding_attention" not in types:
        return {}
    if window is None:
        raise cfg.refuse("layer_types", types, "sliding layers need sliding_window")
    kinds = ["local" if t == "sliding_attention" else "global" for t in types]
    return {"window": int(window), "pattern": layer_pattern(kinds) if "global" in kinds else None}


def llama(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    mt = cfg.model_type
    layers = cfg.number("num_hidden_layers")
    if mt == "qwen2":   # with use_sliding_window, the layers from max_window_layers on slide
        bias: Any = {"q": True, "k": True, "v": True}
        use, first = cfg.flag("use_sliding_window", False), cfg.number("max_window_layers", 28)
    else:               # Mistral and Mixtral slide in every layer when a window is set
        bias = cfg.flag("attention_bias", False) if mt == "llama" else \
            cfg.expect("attention_bias", (False,))
        use, first = True, 0
    slides = [use and cfg.get("sliding_window") is not None and i >= first for i in range(layers)]
    ffn: dict[str, Any] = {"kind": activation(cfg, "hidden_act", "silu", gated=True),
                           "d_ff": cfg.number("intermediate_size"),
                           "bias": cfg.flag("mlp_bias", False) if mt == "llama" else False}
    if mt == "mixtral":
        ffn = {"kind": "moe", "d_ff": ffn["d_ff"], "moe": {
            "experts": cfg.number("num_local_experts"),
            "top_k": cfg.number("num_experts_per_tok", 2), "expert": ffn["kind"]}}
    return {
        "d_model": cfg.number("hidden_size"), "layers": layers,
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None),
                      "head_dim": cfg.number("head_dim", None), "bias": bias,
                      **sliding_window(cfg, slides)}, "ffn": ffn,
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float)},
        **rope_position(cfg, cfg.number("max_position_embeddings", 2048), whole_heads=True)}


def gemma(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    gemma2 = cfg.model_type == "gemma2"
    layers = cfg.number("num_hidden_layers")
    attention = {"heads": cfg.number("num_attention_heads"),
                 "kv_heads": cfg.number("num_key_value_heads", None),
                 "head_dim": cfg.number("head_dim", 256), "bias": cfg.flag("attention_bias", False)}
    if gemma2:   # even layers slide, odd ones are global
        attention |= {"scale": cfg.number("query_pre_attn_scalar", 256, kind=float) ** -0.5,
                      "softcap": cfg.number("attn_logit_softcapping", None, kind=float),
                      **sliding_window(cfg, [i % 2 == 0 for i in range(layers)])}
    return {
        "d_model": cfg.number("hidden_size"), "layers": layers, "attention": attention,
        "ffn": {"kind": activation(cfg, ("hidden_activation", "hidden_act"), "silu", gated=True),
                "d_ff": cfg.number("intermediate_size")},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float),
                 "unit_offset": True, "placement": "sandwich" if gemma2 else "pre"},
        "embedding": {"scale": "sqrt_d_model"},
        "output": {"softcap": cfg.number("final_logit_softcapping", None, kind=float)
                   if gemma2 else None},
        **rope_position(cfg, cfg.number("max_position_embeddings", 8192), whole_heads=True)}


NAMES = {
    "embed": "embed_tokens", "final_norm": "norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", **each("attn.*", "self_attn.*_proj", "q k v o"),
    **each("ffn.*", "mlp.*_proj", "gate up down"), "ffn.router": "block_sparse_moe.gate",
    "ffn.experts.gate": "block_sparse_moe.experts.{e}.w1",
    "ffn.experts.down": "block_sparse_moe.experts.{e}.w2",
    "ffn.experts.up": "block_sparse_moe.experts.{e}.w3"}
LLAMA = Architecture(("llama", "mistral", "qwen2", "mixtral"), llama, Layout(NAMES), only=ONLY,
                     inert=INERT, skip=SKIP)
GEMMA = Architecture(("gemma", "gemma2"), gemma, Layout({
        **NAMES, "ffn_norm": lambda s: "pre_feedforward_layernorm" if s.norm.placement ==
        "sandwich" else "post_attention_layernorm", "attn_post_norm": "post_attention_layernorm",
        "ffn_post_norm": "post_feedforward_layernorm"}),
    tied=True, only={"use_bidirectional_attention": (False,)}, skip=SKIP)
