"""GGUF files of llama.cpp's `deepseek2` architecture (DeepSeek-V2/V3, Kimi-K2): a tiny random
transformers DeepseekV3ForCausalLM / DeepseekV2ForCausalLM written as llama.cpp's converter
(`DeepseekV2Model`) writes it — its metadata keys, its tensor names, kv_b split into `attn_k_b`
(each head's key half, transposed) and `attn_v_b` as newer converters store it, or whole as older
ones did — loaded with `archc.load` and held to transformers running what the file holds.

Table-driven, one row per (model, layout, tensor type): queries through a low-rank latent (V3)
or one projection (V2 without q_lora_rank), biases on q_a, kv_a and o, YaRN with
mscale = mscale_all_dim ≠ 1 (the scores' scale corrected), F32, F16 and Q8_0 files (Q8_0 where a
row is whole 32-value blocks, F16 elsewhere, as the converter falls back). Most rows are dense
(first_k_dense_replace = num_hidden_layers); two route after a dense first layer: V3's router
(σ, a random choice bias, 4 groups of 2 experts, 2 kept, top-2 renormalized, ×2.5, one shared
expert) and V2's (softmax, top-2 of 4, not renormalized, ×1.5, two shared experts). Only the
eager backend runs latent attention.

Tolerance, fp32: 1e-4 of the largest logit, as test_hf_crosscheck: both sides compute with the
same stored values in different orders.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import archc
from archc.errors import SpecError
from archc.quant.tensor import QTensor
from archc.spec.load import layer_spec
from tests.test_hf_crosscheck import randomize, rel_error

gguf = pytest.importorskip("gguf", reason="needs gguf (pip install 'archc[gguf]')")
transformers = pytest.importorskip("transformers", reason="needs transformers "
                                   "(pip install 'archc[hf]')")

RTOL = 1e-4
VOCAB = 97
Q = gguf.GGMLQuantizationType
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0,
        "rope_theta": 1000.0}


def deepseek(v3: bool, *, d: int = 48, heads: int = 3, kv_rank: int = 20, q_rank: int | None = 12,
             rope: int = 8, nope: int = 16, v: int = 10, bias: bool = False,
             rope_parameters: dict[str, Any] | None = None, **moe: Any) -> Any:
    """A DeepSeek config, by default two layers, both dense (`moe`: its MoE fields instead);
    rms_norm_eps 1e-6, the latents' norms' eps in transformers, which llama.cpp takes for them
    from layer_norm_rms_epsilon."""
    config = transformers.DeepseekV3Config if v3 else transformers.DeepseekV2Config
    routing = {"num_hidden_layers": 2, "first_k_dense_replace": 2, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
               **moe}
    return config(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=64, num_attention_heads=heads,
        num_key_value_heads=heads, kv_lora_rank=kv_rank, q_lora_rank=q_rank,
        qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v, moe_intermediate_size=16,
        max_position_embeddings=64, rms_norm_eps=1e-6, attention_bias=bias,
        rope_parameters=rope_parameters or {"rope_type": "default", "rope_theta": 1000.0},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, **routing)


# row → (config factory, model class, kv_b split into attn_k_b and attn_v_b, 2-D tensor type)
CASES: dict[str, tuple[Callable[[], Any], str, bool, Any]] = {
    # q through q_a, its norm and q_b; biases on q_a, kv_a and o; kv_b split
    "v3-split-f32": (lambda: deepseek(True, bias=True), "DeepseekV3ForCausalLM", True, Q.F32),
    # one q projection (q_lora_rank null); kv_b whole, as files before the split hold it
    "v2-whole-f16": (lambda: deepseek(False, q_rank=None), "DeepseekV2ForCausalLM", False,
                     Q.F16),
    # YaRN ×4 from 16 positions with mscale = mscale_all_dim = 0.707: scores scaled by m(0.707)²
    "v3-yarn-split-f16": (lambda: deepseek(True, rope_parameters=YARN), "DeepseekV3ForCausalLM",
                          True, Q.F16),
    # rows of 32 values where Q8_0 fits: k_b's rows (nope = 24) fall back to F16, v_b's are Q8_0
    # and the two are joined as floats
    "v3-split-q8_0": (lambda: deepseek(True, d=64, heads=2, kv_rank=32, q_rank=32, nope=24, v=16),
                      "DeepseekV3ForCausalLM", True, Q.Q8_0),
    # kv_b whole in Q8_0 (rows of kv_rank = 32): kept quantized
    "v3-whole-q8_0": (lambda: deepseek(True, d=64, heads=2, kv_rank=32, q_rank=32, nope=24,
                                       v=16), "DeepseekV3ForCausalLM", False, Q.Q8_0),
    # a dense layer, then two routed ones: σ router, choice bias, 4 groups of 2 (2 kept), top 2
    # renormalized, ×2.5, one shared expert
    "v3-moe-f32": (lambda: deepseek(True, num_hidden_layers=3, first_k_dense_replace=1,
                                    n_routed_experts=8, n_group=4, topk_group=2,
                                    norm_topk_prob=True, routed_scaling_factor=2.5),
                   "DeepseekV3ForCausalLM", True, Q.F32),
    # a dense layer, then a routed one: softmax top 2 of 4 (greedy), ×1.5, two shared experts
    "v2-moe-f16": (lambda: deepseek(False, q_rank=None, first_k_dense_replace=1, n_group=None,
                                    topk_group=None, n_shared_experts=2,
                                    routed_scaling_factor=1.5),
                   "DeepseekV2ForCausalLM", False, Q.F16),
}

# transformers' module → llama.cpp's tensor (gguf's tensor names for deepseek2)
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.q_a_proj": "attn_q_a",
         "self_attn.q_a_layernorm": "attn_q_a_norm", "self_attn.q_b_proj": "attn_q_b",
         "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
         "self_attn.kv_a_layernorm": "attn_kv_a_norm", "self_attn.kv_b_proj": "attn_kv_b",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
         "mlp.experts.gate": "ffn_gate_exps", "mlp.experts.up": "ffn_up_exps",
         "mlp.experts.down_proj": "ffn_down_exps",
         "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
         "mlp.shared_experts.up_proj": "ffn_up_shexp",
         "mlp.shared_experts.down_proj": "ffn_down_shexp"}


def gguf_name(hf: str) -> str:
    """llama.cpp's name of a transformers tensor (its fused experts' halves named
    `mlp.experts.gate` and `.up`; the router's choice bias is `exp_probs_b.bias`)."""
    if hf.endswith("mlp.gate.e_score_correction_bias"):
        return f"blk.{hf.split('.')[2]}.exp_probs_b.bias"
    module, kind = hf.rsplit(".", 1)
    if module in TOP:
        return f"{TOP[module]}.{kind}"
    if ".experts." in hf:   # stored [experts, rows, cols], one tensor per projection
        module, kind = hf, "weight"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{LAYER[rest]}.{kind}"


def metadata(cfg: Any, split: bool) -> dict[str, Any]:
    """The `deepseek2.` metadata convert_hf_to_gguf.py writes for `cfg` (DeepseekV2Model and
    the TextModel fields before it): with the kv_b split, the widths llama.cpp's absorbed
    attention caches (one KV head of the latent and the RoPE key) and the heads' own as `_mla`;
    before it, the heads' widths."""
    kv_rank, rope, nope = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    out: dict[str, Any] = {
        "block_count": cfg.num_hidden_layers, "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size, "feed_forward_length": cfg.intermediate_size,
        "attention.head_count": cfg.num_attention_heads,
        "attention.head_count_kv": 1 if split else cfg.num_attention_heads,
        "rope.freq_base": float(cfg.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps,
        "expert_count": cfg.n_routed_experts, "expert_used_count": cfg.num_experts_per_tok,
        # scoring_func, which config.json holds: sigmoid (2) for V3, softmax (1) for V2
        "expert_gating_func": 2 if cfg.model_type == "deepseek_v3" else 1,
        "leading_dense_block_count": cfg.first_k_dense_replace, "vocab_size": cfg.vocab_size,
        "attention.kv_lora_rank": kv_rank,
        "expert_feed_forward_length": cfg.moe_intermediate_size,
        "expert_shared_count": cfg.n_shared_experts,
        "expert_weights_scale": float(cfg.routed_scaling_factor),
        "rope.dimension_count": rope}
    if split:
        out |= {"attention.key_length": kv_rank + rope, "attention.value_length": kv_rank,
                "attention.key_length_mla": nope + rope,
                "attention.value_length_mla": cfg.v_head_dim}
    else:
        out |= {"attention.key_length": nope + rope, "attention.value_length": cfg.v_head_dim}
    if cfg.n_group is not None:
        out |= {"expert_group_count": cfg.n_group, "expert_group_used_count": cfg.topk_group}
    if cfg.q_lora_rank is not None:
        out["attention.q_lora_rank"] = cfg.q_lora_rank
    if cfg.norm_topk_prob:
        out["expert_weights_norm"] = True
    rope_params = cfg.rope_parameters
    if rope_params.get("rope_type") == "yarn":
        out |= {"rope.scaling.type": "yarn", "rope.scaling.factor": rope_params["factor"],
                "rope.scaling.original_context_length":
                    rope_params["original_max_position_embeddings"],
                "rope.scaling.yarn_beta_fast": rope_params["beta_fast"],
                "rope.scaling.yarn_beta_slow": rope_params["beta_slow"],
                "rope.scaling.yarn_log_multiplier": 0.1 * rope_params["mscale_all_dim"]}
    return out


def stored_as(name: str, x: np.ndarray, qtype: Any) -> tuple[np.ndarray, Any, np.ndarray]:
    """(bytes to write, their type, the values they hold): 1-D tensors and the router in F32,
    others in `qtype`, Q8_0 falling back to F16 where a row is not whole blocks (as the
    converter does)."""
    if x.ndim == 1 or qtype == Q.F32 or "ffn_gate_inp" in name:
        return x, Q.F32, x
    if qtype == Q.Q8_0 and x.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        raw = gguf.quants.quantize(x, qtype)
        return raw, qtype, gguf.quants.dequantize(raw, qtype)
    half = x.astype(np.float16)
    return half, Q.F16, half.astype(np.float32)


def write_deepseek2(model: Any, path: Path, qtype: Any, *, split: bool,
                    meta: dict[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """`model` as llama.cpp's converter writes it (its metadata, or `meta` in its place), 2-D
    weights in `qtype`; kv_b split into attn_k_b [H, kv_rank, nope] and attn_v_b
    [H, v, kv_rank] (`split`) or whole. Returns the weights the file holds in transformers'
    names, kv_b joined again, for transformers to run."""
    cfg = model.config
    heads, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    w = gguf.GGUFWriter(str(path), "deepseek2")
    for key, value in (metadata(cfg, split) if meta is None else meta).items():
        key = f"deepseek2.{key}"
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_string(key, value)

    def add(name: str, x: np.ndarray) -> np.ndarray:
        raw, kind, back = stored_as(name, x, qtype)
        w.add_tensor(name, raw, raw_dtype=kind if kind != Q.F32 else None)
        return np.asarray(back, dtype=np.float32).reshape(x.shape)

    stored: dict[str, torch.Tensor] = {}
    for name, p in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        x = p.numpy().astype(np.float32)
        if name.endswith("mlp.experts.gate_up_proj"):   # [E, 2F, d]: gate rows, then up
            gate, up = np.split(x, 2, axis=1)
            back = np.concatenate([add(gguf_name(name.replace("gate_up_proj", part)),
                                       np.ascontiguousarray(half))
                                   for part, half in (("gate", gate), ("up", up))], axis=1)
        elif split and name.endswith("kv_b_proj.weight"):
            kv = x.reshape(heads, nope + v, x.shape[-1])
            block = gguf_name(name).removesuffix(".attn_kv_b.weight")
            k_b = add(f"{block}.attn_k_b.weight", np.ascontiguousarray(
                kv[:, :nope].transpose(0, 2, 1)))                   # (H, kv_rank, nope)
            v_b = add(f"{block}.attn_v_b.weight", np.ascontiguousarray(kv[:, nope:]))
            back = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(x.shape)
        else:
            back = add(gguf_name(name), x)
        stored[name] = torch.from_numpy(np.ascontiguousarray(back))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


def build(case: str, path: Path) -> torch.nn.Module:
    make_config, cls, split, qtype = CASES[case]
    torch.manual_seed(0)
    hf = getattr(transformers, cls)(make_config()).eval()
    randomize(hf, 0)
    stored = write_deepseek2(hf, path, qtype, split=split)
    missing, unexpected = hf.load_state_dict(stored, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[str, Any, archc.Model]:
    case = request.param
    path = tmp_path_factory.mktemp(case) / f"{case}.gguf"
    hf = build(case, path)
    return case, hf, archc.load(path)


def test_logits_match_transformers(pair: tuple[str, Any, archc.Model]) -> None:
    """Two rows of 20 tokens, past YaRN's original 16 positions."""
    case, hf, model = pair
    ids = torch.randint(3, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    got = model.compile("eager")(ids)
    assert got.shape == want.shape
    err = rel_error(got, want)
    assert err <= RTOL, f"{case}: max error {err:.2e} of the largest logit"


def test_greedy_tokens_match_transformers(pair: tuple[str, Any, archc.Model]) -> None:
    """Prefill, then decode through the latent KV cache, token for token as transformers."""
    case, hf, model = pair
    ids = torch.randint(3, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    settings = transformers.GenerationConfig(max_new_tokens=8, min_new_tokens=8,
                                             do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(ids, generation_config=settings).tolist()
    got = model.compile("eager").generate(ids, max_new_tokens=8, eos_token_id=())
    assert got.tolist() == want, case


def test_the_spec_is_what_the_file_says(pair: tuple[str, Any, archc.Model]) -> None:
    case, hf, model = pair
    cfg, s = hf.config, model.spec
    _, _, split, qtype = CASES[case]
    att, lat = s.attention, s.attention.latent
    assert (att.heads, att.head_dim) == (cfg.num_attention_heads,
                                         cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    assert (lat.kv_rank, lat.rope_dims, lat.q_rank, lat.v_dim) == (
        cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank, cfg.v_head_dim)
    assert s.position.interleaved
    for i in range(s.layers):   # dense below first_k_dense_replace, routed from it
        ffn = layer_spec(s, i).ffn
        if i < cfg.first_k_dense_replace:
            assert (ffn.kind, ffn.d_ff) == ("swiglu", cfg.intermediate_size)
            continue
        moe, v3 = ffn.moe, cfg.model_type == "deepseek_v3"
        assert (ffn.kind, ffn.d_ff, moe.experts, moe.top_k) == (
            "moe", cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok)
        assert (moe.router, moe.choice_bias, moe.normalize_top_k) == (
            ("sigmoid", True, True) if v3 else ("softmax", False, False))
        assert (moe.groups, moe.top_groups, moe.scale, moe.shared_expert_d_ff) == (
            cfg.n_group or 1, cfg.topk_group or 1, cfg.routed_scaling_factor,
            cfg.n_shared_experts * cfg.moe_intermediate_size)
    assert (att.bias.q, att.bias.k, att.bias.o) == (cfg.attention_bias,) * 3
    if cfg.rope_parameters.get("rope_type") == "yarn":
        m = 0.1 * 0.707 * math.log(4.0) + 1
        assert s.position.scaling.yarn_attention_factor == pytest.approx(1.0)
        assert s.attention_scale == pytest.approx(m * m / math.sqrt(att.head_dim))
    # a whole Q8_0 kv_b stays quantized; one joined from its halves is read as floats
    kv_b = model.weights["layers.0.attn.kv_b.weight"]
    assert isinstance(kv_b, QTensor) == (qtype == Q.Q8_0 and not split)
    assert isinstance(model.weights["layers.0.attn.kv_a.weight"], QTensor) == (qtype == Q.Q8_0)


def small_file(path: Path, **changes: Any) -> Path:
    """The first row's model written with its metadata changed (a value of None: dropped)."""
    hf = transformers.DeepseekV3ForCausalLM(deepseek(True))
    meta = metadata(hf.config, split=True)
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            del meta[key]
        else:
            meta[key] = value
    write_deepseek2(hf, path, Q.F32, split=True, meta=meta)
    return path


@pytest.mark.parametrize(("changes", "message"), [
    ({"attention__kv_lora_rank": None},
     r"deepseek2\.attention\.kv_lora_rank: is missing"),
    ({"attention__key_length": 24},
     r"deepseek2\.attention\.key_length: 24 cannot be honoured .* the cached key is the "
     r"latent and the RoPE key \(20 \+ 8\)"),
    ({"attention__head_count_kv": 3},
     r"deepseek2\.attention\.head_count_kv: 3 cannot be honoured .* one head of latents"),
    ({"leading_dense_block_count": 1, "expert_count": None},
     r"deepseek2\.expert_count: is missing"),
    ({"leading_dense_block_count": 1, "expert_gating_func": 3},
     r"deepseek2\.expert_gating_func: 3 cannot be honoured .* archc's routers are 1 \(softmax\), "
     r"2 \(sigmoid\)"),
    ({"rope__scaling__yarn_ext_factor": 0.5},
     r"deepseek2\.rope\.scaling\.yarn_ext_factor: 0\.5 is a field archc does not know"),
    ({"rope__scaling__yarn_log_multiplier": 0.1},
     r"deepseek2\.rope\.scaling\.yarn_log_multiplier: .* the file's RoPE is not YaRN"),
], ids=["no-kv-rank", "key-length", "kv-heads", "no-expert-count", "gating", "unknown-field",
        "log-mul-without-yarn"])
def test_bad_metadata_is_refused_by_name(tmp_path: Path, changes: dict[str, Any],
                                         message: str) -> None:
    with pytest.raises(SpecError, match=message):
        archc.load(small_file(tmp_path / "bad.gguf", **changes))


def test_yarn_without_log_multiplier_scales_scores_as_llama_cpp(tmp_path: Path) -> None:
    """No `yarn_log_multiplier`: llama.cpp rotates with YaRN's m(1) on cos and sin and scales
    the scores by m(1)² besides."""
    spec = archc.load(small_file(tmp_path / "yarn.gguf", **{
        "rope__scaling__type": "yarn", "rope__scaling__factor": 4.0,
        "rope__scaling__original_context_length": 16})).spec
    m = 0.1 * math.log(4.0) + 1
    assert spec.position.scaling.yarn_attention_factor == pytest.approx(m)
    assert spec.attention_scale == pytest.approx(m * m / math.sqrt(24))
