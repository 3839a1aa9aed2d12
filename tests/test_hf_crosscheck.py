"""archc against transformers: tiny random models of every supported model_type, saved with
`save_pretrained`, loaded with `archc.load`, compared on a full forward pass and on greedy
generation token for token.

fp32 throughout. The same function computed with differently ordered sums agrees to ~1e-6 of the
output's magnitude; 1e-4 leaves room for that over a few layers while a wrong bias, scale, mask or
rotation moves outputs by far more. Biases and norm gains get random values first, because
transformers initialises them to constants that would hide a misplaced one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import archc

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install "
                                   "'archc[hf]')")
pytest.importorskip("safetensors", reason="needs safetensors (pip install 'archc[hf]')")

RTOL = 1e-4
VOCAB = 97
SMALL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name → (config factory, model class name)
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    "llama-llama3-rope": (lambda: transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16}, **SMALL),
        "LlamaForCausalLM"),
    "llama-yarn-tied": (lambda: transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0,
                         "original_max_position_embeddings": 16}, **SMALL),
        "LlamaForCausalLM"),
    "llama-linear-rope": (lambda: transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, head_dim=32,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        **SMALL), "LlamaForCausalLM"),
    "llama-dynamic-rope": (lambda: transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=24, rope_parameters={"rope_type": "dynamic",
                                                     "rope_theta": 10000.0, "factor": 4.0},
        **SMALL), "LlamaForCausalLM"),
    "mistral-window": (lambda: transformers.MistralConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=5, **SMALL),
        "MistralForCausalLM"),
    "qwen2-upper-window": (lambda: transformers.Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True,
        sliding_window=4, max_window_layers=1, **SMALL), "Qwen2ForCausalLM"),
    "mixtral": (lambda: transformers.MixtralConfig(
        hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, **SMALL), "MixtralForCausalLM"),
    "gemma": (lambda: transformers.GemmaConfig(
        hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, **SMALL),
        "GemmaForCausalLM"),
    "gemma2": (lambda: transformers.Gemma2Config(
        hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=6,
        query_pre_attn_scalar=20, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
        **SMALL), "Gemma2ForCausalLM"),
    "gpt2": (lambda: transformers.GPT2Config(
        n_embd=64, n_head=4, n_layer=2, n_positions=64, **SMALL), "GPT2LMHeadModel"),
    "gpt2-unscaled-relu": (lambda: transformers.GPT2Config(
        n_embd=64, n_head=4, n_layer=2, n_positions=64, n_inner=80, scale_attn_weights=False,
        activation_function="relu", tie_word_embeddings=False, **SMALL), "GPT2LMHeadModel"),
    "gptj": (lambda: transformers.GPTJConfig(
        n_embd=64, n_head=4, n_layer=2, n_positions=64, rotary_dim=8, **SMALL),
        "GPTJForCausalLM"),
    "gpt_neox": (lambda: transformers.GPTNeoXConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, rope_parameters={"rope_type": "default",
                                                     "rope_theta": 1000.0,
                                                     "partial_rotary_factor": 0.5}, **SMALL),
        "GPTNeoXForCausalLM"),
    "gpt_neox-serial": (lambda: transformers.GPTNeoXConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, use_parallel_residual=False, attention_bias=False,
        **SMALL), "GPTNeoXForCausalLM"),
    "falcon-mqa": (lambda: transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
        **SMALL), "FalconForCausalLM"),
    "falcon-new-arch": (lambda: transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, max_position_embeddings=64, ffn_hidden_size=96,
        bias=True, **SMALL), "FalconForCausalLM"),
    "falcon-alibi-serial": (lambda: transformers.FalconConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, alibi=True,
        multi_query=False, parallel_attn=False, bias=True, max_position_embeddings=64,
        **SMALL), "FalconForCausalLM"),
    "bloom": (lambda: transformers.BloomConfig(
        hidden_size=64, n_layer=2, n_head=4, **SMALL), "BloomForCausalLM"),
    "mpt": (lambda: transformers.MptConfig(
        d_model=64, n_heads=4, n_layers=2, max_seq_len=64, **SMALL), "MptForCausalLM"),
    "opt": (lambda: transformers.OPTConfig(
        hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64, **SMALL), "OPTForCausalLM"),
    "opt-post-norm": (lambda: transformers.OPTConfig(
        hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=64, do_layer_norm_before=False,
        **SMALL), "OPTForCausalLM"),
    "opt-350m-projections": (lambda: transformers.OPTConfig(
        hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=48, do_layer_norm_before=False,
        **SMALL), "OPTForCausalLM"),
    "phi": (lambda: transformers.PhiConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, **SMALL), "PhiForCausalLM"),
    "phi-qk-norm-gqa": (lambda: transformers.PhiConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, qk_layernorm=True,
        tie_word_embeddings=True, **SMALL), "PhiForCausalLM"),
    "bert": (lambda: transformers.BertConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, **SMALL), "BertModel"),
    "t5": (lambda: transformers.T5Config(
        d_model=64, d_kv=16, d_ff=96, num_layers=2, num_decoder_layers=3, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20,
        decoder_start_token_id=0, **SMALL), "T5ForConditionalGeneration"),
    "t5-v1.1-gated": (lambda: transformers.T5Config(
        d_model=64, d_kv=16, d_ff=96, num_layers=2, num_heads=4, feed_forward_proj="gated-gelu",
        tie_word_embeddings=False, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, decoder_start_token_id=0, **SMALL),
        "T5ForConditionalGeneration"),
    # the pure-torch scan of transformers (no mamba_ssm kernels here); decode through its
    # conv and SSM states
    "mamba": (lambda: transformers.MambaConfig(
        hidden_size=64, state_size=16, num_hidden_layers=2, **SMALL), "MambaForCausalLM"),
    "mamba-bias-narrow-conv": (lambda: transformers.MambaConfig(
        hidden_size=48, state_size=8, num_hidden_layers=2, expand=3, conv_kernel=3,
        use_bias=True, time_step_rank=5, **SMALL), "MambaForCausalLM"),
    # three Mamba layers (Δ, B, C norms), then GQA attention; MoE (unnormalized top-2 of 4) on
    # odd layers, SwiGLU on even ones. No eos: transformers' min_new_tokens would forbid it.
    "jamba": (lambda: transformers.JambaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=3, expert_layer_period=2,
        expert_layer_offset=1, num_experts=4, mamba_d_state=8, max_position_embeddings=64,
        **{**SMALL, "eos_token_id": None}), "JambaForCausalLM"),
}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: matmul weights N(0, 1/fan_in) so activations stay at unit scale,
    embeddings N(0, 1), norm gains 1 + N(0, 0.1²), biases and Gemma's (1 + w) gains
    N(0, 0.1²), T5's relative-position tables N(0, 0.5²)."""
    gen = torch.Generator().manual_seed(seed)
    unit_offset = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            module = name.rsplit(".", 2)[-2].lower()
            if p.ndim == 1:
                gain = name.endswith("weight") and ("norm" in module or module.startswith("ln"))
                p.copy_((1.0 if gain and not unit_offset else 0.0) + 0.1 * noise)
            elif "relative_attention_bias" in name:
                p.copy_(0.5 * noise)
            elif any(w in module for w in ("embed", "wte", "wpe", "shared")):
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[-1] ** 0.5)


def build(case: str, directory: Path, seed: int = 0,
          cases: Mapping[str, tuple[Callable[[], Any], str]] = CASES) -> torch.nn.Module:
    """A random transformers model of `case` (a row of `cases`), saved to `directory`."""
    make_config, cls = cases[case]
    config = make_config()
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(config).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    return model


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, archc.Model]:
    case = request.param
    directory = tmp_path_factory.mktemp(case.replace(".", "_"))
    hf = build(case, directory)
    return case, hf, archc.load(directory)


def test_forward_matches_transformers(pair: tuple[str, Any, archc.Model]) -> None:
    case, hf, model = pair
    compiled = model.compile()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 13), generator=gen)
    with torch.no_grad():
        if model.spec.family == "encoder":
            mask = torch.ones_like(ids)
            mask[1, 9:] = 0                      # the second sequence is padded
            types = torch.zeros_like(ids)
            types[:, 6:] = 1
            want = hf(ids, attention_mask=mask, token_type_ids=types).last_hidden_state
            got = compiled(ids, attention_mask=mask, token_type_ids=types)
        elif model.spec.family == "encoder-decoder":
            dec = torch.randint(3, VOCAB, (2, 7), generator=gen)
            mask = torch.ones_like(ids)
            mask[1, 10:] = 0
            want = hf(ids, attention_mask=mask, decoder_input_ids=dec).logits
            got = compiled(ids, attention_mask=mask, decoder_input_ids=dec)
        else:
            want = hf(ids).logits
            got = compiled(ids)
    assert got.shape == want.shape
    assert rel_error(got, want) <= RTOL, case


def test_greedy_generation_matches_transformers(pair: tuple[str, Any, archc.Model]) -> None:
    case, hf, model = pair
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (1, 9), generator=gen)
    if model.spec.family == "encoder":   # no head to generate with: refused, by name
        with pytest.raises(archc.ArchcError, match="is an encoder: it has no output head"):
            model.compile().generate(ids, max_new_tokens=2)
        return
    # transformers sizes the decoder's cache by the encoder's layer count, so an asymmetric T5
    # generates without one there
    settings = transformers.GenerationConfig(max_new_tokens=12, min_new_tokens=12,
                                             do_sample=False, eos_token_id=None,
                                             pad_token_id=0, decoder_start_token_id=0,
                                             use_cache=model.spec.family == "decoder")
    with torch.no_grad():
        want = hf.generate(ids, generation_config=settings)
    got = model.compile().generate(ids, max_new_tokens=12)
    assert got.tolist() == want.tolist(), case
