"""The encoders and encoder-decoders.

- BERT: word, position and token-type embeddings summed and normalized, post-LayerNorm blocks, a
  GELU MLP; archc returns the last hidden state (the pooler and pre-training heads are skipped).
- T5: pre-RMSNorm, no score scaling, a bucketed relative-position bias learned in each stack's
  first layer and shared by its layers, a ReLU MLP (or v1.1's gated GELU), one shared embedding.
"""

from __future__ import annotations

from typing import Any

from archc.sources.hf_config import ACTIVATIONS, GATED, Architecture, HFConfig, activation
from archc.sources.tensor_map import Checkpoint, Layout, Module


def bert(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "family": "encoder", "d_model": cfg.number("hidden_size"),
        "layers": cfg.number("num_hidden_layers"),
        "max_seq_len": cfg.number("max_position_embeddings", 512),
        "attention": {"heads": cfg.number("num_attention_heads"), "mask": "bidirectional",
                      "bias": True},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("intermediate_size"),
                "activation": activation(cfg, "hidden_act", "gelu")},
        "norm": {"kind": "layernorm", "placement": "post",
                 "eps": cfg.number("layer_norm_eps", 1e-12, kind=float)},
        "position": {"kind": "learned"},
        "embedding": {"norm": True, "token_types": cfg.number("type_vocab_size", 2)},
        "output": {"final_norm": False}}


def t5_ffn(cfg: HFConfig) -> dict[str, Any]:
    proj = str(cfg.get("feed_forward_proj", "relu"))
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise cfg.refuse("feed_forward_proj", proj, "'ACT' or 'gated-ACT' is expected")
    # transformers 5 saves the fields it derives
    name = cfg.get("dense_act_fn", "gelu_new" if proj == "gated-gelu" else parts[-1])
    gated = cfg.flag("is_gated_act", len(parts) == 2)
    if name not in ACTIVATIONS:
        raise cfg.refuse("feed_forward_proj", proj, "archc's activations are "
                         + ", ".join(sorted(ACTIVATIONS)))
    if not gated:
        return {"kind": "mlp", "activation": ACTIVATIONS[name], "d_ff": cfg.number("d_ff")}
    if ACTIVATIONS[name] not in GATED:
        raise cfg.refuse("feed_forward_proj", proj, "a gated FFN with exact (erf) GELU has no "
                         "spec kind")
    return {"kind": GATED[ACTIVATIONS[name]], "d_ff": cfg.number("d_ff")}


def t5(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("d_model")
    layers = cfg.number("num_layers")
    # transformers ties the head unless the checkpoint holds a different one; it scales the
    # decoder output by d_model^-0.5 when the config says the head is tied (original T5)
    scale = cfg.get("scale_decoder_outputs", cfg.get("tie_word_embeddings") is not False)
    return {
        "family": "encoder-decoder", "d_model": d, "layers": layers,
        "decoder_layers": cfg.number("num_decoder_layers", layers),
        "max_seq_len": max(512, cfg.number("n_positions", 512)),
        "attention": {"heads": cfg.number("num_heads"), "head_dim": cfg.number("d_kv"),
                      "scale": 1.0}, "ffn": t5_ffn(cfg),
        "norm": {"kind": "rmsnorm", "eps": cfg.number("layer_norm_epsilon", 1e-6, kind=float)},
        "position": {"kind": "relative",
                     "buckets": cfg.number("relative_attention_num_buckets", 32),
                     "max_distance": cfg.number("relative_attention_max_distance", 128)},
        "embedding": {"tied": not ckpt.differ("lm_head.weight", "shared.weight")},
        "output": {"scale": d ** -0.5 if scale else None}}


def t5_stack(stack: str, ffn: int) -> dict[str, Module]:
    """A stack's modules: in each layer self-attention is sublayer 0 and the FFN sublayer `ffn`
    (the decoder's cross-attention is sublayer 1)."""
    dense = f"{ffn}.DenseReluDense"
    layer = {"attn_norm": "0.layer_norm", "attn": "0.SelfAttention",
             "attn.rel_bias": "0.SelfAttention.relative_attention_bias",
             "ffn_norm": f"{ffn}.layer_norm", "ffn.gate": f"{dense}.wi_0",
             "ffn.up": lambda s: f"{dense}.wi_1" if s.ffn.gated else f"{dense}.wi",
             "ffn.down": f"{dense}.wo"}
    return {f"{stack}.final_norm": f"{stack}.final_layer_norm",
            **{f"{stack}.{mine}": theirs for mine, theirs in layer.items()}}


BERT = Architecture(("bert",), bert, Layout({
        "embed": "embeddings.word_embeddings", "pos_embed": "embeddings.position_embeddings",
        "type_embed": "embeddings.token_type_embeddings", "embed_norm": "embeddings.LayerNorm",
        "attn.q": "attention.self.query", "attn.k": "attention.self.key",
        "attn.v": "attention.self.value", "attn.o": "attention.output.dense",
        "attn_norm": "attention.output.LayerNorm", "ffn.up": "intermediate.dense",
        "ffn.down": "output.dense", "ffn_norm": "output.LayerNorm"}, layer="encoder.layer.{i}."),
    tied=None, only={"is_decoder": (False,), "add_cross_attention": (False,),
                     "position_embedding_type": ("absolute",)},
    inert=frozenset({"tie_word_embeddings"}),   # it ties the MLM head, which archc does not run
    # the pooler and pre-training heads sit on top of the hidden states archc returns; the
    # position-id buffer older checkpoints saved is arange(max_seq_len)
    skip=(r"(bert\.)?pooler\.dense\.(weight|bias)", r"cls\..*",
          r"(bert\.)?embeddings\.position_ids"))
T5 = Architecture(("t5",), t5, Layout({
        "embed": "shared", **t5_stack("encoder", 1), **t5_stack("decoder", 2),
        "decoder.cross_norm": "1.layer_norm", "decoder.cross": "1.EncDecAttention"},
        layer="{stack}block.{i}.layer.",
        copies=("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")),
    tied=None, only={"is_encoder_decoder": (True,)}, inert=frozenset({"initializer_factor"}))
