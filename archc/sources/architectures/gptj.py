"""GPT-J: attention and MLP in parallel off one LayerNorm, interleaved (rotate-every-two) RoPE on
the first `rotary_dim` dims of each head, no attention biases, an untied head with a bias."""

from __future__ import annotations

from typing import Any

from archc.sources.architectures.base import Architecture, Checkpoint, output_head
from archc.sources.hf_config import HFConfig, activation, dtype_name
from archc.sources.tensor_map import TensorMap
from archc.spec.schema import Spec


def spec(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("n_embd")
    heads = cfg.number("n_head")
    head_dim = d // heads
    rotary = cfg.number("rotary_dim", head_dim)
    tied = ckpt.head_is_tied(cfg, "lm_head.weight", ckpt("wte.weight"), default=False)
    return {
        "family": "decoder", "vocab_size": cfg.number("vocab_size"), "d_model": d,
        "layers": cfg.number("n_layer"), "max_seq_len": cfg.number("n_positions", 2048),
        "dtype": dtype_name(cfg), "attention": {"heads": heads},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("n_inner", 4 * d),
                "activation": activation(cfg, ("activation_function",), "gelu_new")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "block": {"parallel": True},
        "position": {"kind": "rope", "theta": 10000.0, "fraction": rotary / head_dim,
                     "interleaved": True},
        "embedding": {"tied": tied}, "output": {"bias": True},
    }


def tensors(s: Spec, t: TensorMap, ckpt: Checkpoint) -> None:
    t.rename(ckpt("wte.weight"), "embed.weight")
    t.rename(ckpt("ln_f.weight"), "final_norm.weight")
    t.rename(ckpt("ln_f.bias"), "final_norm.bias")
    t.rename("lm_head.bias", "head.bias")
    output_head(s, t, ckpt)
    for i in range(s.layers):
        hf, ax = ckpt(f"h.{i}."), f"layers.{i}."
        t.rename(hf + "ln_1.weight", ax + "attn_norm.weight")
        t.rename(hf + "ln_1.bias", ax + "attn_norm.bias")
        for p in ("q", "k", "v"):
            t.rename(f"{hf}attn.{p}_proj.weight", f"{ax}attn.{p}.weight")
        t.rename(hf + "attn.out_proj.weight", ax + "attn.o.weight")
        for theirs, mine in (("fc_in", "up"), ("fc_out", "down")):
            t.rename(f"{hf}mlp.{theirs}.weight", f"{ax}ffn.{mine}.weight")
            t.rename(f"{hf}mlp.{theirs}.bias", f"{ax}ffn.{mine}.bias")


GPTJ = Architecture(("gptj",), spec, tensors, frozenset(),
                    skip=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
                    prefixes=("transformer.",))
