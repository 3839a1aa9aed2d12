"""Numbers computed from the IR against the formulas of the seed documents."""

from __future__ import annotations

import dataclasses

import pytest

from archc.ir import lower
from archc.ir.cost import graph_cost, kv_cache_bytes_per_token, parameter_count
from archc.spec import load_spec


def test_kv_cache_formula_llama2_70b() -> None:
    """KV bytes = 2·L·T·H_kv·d_h·bytes; GQA with 8 KV heads is 8× smaller than MHA."""
    spec = load_spec("llama2-70b")
    gqa = kv_cache_bytes_per_token(lower(spec, "bf16"))
    mha_spec = dataclasses.replace(spec, attention=dataclasses.replace(
        spec.attention, kv_heads=spec.attention.heads))
    mha = kv_cache_bytes_per_token(lower(mha_spec, "bf16"))
    layers, kv_heads, head_dim, nbytes = 80, 8, 128, 2
    assert gqa == 2 * layers * kv_heads * head_dim * nbytes
    assert mha == 8 * gqa
    # the guide's worked example: 80 layers, 64 heads, d_k 128, 4096 tokens, fp16 ≈ 10.7 GB
    assert mha * 4096 == 2 * 80 * 64 * 128 * 4096 * 2
    assert round(mha * 4096 / 1e9, 1) == 10.7


@pytest.mark.parametrize("name, expected", [
    ("llama2-7b", 6_738_415_616),      # Llama-2-7b-hf
    ("llama3-8b", 8_030_261_248),      # Meta-Llama-3-8B
    ("mixtral-8x7b", 46_702_792_704),  # Mixtral-8x7B-v0.1
    ("gpt2", 124_439_808),             # gpt2
    ("smollm2-135m", 134_515_008),     # SmolLM2-135M
])
def test_parameter_counts_match_released_checkpoints(name: str, expected: int) -> None:
    assert parameter_count(lower(load_spec(name))) == expected


def test_decode_flops_are_twice_the_matmul_parameters() -> None:
    """At one token and no past, matmul FLOPs are 2 per weight; the rest is small."""
    spec = load_spec("llama2-7b")
    flops, _ = graph_cost(lower(spec).graphs[0]).at({"B": 1, "T": 1, "P": 0})
    embedding = spec.vocab_size * spec.d_model  # a gather, not a matmul
    matmul_params = parameter_count(lower(spec)) - embedding
    assert 2 * matmul_params <= flops <= 2 * matmul_params * 1.01
