"""MPT: ALiBi, pre-LayerNorm without biases, a fused Q/K/V, exact-GELU MLP, tied head. The
attention settings live in a nested `attn_config`, checked field by field like the top level."""

from __future__ import annotations

from typing import Any

from archc.errors import SpecError
from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

# Training-time switches: initialisation, embedding-gradient scaling, logging, kernel choice.
INERT = frozenset({"init_device", "embedding_fraction", "verbose", "init_config",
                   "fc_type", "ffn_config"})
ATTN_INERT = frozenset({"attn_impl", "attn_pdrop"})


def _attention(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    raw = cfg.get("attn_config") or {}
    if not isinstance(raw, dict):
        raise cfg.refuse("attn_config", raw, "a mapping is expected")
    sub = HFConfig(raw, cfg.source)
    sub.model_type = cfg.model_type
    prefix = "attn_config."

    def expect(key: str, allowed: tuple[Any, ...], default: Any) -> None:
        value = sub.get(key, default)
        if value not in allowed:
            raise cfg.refuse(prefix + key, value, "archc implements only "
                             + ", ".join(repr(a) for a in allowed))

    expect("attn_type", ("multihead_attention",), "multihead_attention")
    expect("clip_qkv", (None,), None)
    expect("qk_ln", (False,), False)
    expect("prefix_lm", (False,), False)
    expect("attn_uses_sequence_id", (False,), False)
    expect("alibi", (True,), True)       # transformers' MPT always applies ALiBi
    expect("alibi_bias_max", (8,), 8)
    scale = sub.get("softmax_scale")
    try:
        sub.check_all_understood(ATTN_INERT)
    except SpecError as err:
        raise SpecError(prefix + err.path, err.problem, source=cfg.source,
                        allowed=err.allowed) from None
    return {} if scale is None else {"scale": float(scale)}


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.first(("d_model", "hidden_size"))
    heads = cfg.first(("n_heads", "num_attention_heads"))
    attention: dict[str, Any] = {"heads": heads, **_attention(cfg, ckpt)}
    if cfg.flag("learned_pos_emb", True) and ckpt.has("wpe.weight"):
        raise cfg.refuse("learned_pos_emb", True, "the checkpoint has learned positions beside "
                         "ALiBi; archc's spec has one position kind")
    cfg.expect("logit_scale", (None,))
    cfg.expect("norm_type", ("low_precision_layernorm", "layernorm"), "low_precision_layernorm")
    bias = not cfg.flag("no_bias", True)
    attention["bias"] = bias
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("wte.weight"), default=True)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": cfg.first(("n_layers", "num_hidden_layers")),
        "max_seq_len": cfg.number("max_seq_len", 2048), "dtype": dtype_name(cfg),
        "attention": attention,
        "ffn": {"kind": "mlp", "bias": bias, "activation": "gelu",
                "d_ff": int(cfg.number("expansion_ratio", 4, kind=float) * d)},
        "norm": {"kind": "layernorm", "bias": bias,
                 "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "position": {"kind": "alibi"}, "embedding": {"tied": tied},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    bias = s.norm.bias
    t.rename(ckpt("wte.weight"), "embed.weight")
    t.rename(ckpt("norm_f.weight"), "final_norm.weight")
    if bias:
        t.rename(ckpt("norm_f.bias"), "final_norm.bias")
    output_head(s, t, ckpt)
    kinds = ("weight", "bias") if bias else ("weight",)
    for i in range(s.layers):
        hf, ax = ckpt(f"blocks.{i}."), f"layers.{i}."
        for kind in kinds:
            t.rename(f"{hf}norm_1.{kind}", f"{ax}attn_norm.{kind}")
            t.rename(f"{hf}norm_2.{kind}", f"{ax}ffn_norm.{kind}")
            t.fused(f"{hf}attn.Wqkv.{kind}", [f"{ax}attn.{p}.{kind}" for p in "qkv"])
            t.rename(f"{hf}attn.out_proj.{kind}", f"{ax}attn.o.{kind}")
            t.rename(f"{hf}ffn.up_proj.{kind}", f"{ax}ffn.up.{kind}")
            t.rename(f"{hf}ffn.down_proj.{kind}", f"{ax}ffn.down.{kind}")


MPT = Architecture(("mpt",), spec, tensors, INERT, prefixes=("transformer.",))
