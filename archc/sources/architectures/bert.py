"""BERT: an encoder with word, position and token-type embeddings and a LayerNorm over their sum,
post-LayerNorm blocks, GELU MLP. archc returns the last hidden state; the pooler and the
pre-training heads are task heads on top of it and are skipped."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint
from archc.sources.hf_config import HFConfig, activation, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    cfg.expect("is_decoder", (False,), False)
    cfg.expect("add_cross_attention", (False,), False)
    cfg.expect("position_embedding_type", ("absolute",), "absolute")
    cfg.get("tie_word_embeddings")  # ties the MLM head, which archc does not run
    return {
        "family": "encoder", "vocab_size": cfg.number("vocab_size"),
        "d_model": cfg.number("hidden_size"), "layers": cfg.number("num_hidden_layers"),
        "max_seq_len": cfg.number("max_position_embeddings", 512), "dtype": dtype_name(cfg),
        "attention": {"heads": cfg.number("num_attention_heads"), "mask": "bidirectional",
                      "bias": True},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("intermediate_size"),
                "activation": activation(cfg, ("hidden_act",), "gelu")},
        "norm": {"kind": "layernorm", "placement": "post",
                 "eps": cfg.number("layer_norm_eps", 1e-12, kind=float)},
        "position": {"kind": "learned"},
        "embedding": {"norm": True, "token_types": cfg.number("type_vocab_size", 2)},
        "output": {"final_norm": False},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    e = ckpt("embeddings.")
    t.rename(e + "word_embeddings.weight", "embed.weight")
    t.rename(e + "position_embeddings.weight", "pos_embed.weight")
    if s.embedding.token_types:
        t.rename(e + "token_type_embeddings.weight", "type_embed.weight")
    for kind in ("weight", "bias"):
        t.rename(f"{e}LayerNorm.{kind}", f"embed_norm.{kind}")
    for i in range(s.layers):
        hf, ax = ckpt(f"encoder.layer.{i}."), f"layers.{i}."
        for kind in ("weight", "bias"):
            for theirs, mine in (("query", "q"), ("key", "k"), ("value", "v")):
                t.rename(f"{hf}attention.self.{theirs}.{kind}", f"{ax}attn.{mine}.{kind}")
            t.rename(f"{hf}attention.output.dense.{kind}", f"{ax}attn.o.{kind}")
            t.rename(f"{hf}attention.output.LayerNorm.{kind}", f"{ax}attn_norm.{kind}")
            t.rename(f"{hf}intermediate.dense.{kind}", f"{ax}ffn.up.{kind}")
            t.rename(f"{hf}output.dense.{kind}", f"{ax}ffn.down.{kind}")
            t.rename(f"{hf}output.LayerNorm.{kind}", f"{ax}ffn_norm.{kind}")


BERT = Architecture(
    ("bert",), spec, tensors, frozenset(),
    # the pooler and pre-training heads sit on top of the hidden states archc returns; the
    # position-id buffer older checkpoints saved is arange(max_seq_len)
    skip=(r"(bert\.)?pooler\.dense\.(weight|bias)", r"cls\..*",
          r"(bert\.)?embeddings\.position_ids"),
    prefixes=("bert.",))
