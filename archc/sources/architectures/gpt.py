"""The GPT-2 line of decoders: LayerNorm, an MLP, mostly biases.

- GPT-2: learned positions, a fused Q/K/V, Conv1D projections that store weights [in, out].
- GPT-J: attention and MLP in parallel off one norm, rotate-every-two RoPE on `rotary_dim` dims.
- GPT-NeoX (Pythia): fused per-head Q/K/V, partial RoPE, parallel with a norm per branch, or serial.
- BLOOM: ALiBi, a LayerNorm right after the embeddings, fused per-head Q/K/V.
- Falcon: fused Q/K/V per head, multi-query, or per KV-head group (`new_decoder_architecture`);
  parallel off one or two norms, or serial; RoPE, or ALiBi before the score scale (Falcon-RW).
- MPT: ALiBi, no biases, a fused Q/K/V; the nested `attn_config` is checked field by field.
- OPT: a position table that starts 2 rows in; 350m normalizes after each sublayer and embeds
  tokens narrower than the residual stream, with projections in and out.
- Phi: attention and MLP in parallel off one norm, partial RoPE, optional LayerNorm on q and k.
"""

from __future__ import annotations

from typing import Any

from archc.sources.hf_config import Architecture, HFConfig, activation, rope_position
from archc.sources.tensor_map import QKV, Checkpoint, Layout, each

GPT_SKIP = (r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",)   # causal-mask buffers


def gpt2(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "d_model": cfg.number("n_embd"), "layers": cfg.number("n_layer"),
        "max_seq_len": cfg.number("n_positions", 1024),
        "attention": {"heads": cfg.number("n_head"), "bias": True,
                      "scale": None if cfg.flag("scale_attn_weights", True) else 1.0},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("n_inner", None),
                "activation": activation(cfg, "activation_function", "gelu_new")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "position": {"kind": "learned"}}


def gptj(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    head_dim = cfg.number("n_embd") // cfg.number("n_head")
    return {
        "d_model": cfg.number("n_embd"), "layers": cfg.number("n_layer"),
        "max_seq_len": cfg.number("n_positions", 2048),
        "attention": {"heads": cfg.number("n_head")},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("n_inner", None),
                "activation": activation(cfg, "activation_function", "gelu_new")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "block": {"parallel": True}, "output": {"bias": True},
        "position": {"kind": "rope", "theta": 10000.0, "interleaved": True,
                     "fraction": cfg.number("rotary_dim", head_dim) / head_dim}}


def neox(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "d_model": cfg.number("hidden_size"), "layers": cfg.number("num_hidden_layers"),
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "bias": cfg.flag("attention_bias", True)},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("intermediate_size"),
                "activation": activation(cfg, "hidden_act", "gelu")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_eps", 1e-5, kind=float)},
        "block": {"parallel": True, "shared_norm": False}
        if cfg.flag("use_parallel_residual", True) else {},
        **rope_position(cfg, cfg.number("max_position_embeddings", 2048),
                        theta_keys=("rotary_emb_base", "rope_theta"),
                        fraction_keys=("rotary_pct", "partial_rotary_factor"),
                        default_fraction=0.25)}


def bloom(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number(("hidden_size", "n_embed"))
    return {
        "d_model": d, "layers": cfg.number(("num_hidden_layers", "n_layer")), "max_seq_len": 2048,
        "attention": {"heads": cfg.number(("num_attention_heads", "n_head")), "bias": True},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": 4 * d, "activation": "gelu_tanh"},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "position": {"kind": "alibi"}, "embedding": {"norm": True}}


def falcon(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    heads = cfg.number(("num_attention_heads", "n_head"))
    kv = cfg.number(("num_kv_heads", "n_head_kv"), None)
    multi_query = cfg.flag("multi_query", True)   # the new architecture ignores it
    parallel = cfg.flag("parallel_attn", True)
    if cfg.flag("new_decoder_architecture", False):   # KV-head groups of [queries | k | v]
        cfg.expect("parallel_attn", (True,), "transformers' Falcon has no serial block in the "
                   "new decoder architecture")
        norms = cfg.expect("num_ln_in_parallel_attn", (2, 1), "1 or 2 norms")
    elif (norms := cfg.get("num_ln_in_parallel_attn")) not in (None, 1):
        raise cfg.refuse("num_ln_in_parallel_attn", norms, "transformers' Falcon reads it only "
                         "with new_decoder_architecture")
    elif multi_query:
        kv = 1
    elif kv not in (None, heads):
        raise cfg.refuse("num_kv_heads", kv, "without new_decoder_architecture or multi_query "
                         "every head has its own key and value")
    # newer transformers also write the KV heads its attention derives from the fields above
    cfg.expect("num_key_value_heads", (heads if kv is None else kv,), "the KV heads "
               "num_kv_heads, multi_query and new_decoder_architecture give")
    max_seq = cfg.number("max_position_embeddings", 2048)
    if cfg.flag("alibi", False):
        cfg.used.update(("rope_theta", "rope_scaling", "rope_parameters"))
        position = {"max_seq_len": max_seq, "position": {"kind": "alibi", "alibi_scaled": True}}
    else:
        position = rope_position(cfg, max_seq)
    bias = cfg.flag("bias", False)
    return {
        "d_model": cfg.number("hidden_size"),
        "layers": cfg.number(("num_hidden_layers", "n_layer")),
        "attention": {"heads": heads, "kv_heads": kv, "bias": bias},
        "ffn": {"kind": "mlp", "bias": bias, "d_ff": cfg.number("ffn_hidden_size", None),
                "activation": activation(cfg, "activation", "gelu")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "block": {"parallel": True, "shared_norm": norms != 2} if parallel else {}, **position}


MPT_ATTENTION_ONLY = {
    "attn_type": ("multihead_attention",), "clip_qkv": (None,), "qk_ln": (False,),
    "prefix_lm": (False,), "attn_uses_sequence_id": (False,),
    "alibi": (True,), "alibi_bias_max": (8,)}   # transformers' MPT always applies ALiBi


def mpt(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    raw = cfg.get("attn_config") or {}
    if not isinstance(raw, dict):
        raise cfg.refuse("attn_config", raw, "a mapping is expected")
    attn = HFConfig(raw, cfg.source, model_type=cfg.model_type, prefix="attn_config.")
    for key, allowed in MPT_ATTENTION_ONLY.items():
        attn.expect(key, allowed)
    scale = attn.number("softmax_scale", None, kind=float)
    attn.check_all_understood({"attn_impl"})
    if cfg.flag("learned_pos_emb", True) and ckpt("wpe.weight") in ckpt.names:
        raise cfg.refuse("learned_pos_emb", True, "the checkpoint has learned positions beside "
                         "ALiBi; archc's spec has one position kind")
    d = cfg.number(("d_model", "hidden_size"))
    bias = not cfg.flag("no_bias", True)
    return {
        "d_model": d, "layers": cfg.number(("n_layers", "num_hidden_layers")),
        "max_seq_len": cfg.number("max_seq_len", 2048),
        "attention": {"heads": cfg.number(("n_heads", "num_attention_heads")), "bias": bias,
                      "scale": scale}, "ffn": {"kind": "mlp", "bias": bias, "activation": "gelu",
                "d_ff": int(cfg.number("expansion_ratio", 4, kind=float) * d)},
        "norm": {"kind": "layernorm", "bias": bias,
                 "eps": cfg.number("layer_norm_epsilon", 1e-5, kind=float)},
        "position": {"kind": "alibi"}}


def opt(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    d = cfg.number("hidden_size")
    proj = cfg.number("word_embed_proj_dim", d)
    pre = cfg.flag("do_layer_norm_before", True)
    removed = cfg.flag("_remove_final_layer_norm", False)
    bias = cfg.flag("enable_bias", True)
    return {
        "d_model": d, "layers": cfg.number("num_hidden_layers"),
        "max_seq_len": cfg.number("max_position_embeddings", 2048),
        "attention": {"heads": cfg.number("num_attention_heads"), "bias": bias},
        "ffn": {"kind": "mlp", "bias": bias, "d_ff": cfg.number("ffn_dim"),
                "activation": activation(cfg, "activation_function", "relu")},
        "norm": {"kind": "layernorm", "eps": 1e-5, "placement": "pre" if pre else "post"},
        "position": {"kind": "learned", "offset": 2},   # the table's first two rows are unused
        "embedding": {"project_dim": proj if proj != d else None},
        "output": {"final_norm": pre and not removed}}


def phi(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    return {
        "d_model": cfg.number("hidden_size"), "layers": cfg.number("num_hidden_layers"),
        "attention": {"heads": cfg.number("num_attention_heads"),
                      "kv_heads": cfg.number("num_key_value_heads", None), "bias": True,
                      "qk_norm": cfg.flag("qk_layernorm", False)},
        "ffn": {"kind": "mlp", "bias": True, "d_ff": cfg.number("intermediate_size"),
                "activation": activation(cfg, "hidden_act", "gelu_new")},
        "norm": {"kind": "layernorm", "eps": cfg.number("layer_norm_eps", 1e-5, kind=float)},
        "block": {"parallel": True}, "output": {"bias": True},
        **rope_position(cfg, cfg.number("max_position_embeddings", 2048), default_fraction=0.5)}


H_TO_4H = {"ffn.up": "mlp.dense_h_to_4h", "ffn.down": "mlp.dense_4h_to_h"}
BLOOM_NAMES = {
    "embed": "word_embeddings", "embed_norm": "word_embeddings_layernorm", "final_norm": "ln_f",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    **dict.fromkeys(QKV, "self_attention.query_key_value"), "attn.o": "self_attention.dense",
    **H_TO_4H}

GPT2 = Architecture(("gpt2",), gpt2, Layout({
        "embed": "wte", "pos_embed": "wpe", "final_norm": "ln_f", "attn_norm": "ln_1",
        "ffn_norm": "ln_2", **dict.fromkeys(QKV, "attn.c_attn"), "attn.o": "attn.c_proj",
        "ffn.up": "mlp.c_fc", "ffn.down": "mlp.c_proj"}, layer="h.{i}.", conv1d=True),
    tied=True, only={"add_cross_attention": (False,), "scale_attn_by_inverse_layer_idx": (False,)},
    # GPT2DoubleHeadsModel's multiple-choice head and numerics-only switches
    inert=frozenset({"summary_type", "summary_use_proj", "summary_activation",
                     "summary_proj_to_labels", "summary_first_dropout",
                     "reorder_and_upcast_attn", "n_ctx"}), skip=GPT_SKIP)
GPTJ = Architecture(("gptj",), gptj, Layout({
        "embed": "wte", "final_norm": "ln_f", "attn_norm": "ln_1",
        **each("attn.*", "attn.*_proj", "q k v"), "attn.o": "attn.out_proj",
        "ffn.up": "mlp.fc_in", "ffn.down": "mlp.fc_out"}, layer="h.{i}."), skip=GPT_SKIP)
NEOX = Architecture(("gpt_neox",), neox, Layout({
        "embed": "embed_in", "final_norm": "final_layer_norm", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        **dict.fromkeys(QKV, "attention.query_key_value"), "attn.o": "attention.dense",
        **H_TO_4H}, head=("embed_out", "lm_head"), groups=lambda s: s.attention.heads),
    # causal-mask and RoPE buffers older checkpoints saved
    skip=(r"(gpt_neox\.)?layers\.\d+\.attention\.(bias|masked_bias|rotary_emb\.inv_freq)",))
BLOOM = Architecture(
    ("bloom",), bloom, Layout(BLOOM_NAMES, layer="h.{i}.", groups=lambda s: s.attention.heads),
    tied=True, only={"apply_residual_connection_post_layernorm": (False,), "n_inner": (None,)},
    # Megatron-DeepSpeed training and kernel switches saved with the checkpoints, which the model
    # code never reads (`pretraining_tp` and `slow_but_exact` only reorder the same sums)
    inert=frozenset({"pretraining_tp", "slow_but_exact", "attention_softmax_in_fp32",
                     "bias_dropout_fusion", "masked_softmax_fusion", "offset_alibi",
                     "skip_bias_add", "skip_bias_add_qkv", "seq_length"}))
FALCON = Architecture(("falcon",), falcon, Layout({
        **BLOOM_NAMES,
        "attn_norm": lambda s: "ln_attn" if s.block.parallel and not s.block.shared_norm
        else "input_layernorm",
        "ffn_norm": lambda s: "ln_mlp" if s.block.parallel else "post_attention_layernorm"},
        layer="h.{i}.", groups=lambda s: s.attention.kv_heads), tied=True)
MPT = Architecture(("mpt",), mpt, Layout({
        "embed": "wte", "final_norm": "norm_f", "attn_norm": "norm_1", "ffn_norm": "norm_2",
        **dict.fromkeys(QKV, "attn.Wqkv"), "attn.o": "attn.out_proj",
        **each("ffn.*", "ffn.*_proj", "up down")}, layer="blocks.{i}."),
    tied=True, only={"logit_scale": (None,), "norm_type": ("low_precision_layernorm", "layernorm")},
    # training-time switches: initialisation, embedding-gradient scaling, logging, kernel choice
    inert=frozenset({"init_device", "embedding_fraction", "verbose", "init_config", "fc_type",
                     "ffn_config"}))
OPT = Architecture(("opt",), opt, Layout({
        "embed": "embed_tokens", "embed.project_in": "project_in", "pos_embed": "embed_positions",
        "head.project_out": "project_out", "final_norm": "final_layer_norm",
        "attn_norm": "self_attn_layer_norm", "ffn_norm": "final_layer_norm",
        **each("attn.*", "self_attn.*_proj", "q k v"), "attn.o": "self_attn.out_proj",
        "ffn.up": "fc1", "ffn.down": "fc2"}),
    tied=True, only={"layer_norm_elementwise_affine": (True,)}, inert=frozenset({"init_std"}))
PHI = Architecture(("phi",), phi, Layout({
        "embed": "embed_tokens", "final_norm": "final_layernorm", "attn_norm": "input_layernorm",
        **each("attn.*", "self_attn.*_proj", "q k v"), "attn.o": "self_attn.dense",
        **each("attn.*_norm", "self_attn.*_layernorm", "q k"), "ffn.up": "mlp.fc1",
        "ffn.down": "mlp.fc2"}))
