"""The mixture-of-experts model types of 2025–26, each Llama's layout with its own routing:

- Qwen3-MoE: Qwen3's attention (a per-head QK RMSNorm); a softmax router over every expert, its
  top k renormalized or not (`norm_topk_prob`); dense layers where `mlp_only_layers` or
  `decoder_sparse_step` put them, of their own width (`intermediate_size`; the experts'
  is `moe_intermediate_size`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from archc.sources.architectures.llama import SKIP
from archc.sources.architectures.llama_variants import NAMES_QK, base
from archc.sources.hf_config import Architecture, HFConfig, typed_layers
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


def fused_experts(module: str, *, gate_up: str = "gate_up_proj", down: str = "down_proj",
                  transposed: bool = False, interleaved: bool = False):  # noqa: ANN201
    """A `Layout.special` for experts stored as one tensor per projection for all experts, as
    transformers 5 keeps them: `gate_up` [E, 2F, d] (gate rows first; `interleaved`: gate row n
    and up row n at 2n and 2n + 1) and `down` [E, d, F], or each [E, in, out] (`transposed`).
    Checkpoints with one tensor per expert are left to the layout's table."""
    def special(t: TensorMap) -> None:
        for i in range(t.spec.layers):
            hf, ax = t.ckpt(f"layers.{i}.{module}."), f"layers.{i}.ffn.experts."
            if hf + gate_up not in t.ckpt.names or ax + "gate.weight" not in t.want:
                continue
            n, f, d = t.want[ax + "gate.weight"]

            def split(xs: list[Any]) -> list[Any]:
                x = xs[0].transpose(1, 2) if transposed else xs[0]            # (E, 2F, d)
                if interleaved:
                    return [x[:, 0::2].contiguous(), x[:, 1::2].contiguous()]
                return [p.contiguous() for p in x.chunk(2, dim=1)]
            t.add([hf + gate_up], [(n, d, 2 * f) if transposed else (n, 2 * f, d)],
                  [ax + "gate.weight", ax + "up.weight"], split)
            want = t.want[ax + "down.weight"]                                   # (E, d, F)
            t.add([hf + down], [(n, want[2], want[1]) if transposed else want],
                  [ax + "down.weight"],
                  lambda xs: [xs[0].transpose(1, 2).contiguous() if transposed else xs[0]])
    return special


QWEN3_MOE = Architecture(("qwen3_moe",), qwen3_moe, Layout(
    {**NAMES_QK, "ffn.router": "mlp.gate",
     **each("ffn.experts.*", "mlp.experts.{e}.*_proj", "gate up down")},
    special=fused_experts("mlp.experts")), inert=INERT, skip=SKIP)
