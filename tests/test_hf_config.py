"""config.json → spec without weights or transformers: older transformers spellings give the same
spec as transformers 5's, RoPE scaling kinds map to the spec's, and what cannot be honoured is
refused by name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from archc.errors import SpecError
from archc.sources.hf import hf_spec
from archc.spec.load import layer_kinds

LLAMA = {"model_type": "llama", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 48,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def spec_of(tmp_path: Path, config: dict[str, Any], name: str = "m") -> Any:
    """The spec of a directory holding only `config`, named and described alike whatever the
    directory, so specs compare by content."""
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return dataclasses.replace(hf_spec(directory), name="m", description="")


@pytest.mark.parametrize(("v4", "v5"), [
    ({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0}},
     {"rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}}),
    ({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 16}},
     {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 16}}),
    ({"rope_theta": 1e4, "rope_scaling": None}, {}),
])
def test_transformers_4_rope_spelling_gives_the_same_spec(v4: dict, v5: dict,
                                                          tmp_path: Path) -> None:
    assert spec_of(tmp_path, {**LLAMA, **v4}, "v4") == spec_of(tmp_path, {**LLAMA, **v5}, "v5")


def test_rope_scaling_kinds_map_to_the_spec(tmp_path: Path) -> None:
    yarn = spec_of(tmp_path, {**LLAMA, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 16,
        "original_max_position_embeddings": 16}}, "yarn")
    assert yarn.position.scaling.kind == "yarn"
    assert yarn.position.scaling.beta_fast == 16.0
    assert yarn.position.scaling.original_max_seq_len == 16
    dynamic = spec_of(tmp_path, {**LLAMA, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0,
        "original_max_position_embeddings": 16}}, "dynamic")
    # transformers' dynamic NTK counts from max_position_embeddings; the cache holds factor × it
    assert dynamic.position.scaling.kind == "dynamic"
    assert dynamic.position.scaling.factor == 4.0
    assert dynamic.position.scaling.original_max_seq_len == 64
    assert dynamic.max_seq_len == 256


def test_gpt_neox_old_spellings(tmp_path: Path) -> None:
    base = {"model_type": "gpt_neox", "vocab_size": 50, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 4}
    old = spec_of(tmp_path, {**base, "rotary_pct": 0.5, "rotary_emb_base": 100}, "old")
    new = spec_of(tmp_path, {**base, "rope_parameters": {
        "rope_type": "default", "rope_theta": 100, "partial_rotary_factor": 0.5}}, "new")
    assert old == new and old.rotary_dim == 4 and old.position.theta == 100
    default = spec_of(tmp_path, base, "default")
    assert default.position.fraction == 0.25


def test_qwen2_windows_only_the_upper_layers(tmp_path: Path) -> None:
    s = spec_of(tmp_path, {**LLAMA, "model_type": "qwen2", "num_hidden_layers": 4,
                           "use_sliding_window": True, "sliding_window": 8,
                           "max_window_layers": 2})
    assert s.attention.window == 8 and layer_kinds(s) == ("global", "global", "local", "local")
    assert s.attention.bias.q and s.attention.bias.k and not s.attention.bias.o


def test_gemma2_alternates_local_and_global(tmp_path: Path) -> None:
    s = spec_of(tmp_path, {"model_type": "gemma2", "vocab_size": 50, "hidden_size": 32,
                           "intermediate_size": 48, "num_hidden_layers": 4,
                           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
                           "sliding_window": 8, "query_pre_attn_scalar": 64,
                           "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert s.attention.pattern == ("local", "global")
    assert s.attention.scale == 64 ** -0.5
    assert (s.attention.softcap, s.output.softcap) == (50.0, 30.0)
    assert s.norm.placement == "sandwich" and s.norm.unit_offset


@pytest.mark.parametrize(("config", "message"), [
    ({**LLAMA, "partial_rotary_factor": 0.5}, r"partial_rotary_factor: 0.5 cannot be honoured"
     r".*rotates whole heads"),
    ({**LLAMA, "hidden_act": "gelu"}, r"hidden_act: 'gelu' cannot be honoured.*exact \(erf\)"),
    ({**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                   "truncate": "no"}}, r"rope_parameters.truncate: 'no'"),
    ({**LLAMA, "model_type": "mistral", "attention_bias": True},
     r"attention_bias: True cannot be honoured for model_type 'mistral'"),
    ({"model_type": "bloom", "vocab_size": 50, "hidden_size": 32, "n_layer": 1, "n_head": 4,
      "apply_residual_connection_post_layernorm": True},
     r"apply_residual_connection_post_layernorm: True cannot be honoured"),
    ({"model_type": "mpt", "vocab_size": 50, "d_model": 32, "n_heads": 4, "n_layers": 1,
      "attn_config": {"clip_qkv": 6.0}}, r"attn_config.clip_qkv: 6.0 cannot be honoured"),
    ({"model_type": "mpt", "vocab_size": 50, "d_model": 32, "n_heads": 4, "n_layers": 1,
      "attn_config": {"sliding_window_size": 8}},
     r"attn_config.sliding_window_size: 8 is a field archc does not know"),
    ({"model_type": "falcon", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1,
      "num_attention_heads": 4, "new_decoder_architecture": True, "parallel_attn": False},
     r"parallel_attn: False cannot be honoured"),
    ({"model_type": "falcon", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1,
      "num_attention_heads": 4, "multi_query": True, "num_key_value_heads": 4},
     r"num_key_value_heads: 4 cannot be honoured.*multi_query"),
    ({"model_type": "bert", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1,
      "num_attention_heads": 4, "intermediate_size": 48,
      "position_embedding_type": "relative_key"},
     r"position_embedding_type: 'relative_key' cannot be honoured"),
    ({"model_type": "t5", "vocab_size": 50, "d_model": 32, "d_kv": 8, "d_ff": 48,
      "num_layers": 1, "num_heads": 4, "feed_forward_proj": "gated-gelu-fast"},
     r"feed_forward_proj: 'gated-gelu-fast' cannot be honoured"),
    ({"model_type": "opt", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 1,
      "num_attention_heads": 4, "ffn_dim": 48, "layer_norm_elementwise_affine": False},
     r"layer_norm_elementwise_affine: False cannot be honoured"),
])
def test_fields_archc_cannot_honour_are_refused(config: dict, message: str,
                                                tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=message):
        spec_of(tmp_path, config)


MAMBA = {"model_type": "mamba", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
         "state_size": 4, "expand": 2, "conv_kernel": 4, "layer_norm_epsilon": 1e-5}


def test_mamba_configs_converted_from_the_original_code_load(tmp_path: Path) -> None:
    """Converted checkpoints keep the original code's fields beside transformers' own: the layer
    count again, the RMSNorm switch, the fused add+norm kernel and the vocabulary padding."""
    plain = spec_of(tmp_path, MAMBA, "plain")
    converted = spec_of(tmp_path, {**MAMBA, "n_layer": 2, "rms_norm": True, "fused_add_norm": True,
                                   "pad_vocab_size_multiple": 8}, "converted")
    assert converted == plain
    assert plain.layer_mixers() == ("mamba", "mamba")


@pytest.mark.parametrize(("extra", "message"), [
    ({"n_layer": 3}, r"n_layer: 3 cannot be honoured .*must equal num_hidden_layers \(2\)"),
    ({"rms_norm": False}, r"rms_norm: False cannot be honoured .*RMSNorm"),
])
def test_mamba_fields_that_disagree_are_refused(extra: dict, message: str,
                                                tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=message):
        spec_of(tmp_path, {**MAMBA, **extra})


JAMBA = {"model_type": "jamba", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4,
         "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2,
         "attn_layer_period": 4, "attn_layer_offset": 2, "expert_layer_period": 2,
         "expert_layer_offset": 1, "num_experts": 4, "num_experts_per_tok": 2,
         "mamba_d_state": 4, "max_position_embeddings": 128}


def test_jamba_configs_of_the_original_code_load(tmp_path: Path) -> None:
    """Jamba-v0.1's own config names the context n_ctx and carries the inner-norm switch and a
    logits setting beside transformers' fields."""
    plain = spec_of(tmp_path, JAMBA, "plain")
    legacy = {k: v for k, v in JAMBA.items() if k != "max_position_embeddings"}
    legacy.update(n_ctx=128, mamba_inner_layernorms=True, calc_logits_for_entire_prompt=False)
    assert spec_of(tmp_path, legacy, "legacy") == plain
    assert plain.layer_mixers() == ("mamba", "mamba", "attention", "mamba")
    assert plain.mixer.mamba is not None and plain.mixer.mamba.inner_norms


def test_jamba_without_inner_norms_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match=r"mamba_inner_layernorms: False cannot be honoured"):
        spec_of(tmp_path, {**JAMBA, "mamba_inner_layernorms": False})
