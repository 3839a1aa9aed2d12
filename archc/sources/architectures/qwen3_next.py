"""Qwen3-Next: a hybrid of Gated DeltaNet layers and gated softmax attention.

- Layers by `layer_types` (default: every `full_attention_interval`-th full attention, the rest
  linear attention): linear ones are Gated DeltaNet mixers (fused q/k/v/z and b/a projections, a
  short SiLU conv over q, k and v, L2-normalized q and k, the gated delta rule, an RMSNorm per
  value head gated by SiLU(z)); full ones are Qwen3's attention (per-head QK-norm) on a partial
  rotary, whose query projection also yields a gate: the heads' output times σ(gate).
- Every norm but the gated one is a (1 + w) RMSNorm.
- MoE where `decoder_sparse_step` and `mlp_only_layers` put it (as Qwen3-MoE): a softmax router
  over the experts (top k renormalized by `norm_topk_prob`) and a shared expert scaled by
  σ(shared_expert_gate(x)); dense SwiGLU of `intermediate_size` elsewhere.

Checkpoint tensors kept fused or interleaved by transformers are laid out for archc here: q_proj
holds per head [q | gate]; in_proj_qkvz holds per key head [q | k | v | z] (the value head
group's v and z); in_proj_ba per key head [b | a].
"""

from __future__ import annotations

from typing import Any

import torch

from archc.sources.architectures.llama import SKIP
from archc.sources.architectures.llama_variants import NAMES_QK
from archc.sources.architectures.moe import EXPERTS, INERT, fused_experts, moe_layers
from archc.sources.hf_config import (
    Architecture,
    HFConfig,
    activation,
    rope_position,
    typed_layers,
)
from archc.sources.tensor_map import Checkpoint, Layout, TensorMap, each

LAYER_TYPES = ("linear_attention", "full_attention")


def layer_types(cfg: HFConfig, layers: int) -> list[str]:
    """transformers' rule: `layer_types`, else every `full_attention_interval`-th layer full."""
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.number("full_attention_interval", 4)
        if interval < 1:
            raise cfg.refuse("full_attention_interval", interval, "an interval of 1 or more "
                             "is expected")
        return ["linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(layers)]
    cfg.get("full_attention_interval")   # read, and unused beside layer_types
    if not isinstance(types, list) or len(types) != layers or any(
            t not in LAYER_TYPES for t in types):
        raise cfg.refuse("layer_types", types, f"linear_attention or full_attention per layer "
                         f"({layers}) is expected")
    return types


def qwen3_next(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    layers = cfg.number("num_hidden_layers")
    cfg.expect("hidden_act", ("silu", "swish"), "archc's Gated DeltaNet applies SiLU after the "
               "convolution")
    gated = activation(cfg, "hidden_act", "silu", gated=True)
    out: dict[str, Any] = {
        "d_model": cfg.number("hidden_size"), "layers": layers,
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None),
                      "head_dim": cfg.number("head_dim", None),
                      "bias": cfg.flag("attention_bias", False), "qk_norm": True,
                      "output_gate": True},
        "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float),
                 "unit_offset": True},
        **rope_position(cfg, cfg.number("max_position_embeddings", 2048),
                        default_fraction=0.25)}
    out["mixer"] = {"deltanet": {
        "key_heads": cfg.number("linear_num_key_heads", 16),
        "value_heads": cfg.number("linear_num_value_heads", 32),
        "key_dim": cfg.number("linear_key_head_dim", 128),
        "value_dim": cfg.number("linear_value_head_dim", 128),
        "d_conv": cfg.number("linear_conv_kernel_dim", 4)}}
    step = cfg.number("decoder_sparse_step", 1)
    if step < 1:
        raise cfg.refuse("decoder_sparse_step", step, "a step of 1 or more is expected")
    dense = moe_layers(cfg, layers, cfg.get("mlp_only_layers") or [], "mlp_only_layers")
    experts = cfg.number(EXPERTS, 512)
    routed = [experts > 0 and not d and (i + 1) % step == 0 for i, d in enumerate(dense)]
    dense_ffn = {"kind": gated, "d_ff": cfg.number("intermediate_size")}
    if any(routed):
        out["ffn"] = {"kind": "moe", "d_ff": cfg.number("moe_intermediate_size"), "moe": {
            "experts": experts, "top_k": cfg.number("num_experts_per_tok", 10), "expert": gated,
            "normalize_top_k": cfg.flag("norm_topk_prob", True),
            "shared_expert_d_ff": cfg.number("shared_expert_intermediate_size"),
            "shared_expert_gate": True}}
    else:   # read, and unused: no layer routes
        cfg.get(("moe_intermediate_size", "num_experts_per_tok", "norm_topk_prob",
                 "shared_expert_intermediate_size"))
        out["ffn"] = dense_ffn
    mixers = ["gated_deltanet" if t == "linear_attention" else "attention"
              for t in layer_types(cfg, layers)]
    if "attention" not in mixers:   # no layer attends: no heads, no positions
        out["attention"], out["position"] = None, {"kind": "none"}
    kinds = [f"{'delta' if m == 'gated_deltanet' else 'attn'}+{'moe' if r else 'dense'}"
             for m, r in zip(mixers, routed)]
    sections = {k: {"mixer": {"kind": "gated_deltanet" if k.startswith("delta") else
                              "attention"},
                    **({"ffn": dense_ffn} if k.endswith("dense") and any(routed) else {})}
                for k in kinds}
    return typed_layers(out, kinds, sections)


def by_part(x: torch.Tensor, heads: int, widths: tuple[int, ...]) -> list[torch.Tensor]:
    """Rows [H_k·(w0 + w1 + …), …] laid out per key head → [H_k·w0 | H_k·w1 | …]."""
    parts = x.reshape(heads, sum(widths), *x.shape[1:]).split(widths, dim=1)
    return [torch.cat([p.reshape(-1, *x.shape[1:]) for p in parts]).contiguous()]


EXPERTS_FUSED = fused_experts("mlp.experts")


def tensors(t: TensorMap) -> None:
    """The interleaved query/gate projection, the fused q/k/v/z and b/a projections per key
    head, the depthwise filter [C, 1, K] → [C, K], and experts fused as transformers 5 keeps
    them."""
    EXPERTS_FUSED(t)
    dn = t.spec.mixer.deltanet
    for i in range(t.spec.layers):
        hf, ax = t.ckpt(f"layers.{i}."), f"layers.{i}."
        if ax + "attn.gate.weight" in t.want:
            (rows, d), heads = t.want[ax + "attn.q.weight"], t.spec.attention.heads
            t.add([hf + "self_attn.q_proj.weight"], [(2 * rows, d)],
                  [ax + "attn.q.weight", ax + "attn.gate.weight"],
                  lambda xs, h=heads, d=d: [p.reshape(-1, d).contiguous() for p in
                                            xs[0].reshape(h, 2, -1, d).unbind(1)])
            if t.spec.attention.bias.q:
                t.add([hf + "self_attn.q_proj.bias"], [(2 * rows,)],
                      [ax + "attn.q.bias", ax + "attn.gate.bias"],
                      lambda xs, h=heads: [p.reshape(-1).contiguous() for p in
                                           xs[0].reshape(h, 2, -1).unbind(1)])
        if ax + "delta.qkvz.weight" not in t.want or dn is None:
            continue
        hk, group = dn.key_heads, dn.value_heads // dn.key_heads
        kd, vd = dn.key_dim, group * dn.value_dim      # per key head
        rows, d = t.want[ax + "delta.qkvz.weight"]
        lin = hf + "linear_attn."
        t.add([lin + "in_proj_qkvz.weight"], [(rows, d)], [ax + "delta.qkvz.weight"],
              lambda xs, w=(kd, kd, vd, vd), n=hk: by_part(xs[0], n, w))
        t.add([lin + "in_proj_ba.weight"], [(2 * dn.value_heads, d)], [ax + "delta.ba.weight"],
              lambda xs, w=(group, group), n=hk: by_part(xs[0], n, w))
        c, k = t.want[ax + "delta.conv.weight"]
        t.add([lin + "conv1d.weight"], [(c, 1, k)], [ax + "delta.conv.weight"],
              lambda xs: [xs[0].squeeze(1)])


QWEN3_NEXT = Architecture(("qwen3_next",), qwen3_next, Layout(
    {**NAMES_QK, "ffn.router": "mlp.gate",
     **each("ffn.experts.*", "mlp.experts.{e}.*_proj", "gate up down"),
     **each("ffn.shared.*", "mlp.shared_expert.*_proj", "gate up down"),
     "ffn.shared_gate": "mlp.shared_expert_gate",
     **each("delta.*", "linear_attn.*", "dt_bias A_log norm"), "delta.out": "linear_attn.out_proj"},
    special=tensors),
    inert=INERT, skip=SKIP)
