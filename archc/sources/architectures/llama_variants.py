"""Models that keep Llama's layout (RMSNorm, RoPE, GQA, SwiGLU, `model.layers.N.self_attn.*`)
and change one or two things in it:

- Qwen3: an RMSNorm over each head of q and k before RoPE; head_dim set apart from d_model.
- OLMo 2: no norm before a sublayer, one on its output before the residual add; q and k
  normalized over the whole projection, not per head.
- SmolLM3: every n-th layer without rotary positions (NoPE).
- Granite: multipliers on the embeddings, each sublayer's output, the attention scores and the
  logits.
- EXAONE 4: OLMo 2's norm placement with Qwen3's per-head QK-norm, and sliding-window layers
  with RoPE between global layers without it.
"""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.llama import NAMES, SKIP, sliding_window
from archc.sources.hf_config import (
    Architecture,
    HFConfig,
    activation,
    attention_kinds,
    rope_position,
    typed_layers,
)
from archc.sources.tensor_map import Checkpoint, Layout, each


def base(cfg: HFConfig, *, bias: Any = False) -> dict[str, Any]:
    """The sections every model here shares: sizes, attention heads, a gated FFN, RMSNorm,
    RoPE over whole heads."""
    return {
        "d_model": cfg.number("hidden_size"), "layers": cfg.number("num_hidden_layers"),
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None),
                      "head_dim": cfg.number("head_dim", None), "bias": bias},
        "ffn": {"kind": activation(cfg, "hidden_act", "silu", gated=True),
                "d_ff": cfg.number("intermediate_size"), "bias": cfg.flag("mlp_bias", False)},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float)},
        **rope_position(cfg, cfg.number("max_position_embeddings", 2048), whole_heads=True)}


def windows_from(cfg: HFConfig, layers: int) -> dict[str, Any]:
    """Qwen2's rule, kept by Qwen3 and SmolLM3: with `use_sliding_window`, the layers from
    `max_window_layers` on slide."""
    use, first = cfg.flag("use_sliding_window", False), cfg.number("max_window_layers", 28)
    window = cfg.get("sliding_window")
    if not use:   # transformers drops the window, whatever layer_types says
        if "sliding_attention" in (cfg.get("layer_types") or ()):
            raise cfg.refuse("layer_types", cfg.get("layer_types"), "sliding layers with "
                             "use_sliding_window false have no window in transformers")
        return {}
    return sliding_window(cfg, [window is not None and i >= first for i in range(layers)])


def qwen3(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    out = base(cfg, bias=cfg.flag("attention_bias", False))
    out["attention"] |= {"qk_norm": True, **windows_from(cfg, out["layers"])}
    return out


def olmo2(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    out = base(cfg, bias=cfg.flag("attention_bias", False))
    out["attention"] |= {"qk_norm": True, "qk_norm_over": "projection"}
    out["norm"]["placement"] = "output"
    return out


def smollm3(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    out = base(cfg, bias=cfg.flag("attention_bias", False))
    layers = out["layers"]
    interval = cfg.number("no_rope_layer_interval", 4)
    rotates = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rotates, list) or len(rotates) != layers or any(
            r not in (0, 1) or isinstance(r, bool) for r in rotates):
        raise cfg.refuse("no_rope_layers", rotates, f"a 1 (RoPE) or 0 (NoPE) per layer "
                         f"({layers}) is expected")
    # transformers: with use_sliding_window, the layers layer_types says (by default the NoPE
    # ones) slide
    use, window = cfg.flag("use_sliding_window", False), cfg.get("sliding_window")
    types = cfg.get("layer_types") or ["sliding_attention" if use and window is not None and
                                       not r else "full_attention" for r in rotates]
    window = sliding_window(cfg, [t == "sliding_attention" for t in types]).get("window") \
        if use else None
    kinds = [("rope" if r else "nope") + ("+local" if window and t == "sliding_attention"
                                          else "") for r, t in zip(rotates, types)]
    sections: dict[str, dict[str, Any]] = {
        k: {**({"position": {"kind": "none"}} if k.startswith("nope") else {}),
            **({"attention": {"window": window}} if k.endswith("+local") else {})}
        for k in set(kinds)}
    return typed_layers(out, kinds, sections)


def granite(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    out = base(cfg, bias=cfg.flag("attention_bias", False))

    def multiplier(key: str) -> float | None:   # 1 is no multiplier
        m = cfg.number(key, 1.0, kind=float)
        if m <= 0:
            raise cfg.refuse(key, m, "a multiplier above 0 is expected")
        return None if m == 1.0 else m
    logits = multiplier("logits_scaling")
    out["attention"]["scale"] = cfg.number("attention_multiplier", 1.0, kind=float)
    out["embedding"] = {"scale": multiplier("embedding_multiplier")}
    out["block"] = {"residual_scale": multiplier("residual_multiplier")}
    out["output"] = {"logit_scale": None if logits is None else 1.0 / logits}   # logits / s
    return out


def exaone4(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    out = base(cfg)
    out["attention"]["qk_norm"] = True
    out["norm"]["placement"] = "output"
    window = cfg.number("sliding_window", None)
    if window is None:   # no sliding layers, RoPE in every layer
        cfg.get(("sliding_window_pattern", "layer_types"))
        return out
    kinds = attention_kinds(cfg, out["layers"], "sliding_window_pattern", 4)
    # RoPE only in the sliding layers; the global ones see no positions (NoPE)
    return typed_layers(out, kinds, {"local": {"attention": {"window": window}},
                                     "global": {"position": {"kind": "none"}}})


NAMES_QK = {**NAMES, **each("attn.*_norm", "self_attn.*_norm", "q k")}
# norms on the sublayers' outputs (`norm.placement: output`)
NAMES_OUT = {**NAMES_QK, "attn_post_norm": "post_attention_layernorm",
             "ffn_post_norm": "post_feedforward_layernorm"}
QWEN3 = Architecture(("qwen3",), qwen3, Layout(NAMES_QK), skip=SKIP)
OLMO2 = Architecture(("olmo2",), olmo2, Layout(NAMES_OUT), skip=SKIP)
EXAONE4 = Architecture(("exaone4",), exaone4, Layout(NAMES_OUT), skip=SKIP)
GRANITE = Architecture(("granite",), granite, Layout(NAMES), skip=SKIP)
SMOLLM3 = Architecture(("smollm3",), smollm3, Layout(NAMES), tied=True, skip=SKIP)
