"""GPT-2: learned positions, pre-LayerNorm, fused Q/K/V, biases everywhere, tied head. Its
projections are Conv1D modules that store weights [in, out]; archc keeps [out, in]."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, activation, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

# GPT2DoubleHeadsModel's multiple-choice head and numerics-only switches
INERT = frozenset({"summary_type", "summary_use_proj", "summary_activation",
                   "summary_proj_to_labels", "summary_first_dropout", "reorder_and_upcast_attn",
                   "n_ctx"})


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("n_embd")
    heads = cfg.number("n_head")
    cfg.expect("add_cross_attention", (False,), False)
    cfg.expect("scale_attn_by_inverse_layer_idx", (False,), False)
    scaled = cfg.flag("scale_attn_weights", True)
    attention: dict[str, Any] = {"heads": heads, "bias": True}
    if not scaled:
        attention["scale"] = 1.0
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("wte.weight"), default=True)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": cfg.number("n_layer"), "max_seq_len": cfg.number("n_positions", 1024),
        "dtype": dtype_name(cfg), "attention": attention,
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("n_inner", 4 * d),
                "activation": activation(cfg, ("activation_function",), "gelu_new")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "position": {"kind": "learned"}, "embedding": {"tied": tied},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("wte.weight"), "embed.weight")
    t.rename(ckpt("wpe.weight"), "pos_embed.weight")
    t.rename(ckpt("ln_f.weight"), "final_norm.weight")
    t.rename(ckpt("ln_f.bias"), "final_norm.bias")
    output_head(s, t, ckpt)
    for i in range(s.layers):
        hf, ax = ckpt(f"h.{i}."), f"layers.{i}."
        for theirs, mine in (("ln_1", "attn_norm"), ("ln_2", "ffn_norm")):
            t.rename(f"{hf}{theirs}.weight", f"{ax}{mine}.weight")
            t.rename(f"{hf}{theirs}.bias", f"{ax}{mine}.bias")
        qkv = [f"{ax}attn.{p}" for p in ("q", "k", "v")]
        t.fused(hf + "attn.c_attn.weight", [q + ".weight" for q in qkv], transpose=True)
        t.fused(hf + "attn.c_attn.bias", [q + ".bias" for q in qkv])
        for theirs, mine in (("attn.c_proj", "attn.o"), ("mlp.c_fc", "ffn.up"),
                             ("mlp.c_proj", "ffn.down")):
            t.transposed(f"{hf}{theirs}.weight", f"{ax}{mine}.weight")
            t.rename(f"{hf}{theirs}.bias", f"{ax}{mine}.bias")


GPT2 = Architecture(("gpt2",), spec, tensors, INERT,
                    # causal-mask buffers older checkpoints saved
                    skip=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
                    prefixes=("transformer.",))
