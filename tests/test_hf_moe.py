"""archc against transformers on the mixture-of-experts model types of 2025–26: one tiny random
model of each, saved with `save_pretrained`, read with `archc.load`, and held to transformers'
logits on eager and on the generated kernels (Triton's interpreter without a GPU), and to its
greedy tokens.

Shapes are awkward on purpose: GQA 6/2, head_dim apart from d_model/heads, an odd number of
experts, dense layers between routed ones. Router weights are scaled up so that the routing is
decisive (far from ties that rounding could flip) and router, expert and sink biases are random
(``randomize_moe``), so that a misplaced one shows. The 2×11-token prefill routes tokens to every
expert; a decode step's single token leaves most experts without one.

Tolerance, fp32: 1e-4 of the largest logit, as test_hf_crosscheck — reordered sums give ~1e-6
over two or three layers, while a wrong gate, bias, clamp or routing choice moves logits by 1e-2
and more. Greedy tokens must be equal.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.ir import cost
from archc.ir.lower import lower
from archc.report.facts import facts
from archc.spec import from_dict, load_spec
from archc.spec.load import layer_spec
from tests.test_hf_crosscheck import randomize, rel_error
from tests.test_moe_kernels import small_blocks

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install "
                                   "'archc[hf]')")
pytest.importorskip("safetensors", reason="needs safetensors (pip install 'archc[hf]')")

RTOL = 1e-4
# the routers of the cases below: Qwen3-MoE's `mlp.gate`, gpt-oss's and Llama 4's `router`
ROUTER = re.compile(r"\.(?:mlp\.gate|mlp\.router|feed_forward\.router)\.(weight|bias)$")
VOCAB = 97
SMALL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
PROMPT = 11          # tokens of the compared forward pass
NEW_TOKENS = {"eager": 8, "triton": 3}

# name → (config factory, model class name)
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    # 5 experts, top 2 not renormalized (norm_topk_prob false); layer 1 dense
    # (mlp_only_layers) of its own width 80 beside the experts' 40; head_dim 24 ≠ 60/6, GQA 6/2
    "qwen3_moe": (lambda: transformers.Qwen3MoeConfig(
        hidden_size=60, intermediate_size=80, moe_intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, head_dim=24, num_experts=5,
        num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
        max_position_embeddings=64, **SMALL), "Qwen3MoeForCausalLM"),
    # sinks; sliding (window 5) and full layers; YaRN over 16 trained positions without rounding
    # the blend's dims (truncate false); 5 experts with biases, top 2 by a biased router; the
    # clamp at 1.2 (not 7), which the unit-scale activations cross often
    "gpt_oss": (lambda: transformers.GptOssConfig(
        hidden_size=60, intermediate_size=40, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=24, num_local_experts=5, num_experts_per_tok=2,
        sliding_window=5, max_position_embeddings=64, swiglu_limit=1.2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0,
                         "beta_fast": 8.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 16}, **SMALL),
        "GptOssForCausalLM"),
    # layers 0-2 RoPE on pairs with chunks of 4 keys and a gainless QK-norm, layer 3 NoPE with
    # temperature tuning (floor_scale 3, attn_scale 0.5: the scale moves from 1 at position 2);
    # MoE on layers 1 and 3 (5 experts, top 1, sigmoid router scaling the expert's input, a
    # shared expert), dense layers 0 and 2 of width 80; llama3 RoPE scaling with equal
    # low and high frequency factors (as Llama 4 Scout)
    "llama4_text": (lambda: transformers.Llama4TextConfig(
        hidden_size=60, intermediate_size=40, intermediate_size_mlp=80, num_hidden_layers=4,
        num_attention_heads=6, num_key_value_heads=2, head_dim=24, num_local_experts=5,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=4,
        floor_scale=3, attn_scale=0.5, max_position_embeddings=64,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 16}, **SMALL),
        "Llama4ForCausalLM"),
}


def randomize_moe(model: torch.nn.Module, seed: int) -> None:
    """``randomize``, then router weights ×3 (logits of spread ~3: a decisive routing), and
    router biases and attention sinks N(0, 1), large enough to change choices and weights."""
    randomize(model, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            router = ROUTER.search(name)
            if router and router.group(1) == "weight":
                p.mul_(3.0)
            elif router or name.endswith(".sinks"):
                p.copy_(torch.randn(p.shape, generator=gen))


def build(case: str, directory: Path, seed: int = 0) -> tuple[torch.nn.Module, Path]:
    """A random transformers model of `case`, saved to `directory` (returned with it)."""
    make_config, cls = CASES[case]
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(make_config()).eval()
    randomize_moe(model, seed)
    model.save_pretrained(directory)
    return model, directory


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         kernel_dir: Path) -> tuple[str, Any, dict[str, archc.CompiledModel]]:
    case = request.param
    directory = tmp_path_factory.mktemp(case)
    hf, _ = build(case, directory)
    model = archc.load(directory)
    compiled = {"eager": model.compile("eager"),
                "triton": model.compile("triton", cache_dir=kernel_dir)}
    return case, hf, compiled


def prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_logits_match_transformers(pair: tuple[str, Any, dict[str, archc.CompiledModel]],
                                   backend: str) -> None:
    case, hf, compiled = pair
    ids = prompt(2, PROMPT, seed=1)
    with torch.no_grad():
        want = hf(ids).logits
    got = compiled[backend](ids)
    assert got.shape == want.shape
    err = rel_error(got, want)
    assert err <= RTOL, f"{case} on {backend}: max error {err:.2e} of the largest logit"


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_greedy_tokens_match_transformers(
        pair: tuple[str, Any, dict[str, archc.CompiledModel]], backend: str) -> None:
    """Prefill, then decode through the KV cache, token for token as transformers."""
    case, hf, compiled = pair
    ids = prompt(1, 9, seed=2)
    new = NEW_TOKENS[backend]
    settings = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new,
                                             do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(ids, generation_config=settings)
    got = compiled[backend].generate(ids, max_new_tokens=new)
    assert got.tolist() == want.tolist(), f"{case} on {backend}"


@pytest.mark.parametrize("case", ["gpt_oss", "llama4_text"])
def test_prefill_routes_in_parallel_chunks(case: str, tmp_path: Path, kernel_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """gpt-oss's biased router (softmax over the chosen logits) and experts (biases, interleaved
    gate/up rows, the clamped SwiGLU), Llama 4's sigmoid router scaling the expert's input beside
    a shared expert, on the generated kernels against eager (which the tests above hold to
    transformers) with small routing blocks: a 2×11 prefill's tokens routed in parallel in
    chunks of 16, then greedy decode, each step routed by the router's last program."""
    small_blocks(monkeypatch, route_last=False)
    model = archc.load(build(case, tmp_path)[1])
    eager, kernels = model.compile("eager"), model.compile("triton", cache_dir=kernel_dir)
    ids = prompt(2, PROMPT, seed=1)
    err = rel_error(kernels(ids), eager(ids))
    assert err <= RTOL, f"{case}: max error {err:.2e} of the largest logit"
    ids = prompt(1, 9, seed=2)
    new = NEW_TOKENS["triton"]
    assert kernels.generate(ids, max_new_tokens=new).tolist() == \
        eager.generate(ids, max_new_tokens=new).tolist(), case


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-20b", "llama4-scout"])
def test_active_parameters_are_the_chosen_experts(name: str) -> None:
    """`archc show`'s active parameters: all but the experts a token is not routed to — per
    MoE layer, E − k experts' gate, up and down weights (and biases)."""
    spec = load_spec(name)
    program = lower(spec, spec.dtype)
    moe, d, f = spec.ffn.moe, spec.d_model, spec.ffn.d_ff
    per_expert = 3 * f * d + ((2 * f + d) if moe.bias else 0)
    idle = sum(layer_spec(spec, i).ffn.kind == "moe" for i in range(spec.layers)) * \
        (moe.experts - moe.top_k) * per_expert
    assert cost.active_parameter_count(program) == cost.parameter_count(program) - idle
    rows = dict(facts(spec, {}))
    assert rows["active parameters"].endswith(f"per token: {moe.top_k} of {moe.experts} experts")


def test_active_parameters_of_experts_set_by_a_layer_type() -> None:
    """Experts only some layer types have (DeepSeek's dense first layers): still counted, and
    named from that layer type's section."""
    spec = from_dict({"name": "typed-moe", "vocab_size": 97, "d_model": 48, "layers": 3,
                      "attention": {"heads": 4}, "ffn": {"kind": "swiglu", "d_ff": 40},
                      "layer_types": {"dense": {}, "moe": {"ffn": {
                          "kind": "moe", "d_ff": 16, "moe": {"experts": 8, "top_k": 3}}}},
                      "layer_pattern": ["dense", "moe", "moe"]})
    program = lower(spec, spec.dtype)
    assert cost.active_parameter_count(program) == \
        cost.parameter_count(program) - 2 * (8 - 3) * 3 * 16 * 48
    assert dict(facts(spec, {}))["active parameters"].endswith("per token: 3 of 8 experts")
