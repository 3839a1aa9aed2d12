"""The mixture-of-experts model types of 2025–26, each Llama's layout with its own routing:

- Qwen3-MoE: Qwen3's attention (a per-head QK RMSNorm); a softmax router over every expert, its
  top k renormalized or not (`norm_topk_prob`); dense layers where `mlp_only_layers` or
  `decoder_sparse_step` put them, of their own width (`intermediate_size`; the experts'
  is `moe_intermediate_size`).
- gpt-oss: attention sinks (a learned logit per head in the softmax denominator, through the
  spec's normalizer), sliding-window layers between full ones, YaRN RoPE blended from fractional
  dims (`truncate: false`), biases on q, k, v and o; a router with a bias whose softmax runs over
  the top-k logits only (the top k of a softmax over all, renormalized); experts with biases, their
  gate and up columns interleaved in one [in, out] tensor, and a clamped SwiGLU:
  min(g, L)·σ(α·min(g, L))·(clamp(u, ±L) + 1). Its published checkpoints hold the experts in
  MXFP4, which archc does not read (refused by name); a bf16 copy loads.
- Llama 4 (text): RoPE on pairs of dims (interleaved) with chunked local attention
  (`attention_chunk_size`, a mask expression) and an L2 QK-norm without gains on three layers
  in four, the fourth global without positions (NoPE) and with attention-temperature tuning (a
  score expression scaling by 1 + s·log(1 + ⌊(q_pos + 1)/f⌋)); MoE every
  `interleave_moe_layer_step`-th layer — a shared expert beside the routed ones, a sigmoid
  router over the top k logits whose score scales the expert's input — and dense layers of
  `intermediate_size_mlp` between.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from archc.sources.architectures.llama import NAMES, SKIP
from archc.sources.architectures.llama_variants import NAMES_QK, base
from archc.sources.hf_config import (
    Architecture,
    HFConfig,
    activation,
    attention_kinds,
    rope_position,
    typed_layers,
)
from archc.sources.tensor_map import Checkpoint, Layout, TensorMap, each

# Router noise and load-balancing losses act in training only.
INERT = frozenset({"router_jitter_noise", "router_aux_loss_coef", "output_router_logits"})
EXPERTS = ("num_experts", "num_local_experts")   # transformers 5 writes the second


def moe_layers(cfg: HFConfig, layers: int, which: Sequence[int], key: str) -> list[bool]:
    """Whether each layer routes over experts, given the layers `which` that config field `key`
    names."""
    if not isinstance(which, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                          or not 0 <= i < layers for i in which):
        raise cfg.refuse(key, which, f"a list of layer indices below {layers} is expected")
    return [i in which for i in range(layers)]


def with_dense_layers(spec: dict[str, Any], routed: Sequence[bool],
                      dense: dict[str, Any]) -> dict[str, Any]:
    """`spec` (an MoE model) with the layers not `routed` running the dense FFN `dense`."""
    if not any(routed):
        return {**spec, "ffn": dense}
    return typed_layers(spec, ["moe" if r else "dense" for r in routed],
                        {"moe": {}, "dense": {"ffn": dense}})


def qwen3_moe(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    out = base(cfg, bias=cfg.flag("attention_bias", False))
    layers, gated = out["layers"], out["ffn"]["kind"]
    out["attention"]["qk_norm"] = True
    cfg.expect("mlp_bias", (False,))
    # transformers' Qwen3-MoE slides every layer when use_sliding_window is set
    if cfg.flag("use_sliding_window", False):
        if cfg.get("max_window_layers") is not None:
            raise cfg.refuse("max_window_layers", cfg.get("max_window_layers"), "transformers' "
                             "qwen3_moe slides every layer, whatever max_window_layers says")
        out["attention"]["window"] = cfg.number("sliding_window")
    else:   # read, and unused: no layer slides
        cfg.get(("sliding_window", "max_window_layers"))
    step = cfg.number("decoder_sparse_step", 1)
    if step < 1:
        raise cfg.refuse("decoder_sparse_step", step, "a step of 1 or more is expected")
    dense = moe_layers(cfg, layers, cfg.get("mlp_only_layers") or [], "mlp_only_layers")
    experts = cfg.number(EXPERTS, 128)
    routed = [experts > 0 and not d and (i + 1) % step == 0 for i, d in enumerate(dense)]
    out["ffn"] = {"kind": "moe", "d_ff": cfg.number("moe_intermediate_size"), "moe": {
        "experts": experts, "top_k": cfg.number("num_experts_per_tok", 8), "expert": gated,
        "normalize_top_k": cfg.flag("norm_topk_prob", False)}}
    return with_dense_layers(out, routed, {"kind": gated, "d_ff": cfg.number("intermediate_size")})


def fused_experts(module: str, *, transposed: bool = False, interleaved: bool = False,
                  biases: bool = False):  # noqa: ANN201 (a Layout.special)
    """A `Layout.special` for experts stored as one tensor per projection for all experts, as
    transformers 5 keeps them: `gate_up_proj` [E, 2F, d] (gate rows first; `interleaved`: gate
    row n and up row n at 2n and 2n + 1) and `down_proj` [E, d, F], or each [E, in, out]
    (`transposed`), with `biases` `gate_up_proj_bias` [E, 2F] and `down_proj_bias` [E, d].
    Checkpoints with one tensor per expert are left to the layout's table."""
    def halves(x: Any) -> list[Any]:     # [E, 2F, ...] → gate and up [E, F, ...]
        if interleaved:
            return [x[:, 0::2].contiguous(), x[:, 1::2].contiguous()]
        return [p.contiguous() for p in x.chunk(2, dim=1)]

    def special(t: TensorMap) -> None:
        for i in range(t.spec.layers):
            hf, ax = t.ckpt(f"layers.{i}.{module}."), f"layers.{i}.ffn.experts."
            if hf + "gate_up_proj" not in t.ckpt.names or ax + "gate.weight" not in t.want:
                continue
            n, f, d = t.want[ax + "gate.weight"]
            t.add([hf + "gate_up_proj"], [(n, d, 2 * f) if transposed else (n, 2 * f, d)],
                  [ax + "gate.weight", ax + "up.weight"],
                  lambda xs: halves(xs[0].transpose(1, 2) if transposed else xs[0]))
            t.add([hf + "down_proj"], [(n, f, d) if transposed else (n, d, f)],
                  [ax + "down.weight"],
                  lambda xs: [xs[0].transpose(1, 2).contiguous() if transposed else xs[0]])
            if biases:
                t.add([hf + "gate_up_proj_bias"], [(n, 2 * f)], [ax + "gate.bias", ax + "up.bias"],
                      lambda xs: halves(xs[0]))
                t.add([hf + "down_proj_bias"], [(n, d)], [ax + "down.bias"], lambda xs: xs)
    return special


QWEN3_MOE = Architecture(("qwen3_moe",), qwen3_moe, Layout(
    {**NAMES_QK, "ffn.router": "mlp.gate",
     **each("ffn.experts.*", "mlp.experts.{e}.*_proj", "gate up down")},
    special=fused_experts("mlp.experts")), inert=INERT, skip=SKIP)


def gpt_oss(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    if cfg.get("quantization_config") is not None:
        method = (cfg.get("quantization_config") or {}).get("quant_method", "?")
        raise cfg.refuse("quantization_config", method, "archc reads float experts, not "
                         f"{method} blocks; dequantize the checkpoint first (transformers: "
                         "Mxfp4Config(dequantize=True), then save_pretrained)")
    layers = cfg.number("num_hidden_layers")
    attention = {"heads": cfg.number("num_attention_heads"),
                 "kv_heads": cfg.number("num_key_value_heads", None),
                 "head_dim": cfg.number("head_dim", None),
                 "bias": cfg.flag("attention_bias", True),
                 "params": {"sinks": "layers.{layer}.attn.sinks"},
                 "normalizer": {"kind": "softmax", "sinks": "sinks"}}
    # the experts' activation is the clamped SwiGLU below, whatever hidden_act says
    cfg.get("hidden_act")
    spec = {
        "d_model": cfg.number("hidden_size"), "layers": layers, "attention": attention,
        "ffn": {"kind": "moe", "d_ff": cfg.number("intermediate_size"), "moe": {
            "experts": cfg.number(EXPERTS), "top_k": cfg.number("num_experts_per_tok", 4),
            "expert": "swiglu", "router_bias": True, "normalize_top_k": True, "bias": True,
            "clamp": cfg.number("swiglu_limit", 7.0, kind=float),
            "swish_beta": cfg.number("swiglu_alpha", 1.702, kind=float), "up_offset": 1.0}},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-5, kind=float)},
        **rope_position(cfg, cfg.number("max_position_embeddings", 131072), whole_heads=True)}
    kinds = attention_kinds(cfg, layers, (), 2)
    if "local" not in kinds:
        cfg.get("sliding_window")
        return spec
    return typed_layers(spec, kinds, {"local": {"attention": {
        "window": cfg.number("sliding_window", 128)}}, "global": {}})


GPT_OSS = Architecture(("gpt_oss",), gpt_oss, Layout(
    {**NAMES, "attn.sinks": "self_attn.sinks", "ffn.router": "mlp.router",
     **each("ffn.experts.*", "mlp.experts.*_proj", "gate up down")},
    special=fused_experts("mlp.experts", transposed=True, interleaved=True, biases=True)),
    inert=INERT, skip=SKIP)


def llama4_text(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    layers = cfg.number("num_hidden_layers")
    d_ff = cfg.number("intermediate_size")
    spec = {
        "d_model": cfg.number("hidden_size"), "layers": layers,
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None),
                      "head_dim": cfg.number("head_dim", None),
                      "bias": cfg.flag("attention_bias", False)},
        "ffn": {"kind": "moe", "d_ff": d_ff, "moe": {
            "experts": cfg.number("num_local_experts", 16),
            "top_k": cfg.number("num_experts_per_tok", 1),
            "expert": activation(cfg, "hidden_act", "silu", gated=True), "router": "sigmoid",
            "normalize_top_k": False, "score_on": "input", "shared_expert_d_ff": d_ff}},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-5, kind=float)},
        **rope_position(cfg, cfg.number("max_position_embeddings", 131072), whole_heads=True)}
    spec["position"]["interleaved"] = True   # complex pairs (x[2j], x[2j + 1])
    step = cfg.number("interleave_moe_layer_step", 1)
    if step < 1:
        raise cfg.refuse("interleave_moe_layer_step", step, "a step of 1 or more is expected")
    routed = moe_layers(cfg, layers, cfg.get("moe_layers") or
                        list(range(step - 1, layers, step)), "moe_layers")
    interval = cfg.number("no_rope_layer_interval", 4)
    rotates = cfg.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(rotates, list) or len(rotates) != layers or any(
            r not in (0, 1) or isinstance(r, bool) for r in rotates):
        raise cfg.refuse("no_rope_layers", rotates, f"a 1 (RoPE) or 0 (NoPE) per layer "
                         f"({layers}) is expected")
    chunk = cfg.number("attention_chunk_size", None)
    types = cfg.get("layer_types") or ["chunked_attention" if r and chunk is not None else
                                       "full_attention" for r in rotates]
    if not isinstance(types, list) or len(types) != layers or any(
            t not in ("chunked_attention", "full_attention") for t in types) or (
            chunk is None and "chunked_attention" in types):
        raise cfg.refuse("layer_types", types, "chunked_attention (with attention_chunk_size) "
                         f"or full_attention per layer ({layers}) is expected")
    qk_norm = cfg.flag("use_qk_norm", True)
    # transformers' Llama 4 reads attn_temperature_tuning as a truth value (the published
    # configs write 4)
    tuning = cfg.get("attn_temperature_tuning", True)
    if not isinstance(tuning, (bool, int)):
        raise cfg.refuse("attn_temperature_tuning", tuning, "true or false is expected")
    scale, floor = cfg.number("attn_scale", 0.1, kind=float), cfg.number("floor_scale", 8192)
    if floor < 1:
        raise cfg.refuse("floor_scale", floor, "a whole number ≥ 1 is expected")
    dense = {"kind": spec["ffn"]["moe"]["expert"], "d_ff": cfg.number("intermediate_size_mlp")}
    kinds, sections = [], {}
    for r, t, moe in zip(rotates, types, routed):
        attention: dict[str, Any] = {}
        if t == "chunked_attention":   # the keys of the query's chunk, up to the query
            attention["mask"] = f"kv_pos <= q_pos and q_pos // {chunk} == kv_pos // {chunk}"
        if r and qk_norm:
            attention |= {"qk_norm": True, "qk_norm_gain": False}
        if not r and tuning:   # q·(1 + s·log(1 + ⌊(p + 1)/f⌋)) at query position p
            attention["score"] = f"score * ({scale!r} * log((q_pos + 1) // {floor} + 1) + 1.0)"
        kind = "+".join(("rope" if r else "nope", *(["chunked"] if attention.get("mask") else []),
                         "moe" if moe else "dense"))
        kinds.append(kind)
        sections[kind] = {**({"attention": attention} if attention else {}),
                          **({} if r else {"position": {"kind": "none"}}),
                          **({} if moe else {"ffn": dense})}
    return typed_layers(spec, kinds, sections)


LLAMA4_TEXT = Architecture(("llama4_text",), llama4_text, Layout(
    {**NAMES, **each("ffn.*", "feed_forward.*_proj", "gate up down"),
     "ffn.router": "feed_forward.router",
     **each("ffn.shared.*", "feed_forward.shared_expert.*_proj", "gate up down")},
    special=fused_experts("feed_forward.experts", transposed=True)),
    inert=INERT | {"for_llm_compressor"}, skip=SKIP)
