"""DeepSeek-V2 and V3: multi-head latent attention (the spec's `attention.latent`) and routed
experts beside shared ones, the first `first_k_dense_replace` layers dense.

- Attention: queries through a low-rank latent (`q_lora_rank`, normalized) or one projection;
  keys and values projected up per head from a normalized latent of `kv_lora_rank`, with a
  RoPE key of `qk_rope_head_dim` shared by the heads; each head's query and key are
  `qk_nope_head_dim + qk_rope_head_dim`, its value `v_head_dim`. RoPE rotates pairs of dims
  (V2 always, V3 where `rope_interleave`), YaRN with `mscale` and `mscale_all_dim` (the scores'
  scale corrected by the latter). The latents' norms keep transformers' eps of 1e-6.
- V3's router: σ of the logits; a per-expert correction bias joins them for the choice only;
  `n_group` groups scored by their two best, the `topk_group` best kept; the chosen weights
  renormalized (`norm_topk_prob`) and scaled by `routed_scaling_factor`.
- V2's router: a softmax over the experts, top k over all (`greedy`) or within the
  `topk_group` groups of the best single expert (`group_limited_greedy`), scaled by
  `routed_scaling_factor`, not renormalized.
"""

from __future__ import annotations

from typing import Any

from archc.sources.architectures import llama, moe
from archc.sources.architectures.llama import NAMES, SKIP
from archc.sources.architectures.moe import EXPERTS, fused_experts, with_dense_layers
from archc.sources.hf_config import Architecture, HFConfig, activation, rope_position
from archc.sources.tensor_map import Checkpoint, Layout, each

LATENT_EPS = 1e-6   # transformers builds the latents' RMSNorms with their default eps


def latent_attention(cfg: HFConfig, *, interleaved: bool) -> dict[str, Any]:
    """The spec's attention, position and max_seq_len of a DeepSeek config."""
    heads = cfg.number("num_attention_heads")
    nope, rope = cfg.number("qk_nope_head_dim"), cfg.number("qk_rope_head_dim")
    kv_heads = cfg.number("num_key_value_heads", heads)
    if kv_heads != heads:
        raise cfg.refuse("num_key_value_heads", kv_heads, f"latent attention gives each of the "
                         f"{heads} heads its keys and values (transformers repeats none)")
    cfg.get("head_dim")   # transformers sets it to qk_rope_head_dim, for its RoPE
    if cfg.number("qk_head_dim", nope + rope) != nope + rope:   # and this to their sum
        raise cfg.refuse("qk_head_dim", cfg.get("qk_head_dim"), f"qk_nope_head_dim + "
                         f"qk_rope_head_dim = {nope + rope} is expected")
    q_rank, bias = cfg.number("q_lora_rank", None), cfg.flag("attention_bias", False)
    latent = {"kv_rank": cfg.number("kv_lora_rank"), "rope_dims": rope,
              "v_dim": cfg.number("v_head_dim"), "eps": LATENT_EPS}
    if q_rank is not None:
        latent["q_rank"] = q_rank
    out = {"attention": {"heads": heads, "head_dim": nope + rope, "latent": latent,
                         # q_proj has no bias; q_a_proj, kv_a_proj_with_mqa and o_proj follow
                         # attention_bias
                         "bias": {"q": bias and q_rank is not None, "k": bias, "o": bias}},
           **rope_position(cfg, cfg.number("max_position_embeddings", 4096), whole_heads=True)}
    out["position"]["interleaved"] = interleaved
    return out


def deepseek(cfg: HFConfig, *, v3: bool) -> dict[str, Any]:
    layers = cfg.number("num_hidden_layers")
    gated = activation(cfg, "hidden_act", "silu", gated=True)
    spec = {"d_model": cfg.number("hidden_size"), "layers": layers,
            "norm": {"kind": "rmsnorm", "eps": cfg.number("rms_norm_eps", 1e-6, kind=float)},
            **latent_attention(cfg, interleaved=cfg.flag("rope_interleave", True) if v3
                               else True)}
    dense = {"kind": gated, "d_ff": cfg.number("intermediate_size")}
    experts = cfg.number(("n_routed_experts", *EXPERTS), None)
    first = cfg.number("first_k_dense_replace", 0 if v3 is False else 3)
    if not experts or first >= layers:
        cfg.get(("moe_intermediate_size", "n_shared_experts", "num_experts_per_tok",
                 "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob",
                 "topk_method", "scoring_func"))
        return {**spec, "ffn": dense}
    groups = cfg.number("n_group", None) or 1
    top_groups = cfg.number("topk_group", None) or groups
    d_ff = cfg.number("moe_intermediate_size")
    moe: dict[str, Any] = {"experts": experts, "top_k": cfg.number("num_experts_per_tok"),
                           "expert": gated, "scale": cfg.number("routed_scaling_factor", 1.0,
                                                                kind=float)}
    if v3:
        # the published checkpoints state the router transformers' V3 always runs
        cfg.expect("scoring_func", ("sigmoid",))
        cfg.expect("topk_method", ("noaux_tc",))
        moe |= {"router": "sigmoid", "choice_bias": True,
                "normalize_top_k": cfg.flag("norm_topk_prob", True)}
        if groups > 1:
            moe |= {"groups": groups, "top_groups": top_groups, "group_score": "top2"}
    else:
        method = cfg.expect("topk_method", ("greedy", "group_limited_greedy"))
        # transformers' V2 router never renormalizes, whatever norm_topk_prob says
        cfg.get("norm_topk_prob")
        moe["normalize_top_k"] = False
        if method == "group_limited_greedy" and groups > 1:
            moe |= {"groups": groups, "top_groups": top_groups, "group_score": "max"}
    if shared := cfg.number("n_shared_experts", None):
        moe["shared_expert_d_ff"] = shared * d_ff
    spec["ffn"] = {"kind": "moe", "d_ff": d_ff, "moe": moe}
    return with_dense_layers(spec, [i >= first for i in range(layers)], dense)


def deepseek_v3(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    return deepseek(cfg, v3=True)


def deepseek_v2(cfg: HFConfig, ckpt: Checkpoint) -> dict[str, Any]:
    cfg.expect("mlp_bias", (False,))
    return deepseek(cfg, v3=False)


NAMES_MLA = {
    **NAMES, **each("attn.*", "self_attn.*_proj", "q q_a q_b kv_b o"),
    "attn.kv_a": "self_attn.kv_a_proj_with_mqa",
    **each("attn.*_norm", "self_attn.*_layernorm", "q_a kv_a"),
    "ffn.router": "mlp.gate", "ffn.router.choice_bias": "mlp.gate.e_score_correction_bias",
    **each("ffn.experts.*", "mlp.experts.{e}.*_proj", "gate up down"),
    **each("ffn.shared.*", "mlp.shared_experts.*_proj", "gate up down")}
# the multi-token-prediction layers past num_hidden_layers train a draft head; inference reads
# none of them
INERT = llama.INERT | moe.INERT | {"num_nextn_predict_layers", "num_mtp_layers"}
DEEPSEEK_V3 = Architecture(("deepseek_v3",), deepseek_v3, Layout(
    NAMES_MLA, special=fused_experts("mlp.experts")), inert=INERT, skip=SKIP)
DEEPSEEK_V2 = Architecture(("deepseek_v2",), deepseek_v2, Layout(
    NAMES_MLA, special=fused_experts("mlp.experts")), inert=INERT, skip=SKIP)
