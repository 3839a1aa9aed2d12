"""archc against transformers on the dense model types of 2025–26: one tiny random model of each,
saved with `save_pretrained`, read with `archc.load`, and held to transformers' logits on eager and
on the generated kernels (Triton's interpreter without a GPU), and to its greedy tokens — through
the API and through `archc run` on the saved directory.

Shapes are awkward on purpose: GQA 6/2 or 9/3, head_dim apart from d_model/heads, a sliding
window shorter than the prompt, RoPE with other θ per layer type; biases and norm gains are random
(``randomize``) so a misplaced one shows.

Tolerance, fp32: 1e-4 of the largest logit, as test_hf_crosscheck — reordered sums give ~1e-6
over two or three layers, while a wrong norm, scale, rotation or mask moves logits by 1e-2 and
more. Greedy tokens must be equal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import archc
from archc.cli import main
from tests.test_hf_crosscheck import build, rel_error

transformers = pytest.importorskip("transformers", reason="needs transformers (pip install "
                                   "'archc[hf]')")
pytest.importorskip("safetensors", reason="needs safetensors (pip install 'archc[hf]')")

RTOL = 1e-4
VOCAB = 97
SMALL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
PROMPT = 11          # tokens of the compared forward pass: past every window below
NEW_TOKENS = {"eager": 10, "triton": 3}

# name → (config factory, model class name)
CASES: dict[str, tuple[Callable[[], Any], str]] = {
    # head_dim 24 (not 60/6), GQA 6/2, q/k/v/o biases, layers from 1 on slide (window 5)
    "qwen3": (lambda: transformers.Qwen3Config(
        hidden_size=60, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=64, attention_bias=True,
        use_sliding_window=True, sliding_window=5, max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **SMALL),
        "Qwen3ForCausalLM"),
    # sliding (window 4, θ 10⁴) and global (θ 10⁶, linear ×4) layers; 9/3 heads of 16 ≠ 54/9,
    # a score scale from query_pre_attn_scalar, (1 + w) gains on every norm and on q and k
    "gemma3_text": (lambda: transformers.Gemma3TextConfig(
        hidden_size=54, intermediate_size=64, num_hidden_layers=3, num_attention_heads=9,
        num_key_value_heads=3, head_dim=16, max_position_embeddings=64, sliding_window=4,
        query_pre_attn_scalar=20, layer_types=["sliding_attention", "full_attention",
                                               "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 1000000.0}}, **SMALL),
        "Gemma3ForCausalLM"),
    # norms on each sublayer's output only; q and k normalized over the whole projection
    # (6·10 and 2·10 gains); GQA 6/2
    "olmo2": (lambda: transformers.Olmo2Config(
        hidden_size=60, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, **SMALL),
        "Olmo2ForCausalLM"),
    # every third layer without RoPE (NoPE); GQA 9/3, a tied head
    "smollm3": (lambda: transformers.SmolLM3Config(
        hidden_size=54, intermediate_size=80, num_hidden_layers=3, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=64, no_rope_layer_interval=3,
        **SMALL), "SmolLM3ForCausalLM"),
    # every multiplier away from 1: embeddings ×3, sublayer outputs ×0.4, scores ×0.09 (not
    # 1/sqrt(10)), logits ÷2.5; biases everywhere
    "granite": (lambda: transformers.GraniteConfig(
        hidden_size=60, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, attention_bias=True, mlp_bias=True,
        embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09,
        logits_scaling=2.5, **SMALL), "GraniteForCausalLM"),
    # biases everywhere, LayerNorm with a bias, GELU-tanh MLP, a window of 5 on every layer
    "starcoder2": (lambda: transformers.Starcoder2Config(
        hidden_size=60, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=5, **SMALL),
        "Starcoder2ForCausalLM"),
    # fused qkv_proj and gate_up_proj; LongRoPE over 3/4 of each head (6 pairs) trained on 8
    # positions: the 11-token prompt reads the long factors, the greedy run's 9-token prompt the
    # short ones and its decode steps the long ones; a window of 6
    "phi3": (lambda: transformers.Phi3Config(
        hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=10,
        sliding_window=6, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "original_max_position_embeddings": 10,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]}, **SMALL), "Phi3ForCausalLM"),
    # sandwich norms, q/k/v biases (none on o), fused gate_up_proj, interleaved RoPE on half of
    # each 16-dim head (≠ 48/6), GQA 6/2
    "glm4": (lambda: transformers.Glm4Config(
        hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, **SMALL),
        "Glm4ForCausalLM"),
    # a parallel block on one bias-free LayerNorm; sliding layers (window 4) with interleaved
    # RoPE, the third layer global without positions; logits ×0.3; a tied head; GQA 6/2
    "cohere2": (lambda: transformers.Cohere2Config(
        hidden_size=60, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, logit_scale=0.3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], **SMALL),
        "Cohere2ForCausalLM"),
    # norms on the sublayer outputs only, per-head QK-norm, sliding layers (window 5) with RoPE
    # and a global one without; head_dim 16 ≠ 48/6, GQA 6/2
    "exaone4": (lambda: transformers.Exaone4Config(
        hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5,
        sliding_window_pattern=3, **SMALL), "Exaone4ForCausalLM"),
}


@pytest.fixture(scope="module")
def kernel_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kernels")


Pair = tuple[str, Any, dict[str, archc.CompiledModel], Path]


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         kernel_dir: Path) -> Pair:
    """The case, its transformers model, archc's compiled models and the saved directory."""
    case = request.param
    directory = tmp_path_factory.mktemp(case)
    hf = build(case, directory, cases=CASES)
    model = archc.load(directory)
    compiled = {"eager": model.compile("eager"),
                "triton": model.compile("triton", cache_dir=kernel_dir)}
    return case, hf, compiled, directory


def prompt(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_logits_match_transformers(pair: Pair, backend: str) -> None:
    case, hf, compiled, _ = pair
    ids = prompt(2 if backend == "eager" else 1, PROMPT, seed=1)
    with torch.no_grad():
        want = hf(ids).logits
    got = compiled[backend](ids)
    assert got.shape == want.shape
    err = rel_error(got, want)
    assert err <= RTOL, f"{case} on {backend}: max error {err:.2e} of the largest logit"


def greedy(hf: Any, ids: torch.Tensor, new: int) -> list[list[int]]:
    """transformers' greedy continuation of `ids`, `new` tokens, with the prompt."""
    settings = transformers.GenerationConfig(max_new_tokens=new, min_new_tokens=new,
                                             do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        return hf.generate(ids, generation_config=settings).tolist()


@pytest.mark.parametrize("backend", ["eager", "triton"])
def test_greedy_tokens_match_transformers(pair: Pair, backend: str) -> None:
    """Prefill, then decode through the KV cache, token for token as transformers."""
    case, hf, compiled, _ = pair
    ids = prompt(1, 9, seed=2)
    new = NEW_TOKENS[backend]
    got = compiled[backend].generate(ids, max_new_tokens=new)
    assert got.tolist() == greedy(hf, ids, new), f"{case} on {backend}"


def test_archc_run_answers_with_the_greedy_tokens_of_transformers(
        pair: Pair, capsys: pytest.CaptureFixture[str]) -> None:
    """`archc run DIR` on the saved directory — its config and safetensors read from disk as a
    user's would be — continues its random prompt (`prompt_ids`) as transformers does."""
    case, hf, _, directory = pair
    capsys.readouterr()
    assert main(["run", str(directory), "--json", "--quiet", "--seed", "4", "--prompt-len",
                 str(PROMPT), "--new-tokens", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    ids = torch.tensor(data["prompt_ids"])
    assert ids.shape == (1, PROMPT)
    assert ids[0].tolist() + data["greedy_continuation"] == greedy(hf, ids, 5)[0], case


@pytest.mark.parametrize("backend", ["eager", "triton"])
@pytest.mark.parametrize("pair", ["phi3"], indirect=True)
def test_paged_engine_serves_longrope_within_its_trained_context(pair: Pair, backend: str
                                                                 ) -> None:
    """The paged engine batches sequences of different lengths, while LongRoPE rotates a whole
    sequence by its long factors once it passes the trained context (10 tokens here): sequences
    up to 10 tokens decode batched (on the short factors' table) as `generate` and transformers
    do; a longer one is refused by name, not rotated by the factors of another row's length."""
    from archc.passes.paged import PagedError, paged_kv
    from archc.runtime.paged import EngineError
    from tests.test_paged_engine import check_engine, prompts_of
    case, hf, compiled, _ = pair
    engine = compiled[backend].engine(block_size=4, max_batch=2)
    assert engine.max_seq_len == 10
    prompts = prompts_of([7, 4], VOCAB, seed=5)
    check_engine(compiled[backend], engine, prompts, steps=3)
    want = greedy(hf, torch.tensor(prompts[:1]), 3)[0][7:]
    assert compiled[backend].generate(torch.tensor(prompts[:1]), 3)[0, 7:].tolist() == want
    with pytest.raises(EngineError, match=r"total_tokens=11 exceeds 10: phi3.*'s LongRoPE "
                       r"switches to its long factors past 10 tokens"):
        engine.prefill(9, prompts[0], total_tokens=11)
    with pytest.raises(PagedError, match=r"\(LongRoPE past its trained context of 10 tokens "
                       r"\(sequences of up to 11 here\)\), which a row of another sequence"):
        paged_kv(compiled[backend].session.program, 4, 11)


@pytest.mark.parametrize("pair", ["phi3"], indirect=True)
def test_serve_names_the_context_a_longrope_model_is_served_in(
        pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`archc serve` on the saved directory (with a tokenizer beside it) says, when it starts,
    that the context it serves is LongRoPE's trained one."""
    pytest.importorskip("fastapi")
    import shutil

    from archc.serve.server import Server
    from tests.test_generate import trained_tokenizer
    directory = shutil.copytree(pair[3], tmp_path / "phi3")
    trained_tokenizer(VOCAB).save(str(directory / "tokenizer.json"))
    monkeypatch.setattr(Server, "run", lambda self: None)
    capsys.readouterr()
    assert main(["serve", str(directory), "--port", "0"]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "'s LongRoPE switches to its long factors past 10 tokens" in err
    assert "context 10 tokens" in err
