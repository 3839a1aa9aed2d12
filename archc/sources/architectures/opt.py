"""OPT: learned positions whose table starts 2 rows in, LayerNorm before (most sizes) or after
(350m) each sublayer, ReLU MLP, biases, tied head; 350m also embeds tokens narrower than the
residual stream, with projections in and out."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, activation, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

INERT = frozenset({"init_std"})
POSITION_OFFSET = 2   # OPT reserves the first two rows of its position table


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("hidden_size")
    proj = cfg.number("word_embed_proj_dim", d)
    cfg.expect("layer_norm_elementwise_affine", (True,), True)
    pre = cfg.flag("do_layer_norm_before", True)
    removed = cfg.flag("_remove_final_layer_norm", False)
    final_norm = pre and not removed
    bias = cfg.flag("enable_bias", True)
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("embed_tokens.weight"), default=True)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": cfg.number("num_hidden_layers"),
        "max_seq_len": cfg.number("max_position_embeddings", 2048), "dtype": dtype_name(cfg),
        "attention": {"heads": cfg.number("num_attention_heads"), "bias": bias},
        "ffn": {"kind": "mlp", "bias": bias, "d_ff": cfg.number("ffn_dim"),
                "activation": activation(cfg, ("activation_function",), "relu")},
        "norm": {"kind": "layernorm", "eps": 1e-5, "placement": "pre" if pre else "post"},
        "position": {"kind": "learned", "offset": POSITION_OFFSET},
        "embedding": {"tied": tied, **({"project_dim": proj} if proj != d else {})},
        "output": {"final_norm": final_norm},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("embed_tokens.weight"), "embed.weight")
    t.rename(ckpt("embed_positions.weight"), "pos_embed.weight")
    if s.embedding.project_dim is not None:
        t.rename(ckpt("project_in.weight"), "embed.project_in.weight")
        t.rename(ckpt("project_out.weight"), "head.project_out.weight")
    if s.output.final_norm:
        t.rename(ckpt("final_layer_norm.weight"), "final_norm.weight")
        t.rename(ckpt("final_layer_norm.bias"), "final_norm.bias")
    output_head(s, t, ckpt)
    kinds = ("weight", "bias") if s.attention.bias.any else ("weight",)
    for i in range(s.layers):
        hf, ax = ckpt(f"layers.{i}."), f"layers.{i}."
        for theirs, mine in (("self_attn_layer_norm", "attn_norm"),
                             ("final_layer_norm", "ffn_norm")):
            t.rename(f"{hf}{theirs}.weight", f"{ax}{mine}.weight")
            t.rename(f"{hf}{theirs}.bias", f"{ax}{mine}.bias")
        for kind in kinds:
            for p in ("q", "k", "v"):
                t.rename(f"{hf}self_attn.{p}_proj.{kind}", f"{ax}attn.{p}.{kind}")
            t.rename(f"{hf}self_attn.out_proj.{kind}", f"{ax}attn.o.{kind}")
            t.rename(f"{hf}fc1.{kind}", f"{ax}ffn.up.{kind}")
            t.rename(f"{hf}fc2.{kind}", f"{ax}ffn.down.{kind}")


OPT = Architecture(("opt",), spec, tensors, INERT, prefixes=("model.decoder.", "decoder."))
