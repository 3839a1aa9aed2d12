"""T5: an encoder-decoder with RMSNorm before each sublayer, no score scaling, a bucketed
relative-position bias learned in each stack's first layer and shared by all its layers, a ReLU
MLP (T5) or a gated one (T5 v1.1's gated-gelu), and one embedding shared by both stacks."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint
from archc.sources.hf_config import ACTIVATIONS, HFConfig, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec

INERT = frozenset({"initializer_factor", "n_positions"})
GATED = {"relu": "reglu", "gelu_tanh": "geglu", "silu": "swiglu", "sigmoid": "glu"}


def _ffn(cfg: HFConfig) -> dict[str, Any]:
    proj = str(cfg.get("feed_forward_proj", "relu"))
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise cfg.refuse("feed_forward_proj", proj, "'ACT' or 'gated-ACT' is expected")
    act_name = "gelu_new" if proj == "gated-gelu" else parts[-1]
    act_name = cfg.get("dense_act_fn", act_name)      # transformers 5 saves the derived fields
    gated = cfg.flag("is_gated_act", parts[0] == "gated" and len(parts) == 2)
    if act_name not in ACTIVATIONS:
        raise cfg.refuse("feed_forward_proj", proj, "archc's activations are "
                         + ", ".join(sorted(ACTIVATIONS)))
    act = ACTIVATIONS[act_name]
    d_ff = cfg.number("d_ff")
    if not gated:
        return {"kind": "mlp", "activation": act, "d_ff": d_ff}
    if act not in GATED:
        raise cfg.refuse("feed_forward_proj", proj, "a gated FFN with exact (erf) GELU has no "
                         "spec kind")
    return {"kind": GATED[act], "d_ff": d_ff}


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("d_model")
    cfg.expect("is_encoder_decoder", (True,), True)
    # transformers ties the head unless the checkpoint holds a different one; it scales the
    # decoder output by d_model^-0.5 when the config says the head is tied (original T5)
    scale = cfg.get("scale_decoder_outputs")
    if scale is None:
        scale = cfg.get("tie_word_embeddings") is not False
    cfg.get("tie_word_embeddings")
    tied = not ckpt.has("lm_head.weight") or bool(
        ckpt.source.shape("lm_head.weight") == ckpt.source.shape("shared.weight")
        and (ckpt.tensor("lm_head.weight") == ckpt.tensor("shared.weight")).all())
    layers = cfg.number("num_layers")
    return {
        "family": "encoder-decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": layers, "decoder_layers": cfg.number("num_decoder_layers", layers),
        "max_seq_len": max(512, cfg.number("n_positions", 512)), "dtype": dtype_name(cfg),
        "attention": {"heads": cfg.number("num_heads"), "head_dim": cfg.number("d_kv"),
                      "scale": 1.0},
        "ffn": _ffn(cfg),
        "norm": {"kind": "rmsnorm", "eps": cfg.number("layer_norm_epsilon", 1e-6, kind=float)},
        "position": {"kind": "relative",
                     "buckets": cfg.number("relative_attention_num_buckets", 32),
                     "max_distance": cfg.number("relative_attention_max_distance", 128)},
        "embedding": {"tied": tied},
        "output": {"scale": d ** -0.5} if scale else {},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename("shared.weight", "embed.weight")
    for stack in ("encoder", "decoder"):
        if ckpt.has(f"{stack}.embed_tokens.weight"):
            t.duplicate(f"{stack}.embed_tokens.weight", "embed.weight")
    if not s.embedding.tied:
        t.rename("lm_head.weight", "head.weight")
    elif ckpt.has("lm_head.weight"):
        t.duplicate("lm_head.weight", "embed.weight")
    gated = s.ffn.gated
    assert s.decoder_layers is not None
    for stack, layers in (("encoder", s.layers), ("decoder", s.decoder_layers)):
        t.rename(f"{stack}.final_layer_norm.weight", f"{stack}.final_norm.weight")
        t.rename(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                 f"{stack}.layers.0.attn.rel_bias.weight")
        for i in range(layers):
            hf, ax = f"{stack}.block.{i}.layer.", f"{stack}.layers.{i}."
            sublayers = [("SelfAttention", "attn")]
            if stack == "decoder":
                sublayers.append(("EncDecAttention", "cross"))
            for n, (theirs, mine) in enumerate(sublayers):
                t.rename(f"{hf}{n}.layer_norm.weight", f"{ax}{mine}_norm.weight")
                for p in ("q", "k", "v", "o"):
                    t.rename(f"{hf}{n}.{theirs}.{p}.weight", f"{ax}{mine}.{p}.weight")
            n = len(sublayers)
            t.rename(f"{hf}{n}.layer_norm.weight", f"{ax}ffn_norm.weight")
            ffn = f"{hf}{n}.DenseReluDense."
            if gated:
                t.rename(ffn + "wi_0.weight", ax + "ffn.gate.weight")
                t.rename(ffn + "wi_1.weight", ax + "ffn.up.weight")
            else:
                t.rename(ffn + "wi.weight", ax + "ffn.up.weight")
            t.rename(ffn + "wo.weight", ax + "ffn.down.weight")


T5 = Architecture(("t5",), spec, tensors, INERT)
